"""Attention under the masks of training (issue 26, item 4): which torch kernel computes
transformers' causal-LM attention over packed documents, sliding windows and padding fastest,
measured against SDPA's causal kernel (attention with no document, window or pad).

Variants, each a layer's forward + backward (q, k, v gradients), bf16:
  sdpa_causal   SDPA is_causal: the yardstick (it ignores documents and windows: not a candidate)
  sdpa_mask     SDPA with the [B, 1, S, S] boolean mask (masks.py's boolean form)
  flash_varlen  flash attention over each document with flash's window, or over each row's tokens and
                its right-padded queries (masks.py's sequence form: what coda.models runs on a GPU)
  flex          torch.compile(flex_attention) with a block mask of the same rule
Cases, batch 2 x seq 4096, the train models' attention shapes (bench/train.py), documents of
seq/8 to seq/2 tokens as train.py packs them:
  gemma3_window         4 q / 1 kv heads of 256, window 512, one document a row
  gemma3_packed_window  the same over packed documents
  llama_packed          32 q / 8 kv heads of 64, packed
  qwen3_packed          16 q / 8 kv heads of 128, packed
  llama_padded          32 q / 8 kv heads of 64, the second row right-padded from token 2560 (5/8 of it)
Each variant is first checked against SDPA in fp32 with the boolean mask on the same inputs (the
largest relative error of output and gradients, which must stay within 2x bf16 sdpa_mask's own, and
sdpa_mask's within a few bf16 ulps, 2^-6 in bf16),
then timed (median, do_bench). first_s: its first call (flex's compile); mask_ms: building its mask
(once per forward, shared by the layers with that window).

    python bench/tools/attention.py --out DIR
    python bench/tools/attention.py --merge DIR/attention.json --out bench/results/attention_<commit>
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared harness, train.py

import torch

import harness
from coda.models import attention, masks
from harness import NOTES, log, rel_err

BATCH, SEQ = 2, 4096
CASES = {  # name: (q heads, kv heads, head_dim, window, layout: one document a row, packed or padded)
    "gemma3_window": (4, 1, 256, 512, "one"),
    "gemma3_packed_window": (4, 1, 256, 512, "packed"),
    "llama_packed": (32, 8, 64, None, "packed"),
    "qwen3_packed": (16, 8, 128, None, "packed"),
    "llama_padded": (32, 8, 64, None, "padded"),
}
VARIANTS = ("sdpa_causal", "sdpa_mask", "flash_varlen", "flex")


def _documents(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """[B, S] document index per token: train.py's packed rows."""
    from train import batches

    return masks.documents(batches(8, batch, seq, True, str(device), count=1)[0]["position_ids"])


def _padding(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """[B, S] attention_mask of the padded case: the last row right-padded from 5/8 of it."""
    pad = torch.ones(batch, seq, dtype=torch.long, device=device)
    pad[-1, seq * 5 // 8:] = 0
    return pad


def _flex(batch: int, seq: int, heads: int, kv: int, docs: torch.Tensor | None, window: int | None,
          pad: torch.Tensor | None):
    """(make_mask, run) of FlexAttention with the rule of masks.py, for q/k/v in token-major layout."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)

    def rule(b, h, qi, ki):
        ok = ki <= qi
        if docs is not None:
            ok = ok & (docs[b, qi] == docs[b, ki])
        if window is not None:
            ok = ok & (qi - ki < window)
        if pad is not None:
            ok = ok & (pad[b, ki] == 1)
        return ok

    def make_mask():
        return create_block_mask(rule, batch, None, seq, seq, device=harness.DEVICE)

    def run(q, k, v, block_mask, scale):
        q, k, v = (t.view(batch, seq, -1, t.shape[-1]).transpose(1, 2) for t in (q, k, v))
        out = compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=heads != kv)
        return out.transpose(1, 2).reshape(batch * seq, -1)

    return make_mask, run


def _variant(name: str, batch: int, seq: int, heads: int, kv: int, head_dim: int, docs: torch.Tensor | None,
             window: int | None, pad: torch.Tensor | None):
    """(make_mask, run(q, k, v, mask, scale)) of one variant."""
    dev = torch.device(harness.DEVICE)

    def coda_attend(q, k, v, mask, scale):
        return attention.attend(q, k, v, batch, seq, mask, scale)

    if name == "sdpa_causal":
        return (lambda: None), coda_attend
    if name in ("sdpa_mask", "flash_varlen"):
        sequences = name == "flash_varlen"
        if sequences and not attention.varlen_applies(dev, torch.bfloat16, head_dim):
            raise RuntimeError(f"torch {torch.__version__} has no variable-length flash attention with windows")
        return (lambda: masks.build(batch, seq, dev, padding=pad, docs=docs, window=window,
                                    sequences=sequences)), coda_attend
    return _flex(batch, seq, heads, kv, docs, window, pad)


def measure(batch: int = BATCH, seq: int = SEQ, cases: dict = CASES, variants: tuple[str, ...] = VARIANTS,
            dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """A row per case and variant (a variant that fails is a note)."""
    dev, rows = torch.device(harness.DEVICE), []
    packed_docs = _documents(batch, seq, dev)
    for case, (heads, kv, hd, window, layout) in cases.items():
        docs = packed_docs if layout == "packed" else None
        pad = _padding(batch, seq, dev) if layout == "padded" else None
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(batch * seq, n, hd, device=dev, generator=g) for n in (heads, kv, kv))
        grad = torch.randn(batch * seq, heads * hd, device=dev, generator=g).to(dtype)
        scale = hd ** -0.5
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        exact = masks.build(batch, seq, dev, padding=pad, docs=docs, window=window)
        ref_leaves = [t.requires_grad_() for t in (q, k, v)]
        ref_out = attention.attend(*ref_leaves, batch, seq, exact, scale)
        ref = [ref_out, *torch.autograd.grad(ref_out, ref_leaves, grad.float())]
        bound = None
        for name in variants:
            try:
                make_mask, run = _variant(name, batch, seq, heads, kv, hd, docs, window, pad)

                def step():
                    out = run(*leaves, mask, scale)
                    return [out, *torch.autograd.grad(out, leaves, grad)]

                _sync()
                start = time.perf_counter()
                mask = make_mask()
                got = step()
                _sync()
                first_s = time.perf_counter() - start
                err = max(rel_err(a, b) for a, b in zip(got, ref))
                if name == "sdpa_mask":
                    if dtype == torch.bfloat16 and err > 2 ** -6:
                        raise AssertionError(f"error {err:.3g} over a few bf16 ulps (2^-6)")
                    bound = 2 * err
                elif name != "sdpa_causal" and bound is not None and err > bound:
                    raise AssertionError(f"error {err:.3g} over 2x bf16 sdpa_mask's ({bound:.3g})")
                row = {"case": case, "heads": heads, "kv_heads": kv, "head_dim": hd, "window": window,
                       "layout": layout, "variant": name, "ms": harness.timed(step),
                       "mask_ms": harness.timed(make_mask), "first_s": first_s,
                       "error": None if name == "sdpa_causal" else err}
                rows.append(row)
                log(f"  {case:22s} {name:13s} {row['ms']:7.3f} ms  mask {row['mask_ms']:.3f} ms  first "
                    f"{first_s:.1f} s  error {err:.2e}")
            except Exception as exc:  # noqa: BLE001
                NOTES.append(f"{case} {name}: {type(exc).__name__}: {str(exc)[:300]}")
                log(f"  {case} {name}: {type(exc).__name__}: {str(exc)[:300]}")
    return rows


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def table(rows: list[dict]) -> str:
    causal = {r["case"]: r["ms"] for r in rows if r["variant"] == "sdpa_causal"}
    masked = {r["case"]: r["ms"] for r in rows if r["variant"] == "sdpa_mask"}
    lines = ["| case | heads (q / kv x dim) | window | variant | ms fwd+bwd | vs sdpa_causal | vs sdpa_mask | "
             "mask ms | first call s | error vs fp32 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = "-" if r["error"] is None else f"{r['error']:.1e}"
        lines.append(f"| {r['case']} | {r['heads']} / {r['kv_heads']} x {r['head_dim']} | {r['window'] or '-'} | "
                     f"{r['variant']} | {r['ms']:.3f} | {r['ms'] / causal[r['case']]:.2f} | "
                     f"{_faster(masked.get(r['case']), r['ms'])} | {r['mask_ms']:.3f} | {r['first_s']:.1f} | "
                     f"{err} |")
    return "\n".join(lines)


def _faster(masked_ms: float | None, ms: float) -> str:
    """How many times faster than sdpa_mask (- without it)."""
    return "-" if masked_ms is None else f"{masked_ms / ms:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--merge", type=Path, help="write <out>/attention.{json,md} from a measured JSON")
    args = ap.parse_args()
    data = harness.measured_or_merged(
        args.merge, "attention.py", f"batch {BATCH} x seq {SEQ}, bf16, forward + backward (q, k, v gradients) of one "
        "layer's attention, do_bench median; each variant checked first against fp32 SDPA with the boolean mask",
        lambda: {"rows": measure()})
    text = table(data["rows"])
    harness.write_results(args.out, "attention", data, text)
    log(text)


if __name__ == "__main__":
    main()
