"""Where coda's block step spends its GPU time when launched as usual and when replayed as one
CUDA graph, kernel by kernel (H200).

The block step (native weights, forward+backward) replayed as a CUDA graph has timed slower than
the same step launched from Python (bench/results/block_kernels*). This profiles both (torch
profiler, CUPTI kernel records, `--iters` steps each, after warm-up) and lists each kernel's mean
GPU time per step on both paths, with the sums of kernel time against each path's timed step
(and the same for the SoL graph of the block's bare cuBLAS GEMMs): what is not kernel time is
gaps between kernels.

    python bench/graph_vs_stream.py --out DIR [--d 2048] [--iters 10]
    python bench/graph_vs_stream.py --merge DIR/graph_vs_stream.json --out bench/results/graph_vs_stream
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch

import harness
from harness import NOTES, log
from ops_block import WIDTHS, block_case, block_steps, sol_replay



def kernel_times(fn, iters: int) -> dict[str, float]:
    """{kernel name: mean GPU ms per call} over `iters` calls, after warm-up."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += (e.time_range.end - e.time_range.start) / 1000 / iters
    return dict(per)


def measure(d: int, iters: int, m: int = 8192) -> dict:
    case = block_case(m, d, WIDTHS[d])
    fn, check = block_steps(case)["coda_native"]
    err = check(fn())
    if not err < 2e-2:
        raise AssertionError(f"coda_native error {err:.3g} vs fp32")
    replay, sol = harness.graphed(fn), sol_replay(case["fwd"] + case["bwd"])
    stream, graph, sol_kernels = kernel_times(fn, iters), kernel_times(replay, iters), kernel_times(sol, iters)
    names = sorted(set(stream) | set(graph), key=lambda k: -max(stream.get(k, 0), graph.get(k, 0)))
    rows = [{"kernel": k, "stream_ms": stream.get(k, 0.0), "graph_ms": graph.get(k, 0.0)} for k in names]
    result = {"D": d, "err": err, "timed_ms": harness.timed(fn), "graph_timed_ms": harness.timed(replay),
              "sol_timed_ms": harness.timed(sol), "stream_kernels_ms": sum(stream.values()),
              "graph_kernels_ms": sum(graph.values()), "sol_kernels_ms": sum(sol_kernels.values()), "rows": rows}
    log(f"  D={d} timed {result['timed_ms']:.3f} graph {result['graph_timed_ms']:.3f} SoL {result['sol_timed_ms']:.3f} ms; "
        f"kernels {result['stream_kernels_ms']:.3f} / {result['graph_kernels_ms']:.3f} / {result['sol_kernels_ms']:.3f}")
    return result


def table(data: dict) -> str:
    lines = []
    for w in data["widths"]:
        lines += [f"D={w['D']}: timed {w['timed_ms']:.3f} ms launched, {w['graph_timed_ms']:.3f} ms as a graph, "
                  f"{w['sol_timed_ms']:.3f} ms the SoL graph (its 12 cuBLAS GEMMs); the profiled kernels' time per step "
                  f"{w['stream_kernels_ms']:.3f} / {w['graph_kernels_ms']:.3f} / {w['sol_kernels_ms']:.3f} ms.", "",
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

    def widths() -> dict:
        out = []
        for d in map(int, args.d.split(",")):
            try:
                out.append(measure(d, args.iters))
            except Exception as exc:  # noqa: BLE001
                NOTES.append(f"D={d}: {type(exc).__name__}: {str(exc)[:200]}")
        return {"widths": out}

    data = harness.measured_or_merged(
        args.merge, "graph_vs_stream.py", f"coda_native block step, bf16, M=8192, untuned; torch.profiler CUDA kernel "
        f"records, mean per step over {args.iters} steps each way after warm-up; timed = do_bench median", widths)
    harness.write_results(args.out, "graph_vs_stream", data, table(data))
    log(table(data))


if __name__ == "__main__":
    main()
