"""Write an epilogue, run it fused into a GEMM with coda.gemm, and check it against its fp32 reference.

The epilogue below scales each output row by a per-row factor, adds a per-column bias, applies
SwiGLU to the interleaved gate/up column pairs and also returns each row's maximum: one kernel,
the GEMM's output never written to memory before its epilogue ran.

    python examples/custom_epilogue.py                       # small sizes: seconds on the CPU
    python examples/custom_epilogue.py --m 8192 --n 16384 --k 2048   # a Llama MLP's shape, on a GPU

Without a CUDA GPU, coda runs its kernels through Triton's interpreter.
"""

from __future__ import annotations

import argparse

import torch

import coda


@coda.epilogue
def scaled_swiglu(acc, rstd: coda.VecM, bias: coda.VecN):
    z = acc * rstd + bias               # rstd: one value per row, bias: one per column
    gate, up = coda.pairs(z)            # columns (2i, 2i+1) -> two half-width tiles
    return {"y": coda.silu(gate) * up, "row_max": coda.reduce_n(z, "max")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=64, help="rows (tokens)")
    ap.add_argument("--n", type=int, default=96, help="output columns (even: gate/up pairs)")
    ap.add_argument("--k", type=int, default=48, help="reduction size (hidden size)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--show-source", action="store_true", help="print the generated Triton source too")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    x = torch.randn(args.m, args.k, device=device).to(dtype)
    w = (torch.randn(args.n, args.k, device=device) * args.k**-0.5).to(dtype)  # an nn.Linear weight: [out, in]
    rstd = torch.rand(args.m, device=device) + 0.5
    bias = torch.randn(args.n, device=device) * 0.1

    out = coda.gemm(x, w.T, scaled_swiglu, rstd=rstd, bias=bias)  # w.T: a transposed view, no copy
    ref = scaled_swiglu.reference(x, w.T, rstd=rstd, bias=bias)    # the same graph, evaluated in fp32 torch

    print(scaled_swiglu.graph)
    if args.show_source:
        print(scaled_swiglu.source(x, w.T, rstd=rstd, bias=bias))
    worst = 0.0
    for name, r in ref.items():
        err = ((out[name].float() - r.float()).norm() / r.float().norm()).item()
        worst = max(worst, err)
        print(f"{name}: {tuple(out[name].shape)} {out[name].dtype}, relative error {err:.2e} against the fp32 reference")
    tolerance = 2e-2 if dtype != torch.float32 else 1e-4
    if not worst < tolerance:
        raise SystemExit(f"relative error {worst:.2e} above {tolerance:.0e}")
    print(f"ok: every output within {tolerance:.0e} of the fp32 reference")


if __name__ == "__main__":
    main()
