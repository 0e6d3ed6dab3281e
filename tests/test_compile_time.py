"""A first call compiles in seconds (issue 27): the runtime's default configs keep every kernel's
epilogue code under `config.CODE_BUDGET`, and sm_90 compiles of the block epilogues, of heavy
programs like those the H200 found slow, and of random programs take no more than a limit.

The limit is relative to a kernel compiled in the same worker process (the RoPE epilogue on
gluon-hopper: 1.1 s on the 2-core CPU machine, idle), so a loaded machine slows both alike: every
compile must take at most `LIMIT_FACTOR` times as long. The machine is shared with the other test
worker, whose load comes and goes, so a compile over the limit is timed once more beside a fresh
RoPE compile (both with an empty Triton cache) and judged by the better of the two ratios: noise
only slows a compile, and a slow program stays over the limit both times. The issue's target is
15 s on the H200's host. Measured here against the RoPE compile (idle machine): the issue's
programs 0.4-3.4x, the block epilogues 0.2-1.9x; before the budget, `HEAVY_TRIG` on Triton took
86 s (20x then; 59 s of it in LLVM's O3) and `TRIG_WIDTH1` on gluon-hopper 32 s (8x then).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, settings

import coda
from coda.runtime import config
from coda.runtime.config import CODE_BUDGET, default_config, epilogue_code
from coda.runtime.launch import PLAIN
from aot_worker import AotWorker, script
from cpu_calls import ops_epilogues
from test_properties import Program, programs

LIMIT_FACTOR = 5
TIMEOUT_S = 600


BLOCK = ops_epilogues()

# Programs of the kind the H200 found slow on a first call: two width-2 Tile operands (one read
# column-major), sin/cos, silu, where, interleave, group values and grouped max reductions.
HEAVY = """\
def f(acc, t1: coda.Tile(width=2), t2: coda.Tile(width=2)):
    x = coda.interleave(coda.sin(acc), coda.silu(acc))
    y = coda.where(t1 > 0, x * t2, coda.sin(t1))
    return {"y": y, "r": coda.reduce_n(y, "max", group=4)}
"""
HEAVY_TRIG = """\
def f(acc, t1: coda.Tile(width=2), t2: coda.Tile(width=2), v: coda.VecN(width=2)):
    x = coda.interleave(coda.sin(acc), coda.silu(acc))
    y = coda.where(t1 > 0, x * t2, coda.sin(t1))
    z = coda.sin(y * 0.5 + t2) + coda.cos(x - v)
    g = coda.group_max(z, 4) + coda.sin(coda.group_sum(y, 8))
    e, o = coda.pairs(g)
    w = coda.interleave(coda.silu(e) * o, coda.cos(o))
    return {"y": w, "r": coda.reduce_n(w, "max", group=4), "s": coda.reduce_n(z, "sum"), "c": coda.reduce_m(y, "sum")}
"""
TRIG_WIDTH1 = """\
def f(acc, t1: coda.Tile, t2: coda.Tile):
    y = coda.where(t1 > 0, coda.sin(acc) * t2, coda.sin(t1))
    z = coda.sin(y * 0.5 + t2) + coda.cos(acc - t1)
    g = coda.group_max(z, 4) + coda.sin(coda.group_sum(y, 8))
    w = coda.silu(g) * coda.cos(z) + coda.tanh(y)
    return {"y": w, "r": coda.reduce_n(w, "max", group=4), "s": coda.reduce_n(z, "sum"), "c": coda.reduce_m(y, "sum")}
"""
THREE_REDUCTIONS = """\
def f(acc):
    return {"s": coda.reduce_n(acc, "sum"), "m": coda.reduce_n(acc, "max"), "l": coda.reduce_n(acc, "logsumexp")}
"""
STORE_TWO_GROUPS = """\
def f(acc):
    return {"y": coda.interleave(acc, acc * 2.0), "g1": coda.reduce_n(acc, "max", group=4),
            "g2": coda.reduce_n(acc * acc, "max", group=8)}
"""
# name -> (source, (M, N, K), column-major operands)
ISSUE = {"heavy": (HEAVY, (129, 2048, 16), ["t2"]), "heavy_trig": (HEAVY_TRIG, (129, 2048, 16), ["t2"]),
         "trig_width1": (TRIG_WIDTH1, (129, 2048, 16), ["t2"]), "three_reductions": (THREE_REDUCTIONS, (1, 64, 8192), []),
         "store_two_groups": (STORE_TWO_GROUPS, (1, 2048, 64), [])}
BLOCK_SHAPES = [(256, 256, 128), (8192, 4096, 2048), (8192, 6144, 4096), (8192, 28672, 4096), (8192, 2048, 8192)]


def _graph(source: str) -> coda.ir.Graph:
    namespace: dict[str, object] = {"coda": coda}
    exec(source, namespace)  # noqa: S102 - the test's own programs
    return coda.epilogue(namespace["f"]).graph


# -- the budget (no compiles) -----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "gluon-hopper"])
@pytest.mark.parametrize("name", sorted(BLOCK) + ["plain"])
def test_budget_changes_no_block_epilogue(monkeypatch: pytest.MonkeyPatch, name: str, backend: str) -> None:
    """The block epilogues' defaults (and so their kernels' speed) are what they were without it."""
    graph = PLAIN if name == "plain" else BLOCK[name].graph
    for m, n, k in BLOCK_SHAPES:
        n = n * 3 if "qknorm" in name else n  # whole heads of q, k and v
        budgeted = default_config(graph, "bfloat16", False, m, n, k, backend)
        monkeypatch.setattr(config, "CODE_BUDGET", math.inf)
        assert default_config(graph, "bfloat16", False, m, n, k, backend) == budgeted, (name, m, n, k)
        monkeypatch.undo()
        assert epilogue_code(graph, budgeted) <= CODE_BUDGET


@pytest.mark.parametrize("backend, source", [("triton", HEAVY_TRIG), ("triton", TRIG_WIDTH1),
                                             ("gluon-hopper", TRIG_WIDTH1)])
def test_heavy_default_fits_the_budget(monkeypatch: pytest.MonkeyPatch, backend: str, source: str) -> None:
    """Over the budget, gluon-hopper loops over its subtiles and Triton drops the flattened loop's
    copy of the epilogue (and halves its tile while that is not enough), until the code fits."""
    graph = _graph(source)
    cfg = default_config(graph, "bfloat16", False, 129, 2048, 16, backend)
    assert epilogue_code(graph, cfg) <= CODE_BUDGET
    monkeypatch.setattr(config, "CODE_BUDGET", math.inf)
    unbounded = default_config(graph, "bfloat16", False, 129, 2048, 16, backend)
    assert epilogue_code(graph, unbounded) > CODE_BUDGET
    if backend == "triton":
        assert unbounded.flatten and not cfg.flatten
    else:
        assert cfg.epilogue_loop and not unbounded.epilogue_loop


# -- sm_90 compiles, timed ----------------------------------------------------------------------

# The worker's imports and `handle` (aot_worker.script adds the reply stream and the request loop).
WORKER = script('''
    import os
    import time

    import coda
    from coda.runtime.aot import compile_call
    from coda.runtime.config import default_config
    from coda.runtime.launch import PLAIN
    from cpu_calls import call, ops_epilogues

    EPILOGUES = {name: ep.graph for name, ep in ops_epilogues().items()}
    EPILOGUES["plain"] = PLAIN


    def handle(req):
        if "triton_cache" in req:  # Triton reads its cache directory at each compile
            os.environ["TRITON_CACHE_DIR"] = req["triton_cache"]
        if "name" in req:
            graph, dtypes = EPILOGUES[req["name"]], None
        else:
            namespace = {"coda": coda}
            exec(req["source"], namespace)
            graph = coda.epilogue(namespace[req.get("fn", "f")]).graph
            dtypes = req["dtypes"]
        m, n, k = req["shape"]
        c = call(graph, m, n, k, dtypes, col_major=req.get("col_major", []))
        cfg = default_config(graph, c.in_dtype, False, m, n, k, req["backend"])
        start = time.perf_counter()
        compile_call(c, cfg)
        return {"seconds": time.perf_counter() - start,
                "config": f"{cfg.block_m}x{cfg.block_n}/{cfg.subtile}{' loop' if cfg.epilogue_loop else ''}"
                          f"{' flatten' if cfg.flatten else ''}{' cooperative' if cfg.cooperative else ''}"}
''')


class Worker:
    """The timing process (aot_worker.AotWorker: TRITON_INTERPRET=0, its own caches), warmed up, with
    the RoPE epilogue's gluon-hopper compile as the unit the limit is a multiple of."""

    UNIT = {"name": "rope", "backend": "gluon-hopper", "shape": [512, 256, 128]}

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.proc = AotWorker(tmp, WORKER, TIMEOUT_S)
        self.seconds: dict[str, dict] = {}
        self.ask(name="plain", backend="triton", shape=[256, 256, 128])  # warm-up: imports, first-compile setup
        self.unit = self.ask(**self.UNIT)["seconds"]

    def ask(self, **req: object) -> dict:
        return self.proc.request(req, f"{req}: ")

    def timed(self, what: str, **req: object) -> None:
        """Compile, record, and fail when it took more than LIMIT_FACTOR RoPE compiles, also when
        timed again beside a fresh RoPE compile."""
        result = self.seconds[what] = {**self.ask(**req), "unit": self.unit}
        if result["seconds"] > LIMIT_FACTOR * self.unit:
            cache = str(self.tmp / f"triton_again_{len(self.seconds)}")
            unit = self.ask(**self.UNIT, triton_cache=cache)["seconds"]
            again = self.ask(**req, triton_cache=cache)["seconds"]
            result["again"] = {"seconds": again, "unit": unit}
            assert again <= LIMIT_FACTOR * unit, (
                f"{what} ({result['config']}): compiled in {result['seconds']:.1f} s and {again:.1f} s, over "
                f"{LIMIT_FACTOR} x the RoPE epilogue's compile beside each ({self.unit:.2f} s, {unit:.2f} s)")

    def close(self) -> None:
        self.proc.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory):
    w = Worker(tmp_path_factory.mktemp("compile_time"))
    try:
        yield w
    finally:
        print(json.dumps(w.seconds, indent=1))  # with pytest -s: the seconds behind the assertions
        w.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "gluon-hopper"])
@pytest.mark.parametrize("name", sorted(ISSUE))
def test_issue_programs_compile_in_seconds(worker: Worker, name: str, backend: str) -> None:
    source, shape, col_major = ISSUE[name]
    graph = _graph(source)
    dtypes = {s.name: "bfloat16" if s.kind.value == "tile" else "float32" for s in graph.operands}
    worker.timed(f"{name} {backend}", source=source, dtypes=dtypes, shape=list(shape), col_major=col_major,
                 backend=backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "gluon-hopper"])
@pytest.mark.parametrize("name", sorted(BLOCK))
def test_block_epilogues_compile_in_seconds(worker: Worker, name: str, backend: str) -> None:
    worker.timed(f"{name} {backend}", name=name, backend=backend, shape=[256, 768, 128])


DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.int32: "int32", torch.int64: "int64", torch.bool: "bool", None: None}


@pytest.mark.slow
@settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(program=programs(129, 2048, 16))
def test_random_programs_compile_in_seconds(worker: Worker, program: Program) -> None:
    source = program.source()
    note(source)
    dtypes = {p.name: DTYPE_NAMES[p.dtype] for p in program.params}
    tiles = [p.name for p in program.params if p.kind.value == "tile"]
    for backend in ("triton", "gluon-hopper"):
        worker.timed(f"random {len(worker.seconds)} {backend}", source=source, fn="random_epilogue", dtypes=dtypes,
                     shape=[129, 2048, 16], col_major=tiles[:1], backend=backend)
