"""Is the block's forward+backward bound by the host? (H200)

For each variant of the block at D (bench/ops_block.block_case), checked against its fp32
reference first: the step timed as the suites time it (do_bench median), the same step
replayed as one CUDA graph (the GPU's own time), and
the host's time to enqueue one step while the GPU is kept busy (no waiting on the GPU), with
the host functions that take it (cProfile, coda's variants).

    python bench/host_step.py --out DIR [--d 2048] [--variants coda_native,eager,liger]
    python bench/host_step.py --merge DIR/host_step_d2048.json --out bench/results/host_step
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

import harness
from harness import log
from ops_block import WIDTHS, block_case, block_steps


def enqueue_ms(fn, steps: int = 8, profile: cProfile.Profile | None = None) -> float:
    """Host ms per step with the GPU busy far longer than the host needs (it never waits),
    under `profile` when one is given."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU spin ahead of the steps
    if profile is not None:
        profile.enable()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    host = (time.perf_counter() - t) / steps * 1e3
    if profile is not None:
        profile.disable()
    torch.cuda.synchronize()
    return host


def table(data: dict) -> str:
    lines = ["| D | variant | timed ms | CUDA-graph replay ms | host ms per step |", "|---|---|---|---|---|"]
    for r in data["rows"]:
        graph = "-" if r["graph_ms"] is None else f"{r['graph_ms']:.3f}"
        lines.append(f"| {r['D']} | {r['variant']} | {r['timed_ms']:.3f} | {graph} | {r['host_ms']:.3f} |")
    return "\n".join(lines)


def merge(path: Path, out: Path, note: str | None = None) -> None:
    data = json.loads(path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    (out / path.name).write_text(json.dumps(data, indent=1))
    m = data["meta"]
    md = [f"# {path.stem}", "", f"{m['gpu']}, torch {m['torch']}, commit {m['commit']}; M=8192, bf16, the block "
          "forward+backward of bench/ops_block.py. timed: do_bench median; CUDA-graph replay: the same step "
          "captured once; host: the CPU's time to enqueue one step while the GPU is kept busy. coda's host "
          "profile (cProfile, 8 steps, by own time) is in the JSON.", "", *([note, ""] if note else []),
          table(data), ""]
    (out / f"{path.stem}.md").write_text("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--merge", type=Path, help="write <out>/<name>.{json,md} from a measured JSON")
    ap.add_argument("--note", help="with --merge: a line for the page")
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--f", type=int, default=0)
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--variants", default="coda_native,eager,liger")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out, args.note)
    if not args.f and args.d not in WIDTHS:
        ap.error(f"--d {args.d}: give --f (the FFN width); known: {WIDTHS}")
    case = block_case(args.m, args.d, args.f or WIDTHS[args.d])
    steps = block_steps(case)
    rows = []
    for name in args.variants.split(","):
        if name not in steps:
            log(f"{name}: not available")
            continue
        fn, check = steps[name]
        err = check(fn())
        if not err < 2e-2:
            log(f"{name}: error {err:.3g} against fp32, not timed")
            continue
        row = {"D": args.d, "variant": name, "err": err, "timed_ms": harness.timed(fn), "host_ms": enqueue_ms(fn)}
        if name.startswith("coda"):  # a second, profiled pass: the profiler slows the host down
            pr = cProfile.Profile()
            enqueue_ms(fn, profile=pr)
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
            row["profile_tottime"] = buf.getvalue()
        row["graph_ms"] = harness.graph_ms(fn)
        rows.append(row)
        log(f"D={args.d} {name:12s} timed {row['timed_ms']:.3f} ms, graph {row['graph_ms']}, "
            f"host {row['host_ms']:.3f} ms")
        if "profile_tottime" in row:
            print(row["profile_tottime"])
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": harness.commit()}
    (args.out / f"host_step_d{args.d}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
