"""Host time without the kernels: of one coda.gemm() call (plan lookup, argument binding, TMA
descriptors, output allocation, reduction finalize), and of one decoder layer of a coda model's
training step (forward and backward: the ops' Python, autograd, torch's own ops on tiny tensors).

When kernels are short (a block at D=2048 runs 13 GEMMs of 0.05-0.8 ms; Gemma 3 1B's layers are
host-bound on the H200, bench/tools/step_gaps.py) this time decides whether the GPU waits for
Python. The kernel launch is replaced by a no-op after each plan is built, so it runs anywhere
(through the interpreter for the first, real call on a CPU); Triton's and CUDA's own launch
overhead comes on top on a GPU. --models: bench/train.py's --tiny models (each family's
structure) with 1 and 5 layers, every coda and Triton kernel launch a no-op; a layer's time is
the difference over 4 (the ends cancel), and so are its counts: coda's GEMMs, and the torch ops
outside coda's operators that would launch a kernel on a GPU (not views or allocations), counted
in a second pass (the counting dispatch mode sees coda's operators as torch.library ops, not what
they run inside).

    python bench/tools/host_overhead.py [--calls 2000] [--models gemma3-1b,qwen3-1.7b]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

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


def _step_ms(train, name: str, layers: int, steps: int) -> float:
    """Median milliseconds of a forward+backward of the --tiny model with `layers` layers (CPU)."""
    family = train.MODELS[name]
    model = train.build("coda", train.hf_model(family, "cpu", 0, True, layers))
    batch = train.batches(family.shape(True, layers)["vocab_size"], 2, 16, False, "cpu")[0]
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        model(**batch).loss.backward()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[3:])


# Ops that launch no kernel: views, allocations (and coda's op wrappers, which run other ops).
_NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "expand", "split_with_sizes", "split", "slice", "select",
              "unsqueeze", "squeeze", "permute", "alias", "detach", "reshape", "as_strided", "empty", "empty_like",
              "empty_strided", "unbind", "narrow", "lift_fresh"}


def _step_ops(train, name: str, layers: int) -> tuple[int, int]:
    """(coda GEMMs, kernel-launching torch ops outside coda's operators) of one forward+backward of
    the --tiny model."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from coda.runtime.plan import Plan

    family = train.MODELS[name]
    model = train.build("coda", train.hf_model(family, "cpu", 0, True, layers))
    batch = train.batches(family.shape(True, layers)["vocab_size"], 2, 16, False, "cpu")[0]
    model(**batch).loss.backward()  # plans built
    counts = {"gemm": 0, "other": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in _NO_KERNEL and func.namespace != "coda":
                counts["other"] += 1
            return func(*args, **(kwargs or {}))

    execute = Plan.execute

    def counted(self, *args, **kwargs):
        counts["gemm"] += 1
        return execute(self, *args, **kwargs)

    Plan.execute = counted
    try:
        with Count():
            model(**batch).loss.backward()
    finally:
        Plan.execute = execute
    return counts["gemm"], counts["other"]


def per_layer(models: list[str], steps: int) -> dict[str, dict[str, float]]:
    """Host milliseconds, coda GEMMs and torch ops outside coda's operators per decoder layer
    (forward + backward) of each model, kernels stubbed. Stubs stay in place: run it in its own
    process."""
    import triton.runtime.interpreter as interpreter

    from coda.runtime.plan import Plan

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import train  # bench/train.py: the models measured there

    Plan._launch = lambda self, args: None
    interpreter.InterpretedFunction.run = lambda self, *args, **kwargs: None
    torch.set_num_threads(1)
    result = {}
    for name in models:
        ms = (_step_ms(train, name, 5, steps) - _step_ms(train, name, 1, steps)) / 4
        (g5, o5), (g1, o1) = _step_ops(train, name, 5), _step_ops(train, name, 1)
        result[name] = {"ms": ms, "gemms": (g5 - g1) / 4, "ops": (o5 - o1) / 4}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--models", help="comma-separated bench/train.py models: host time per layer instead")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    if args.models:
        for name, r in per_layer(args.models.split(","), args.steps).items():
            print(f"{name:16s} {r['ms']:6.2f} ms per layer, forward + backward (host only); {r['gemms']:.0f} coda GEMMs "
                  f"and {r['ops']:.0f} torch ops outside coda's operators a layer")
        return
    for name, us in measure(args.calls).items():
        print(f"{name:28s} {us:7.1f} us per call (host only)")


if __name__ == "__main__":
    main()
