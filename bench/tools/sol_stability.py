"""How steady the block's speed of light (SoL) is within one process, and how it is captured (H200).

The block's ratios are taken against its SoL graph (its bare cuBLAS GEMMs back to back in one CUDA
graph), which is only as good as it is steady. This times, in `--rounds` rounds per width in one
process: the SoL graph as block_kernels captures it (every GEMM's output kept, distinct buffers), the
same GEMMs captured with each output dropped at once (buffers reused), the sum of each GEMM timed
alone, and coda's block step (native weights), each followed by the GPU's SM clock, power draw and
temperature (nvidia-smi). (Its first run showed the SoL graph reading freed inputs: fixed in
harness.graphed at f0e466d.)

    python bench/tools/sol_stability.py --out DIR [--d 2048,4096] [--rounds 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared harness

import torch

import harness
from harness import log, rand
from ops_block import WIDTHS, block_case, block_steps, sol_replay

SMI = "clocks.sm,power.draw,temperature.gpu,power.limit"


def gpu_state() -> dict:
    """The GPU's SM clock (MHz), power draw and limit (W) and temperature (C) now."""
    out = subprocess.run(["nvidia-smi", f"--query-gpu={SMI}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout.split("\n")[0]
    return dict(zip(("sm_mhz", "power_w", "temp_c", "power_limit_w"), (float(v) for v in out.split(","))))


def measure(d: int, rounds: int, m: int = 8192) -> list[dict]:
    case = block_case(m, d, WIDTHS[d])
    shapes = case["fwd"] + case["bwd"]
    step, check = block_steps(case)["coda_native"]
    err = check(step())
    if not err < 2e-2:
        raise AssertionError(f"coda_native error {err:.3g} vs fp32")
    kept = sol_replay(shapes)
    pairs = [(rand(mm, k), rand(n, k, scale=k**-0.5)) for mm, n, k in shapes]

    def dropped_outputs() -> None:
        for a, w in pairs:
            a @ w.T

    dropped = harness.graphed(dropped_outputs)
    timings = {"sol_kept_ms": lambda: harness.timed(kept), "sol_dropped_ms": lambda: harness.timed(dropped),
               "sum_alone_ms": lambda: sum(harness.timed(lambda a=a, w=w: a @ w.T) for a, w in pairs),
               "coda_native_ms": lambda: harness.timed(step)}
    out = []
    for r in range(rounds):
        row: dict = {"D": d, "round": r}
        for name, time_it in timings.items():
            row[name] = time_it()
            row[name.replace("_ms", "_gpu")] = gpu_state()
        row["ratio_kept"] = row["coda_native_ms"] / row["sol_kept_ms"]
        log(f"  D={d} round {r}: SoL kept {row['sol_kept_ms']:.3f} dropped {row['sol_dropped_ms']:.3f} "
            f"sum alone {row['sum_alone_ms']:.3f} coda_native {row['coda_native_ms']:.3f} ms "
            f"({row['ratio_kept']:.3f}x kept SoL); {row['coda_native_gpu']}")
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| D | round | SoL graph (outputs kept) | SoL graph (outputs dropped) | sum of GEMMs alone | coda_native "
             "| coda / SoL kept | SM MHz, W, C after coda |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["coda_native_gpu"]
        lines.append(f"| {r['D']} | {r['round']} | {r['sol_kept_ms']:.3f} | {r['sol_dropped_ms']:.3f} | "
                     f"{r['sum_alone_ms']:.3f} | {r['coda_native_ms']:.3f} | {r['ratio_kept']:.3f} | "
                     f"{g['sm_mhz']:.0f}, {g['power_w']:.0f}, {g['temp_c']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--d", default="2048,4096")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sol_stability needs a CUDA GPU")
    rows = [row for d in map(int, args.d.split(",")) for row in measure(d, args.rounds)]
    data = {"meta": harness.run_meta("do_bench median, bf16, M=8192; rounds in one process"), "rows": rows, "notes": []}
    harness.write_results(args.out, "sol_stability", data, table(rows))


if __name__ == "__main__":
    main()
