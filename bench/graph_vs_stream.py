"""Where coda's block step spends its GPU time when launched as usual and when replayed as one
CUDA graph, kernel by kernel (H200).

The block step (native weights, forward+backward) replayed as a CUDA graph has timed slower than
the same step launched from Python (bench/results/block_kernels*). This profiles both (torch
profiler, CUPTI kernel records, `--iters` steps each, after warm-up) and lists each kernel's mean
GPU time per step on both paths, and the span of a step (first kernel start to last kernel end),
so that the difference can be put on kernels or on the gaps between them.

    python bench/graph_vs_stream.py --out DIR [--d 2048] [--iters 10]
    python bench/graph_vs_stream.py --merge DIR/graph_vs_stream.json --out bench/results/graph_vs_stream
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

import harness
from harness import NOTES, log
from ops_block import block_case, block_steps

WIDTHS = {2048: 8192, 4096: 14336}


def _graphed(fn):
    """fn captured once into a CUDA graph (after two warm-up calls on a side stream); its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def kernel_times(fn, iters: int) -> tuple[dict[str, float], float]:
    """({kernel name: mean GPU ms per call}, mean ms from a call's first kernel start to its last end)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
            torch.cuda.synchronize()  # calls apart: each span is one call's
    per: dict[str, float] = defaultdict(float)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in events:
        per[e.name] += (e.time_range.end - e.time_range.start) / 1000 / iters
    starts = sorted((e.time_range.start, e.time_range.end) for e in events)
    # calls are separated by a synchronize: a gap longer than 200 us starts a new call
    spans, first, last = [], None, None
    for start, end in starts:
        if first is None or start - last > 200:
            if first is not None:
                spans.append(last - first)
            first = start
        last = end if last is None else max(last, end)
    if first is not None:
        spans.append(last - first)
    return dict(per), sum(spans) / len(spans) / 1000 if spans else float("nan")


def measure(d: int, iters: int, m: int = 8192) -> dict:
    case = block_case(m, d, WIDTHS[d])
    fn, check = block_steps(case)["coda_native"]
    err = check(fn())
    if not err < 2e-2:
        raise AssertionError(f"coda_native error {err:.3g} vs fp32")
    replay = _graphed(fn)
    stream, stream_span = kernel_times(fn, iters)
    graph, graph_span = kernel_times(replay, iters)
    names = sorted(set(stream) | set(graph), key=lambda k: -max(stream.get(k, 0), graph.get(k, 0)))
    rows = [{"kernel": k, "stream_ms": stream.get(k, 0.0), "graph_ms": graph.get(k, 0.0)} for k in names]
    result = {"D": d, "err": err, "timed_ms": harness.timed(fn), "graph_timed_ms": harness.timed(replay),
              "stream_span_ms": stream_span, "graph_span_ms": graph_span,
              "stream_kernels_ms": sum(stream.values()), "graph_kernels_ms": sum(graph.values()), "rows": rows}
    log(f"  D={d} timed {result['timed_ms']:.3f} graph {result['graph_timed_ms']:.3f} ms; kernels "
        f"{result['stream_kernels_ms']:.3f} / {result['graph_kernels_ms']:.3f}; span {stream_span:.3f} / {graph_span:.3f}")
    return result


def table(data: dict) -> str:
    lines = []
    for w in data["widths"]:
        lines += [f"D={w['D']}: timed {w['timed_ms']:.3f} ms launched, {w['graph_timed_ms']:.3f} ms as a graph; "
                  f"kernel time per step {w['stream_kernels_ms']:.3f} / {w['graph_kernels_ms']:.3f} ms; span per step "
                  f"(first kernel start to last end, profiled) {w['stream_span_ms']:.3f} / {w['graph_span_ms']:.3f} ms.", "",
                  "| kernel | launched ms | graph ms | graph - launched |", "|---|---|---|---|"]
        lines += [f"| {r['kernel'][:90]} | {r['stream_ms']:.4f} | {r['graph_ms']:.4f} | {r['graph_ms'] - r['stream_ms']:+.4f} |"
                  for r in w["rows"]]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/graph_vs_stream"))
    ap.add_argument("--d", default="2048")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--merge", type=Path, help="write <out>/graph_vs_stream.{json,md} from a measured JSON")
    args = ap.parse_args()
    if args.merge:
        data = json.loads(args.merge.read_text())
    else:
        if not torch.cuda.is_available():
            sys.exit("graph_vs_stream.py measures on a CUDA GPU; --merge runs anywhere")
        torch.manual_seed(0)
        meta = harness.run_meta(f"coda_native block step, bf16, M=8192, untuned; torch.profiler CUDA kernel records, "
                                f"mean per step over {args.iters} steps each way after warm-up; timed = do_bench median")
        data = {"meta": meta, "widths": [], "notes": NOTES}
        for d in map(int, args.d.split(",")):
            try:
                data["widths"].append(measure(d, args.iters))
            except Exception as exc:  # noqa: BLE001
                NOTES.append(f"D={d}: {type(exc).__name__}: {str(exc)[:200]}")
    harness.write_results(args.out, "graph_vs_stream", data, table(data))
    log(table(data))


if __name__ == "__main__":
    main()
