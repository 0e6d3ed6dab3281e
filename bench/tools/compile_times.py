"""First-call compile time and correctness of the property tests' random epilogues on the GPU
(issue 27: every random program compiles in under 15 s, ptxas included, with no OutOfResources
and no hang).

Programs come from tests/test_properties.py's generator (derandomized, so every run draws the
same ones) at the shapes where the H200 once found first calls of 100 s and more, and at two
large ones. Each backend runs in its own process on empty coda and Triton caches: per program,
the first call's wall clock to a device synchronize (compile + run), the compile log's first
launches (CODA_COMPILE_LOG), and the result against the program's fp32 reference (the property
test's tolerances); any error is recorded with its type.

    python bench/tools/compile_times.py --out DIR [--per-shape 8] [--backends auto,triton]
    python bench/tools/compile_times.py --merge DIR/compile_times.json --out bench/results/compile_times --note "..."
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # the random-program generator and its reference check

Shapes = tuple[tuple[int, int, int], ...]
# (M, N, K): the slow first calls (three reductions at M=1, N=64, K=8192; grouped max
# reductions at M=1, N=2048, K=64; width-2 operands at M=129, N=2048, K=16), its OutOfResources
# shapes (M=128 and 7 at N=4096, K=1024), and a full tile grid.
SHAPES: Shapes = ((1, 64, 8192), (1, 2048, 64), (129, 2048, 16), (128, 4096, 1024), (7, 4096, 1024), (1024, 1024, 512))
LIMIT_S = 15.0


def draw_programs(per_shape: int, shapes: Shapes = SHAPES) -> list[tuple[tuple[int, int, int], object]]:
    """`per_shape` random programs for each shape, the same on every run (derandomized)."""
    from hypothesis import Phase, given, settings
    from test_properties import SETTINGS, programs

    drawn = []
    for shape in shapes:
        found = []

        @settings(max_examples=per_shape, database=None, derandomize=True, phases=[Phase.generate], **SETTINGS)
        @given(program=programs(*shape))
        def collect(program) -> None:
            found.append(program)

        collect()
        drawn += [(shape, p) for p in found]
    return drawn


def measure_backend(per_shape: int, shapes: Shapes = SHAPES) -> list[dict]:
    """In this process (its backend and caches set by the caller): every program's first call."""
    import torch

    import coda
    from test_properties import compare, int_matrix

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # CPU: the interpreter
    log_path = Path(os.environ["CODA_COMPILE_LOG"])
    rows = []
    for i, ((m, n, k), program) in enumerate(draw_programs(per_shape, shapes)):
        gen = torch.Generator().manual_seed(i)
        row = {"program": i, "m": m, "n": n, "k": k, "source": program.source()}
        seen = len(log_path.read_text().splitlines()) if log_path.exists() else 0
        try:
            ep = program.epilogue()
            a = int_matrix(m, k, torch.bfloat16, i % 2 == 1, gen)
            b = int_matrix(k, n, torch.bfloat16, i % 3 == 1, gen)
            operands = {p.name: p.make(m, n, gen) for p in program.params}
            sync()
            t0 = time.perf_counter()
            out = coda.runtime.run(ep.graph, a, b, operands)
            sync()
            row["first_call_s"] = time.perf_counter() - t0
            compare(ep.graph, out, ep.reference(a, b, **operands), a, b)
            row["correct"] = True
        except Exception as exc:  # recorded, and the next program runs
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        launches = [json.loads(line) for line in log_path.read_text().splitlines()[seen:]] if log_path.exists() else []
        row["launches"] = [{"kernel": x["kernel"], "backend": x["backend"], "config": x["config"],
                            "compile_s": x["seconds"]} for x in launches]
        print(f"[compile_times] {i} {m}x{n}x{k}: {row.get('first_call_s', float('nan')):.2f} s "
              f"{[x['backend'] for x in row['launches']]} {row.get('error', 'ok')}", flush=True)
        rows.append(row)
    return rows


def run_backend(backend: str, per_shape: int, timeout: float, shapes: Shapes = SHAPES) -> dict:
    """One fresh process for `backend` on empty caches; its rows, or why it stopped."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, CODA_CACHE_DIR=f"{tmp}/coda", TRITON_CACHE_DIR=f"{tmp}/triton",
                   CODA_COMPILE_LOG=f"{tmp}/compile.jsonl", CODA_AUTOTUNE="0")
        env["CODA_BACKEND"] = backend
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, __file__, "--worker", str(out), "--per-shape", str(per_shape),
               "--shapes", ",".join("x".join(map(str, s)) for s in shapes)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout)
            stopped = None if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            stopped = f"timed out after {timeout:.0f} s"
        rows = json.loads(out.read_text()) if out.exists() else []
        return {"backend": backend, "rows": rows, "stopped": stopped, "wall_s": time.perf_counter() - t0}


def table(runs: list[dict]) -> str:
    lines = ["| CODA_BACKEND | programs | errors | slowest first call (s) | median (s) | over 15 s | process |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        times = sorted(x["first_call_s"] for x in r["rows"] if "first_call_s" in x)
        errors = sum("error" in x for x in r["rows"])
        med = times[len(times) // 2] if times else float("nan")
        lines.append(f"| {r['backend']} | {len(r['rows'])} | {errors} | {max(times, default=float('nan')):.2f} | "
                     f"{med:.2f} | {sum(t > LIMIT_S for t in times)} | {r['stopped'] or 'finished'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--per-shape", type=int, default=8)
    ap.add_argument("--shapes", help="MxNxK,... instead of the issue's shapes (a tiny one, e.g. 3x16x8, lets the "
                                     "tests run a backend's worker on the CPU)")
    ap.add_argument("--backends", default="auto,triton", help="CODA_BACKEND values, one process each")
    ap.add_argument("--timeout", type=float, default=240, help="seconds a backend's process may run")
    ap.add_argument("--merge", type=Path, help="re-render a measured JSON (runs anywhere)")
    ap.add_argument("--note", help="a paragraph for the page: when, where, the command")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = tuple(tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")) if args.shapes else SHAPES
    if args.worker:
        args.worker.write_text(json.dumps(measure_backend(args.per_shape, shapes)))
        return
    if args.out is None:
        ap.error("--out is required")
    import harness

    protocol = ("Random programs of tests/test_properties.py (derandomized), per shape in "
                f"{', '.join('x'.join(map(str, s)) for s in shapes)}, bf16 a and b; each backend in a fresh process on "
                "empty caches, CODA_AUTOTUNE=0; first call = wall clock to a device synchronize; each result checked "
                "against its fp32 reference.")
    data = harness.measured_or_merged(args.merge, "compile_times.py", protocol, lambda: {
        "runs": [run_backend(b, args.per_shape, args.timeout, shapes) for b in args.backends.split(",")]})
    harness.write_results(args.out, "compile_times", data, table(data["runs"]), (args.note,) if args.note else ())
    print(table(data["runs"]))


if __name__ == "__main__":
    main()
