"""What every GPU benchmark script here shares: check-then-time rows (the protocol: docs/PERFORMANCE.md)."""

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

DEVICE = "cuda"  # where inputs are made (a CPU smoke run of a script may change it)
ROWS: list[dict] = []  # {"op", "M", "N", "K", "variant", "ms", "tflops"}
NOTES: list[str] = []  # variants that failed or were skipped, with why


def commit() -> str:
    """The commit measured: $CODA_COMMIT first (the device machine's copy of the tree carries a
    stale .git, so its `git rev-parse` names an older commit), else this checkout's HEAD."""
    if os.environ.get("CODA_COMMIT"):
        return os.environ["CODA_COMMIT"]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent)
    return head.stdout.strip() or "unknown"


def run_meta(protocol: str, **extra: object) -> dict:
    """What a results file records about its run: the GPU, the versions, the commit measured,
    any `extra` facts, and the protocol."""
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit(), "python": platform.python_version(), **extra, "protocol": protocol}


def measured_or_merged(merge: Path | None, script: str, protocol: str, measure: Callable[[], dict]) -> dict:
    """A script's data: read back from `merge` (a JSON it measured before; runs anywhere), else
    measured now on a CUDA GPU, seeded: {"meta": run_meta(protocol), **measure(), "notes"}."""
    if merge:
        return json.loads(merge.read_text())
    if not torch.cuda.is_available():
        sys.exit(f"{script} measures on a CUDA GPU; --merge runs anywhere")
    torch.manual_seed(0)
    return {"meta": run_meta(protocol), **measure(), "notes": NOTES}


def write_results(out: Path, name: str, data: dict, table: str, preface: tuple[str, ...] = ()) -> None:
    """<out>/<name>.json (`data`: {"meta", "notes", ...}) and <out>/<name>.md: the run's GPU,
    versions and commit, its protocol, `preface` paragraphs, the table, then the notes."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    meta = data["meta"]
    md = [f"# {name}", "", f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}.",
          "", meta["protocol"], ""]
    for paragraph in preface:
        md += [paragraph, ""]
    md += [table, ""] + [f"* {n}" for n in data["notes"]]
    (out / f"{name}.md").write_text("\n".join(md) + "\n")


def log(msg: str) -> None:
    print(msg, flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def gemm_reference(graph, a: torch.Tensor, b: torch.Tensor, operands: dict) -> dict[str, torch.Tensor]:
    """A coda GEMM's fp32 oracle: its epilogue graph on the fp32 product, every output by name."""
    from coda.ir.reference import evaluate

    return evaluate(graph, a.float() @ b.float(), operands)


def gemm_error(result, ref: dict[str, torch.Tensor]) -> float:
    """The largest relative error of a coda GEMM's result (a tensor or a dict) against its oracle."""
    outs = result if isinstance(result, dict) else {next(iter(ref)): result}
    return max(rel_err(outs[k], ref[k]) for k in ref)


def timed(fn) -> float:
    import triton

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def heat(fn, seconds: float) -> None:
    """Run fn back to back for `seconds`, so that what is timed next runs at the clock the H200 holds
    under sustained GEMM load (power-bound near its 700 W: 1410-1485 MHz in bench/results/sol_stability),
    not the higher one it starts from after idling through compiles and checks (1980 MHz)."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        torch.cuda.synchronize()


def graphed(fn):
    """fn captured once into a CUDA graph (after two warm-up calls on a side stream; outputs and
    grads reused); its replay, which holds fn: the graph reads the tensors fn's closure holds, and
    once freed their memory is reused, or given back to the driver by the next capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()

    def replay(_inputs=fn) -> None:
        g.replay()

    return replay


def graph_ms(fn) -> float | None:
    """The step captured once into a CUDA graph (`graphed`) and replayed."""
    try:
        return timed(graphed(fn))
    except Exception as exc:  # noqa: BLE001
        log(f"  graph capture failed: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def record(op: str, shape: tuple[int, int, int], variant: str, fn, check=None) -> None:
    """Check fn's result with `check(result) -> error` (must be < 2e-2), then time it."""
    m, n, k = shape
    try:
        if check is not None:
            err = check(fn())
            if not err < 2e-2:
                raise AssertionError(f"error {err:.3g} vs the fp32 reference")
        ms = timed(fn)
    except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
        log(f"  {op:13s} {variant:30s} FAILED: {type(exc).__name__}: {str(exc)[:160]}")
        NOTES.append(f"{op} {shape} {variant}: {type(exc).__name__}: {str(exc)[:200]}")
        return
    ROWS.append({"op": op, "M": m, "N": n, "K": k, "variant": variant, "ms": ms,
                 "tflops": 2.0 * m * n * k / (ms * 1e-3) / 1e12})
    log(f"  {op:13s} M={m:6d} N={n:6d} K={k:6d} {variant:30s} {ms:8.4f} ms")


def compiled(op: str, shape, fn, check, modes: list[str]) -> None:
    for mode in modes:
        t0 = time.time()
        cfn = torch.compile(fn) if mode == "default" else torch.compile(fn, mode=mode)
        try:
            cfn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            NOTES.append(f"{op} {shape} compile_{mode}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        log(f"  (torch.compile {mode}: {time.time() - t0:.0f} s)")
        record(op, shape, f"compile_{mode}", cfn, check)
    torch._dynamo.reset()


def by_shape(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """(op, M, N, K) -> {variant: ms}, in measuring order."""
    groups: dict[tuple, dict[str, float]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["M"], r["N"], r["K"]), {})[r["variant"]] = r["ms"]
    return groups


def fastest_compile(variants: dict[str, float]) -> float | None:
    """The benchmark protocol's compile: the faster of the torch.compile modes measured."""
    times = [t for name, t in variants.items() if name.startswith("compile_")]
    return min(times) if times else None


def ratio(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None else x / y


def rand(*shape: int, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(torch.bfloat16).requires_grad_(grad)
