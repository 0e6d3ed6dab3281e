"""The bf16 test's statistic over seeds: for each family's tiny test model (tests/test_families.py's
FROM_HF_CASES) and each weight seed, coda's bf16 error against HF in fp32, per parameter, over HF's own
bf16 error; the worst parameter's ratio err / (2 * hf_err + 2**-8) (the test passes at <= 1). Run
with coda's attention as chosen (varlen flash for windowed layers on a GPU), with SDPA's masked
kernel, the one transformers runs, and with HF's bf16 run and coda's both under SDPA's math backend
("math": the same attention arithmetic on both sides), to tell attention-kernel rounding from an
error in coda's own kernels.

    python bench/tools/bf16_seeds.py --out DIR [--families exaone4,qwen3] [--seeds 8] [--seq 64]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import coda  # noqa: E402
import coda.models.llama as coda_llama  # noqa: E402
from conftest import DEVICE, rel  # noqa: E402
from test_families import FROM_HF_CASES, SEQ, hf_model, run  # noqa: E402


def case(model_type: str, seed: int, seq: int) -> dict:
    hf32 = hf_model(model_type, seed, **FROM_HF_CASES[model_type])
    hf32.to(torch.bfloat16).float()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    (_, ref), (_, hf_default) = run(hf32, seq=seq), run(hf16, seq=seq)
    out = {"family": model_type, "seed": seed}
    chosen = coda_llama.varlen_applies
    for attn, applies in (("chosen", chosen), ("sdpa_mask", lambda *a: False), ("math", lambda *a: False)):
        coda_llama.varlen_applies = applies
        try:
            with sdpa_kernel(SDPBackend.MATH) if attn == "math" else contextlib.nullcontext():
                hf = run(copy.deepcopy(hf16), seq=seq)[1] if attn == "math" else hf_default
                model = coda.models.from_hf(copy.deepcopy(hf16))
                _, ours = run(model, seq=seq)
        finally:
            coda_llama.varlen_applies = chosen
        ratios = {n: rel(ours[n], g) / (2 * rel(hf[n], g) + 2**-8) for n, g in ref.items()}
        worst = max(ratios, key=ratios.get)
        out[attn] = {"worst": worst, "ratio": ratios[worst], "err": rel(ours[worst], ref[worst]),
                     "hf_err": rel(hf[worst], ref[worst])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--families", default="exaone4,qwen3,olmo2,glm4,gemma3_text")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per row (the test's: %(default)s)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model_type in args.families.split(","):
        for seed in range(args.seeds):
            row = case(model_type, seed, args.seq)
            rows.append(row)
            print(f"{model_type} seed {seed}: " + "; ".join(
                f"{k} {row[k]['ratio']:.2f} ({row[k]['worst']} {row[k]['err']:.3g} vs HF {row[k]['hf_err']:.3g})"
                for k in ("chosen", "sdpa_mask", "math")), flush=True)
            (args.out / "bf16_seeds.json").write_text(json.dumps({"device": str(DEVICE), "seq": args.seq, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
