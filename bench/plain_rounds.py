"""Does the gluon-hopper default pick the faster schedule for a plain GEMM by tile rounds (H200)?

The default runs plain GEMMs cooperative (128x256 tiles) unless those tiles would leave the
persistent grid's busiest SM clearly more work than ping-pong's 128x128
(`coda.runtime.config.cooperative_rounds_lose`). For shapes on both sides of that rule, and
both memory orders of a, time coda's plain GEMM under the default config, forced cooperative and
forced ping-pong, beside torch.matmul (cuBLAS) of the same operands; every variant is checked
against fp32 first.

    CODA_AUTOTUNE=0 python bench/plain_rounds.py --out DIR
    python bench/plain_rounds.py --merge DIR/plain_rounds.json --out bench/results/plain_rounds
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import coda
import harness
from coda.runtime import launch
from coda.runtime.config import cooperative_rounds_lose, default_config
from harness import NOTES, gemm_error, gemm_reference, log

# [M, N, K]: D=2048's qkv weight gradient (the rule picks ping-pong), then D=4096's and three
# of the block's plain GEMMs where it keeps cooperative
SHAPES = [(3072, 2048, 8192), (6144, 4096, 8192), (2048, 2048, 8192), (8192, 2048, 2048), (2048, 8192, 8192)]
FORCED = {
    "cooperative": dict(block_m=128, block_n=256, block_k=64, num_warps=4, num_stages=3, subtile=8,
                        cooperative=True),
    "ping-pong": dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4, subtile=4),
}


def measure() -> list[dict]:
    rows = []
    forced = [(label, coda.Config(backend="gluon-hopper", **c)) for label, c in FORCED.items()]
    for m, n, k in SHAPES:
        for a_order in ("row", "col"):
            a = (torch.randn(m, k) if a_order == "row" else torch.randn(k, m).T).to("cuda", torch.bfloat16)
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            ref = gemm_reference(launch.PLAIN, a, b, {})
            default = default_config(launch.PLAIN, "bfloat16", False, m, n, k, "gluon-hopper")
            base = {"shape": [m, n, k], "a": a_order, "rule_picks": "ping-pong" if cooperative_rounds_lose(m, n)
                    else "cooperative", "default_cooperative": default.cooperative}
            blas = harness.timed(lambda: a @ b)
            rows.append({**base, "variant": "cuBLAS", "ms": blas})
            for name, cfg in [("default", default)] + forced:
                try:
                    err = gemm_error(launch.run(launch.PLAIN, a, b, {}, config=cfg), ref)
                    if not err < 2e-2:
                        raise AssertionError(f"error {err:.3g} vs fp32")
                    ms = harness.timed(lambda: launch.run(launch.PLAIN, a, b, {}, config=cfg))
                    rows.append({**base, "variant": name, "ms": ms, "err": err})
                    log(f"  [{m}, {n}, {k}] a {a_order:3s} {name:12s} {ms:.4f} ms, x cuBLAS {ms / blas:.3f}")
                except Exception as exc:  # noqa: BLE001
                    NOTES.append(f"[{m}, {n}, {k}] a {a_order} {name}: {type(exc).__name__}: {str(exc)[:200]}")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| GEMM [M, N, K] | a | rule picks | cuBLAS ms | default (x cuBLAS) | cooperative | ping-pong |",
             "|---|---|---|---|---|---|---|"]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((tuple(r["shape"]), r["a"]), {})[r["variant"]] = r
    for (shape, a_order), g in groups.items():
        blas = g["cuBLAS"]["ms"]
        cell = lambda v: f"{g[v]['ms']:.4f} ({g[v]['ms'] / blas:.3f})" if v in g else "-"  # noqa: E731
        lines.append(f"| {list(shape)} | {a_order} | {g['cuBLAS']['rule_picks']} | {blas:.4f} | {cell('default')} | "
                     f"{cell('cooperative')} | {cell('ping-pong')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/plain_rounds"))
    ap.add_argument("--merge", type=Path, help="write <out>/plain_rounds.{json,md} from a measured JSON")
    args = ap.parse_args()
    data = harness.measured_or_merged(args.merge, "plain_rounds.py", "do_bench median, bf16, untuned configs given "
                                      "explicitly; each checked against fp32 first; cuBLAS = a @ b of the same "
                                      "operands in the same run", lambda: {"rows": measure()})
    harness.write_results(args.out, "plain_rounds", data, table(data["rows"]))
    log(table(data["rows"]))


if __name__ == "__main__":
    main()
