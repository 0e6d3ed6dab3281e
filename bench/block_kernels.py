"""The block (docs/ALGEBRA.md 7) kernel by kernel on each backend, and the whole block against its
speed of light and its peers (the benchmark protocol in docs/DESIGN.md), in one process on the H200.

rows:  every GEMM coda runs in one forward+backward of the block (native weights), recorded as it
       runs, then replayed alone on each backend ("gluon-hopper", "triton") and as the bare cuBLAS
       GEMM of the same operands (same shapes and memory orders). Each replay is checked against the
       fp32 reference of its epilogue first. `chosen` marks the backend the runtime picks for it.
sweep: (--sweep) the gluon-hopper kernels again under other tile configs.
block: sol_graph (the 12 bare cuBLAS GEMMs back to back in one CUDA graph; the median of its
       timings, one before each variant's, each after HEAT_S s of its replays; the H200 runs them
       power-bound and the SoL moves by 2-4% within a run, so each row's "sol_ms" is the SoL timed
       just before it, and its ratio is taken against that), coda (standard
       weights), coda_native, eager, compile_default, compile_max_autotune_no_cudagraphs, liger;
       forward+backward, each checked against fp32 first; coda_native_graph, the coda_native step
       replayed as one CUDA graph (no host, no allocator), and per timed row the cudaMalloc calls
       made while it was timed (each synchronizes the device with the host). Each width's block
       rows come from a fresh process of this script (--block-only D), as a training job runs it:
       in the process that had run the kernel rows, D=2048's step once timed 0.35-0.47 ms above
       its time in any fresh process, for a reason not found (docs/HISTORY.md, "The block over time").

    python bench/block_kernels.py --out DIR [--d 2048,4096] [--sweep] [--no-peers]
    python bench/block_kernels.py --out DIR --d 2048 --ffn 11008 --heads 16,4 --no-block   (another model's GEMMs)
    python bench/block_kernels.py --merge DIR/block_kernels.json --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import coda
from coda.runtime import choose, launch
from coda.runtime.validate import validate
import harness
from harness import NOTES, gemm_error, gemm_reference, log
from ops_block import WIDTHS, block_case, block_steps, fwd_bwd, joined, max_err, sol_replay

HEAT_S = 3.0  # seconds of SoL replays before each timed block row
BACKENDS = ("gluon-hopper", "triton")
# gluon-hopper configs of --sweep: epilogue subtiles (register slices of one 128x128 accumulator),
# ring depth, a 64x256 tile (m64n256 MMAs), a 128-deep K step, and a larger row group.
SWEEP = [dict(block_m=128, block_n=128, block_k=64, num_stages=4, subtile=1),
         dict(block_m=128, block_n=128, block_k=64, num_stages=4, subtile=2),
         dict(block_m=128, block_n=128, block_k=64, num_stages=4, subtile=4),
         dict(block_m=128, block_n=128, block_k=64, num_stages=3, subtile=2),
         dict(block_m=128, block_n=128, block_k=64, num_stages=5, subtile=4),
         dict(block_m=64, block_n=256, block_k=64, num_stages=4, subtile=4),
         dict(block_m=128, block_n=128, block_k=128, num_stages=3, subtile=4),
         dict(block_m=128, block_n=128, block_k=64, num_stages=4, subtile=4, group_m=16)]


def record_calls(step) -> list[tuple]:
    """The (graph, a, b, operands, out) of every coda GEMM that `step()` runs, in order."""
    calls, real = [], launch.run

    def spy(graph, a, b, operands, *, out=None, config=None):
        result = real(graph, a, b, operands, out=out, config=config)
        fresh = {k: torch.empty_like(v) for k, v in (out or {}).items()} if isinstance(out, dict) else None
        calls.append((graph, a.detach(), b.detach(), {k: v.detach() if isinstance(v, torch.Tensor) else v
                                                         for k, v in operands.items()}, fresh))
        return result

    launch.run = spy
    try:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        launch.run = real
    return calls


def kernel_rows(d: int, f: int, m: int, sweep: bool, save, heads: int = 32, kv: int = 8) -> tuple[list[dict], list[dict]]:
    """Every GEMM of the block on each backend (and, with `sweep`, gluon configs); `save(rows, swept)`
    after each kernel, so a run stopped by its time limit keeps what it measured."""
    case = block_case(m, d, f, heads, kv)
    calls = record_calls(fwd_bwd(case["ours_native"], case["native_params"], case["go"]))
    rows, swept = [], []
    for i, (graph, a, b, operands, out) in enumerate(calls):
        name = "plain" if graph.hash == launch.PLAIN.hash else graph.name
        label = f"{'fwd' if i < 4 else 'bwd'}{i}:{name}"
        shape = [a.shape[0], b.shape[1], a.shape[1]]
        bare = harness.timed(lambda: torch.matmul(a, b))
        ref = gemm_reference(graph, a, b, operands)
        os.environ["CODA_BACKEND"] = "auto"
        launch.run(graph, a, b, operands, out=out)
        interpret = coda.runtime.interpreting()
        cfg = choose.chosen_config(validate(graph, a, b, operands, out, interpret), interpret)
        chosen = cfg.backend if cfg is not None else "triton"
        for backend in BACKENDS:
            os.environ["CODA_BACKEND"] = backend
            fn = lambda: launch.run(graph, a, b, operands, out=out)  # noqa: E731
            try:
                err = gemm_error(fn(), ref)
                if not err < 2e-2:
                    raise AssertionError(f"error {err:.3g} vs the fp32 reference")
                ms = harness.timed(fn)
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run this kernel is reported
                NOTES.append(f"D={d} {label} {backend}: {type(exc).__name__}: {str(exc)[:200]}")
                log(f"  {label:34s} {backend:13s} FAILED {type(exc).__name__}: {str(exc)[:120]}")
                continue
            rows.append({"D": d, "FFN": f, "M": m, "kernel": label, "backend": backend, "chosen": backend == chosen,
                         "ms": ms, "bare_gemm_ms": bare, "gemm": shape, "err": err})
            log(f"  {label:34s} {backend:13s} {ms:8.4f} ms  cuBLAS {bare:8.4f}  x{ms / bare:5.3f}"
                f"{'  (chosen)' if backend == chosen else ''}")
            if sweep and backend == "gluon-hopper":
                for c in SWEEP:
                    try:
                        conf = coda.Config(backend="gluon-hopper", num_warps=4, **c)
                        run = lambda: launch.run(graph, a, b, operands, out=out, config=conf)  # noqa: E731
                        err = gemm_error(run(), ref)
                        t = harness.timed(run) if err < 2e-2 else None
                    except Exception as exc:  # noqa: BLE001
                        t, err = None, f"{type(exc).__name__}: {str(exc)[:100]}"
                    swept.append({"D": d, "kernel": label, "config": c, "ms": t, "bare_gemm_ms": bare, "err": err})
                    log(f"    sweep {c} -> {t if t is None else round(t / bare, 3)}")
        os.environ["CODA_BACKEND"] = "auto"
        save(rows, swept)
    return rows, swept


def _device_allocs() -> int:
    """cudaMalloc calls so far: one during a timed step synchronizes the device with the host."""
    return torch.cuda.memory_stats().get("num_device_alloc", 0)


def block_rows(d: int, f: int, m: int, peers: bool, compile_budget_s: float, save) -> list[dict]:
    """The block rows; `save(rows)` after each, so a run stopped by its time limit keeps what it measured."""
    case = block_case(m, d, f)
    ref_all = (case["ref"], *case["refg"])
    sol = sol_replay(case["fwd"] + case["bwd"])
    sols: list[float] = []
    out = [{"D": d, "FFN": f, "M": m, "variant": "sol_graph"}]

    def sol_now() -> float:
        """The SoL graph timed on a GPU warmed by HEAT_S s of its replays; the sol_graph row holds
        the median of every such timing of the run."""
        harness.heat(sol, HEAT_S)
        sols.append(harness.timed(sol))
        out[0].update(ms=statistics.median(sols), samples=list(sols))
        return sols[-1]

    def row(variant: str, fn, **extra) -> dict:
        """variant's row: fn timed right after a warm SoL, which its ratio is taken against (the
        power-bound clock drifts over a run), and the cudaMalloc calls made while fn was timed."""
        sol_ms = sol_now()
        allocs = _device_allocs()
        ms = harness.timed(fn)
        return {"D": d, "FFN": f, "M": m, "variant": variant, "ms": ms, "sol_ms": sol_ms,
                "device_allocs": _device_allocs() - allocs, **extra}

    sol_now()
    save(out)
    steps = block_steps(case)
    for name in ("coda", "coda_native") + (("eager", "liger") if peers else ()):
        if name not in steps:  # liger, where Liger-Kernel is not installed
            continue
        fn, check = steps[name]
        try:
            err = check(fn())
            if not err < 2e-2:
                raise AssertionError(f"error {err:.3g} vs fp32")
            out.append(row(name, fn, err=err))
            save(out)
            log(f"  block D={d} {name:40s} {out[-1]['ms']:8.3f} ms, SoL {out[-1]['sol_ms']:.3f} "
                f"({out[-1]['device_allocs']} cudaMalloc while timed)")
            if name == "coda_native":  # the same step as one CUDA graph: no host, no allocator
                try:
                    out.append(row("coda_native_graph", harness.graphed(fn)))
                    save(out)
                    log(f"  block D={d} {'coda_native_graph':40s} {out[-1]['ms']:8.3f} ms, SoL {out[-1]['sol_ms']:.3f}")
                except Exception as exc:  # noqa: BLE001
                    NOTES.append(f"block D={d} coda_native_graph: {type(exc).__name__}: {str(exc)[:200]}")
        except Exception as exc:  # noqa: BLE001
            NOTES.append(f"block D={d} {name}: {type(exc).__name__}: {str(exc)[:200]}")
    if peers:
        for mode in ("default", "max-autotune-no-cudagraphs"):
            t0 = time.time()
            # max-autotune compiles for minutes (242 s at D=2048 on the H200): it needs more room
            if t0 + (300 if mode != "default" else 60) > compile_budget_s:
                NOTES.append(f"block D={d} compile_{mode}: not run (out of this run's time budget)")
                continue
            eager = case["impls"]["eager"]
            cf = torch.compile(eager) if mode == "default" else torch.compile(eager, mode=mode)
            fn = fwd_bwd(cf, case["params"], case["go"])
            try:
                err = max_err(joined(fn()), ref_all)
                out.append(row(f"compile_{mode.replace('-', '_')}", fn, err=err, compile_s=time.time() - t0))
                save(out)
                log(f"  block D={d} compile_{mode:30s} {out[-1]['ms']:8.3f} ms, SoL {out[-1]['sol_ms']:.3f} "
                    f"({out[-1]['compile_s']:.0f} s)")
            except Exception as exc:  # noqa: BLE001
                NOTES.append(f"block D={d} compile_{mode}: {type(exc).__name__}: {str(exc)[:200]}")
            torch._dynamo.reset()
    return out


def _config_label(c: dict) -> str:
    text = f"{c['block_m']}x{c['block_n']}x{c['block_k']} st{c['num_stages']} sub{c['subtile']}"
    return text + (f" g{c['group_m']}" if "group_m" in c else "")


def table(data: dict) -> str:
    lines = ["| D | kernel | GEMM [M, N, K] | cuBLAS ms | gluon-hopper ms (x cuBLAS) | triton ms (x cuBLAS) | chosen |",
             "|---|---|---|---|---|---|---|"]
    by: dict[tuple, dict] = {}
    for r in data["rows"]:
        by.setdefault((r["D"], r["kernel"]), {"gemm": r["gemm"], "bare": r["bare_gemm_ms"]})[r["backend"]] = r
    for (d, kernel), v in by.items():
        cells = []
        for b in BACKENDS:
            r = v.get(b)
            cells.append("-" if r is None else f"{r['ms']:.3f} ({r['ms'] / r['bare_gemm_ms']:.3f})")
        chosen = next((b for b in BACKENDS if v.get(b, {}).get("chosen")), "-")
        lines.append(f"| {d} | {kernel} | {v['gemm']} | {v['bare']:.3f} | {cells[0]} | {cells[1]} | {chosen} |")
    if data.get("sweep"):  # gluon configs: ms / cuBLAS ms, one column a config
        labels = list(dict.fromkeys(_config_label(r["config"]) for r in data["sweep"]))
        lines += ["", "gluon-hopper sweep (x cuBLAS): " + ", ".join(labels), "",
                  "| D | kernel | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
        swept: dict[tuple, dict] = {}
        for r in data["sweep"]:
            cell = f"{r['ms'] / r['bare_gemm_ms']:.3f}" if r["ms"] else "-"
            swept.setdefault((r["D"], r["kernel"]), {})[_config_label(r["config"])] = cell
        for (d, kernel), v in swept.items():
            lines.append(f"| {d} | {kernel} | " + " | ".join(v.get(c, "-") for c in labels) + " |")
    lines += ["", "| D | variant | ms fwd+bwd | x SoL |", "|---|---|---|---|"]
    sol = {r["D"]: r["ms"] for r in data["block"] if r["variant"] == "sol_graph"}
    for r in data["block"]:  # against the SoL timed just before the row, where the run recorded it
        base = r.get("sol_ms", sol.get(r["D"]))
        x = f"{r['ms'] / base:.3f}" if base else "-"
        lines.append(f"| {r['D']} | {r['variant']} | {r['ms']:.3f} | {x} |")
    return "\n".join(lines)


def fresh_block_rows(d: int, m: int, peers: bool, budget_s: float, out: Path) -> list[dict]:
    """Width d's block rows, measured by a fresh process of this script (its log goes to ours)."""
    path = out / f"block_d{d}.json"
    path.unlink(missing_ok=True)
    torch.cuda.empty_cache()  # the child allocates on the same GPU
    cmd = [sys.executable, __file__, "--block-only", str(d), "--m", str(m), "--out", str(out),
           "--budget", f"{max(budget_s, 0):.0f}"] + ([] if peers else ["--no-peers"])
    code = subprocess.run(cmd).returncode
    child = json.loads(path.read_text()) if path.exists() else {"block": [], "notes": []}
    NOTES.extend(child["notes"])
    if code != 0:
        NOTES.append(f"block D={d}: its process exited with {code} after {len(child['block'])} rows")
    return child["block"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--d", default="2048,4096")
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-d", default=None, help="widths to sweep (default: every --d)")
    ap.add_argument("--ffn", type=int, help="kernel rows at this FFN width instead of the width's own (e.g. 11008)")
    ap.add_argument("--heads", default="32,8", help="query heads,kv heads of the kernel rows (e.g. 16,4)")
    ap.add_argument("--no-block", action="store_true", help="kernel rows only, no block rows")
    ap.add_argument("--block-only", type=int, choices=sorted(WIDTHS), metavar="D",
                    help="width D's block rows only, into <out>/block_dD.json (what the full run starts once per width)")
    ap.add_argument("--no-peers", action="store_true", help="only sol_graph, coda and coda_native block rows")
    ap.add_argument("--budget", type=float, default=480, help="seconds after which torch.compile peers are skipped")
    ap.add_argument("--merge", type=Path, help="write <out>/block_kernels.{json,md} from a measured JSON")
    ap.add_argument("--note")
    args = ap.parse_args()
    if args.merge:
        data = json.loads(args.merge.read_text())
        if args.note:
            data["meta"]["note"] = args.note
        note = data["meta"].get("note")
        harness.write_results(args.out, "block_kernels", data, table(data), (note,) if note else ())
        return
    if not torch.cuda.is_available():
        sys.exit("block_kernels.py measures on a CUDA GPU; --merge runs anywhere")
    t0 = time.time()
    torch.manual_seed(0)
    meta = harness.run_meta("do_bench median, bf16, M=8192; each kernel replayed alone on the operands the block gave "
                            "it (checked against the fp32 reference of its epilogue first); bare_gemm_ms = torch.matmul "
                            "(cuBLAS) of the same operands; block rows forward+backward, checked against fp32.",
                            autotune=os.environ.get("CODA_AUTOTUNE", "0"))
    data = {"meta": meta, "rows": [], "sweep": [], "block": [], "notes": NOTES}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.block_only:
        d = args.block_only
        path = args.out / f"block_d{d}.json"

        def save_block(rows: list[dict]) -> None:
            path.write_text(json.dumps({"block": rows, "notes": NOTES}, indent=1))
        # saved once more at the end: notes made after the last row (a peer skipped or failed) count too
        save_block(block_rows(d, WIDTHS[d], args.m, not args.no_peers, t0 + args.budget, save_block))
        return

    def save(block: list[dict] | None = None):
        current = {**data, "block": data["block"] + (block or [])}
        (args.out / "block_kernels.json").write_text(json.dumps(current, indent=1))

    sweep_d = set(map(int, (args.sweep_d or args.d).split(",")))
    for d in map(int, args.d.split(",")):
        def save_rows(rows, swept, _rows=list(data["rows"]), _swept=list(data["sweep"])):
            data["rows"], data["sweep"] = _rows + rows, _swept + swept
            save()
        heads, kv = map(int, args.heads.split(","))
        kernel_rows(d, args.ffn or WIDTHS[d], args.m, args.sweep and d in sweep_d, save_rows, heads, kv)
    for d in ([] if args.no_block else map(int, args.d.split(","))):
        data["block"] += fresh_block_rows(d, args.m, not args.no_peers, t0 + args.budget - time.time(), args.out)
        save()
    log(table(data))
    log(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
