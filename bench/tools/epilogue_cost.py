"""Where a heavy epilogue's time goes on gluon-hopper, and which epilogue options hide it (H200).

For the block's heaviest fused GEMMs at D=2048 (short K: the epilogue is longest next to the
K loop), time each one under gluon-hopper configs that vary the epilogue's pipelining (Tile-
operand ring slots `epi_stages`, TMA store staging buffers `store_buffers`, subtile width, ring
depth), next to the bare cuBLAS GEMM and coda's own plain GEMM of the same shape; and, for the
SwiGLU backward, two halves of its epilogue (its loads alone, its stores alone) to tell which
one costs. Every kernel is checked against its fp32 reference before it is timed.

    python bench/tools/epilogue_cost.py --out DIR
    python bench/tools/epilogue_cost.py --out DIR --cases residual_norm_stats --configs "sub4 e2 b1" --ks 64,2048,8192
    python bench/tools/epilogue_cost.py --out DIR --alone no --cases rms_qknorm_rope_hd64,qknorm_rope_backward_hd64 \
        --configs "m64 sub2,m64 n256 sub4"
    python bench/tools/epilogue_cost.py --merge DIR/epilogue_cost.json --out bench/results/epilogue_cost --name NAME
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared harness

import torch

import coda
from coda.ops import epilogues as E
from coda.ops.qknorm import qknorm_columns
from coda.runtime import launch
import harness
from harness import NOTES, gemm_error, gemm_reference, log, rand


@coda.epilogue
def swiglu_loads_only(acc, z: coda.Tile(width=2)):
    """The SwiGLU backward's Tile load and row sum, no tile stores."""
    gate, up = coda.pairs(z)
    return coda.reduce_n(acc * gate * up, "sum")


@coda.epilogue
def swiglu_stores_only(acc):
    """The SwiGLU backward's stores (dz of width 2, y), no Tile load."""
    return {"dz": coda.interleave(acc, acc * 2.0), "y": acc}


@coda.epilogue
def swiglu_math_only(acc):
    """The SwiGLU backward's arithmetic on the accumulator alone (acc plays gate and up), stored
    as one plain output: its instructions without its memory traffic."""
    s = coda.sigmoid(acc)
    dgate = acc * acc * s * (1.0 + acc * (1.0 - s))
    dup = acc * acc * s
    return acc * dgate + acc * dup + acc * s * acc


@coda.epilogue
def swiglu_backward_keep_h(acc, z: coda.Tile(width=2)):
    """The SwiGLU backward if the forward's h were kept for dW_down: swiglu_backward_zdz without
    its y output (a third of its stores), at M x FFN of activation memory a layer."""
    gate, up = coda.pairs(z)
    s = coda.sigmoid(gate)
    dgate, dup = acc * up * s * (1.0 + gate * (1.0 - s)), acc * gate * s
    return {"dz": coda.interleave(dgate, dup), "zdz": coda.reduce_n(gate * dgate + up * dup, "sum")}


def _case(name: str, m: int, d: int, f: int, k: int | None = None) -> tuple:
    """(epilogue, a, b, operands) of one block GEMM at D=d, FFN=f (b = W.T, nn.Linear layout);
    `k` replaces the GEMM's inner size (64: the epilogue alone, next to a negligible K loop)."""
    kd = k or d
    dev = harness.DEVICE
    if name == "swiglu_backward_zdz":
        return E.swiglu_backward_zdz, rand(m, kd), rand(f, kd, scale=kd**-0.5).T, {"z": rand(m, 2 * f)}
    if name == "swiglu_backward_keep_h":
        return swiglu_backward_keep_h, rand(m, kd), rand(f, kd, scale=kd**-0.5).T, {"z": rand(m, 2 * f)}
    if name == "swiglu_loads_only":
        return swiglu_loads_only, rand(m, kd), rand(f, kd, scale=kd**-0.5).T, {"z": rand(m, 2 * f)}
    if name == "swiglu_stores_only":
        return swiglu_stores_only, rand(m, kd), rand(f, kd, scale=kd**-0.5).T, {}
    if name == "swiglu_math_only":
        return swiglu_math_only, rand(m, kd), rand(f, kd, scale=kd**-0.5).T, {}
    if name == "plain_swiglu_shape":
        return None, rand(m, kd), rand(f, kd, scale=kd**-0.5).T, {}
    if name == "plain_d":  # the residual/RMSNorm GEMMs' [M, D] output with no epilogue (for ncu beside them)
        return None, rand(m, kd), rand(d, kd, scale=kd**-0.5).T, {}
    if name == "residual_norm_stats":
        return (E.residual_norm_stats, rand(m, kd), rand(d, kd, scale=kd**-0.5).T,
                {"residual": rand(m, d), "norm_weight": (1 + 0.1 * torch.randn(d, device=dev))})
    if name == "rmsnorm_backward_residual":
        k = k or 3 * d // 2  # the QKV width of 32/8 heads
        return (E.rmsnorm_backward_residual, rand(m, k), rand(k, d, scale=k**-0.5),
                {"grad": rand(m, d), "x": rand(m, d), "norm_weight": 1 + 0.1 * torch.randn(d, device=dev),
                 "rstd": torch.rand(m, device=dev) + 0.5, "zdz_over_d": torch.randn(m, device=dev) * 0.01})
    if name == "rms_swiglu":
        return E.rms_swiglu, rand(m, kd), rand(2 * f, kd, scale=kd**-0.5).T, {"rstd": torch.rand(m, device=dev) + 0.5}
    if name == "rms_rope":
        q = 3 * d // 2
        return (E.rms_rope, rand(m, kd), rand(q, kd, scale=kd**-0.5).T,
                {"rstd": torch.rand(m, device=dev) + 0.5, "pos": torch.arange(m, device=dev) % 4096,
                 "freq": torch.rand(q // 2, device=dev) * 0.5})
    if name.startswith(("rms_qknorm_rope_hd", "qknorm_rope_backward_hd")):  # QK-norm, d / hd q heads, a 4th as kv
        hd = int(name.rpartition("hd")[2])
        heads = max(1, d // hd)
        kv = max(1, heads // 4)
        n = (heads + 2 * kv) * hd  # 3 d / 2 from 4 heads on, as rms_rope's
        norms = 1 + 0.1 * torch.randn(2, hd, device=dev)
        qk_weight, qk_mask = qknorm_columns(norms[0], norms[1], heads, kv)
        ops = {"rstd": torch.rand(m, device=dev) + 0.5, "qk_weight": qk_weight, "qk_mask": qk_mask, "eps": 1e-6,
               "pos": torch.arange(m, device=dev) % 4096, "freq": torch.rand(n // 2, device=dev) * 0.5}
        ep = E.rms_qknorm_rope(hd)
        if name.startswith("qknorm_rope_backward"):
            ep, ops = E.qknorm_rope_backward(hd), {**ops, "grad": rand(m, n)}
        return ep, rand(m, kd), rand(n, kd, scale=kd**-0.5).T, ops
    raise ValueError(name)


CASES = ["swiglu_backward_zdz", "swiglu_backward_keep_h", "swiglu_loads_only", "swiglu_stores_only", "swiglu_math_only", "plain_swiglu_shape",
         "plain_d", "residual_norm_stats", "rmsnorm_backward_residual", "rms_swiglu", "rms_rope",
         # QK-norm at head_dim 64 (128 too by name, which Triton's 64-column subtiles cannot run)
         "rms_qknorm_rope_hd64", "qknorm_rope_backward_hd64"]
BASE = dict(backend="gluon-hopper", block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4)
CONFIGS = {
    "sub4 e2 b1": dict(subtile=4),
    "sub4 e4 b1": dict(subtile=4, epi_stages=4),
    "sub4 e2 b2": dict(subtile=4, store_buffers=2),
    "sub4 e4 b2": dict(subtile=4, epi_stages=4, store_buffers=2),
    "sub4 e3 b2 st3": dict(subtile=4, epi_stages=3, store_buffers=2, num_stages=3),
    "sub2 e2 b1": dict(subtile=2),
    "sub2 e2 b2": dict(subtile=2, store_buffers=2),
    "sub8 e4 b2": dict(subtile=8, epi_stages=4, store_buffers=2),
    "sub8 e2 b1": dict(subtile=8),
    "sub8 e4 b1": dict(subtile=8, epi_stages=4),
    "sub8 e2 b2": dict(subtile=8, store_buffers=2),
    "sub4 loop": dict(subtile=4, epilogue_loop=True),
    "sub8 loop": dict(subtile=8, epilogue_loop=True),
    "sub4 loop b2": dict(subtile=4, epilogue_loop=True, store_buffers=2),
    "sub4 st5 b2": dict(subtile=4, num_stages=5, store_buffers=2),
    "sub4 loop g16": dict(subtile=4, epilogue_loop=True, group_m=16),
    "sub4 loop g4": dict(subtile=4, epilogue_loop=True, group_m=4),
    "sub8 loop st5": dict(subtile=8, epilogue_loop=True, num_stages=5),
    "sub8 st5": dict(subtile=8, num_stages=5),
    "sub8 st6": dict(subtile=8, num_stages=6),
    "sub4 e2 ptr-stores": dict(subtile=4, tma_store=False),
    "sub4 loop ptr-stores": dict(subtile=4, epilogue_loop=True, tma_store=False),
    # the K loop's side: a deeper operand ring (latency of operands that miss L2), tile order
    "sub4 st5": dict(subtile=4, num_stages=5),
    "sub4 st6": dict(subtile=4, num_stages=6),
    "sub4 g4": dict(subtile=4, group_m=4),
    "sub4 g16": dict(subtile=4, group_m=16),
    # the cooperative schedule: both consumers on one 128x256 tile, 64 rows each
    "coop sub8": dict(block_n=256, subtile=8, num_stages=3, cooperative=True),
    "coop sub8 st4": dict(block_n=256, subtile=8, num_stages=4, cooperative=True),
    "coop sub4": dict(block_n=256, subtile=4, num_stages=3, cooperative=True),
    "coop sub8 loop": dict(block_n=256, subtile=8, num_stages=3, cooperative=True, epilogue_loop=True),
    # 64-row tiles, for QK-norm's head-wide groups (runtime/config.py's defaults for groups of 64+ columns)
    "m64 sub2": dict(block_m=64, subtile=2),
    "m64 sub1": dict(block_m=64, subtile=1),
    "m64 n256 sub4": dict(block_m=64, block_n=256, subtile=4),
    "m64 n256 sub2": dict(block_m=64, block_n=256, subtile=2),
    "m64 n256 sub2 st3": dict(block_m=64, block_n=256, subtile=2, num_stages=3),
}


# Triton's default for heavy epilogues, beside the gluon configs in the epilogue-alone runs
TRITON = dict(backend="triton", block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, flatten=True,
              subtile=2)


def _config(label: str) -> coda.Config:
    extra = TRITON if label == "triton" else CONFIGS[label]
    return coda.Config(**(extra if extra.get("backend") == "triton" else {**BASE, **extra}))


def launch_once(name: str, m: int, d: int, f: int, k: int | None, label: str) -> None:
    """For a profiler: check one case under one config against fp32, then launch it twice more
    (bench/tools/ncu_epilogue.sh profiles the third launch)."""
    ep, a, b, ops = _case(name, m, d, f, k)
    graph = launch.PLAIN if ep is None else ep.graph
    cfg = _config(label)
    err = gemm_error(launch.run(graph, a, b, ops, config=cfg), gemm_reference(graph, a, b, ops))
    if not err < 2e-2:
        sys.exit(f"{name} {label}: error {err:.3g} vs the fp32 reference")
    for _ in range(2):
        launch.run(graph, a, b, ops, config=cfg)
    torch.cuda.synchronize()
    log(f"{name} K={k} {label}: checked (rel. error {err:.2e}) and launched 3 times")


def measure(m: int, d: int, f: int, cases: list[str], labels: list[str], k: int | None = None,
            plain: bool = False) -> list[dict]:
    """Rows of (case, config) timings; with `plain`, also coda's plain GEMM of the same operands
    under each config (config label '<label> plain'): the fused kernel less its epilogue."""
    rows = []
    for name in cases:
        ep, a, b, ops = _case(name, m, d, f, k)
        graph = launch.PLAIN if ep is None else ep.graph
        shape = [a.shape[0], b.shape[1], a.shape[1]]
        bare = harness.timed(lambda: torch.matmul(a, b))
        ref = gemm_reference(graph, a, b, ops)
        runs = [(label, graph, ops, ref) for label in (labels if ep is not None else labels[:1])]
        if plain and ep is not None:
            plain_ref = gemm_reference(launch.PLAIN, a, b, {})
            runs += [(f"{label} plain", launch.PLAIN, {}, plain_ref) for label in labels if label != "triton"]
        for label, g, o, r in runs:
            try:
                cfg = _config(label.removesuffix(" plain"))
                fn = lambda: launch.run(g, a, b, o, config=cfg)  # noqa: E731
                err = gemm_error(fn(), r)
                if not err < 2e-2:
                    raise AssertionError(f"error {err:.3g} vs the fp32 reference")
                ms = harness.timed(fn)
            except Exception as exc:  # noqa: BLE001 - a config that cannot run is reported
                NOTES.append(f"{name} {label}: {type(exc).__name__}: {str(exc)[:200]}")
                log(f"  {name:28s} {label:20s} FAILED {type(exc).__name__}: {str(exc)[:120]}")
                continue
            rows.append({"case": name if k is None else f"{name} K={k}", "gemm": shape, "config": label, "ms": ms,
                         "bare_gemm_ms": bare, "err": err})
            log(f"  {name:28s} {label:20s} {ms:8.4f} ms  cuBLAS {bare:8.4f}  x{ms / bare:5.3f}")
    return rows


def table(data: dict) -> str:
    labels = list(dict.fromkeys(r["config"] for r in data["rows"]))
    lines = ["| case | GEMM [M, N, K] | cuBLAS ms | " + " | ".join(labels) + " |",
             "|---|---|---|" + "---|" * len(labels)]
    by: dict[str, dict] = {}
    for r in data["rows"]:
        by.setdefault(r["case"], {"gemm": r["gemm"], "bare": r["bare_gemm_ms"]})[r["config"]] = r["ms"] / r["bare_gemm_ms"]
    for case, v in by.items():
        cells = [f"{v[c]:.3f}" if c in v else "-" for c in labels]
        lines.append(f"| {case} | {v['gemm']} | {v['bare']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--f", type=int, default=8192)
    ap.add_argument("--alone", choices=("yes", "no", "only"), default="yes",
                    help="also (or only) the epilogues alone (K = 64, both backends)")
    ap.add_argument("--cases", help=f"comma-separated, of {CASES}")
    ap.add_argument("--launch", metavar="CASE", help="check and launch one case 3 times (for ncu; see --config, --k)")
    ap.add_argument("--config", default="sub4 e2 b1", help="--launch: a CONFIGS label or 'triton'")
    ap.add_argument("--k", type=int, help="--launch: the GEMM's K (default: the block's)")
    ap.add_argument("--configs", help="comma-separated labels of CONFIGS")
    ap.add_argument("--ks", help="instead of the block's K: each case at each of these K (comma-separated), beside "
                                 "coda's plain GEMM under the same configs (does the epilogue hide behind a longer K loop?)")
    ap.add_argument("--name", default="epilogue_cost", help="--merge: the result files' name")
    ap.add_argument("--merge", type=Path, help="write <out>/epilogue_cost.{json,md} from a measured JSON")
    args = ap.parse_args()
    if args.merge:
        data = json.loads(args.merge.read_text())
        harness.write_results(args.out, args.name, data, table(data),
                              ("Each cell: ms / cuBLAS ms of the same GEMM (same run).",))
        return
    if not torch.cuda.is_available():
        sys.exit("epilogue_cost.py measures on a CUDA GPU; --merge runs anywhere")
    torch.manual_seed(0)
    if args.launch:
        launch_once(args.launch, args.m, args.d, args.f, args.k, args.config)
        return
    meta = harness.run_meta(f"do_bench median, bf16, M={args.m}, D={args.d}, FFN={args.f}; each kernel checked "
                            "against its fp32 reference first; cuBLAS = torch.matmul of the same operands, timed in "
                            "the same run")
    # the epilogues alone first (K = 64: a tile's time is then its epilogue's, the consumers'
    # epilogues taking turns), on both backends; then the real shapes under the gluon configs
    cases = args.cases.split(",") if args.cases else CASES
    labels = args.configs.split(",") if args.configs else list(CONFIGS)
    rows = []
    if args.ks:
        for k in (int(v) for v in args.ks.split(",")):
            rows += measure(args.m, args.d, args.f, cases, labels, k=k, plain=True)
    elif args.alone != "no":
        rows += measure(args.m, args.d, args.f, cases, labels + ["triton"], k=64)
    if args.alone != "only" and not args.ks:
        rows += measure(args.m, args.d, args.f, cases, labels)
    data = {"meta": meta, "rows": rows, "notes": NOTES}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "epilogue_cost.json").write_text(json.dumps(data, indent=1))
    log(table(data))


if __name__ == "__main__":
    main()
