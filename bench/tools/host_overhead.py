"""Host time of one coda.gemm() call, without the kernel: what a repeated call costs the CPU
(plan lookup, argument binding, TMA descriptors, output allocation, reduction finalize).

When kernels are short (a block at D=2048 runs 13 GEMMs of 0.05-0.8 ms) this time decides
whether the GPU waits for Python. The kernel launch is replaced by a no-op after each plan is
built, so it runs anywhere (through the interpreter for the first, real call on a CPU);
Triton's own launch overhead comes on top on a GPU.

    python bench/tools/host_overhead.py [--calls 2000]
"""

import argparse
import time

import torch

import coda
from coda.ops import epilogues as E
from coda.runtime import launch


class _NoLaunch:
    """Stands in for a compiled kernel: `kernel[grid](**args)` does nothing."""

    def __getitem__(self, grid):
        return lambda **kwargs: None


def cases(device: str) -> dict[str, object]:
    m, d, k = 256, 128, 128
    x, w = torch.randn(m, k, device=device).bfloat16(), torch.randn(d, k, device=device).bfloat16()
    res, g = torch.randn(m, d, device=device).bfloat16(), torch.randn(d, device=device).bfloat16()
    ones = torch.ones(m, device=device)
    return {
        "plain": lambda: coda.gemm(x, w.T),
        "row_scale": lambda: coda.gemm(x, w.T, E.row_scale, rstd=ones),
        "residual_norm_stats": lambda: coda.gemm(x, w.T, E.residual_norm_stats, residual=res, norm_weight=g),
        "rmsnorm_backward_residual": lambda: coda.gemm(x, w.T, E.rmsnorm_backward_residual, grad=res, x=res,
                                                       norm_weight=g, rstd=ones, zdz_over_d=ones),
    }


def measure(calls: int) -> dict[str, float]:
    """Microseconds per call of each case, kernel launch stubbed."""
    device = "cpu" if coda.runtime.interpreting() else "cuda"
    result = {}
    for name, f in cases(device).items():
        f()  # builds (and, here, runs) the plan
        for plan in launch._plans.values():
            plan.kernel, plan.direct = _NoLaunch(), None
        for _ in range(20):
            f()
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        result[name] = (time.perf_counter() - t0) / calls * 1e6
    launch._plans.clear()  # the stubbed plans must not serve later real calls
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    for name, us in measure(args.calls).items():
        print(f"{name:28s} {us:7.1f} us per call (host only)")


if __name__ == "__main__":
    main()
