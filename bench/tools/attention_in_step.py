"""Is cuDNN's attention backward slower inside coda's training step than inside transformers'? At
Llama-3.2-1B's shape its backward kernel took 16.7 ms a step in coda's model against 15.5 ms in HF +
Liger's (the same kernel; train.json at 5f0d0df, H200), while attention_layout.py found 2-3% between
the layouts in isolation. This trains coda's model with its attention call swapped in turn: q, k, v as
coda hands them over (views of the fused QKV), copied contiguous [B, H, S, hd] first, and the latter
with the output gradient made contiguous head-major too; SDPA held to its flash kernel; and flash's
variable-length kernel with one sequence a row (coda's packed-documents call); each variant twice,
alternating, in one process. Step ms (median of 10, CUDA events) and one profiled step's top kernels per run.

    python bench/tools/attention_in_step.py --out DIR [--model llama3.2-1b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: train.py's model and data

import coda  # noqa: F401  (before anything imports Triton)
import torch
import torch.nn.functional as F

import coda.models.attention as attention
import coda.models.llama as llama
import coda.models.masks as masks
import train
from torch.nn.attention import SDPBackend, sdpa_kernel


class _HeadMajorGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (head-major for a [B, H, S, hd] output)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def _contiguous(head_major_grad: bool):
    def attend(q, k, v, batch, seq, mask, scale, softcap=None, keyless="zeros"):
        assert mask is None and softcap is None, "the causal path only"
        tokens, h, hd = q.shape
        bq, bk, bv = (t.view(batch, seq, -1, hd).transpose(1, 2).contiguous() for t in (q, k, v))
        out = F.scaled_dot_product_attention(bq, bk, bv, is_causal=True, scale=scale, enable_gqa=h != k.shape[1])
        out = _HeadMajorGrad.apply(out) if head_major_grad else out
        return out.transpose(1, 2).reshape(tokens, h * hd)
    return attend


def _flash_backend(q, k, v, batch, seq, mask, scale, softcap=None, keyless="zeros"):
    """coda's call with SDPA held to its flash kernel (FlashAttention-2), not the one it picks
    (cuDNN's on Hopper): on coda's layout flash's backward may fare otherwise."""
    assert mask is None and softcap is None, "the causal path only"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH):  # (the CPU test: MATH)
        return attention.attend(q, k, v, batch, seq, mask, scale)


def _varlen_rows(q, k, v, batch, seq, mask, scale, softcap=None, keyless="zeros"):
    """Flash's variable-length kernel with each row one sequence, as coda runs packed documents: it
    reads [T, H, hd] as coda hands it over, with no [B, H, S, hd] view."""
    assert mask is None and softcap is None, "the causal path only"
    starts = torch.arange(0, (batch + 1) * seq, seq, device=q.device, dtype=torch.int32)
    return attention.attend(q, k, v, batch, seq, masks.AttentionMask(starts=starts, longest=seq), scale)


def variants(device: torch.device) -> dict:
    """The attention calls compared, by name; the variable-length one only where flash runs it."""
    out = {"as_is": attention.attend, "contiguous_qkv": _contiguous(False),
           "contiguous_qkv_head_major_grad": _contiguous(True), "flash_backend": _flash_backend}
    if attention.varlen_applies(device, torch.bfloat16, 64):
        out["varlen_rows"] = _varlen_rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="llama3.2-1b", choices=sorted(train.MODELS))
    args = ap.parse_args()
    family = train.MODELS[args.model]
    model = train.coda_from_hf(train.hf_model(family, "cuda", 0, False, None))
    data = train.batches(family.shape(False, None)["vocab_size"], 2, 4096, False, "cuda")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4, fused=True)

    def step(i: int) -> None:
        model(**data[i % len(data)]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    runs = {}
    for name, attend in list(variants(torch.device("cuda")).items()) * 2:
        llama.attend = attend
        for i in range(3):
            step(i)
        times = train.cuda_step_ms(step, 10)
        _, top = train.breakdown(lambda: step(0), top=14)
        runs.setdefault(name, []).append({"step_ms": statistics.median(times), "top_kernels": top})
        print(f"[attention_in_step] {name}: {statistics.median(times):.2f} ms; "
              + "; ".join(f"{t['kernel'][:48]} {t['ms']:.2f}" for t in top[:6]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model}
    (args.out / f"attention_in_step_{args.model}.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
