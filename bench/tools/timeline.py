"""Where each consumer's time goes inside a gluon-hopper GEMM, tile by tile (H200).

The generated kernel is instrumented (its source text, here only, never in the library):
each consumer reads its SM's cycle counter (%clock64) at five points of every tile it runs

    t0 before its K-loop turn, t1 K loop starts, t2 last MMA retired,
    t3 epilogue turn taken (epilogue starts), t4 epilogue done

and the cycles its K loop spent waiting for operands (the ring's ready barriers),
and writes them to a [programs, 2, MAX_TILES, 6] int64 buffer. Per case the script prints,
averaged over tiles and SMs, the K loop (t2 - t1), the epilogue (t4 - t3), the waits for
either turn (t1 - t0, t3 - t2), and the cycles between a consumer's successive tiles, so a
fused GEMM can be read against the plain GEMM of its shape: which part grew, by how much.

    python bench/tools/timeline.py --out DIR [--cases residual_norm_stats,plain_d] [--d 2048]
    python bench/tools/timeline.py --out DIR --variant late_eturn   # the same kernels, one change undone
    python bench/tools/timeline.py --aot    # CPU: the instrumented kernels compile for sm_90
    python bench/tools/timeline.py --merge A.json B.json --out bench/results/timeline --note "..."
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared harness

POINTS = ("t0", "t1", "t2", "t3", "t4", "ready_wait")
F = len(POINTS)
MAX_TILES = 96
_CLOCK = ('gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, '
          'pack=1)')


def instrument(text: str) -> str:
    """The generated gluon-hopper source with the clock reads of every consumer tile."""
    def sub(old: str, new: str) -> None:
        nonlocal text
        if text.count(old) != 1:
            raise ValueError(f"timeline: the template changed ({old.strip()[:60]!r} found {text.count(old)} times)")
        text = text.replace(old, new)

    def mark(i: int, value: str = _CLOCK) -> str:
        return (f"        if own < {MAX_TILES}:\n"
                f"            gl.store(TL + ((gl.program_id(0) * 2 + CID) * {MAX_TILES} + own) * {F} + {i}, {value})\n")

    sub("    a_src, b_src, M, N, K,\n", "    a_src, b_src, M, N, K, TL,\n")
    sub("def _consumer(CID: gl.constexpr, a_bufs,", "def _consumer(CID: gl.constexpr, TL, a_bufs,")
    sub("(_consumer, (0, a_bufs,", "(_consumer, (0, TL, a_bufs,")
    sub("(_consumer, (1, a_bufs,", "(_consumer, (1, TL, a_bufs,")
    sub("        if PINGPONG:\n            mbarrier.wait(turn.index(CID), turn_phase)\n",
        mark(0) + "        if PINGPONG:\n            mbarrier.wait(turn.index(CID), turn_phase)\n" + mark(1)
        + f"        ready_wait = {_CLOCK} * 0\n")  # an int64 zero of the clock's type
    sub("            mbarrier.wait(ready.index(s), (c // STAGES) & 1)\n",
        f"            wait_from = {_CLOCK}\n            mbarrier.wait(ready.index(s), (c // STAGES) & 1)\n"
        f"            ready_wait += {_CLOCK} - wait_from\n")
    sub("        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))\n",
        "        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))\n" + mark(2) + mark(5, "ready_wait"))
    sub("        if PINGPONG:\n            mbarrier.wait(eturn.index(CID), turn_phase)\n",
        "        if PINGPONG:\n            mbarrier.wait(eturn.index(CID), turn_phase)\n" + mark(3))
    sub("        local += 2 if PINGPONG else 1\n", mark(4) + "        local += 2 if PINGPONG else 1\n")
    return text


_HANDOFF = re.compile(r"^( *)if PINGPONG:\n\1    mbarrier\.arrive\(eturn\.index\(1 - CID\), count=1(, pred=[^\n]*)?\)\n",
                      re.M)


def late_eturn(text: str) -> str:
    """The source with the epilogue turn handed on at the epilogue's end (template v3) instead of
    after the epilogue ring's HANDOFF wait: what the early handoff gains."""
    text, n = _HANDOFF.subn("", text)
    end = "        local += 2 if PINGPONG else 1\n"
    if n == 0 or text.count(end) != 1:
        raise ValueError(f"timeline: no eturn handoff to move ({n} found)")
    return text.replace(end, "        if PINGPONG:\n            mbarrier.arrive(eturn.index(1 - CID), count=1)\n" + end)


def exact_sigmoid(text: str) -> str:
    """The source with Triton's sigmoid (jit_helpers._sigmoid: its exp keeps the range check
    for subnormal results) in place of gluon_helpers' one (the flush-to-zero ex2.approx)."""
    anchor = "from coda.templates.gluon_helpers import "
    if text.count(anchor) != 1:
        raise ValueError("timeline: the template changed (its gluon_helpers import)")
    if "_sigmoid(" not in text:  # an epilogue without a sigmoid: nothing to replace
        return text
    start = text.index(anchor)
    # the end of the import statement: its line, or the line closing its parenthesized names
    end = text.index(")", start) if text[start:text.index("\n", start)].rstrip().split("#")[0].rstrip().endswith("(") \
        else start
    line_end = text.index("\n", end) + 1
    return (text[:line_end] + "from coda.templates import jit_helpers as _jh\n"
            + "_sigmoid = gluon.jit(_jh._sigmoid.fn)\n" + text[line_end:])


VARIANTS = {"as_generated": lambda text: text, "late_eturn": late_eturn, "exact_sigmoid": exact_sigmoid}


def _patch_generate(module, variant: str = "as_generated") -> None:
    real = module.generate

    def generate(graph, spec):
        text = real(graph, spec)
        return instrument(VARIANTS[variant](text)) if spec.backend == "gluon-hopper" else text

    module.generate = generate


def aot_check(variant: str) -> None:
    """Compile instrumented GEMMs for sm_90 (no GPU): residual+norm under both schedules, and the
    SwiGLU backward (an epilogue ring, a sigmoid, the loop form)."""
    from coda.ops import epilogues as E
    from coda.runtime import aot

    _patch_generate(aot, variant)
    real_signature = aot._signature

    def signature(graph, spec, cfg):  # TL follows a_src, b_src, M, N, K, as in the kernel's parameters
        sig, constexprs = real_signature(graph, spec, cfg)
        items = list(sig.items())
        return dict(items[:5] + [("TL", "*i64")] + items[5:]), constexprs

    aot._signature = signature
    import epilogue_cost

    bf16 = {"residual": "bfloat16", "norm_weight": "bfloat16", "z": "bfloat16"}
    for name, label in (("residual_norm_stats", "sub4 e2 b1"), ("residual_norm_stats", "coop sub8"),
                        ("swiglu_backward_zdz", "sub4 loop")):
        graph, cfg = getattr(E, name).graph, epilogue_cost._config(label)
        spec = aot.hopper_spec(graph, backend="gluon-hopper", subtile=cfg.subtile, epilogue_loop=cfg.epilogue_loop,
                               operand_dtypes={s.name: bf16[s.name] for s in graph.operands})
        clocks = aot.compile_hopper(graph, spec, cfg).ptx.count("%clock64")
        print(f"{name} {label}: {clocks} clock reads in the PTX")
        if clocks < 2 * len(POINTS):
            raise AssertionError(f"{label}: {clocks} clock reads in the PTX, expected both consumers' "
                                 f"{len(POINTS)} points at least")


def run_case(name: str, m: int, d: int, f: int, label: str, variant: str) -> dict:
    """One case's per-tile spans under one config (epilogue_cost's labels; "default": the runtime's
    untuned default), after its result passes the fp32 check."""
    import torch

    from coda.runtime import launch, plan
    import epilogue_cost
    from harness import gemm_error, gemm_reference

    ep, a, b, ops = epilogue_cost._case(name, m, d, f)
    graph = launch.PLAIN if ep is None else ep.graph
    sms = torch.cuda.get_device_properties(0).multi_processor_count  # programs <= SMs; unused rows stay 0
    buf = torch.zeros(sms * 2 * MAX_TILES * F, dtype=torch.int64, device="cuda")
    real_launch = plan.Plan._launch

    def _launch(self, args):
        args["TL"] = buf
        return real_launch(self, args)

    plan.Plan._launch = _launch
    try:
        os.environ["CODA_BACKEND"] = "gluon-hopper"
        cfg = None if label == "default" else epilogue_cost._config(label)
        err = gemm_error(launch.run(graph, a, b, ops, config=cfg), gemm_reference(graph, a, b, ops))
        if not err < 2e-2:
            raise AssertionError(f"{name} {label} {variant}: error {err:.3g} against fp32")
        for _ in range(2):  # the buffer keeps the last launch's clocks
            launch.run(graph, a, b, ops, config=cfg)
        torch.cuda.synchronize()
        cfg = cfg or launch.chosen_config(graph, a, b, ops)
    finally:
        plan.Plan._launch = real_launch
    out: dict[str, object] = {"case": name, "D": d, "label": label, "variant": variant, "err": err,
                              "gemm": [a.shape[0], b.shape[1], a.shape[1]], "config": str(cfg)}
    return {**out, **summarize(buf.view(sms, 2, MAX_TILES, F).tolist())}


def summarize(records: list) -> dict[str, float | None]:
    """Averages of the clock records [program][consumer][tile][point]. A tile's record is whole
    once its t4 is written (no clock reads 0); a consumer's tiles are in the order it ran them."""
    consumers = [[[row for row in tiles if row[4]] for tiles in pair] for pair in records]
    ran = [pair for pair in consumers if pair[0] or pair[1]]  # the programs that ran any tile
    runs = [run for pair in ran for run in pair]
    tiles = [row for run in runs for row in run]
    spans = {"turn_wait": (0, 1), "k_loop": (1, 2), "eturn_wait": (2, 3), "epilogue": (3, 4)}
    out: dict[str, float | None] = {key: statistics.mean(row[j] - row[i] for row in tiles) if tiles else None
                                    for key, (i, j) in spans.items()}
    out["ready_wait"] = statistics.mean(row[5] for row in tiles) if tiles else None
    periods = [nxt[1] - row[1] for run in runs for row, nxt in zip(run, run[1:])]
    out["period"] = statistics.mean(periods) if periods else None
    out["tiles_per_consumer"] = statistics.mean(len(run) for run in runs)
    out["sm_span"] = statistics.mean(max(row[4] for run in pair for row in run)
                                     - min(row[0] for run in pair for row in run) for pair in ran)
    return out


COLUMNS = ("k_loop", "ready_wait", "epilogue", "turn_wait", "eturn_wait", "period", "sm_span")


def table(rows: list[dict]) -> str:
    """Cycles per consumer tile (averages) and per SM, one line per (case, config)."""
    lines = ["| case | GEMM [M, N, K] | config | tiles per consumer | " + " | ".join(COLUMNS) + " |",
             "|---|---|---|---|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [f"{r[c]:.0f}" if r.get(c) is not None else "-" for c in COLUMNS]
        variant = "" if r.get("variant", "as_generated") == "as_generated" else f", {r['variant']}"
        lines.append(f"| {r['case']} | {r['gemm']} | {r['label']} ({_schedule(r['config'])}{variant}) | "
                     f"{r['tiles_per_consumer']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _schedule(config: str) -> str:
    coop = "cooperative=True" in config
    fields = dict(kv.split("=", 1) for kv in config.split() if "=" in kv)
    return (f"{'cooperative' if coop else 'ping-pong'} {fields.get('block_m')}x{fields.get('block_n')}, "
            f"{fields.get('num_stages')} stages, subtile {fields.get('subtile')}, e{fields.get('epi_stages')} "
            f"b{fields.get('store_buffers')}{', loop' if 'epilogue_loop=True' in config else ''}")


def merge(paths: list[Path], out: Path, d: int, note: str | None) -> None:
    rows = [r for p in paths for r in json.loads(p.read_text())]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"timeline_d{d}.json").write_text(json.dumps(rows, indent=1))
    md = ["# timeline", "", "Per consumer tile of gluon-hopper GEMMs (bench/tools/timeline.py): SM cycles (%clock64) "
          "averaged over every tile of every SM; k_loop = t2 - t1, ready_wait = the K loop's waits on its "
          "operands (inside k_loop; the previous MMA runs meanwhile), epilogue = t4 - t3, turn_wait = t1 - t0, "
          "eturn_wait = t3 - t2, period = between a consumer's successive K-loop starts, sm_span = first t0 "
          "to last t4 on an SM.", "", *([note, ""] if note else []), table(rows), ""]
    (out / f"timeline_d{d}.md").write_text("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--aot", action="store_true")
    ap.add_argument("--merge", type=Path, nargs="+", help="write <out>/timeline_d<D>.{json,md} from measured JSONs")
    ap.add_argument("--note")
    ap.add_argument("--cases", default="plain_d,residual_norm_stats,rmsnorm_backward_residual,rms_rope,"
                                       "plain_swiglu_shape,swiglu_backward_zdz")
    ap.add_argument("--configs", default="default", help="epilogue_cost config labels, comma-separated")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="as_generated",
                    help="a change to the generated source")
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--f", type=int, default=8192)
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out, args.d, args.note)
    # the instrumented sources never go to the shared kernel cache (its key does not know them),
    # and "default" is the untuned default config (tuning would time instrumented kernels)
    os.environ["CODA_CACHE_DIR"] = tempfile.mkdtemp(prefix="coda-timeline-")
    os.environ["CODA_AUTOTUNE"] = "0"
    if args.aot:
        aot_check(args.variant)
        return
    from coda.runtime import cache

    _patch_generate(cache, args.variant)
    rows = []
    for name in args.cases.split(","):
        for label in args.configs.split(","):
            row = run_case(name, args.m, args.d, args.f, label, args.variant)
            rows.append(row)
            print("  ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"timeline_d{args.d}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
