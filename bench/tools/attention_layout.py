"""Does the memory layout coda hands SDPA cost attention time? coda's model slices q, k and v out of
its fused QKV GEMM's output (views of [T, (H + 2 KV) * hd], rows strided by the whole width), where
transformers passes separate projections (Liger's RoPE makes q and k contiguous [B, H, S, hd]).
This times causal SDPA forward and forward+backward (cuDNN on the H100/H200) on each layout, with
the output gradient laid out token-major (as the O projection's backward gives it) or head-major,
at Llama-3.2-1B's and Qwen3-1.7B's attention shapes (batch 2 x 4096).

    python bench/tools/attention_layout.py --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared harness

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import harness

SHAPES = {"llama3.2-1b": (32, 8, 64), "qwen3-1.7b": (16, 8, 128)}  # q heads, kv heads, head_dim
BATCH, SEQ = 2, 4096


def layouts(h: int, kv: int, hd: int) -> dict:
    """name -> a function returning (q, k, v as [B, heads, S, hd] views, the leaves to differentiate)."""
    t = BATCH * SEQ
    bf16 = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    qkv = torch.randn(t, (h + 2 * kv) * hd, **bf16)
    sep = [torch.randn(t, n * hd, **bf16) for n in (h, kv, kv)]
    bhsd = [torch.randn(BATCH, n, SEQ, hd, **bf16) for n in (h, kv, kv)]
    heads = lambda x: x.view(BATCH, SEQ, -1, hd).transpose(1, 2)  # noqa: E731

    def fused():
        q, k, v = qkv.view(t, h + 2 * kv, hd).split([h, kv, kv], dim=1)
        return heads(q), heads(k), heads(v), [qkv]

    return {"coda: slices of the fused QKV": fused,
            "separate projections": lambda: (*(heads(x) for x in sep), sep),
            "contiguous [B, H, S, hd]": lambda: (*bhsd, bhsd),
            "transformers + Liger: q, k contiguous, v a view": lambda: (bhsd[0], bhsd[1], heads(sep[2]),
                                                                         bhsd[:2] + [sep[2]])}


def measure() -> dict:
    rows = []
    for model, (h, kv, hd) in SHAPES.items():
        token_major = torch.randn(BATCH, SEQ, h, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        for name, make in layouts(h, kv, hd).items():
            for grad_name, grad in (("token-major", token_major), ("head-major", token_major.contiguous())):
                def forward():
                    with torch.no_grad():
                        q, k, v, _ = make()
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

                def forward_backward():
                    q, k, v, leaves = make()
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    torch.autograd.grad(out, leaves, grad)

                row = {"model": model, "layout": name, "grad": grad_name, "fwd_ms": do_bench(forward, rep=300),
                       "fwd_bwd_ms": do_bench(forward_backward, rep=500)}
                harness.log(f"[attention_layout] {row}")
                rows.append(row)
    return {"rows": rows}


def table(rows: list[dict]) -> str:
    lines = ["| model | q, k, v | output gradient | forward ms | forward + backward ms | vs coda's |",
             "|---|---|---|---:|---:|---:|"]
    base = {(r["model"], r["grad"]): r["fwd_bwd_ms"] for r in rows if r["layout"].startswith("coda")}
    for r in rows:
        lines.append(f"| {r['model']} | {r['layout']} | {r['grad']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
                     f"{r['fwd_bwd_ms'] / base[(r['model'], r['grad'])]:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--merge", type=Path, help="re-render a measured JSON (runs anywhere), with --note")
    ap.add_argument("--note")
    args = ap.parse_args()
    protocol = ("Causal SDPA (enable_gqa), bf16, batch 2 x 4096, one layer's attention; triton's do_bench medians "
                "(forward under no_grad; forward + backward to the leaves' gradients).")
    data = harness.measured_or_merged(args.merge, "attention_layout.py", protocol, measure)
    harness.write_results(args.out, "attention_layout", data, table(data["rows"]),
                          (args.note,) if args.note else ())
    print(table(data["rows"]))


if __name__ == "__main__":
    main()
