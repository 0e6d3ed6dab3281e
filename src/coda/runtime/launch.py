"""gemm(): validate, specialize, fetch the kernel, launch, finalize reductions."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch
import triton

from ..codegen import OperandForm, Specialization, generate
from ..ir.graph import Graph
from ..ir.nodes import StoreOutput
from ..ir.types import Kind
from ..ir.trace import trace
from .. import __version__
from ..templates import TEMPLATE_VERSION
from . import autotune
from .cache import load_kernel, stats
from .config import HOPPER_SMEM_BYTES, Config, check_config, default_config, ring_bytes, staging_bytes
from .device import device_name, interpreting, num_programs
from .plan import Plan
from . import guard
from .threads import build_lock
from .validate import IN_DTYPES, Call, validate


def _identity(acc):
    return acc


PLAIN = trace(_identity)


def _tma_ok(t: torch.Tensor, major: int) -> bool:
    """TMA needs a unit stride on the `major`-th dim, a 16-byte aligned base and other stride."""
    other = 1 - major
    size = t.element_size()
    return (
        t.stride(major) == 1
        and t.data_ptr() % 16 == 0
        and (t.stride(other) * size) % 16 == 0
        and t.shape[major] * size >= 16
    )


def operand_load(t: torch.Tensor) -> str:
    """How the template reads a [rows, cols] GEMM operand: TMA row/col-major or pointers."""
    if _tma_ok(t, 1):
        return "tma_row"
    if _tma_ok(t, 0):
        return "tma_col"
    return "ptr"


def _tma_box_ok(cfg: Config, cols: object, itemsize: int) -> bool:
    """A [BLOCK_M, cols] TMA box: at most 256 per dim and at least 16 bytes per row."""
    return cols <= 256 and cfg.block_m <= 256 and cols * itemsize >= 16


def _tma_store_ok(call: Call, o: StoreOutput, cfg: Config) -> bool:
    """A TMA store needs an aligned row-major target and a legal box."""
    if not _tma_box_ok(cfg, cfg.epi_n * call.graph.node(o.x).frac_width, call.out_dtype(o).itemsize):
        return False
    t = call.out.get(o.name)
    if t is None:  # gemm() allocates it row-major; only the row pitch can break alignment
        row_bytes = call.output_shape(o)[1] * call.out_dtype(o).itemsize
        return row_bytes % 16 == 0
    return _tma_ok(t, 1)


def _tma_tile_ok(call: Call, name: str, cfg: Config) -> bool:
    spec = next(s for s in call.graph.operands if s.name == name)
    t = call.operands[name]
    return t.dtype != torch.bool and _tma_box_ok(cfg, cfg.epi_n * spec.frac_width, t.element_size()) and _tma_ok(t, 1)


def _wide(call: Call) -> bool:
    """Whether row offsets need int64: some tensor the epilogue indexes spans >= 2**31 elements."""
    tensors = [t for t in call.operands.values() if isinstance(t, torch.Tensor)] + list(call.out.values())
    spans = [sum((n - 1) * s for n, s in zip(t.shape, t.stride())) for t in tensors if t.numel()]
    outputs = [call.m * max(call.n, 1) * 2]  # outputs gemm allocates: [M, width*N], width <= 2
    return max(spans + outputs, default=0) >= 2**31 - 1


def _spec_fields(call: Call, interpret: bool, cfg: Config | None = None) -> tuple:
    stores = [(o.name, IN_DTYPES[call.out_dtype(o)]) for o in call.graph.outputs if isinstance(o, StoreOutput)]
    tiles, tma = [], []
    if cfg is not None:
        # Every TMA Tile load and TMA store stages a tile in shared memory beside the operand
        # ring: Tile loads first, then stores, each while it fits, so that no config fails for
        # want of shared memory because of them (the rest use pointers).
        free = HOPPER_SMEM_BYTES - ring_bytes(cfg, call.a.element_size())
        for s in call.graph.operands:
            if s.kind == Kind.TILE and _tma_tile_ok(call, s.name, cfg):
                need = staging_bytes(cfg, s.frac_width, call.operands[s.name].element_size())
                if need <= free:
                    free -= need
                    tiles.append(s.name)
        for o in call.graph.outputs:
            if isinstance(o, StoreOutput) and cfg.tma_store and _tma_store_ok(call, o, cfg):
                need = staging_bytes(cfg, call.graph.node(o.x).frac_width, call.out_dtype(o).itemsize)
                if need <= free:
                    free -= need
                    tma.append(o.name)
    forms = tuple((f.name, f.dtype) for f in call.forms)
    return (call.in_dtype, operand_load(call.a), operand_load(call.b), forms, tuple(stores), interpret, tuple(tma),
            tuple(tiles), _wide(call), 1 if cfg is None else cfg.subtile)


def _make_spec(fields: tuple) -> Specialization:
    in_dtype, a_load, b_load, forms, stores, interpret, tma, tiles, wide, subtile = fields
    return Specialization(
        in_dtype=in_dtype, a_load=a_load, b_load=b_load,
        operands=tuple(OperandForm(name=n, dtype=d) for n, d in forms),
        store_dtypes=stores, interpret=interpret, tma_stores=tma, tma_tiles=tiles, wide=wide, subtile=subtile,
    )


def specialize(call: Call, interpret: bool, cfg: Config | None = None) -> Specialization:
    return _make_spec(_spec_fields(call, interpret, cfg))


# (graph hash, specialization fields) -> (spec, kernel): the per-call lookup stays a
# tuple hash, so launch overhead does not grow with pydantic validation or hashing.
_kernels: dict[tuple, tuple[Specialization, object]] = {}


def _kernel_for(call: Call, interpret: bool, cfg: Config) -> tuple[Specialization, object]:
    key = (call.graph.hash, _spec_fields(call, interpret, cfg))
    hit = _kernels.get(key)
    if hit is not None:
        stats["memory_hits"] += 1
        return hit
    spec = _make_spec(key[1])
    hit = _kernels[key] = (spec, load_kernel(call.graph, spec))
    return hit


def run(
    graph: Graph, a: object, b: object, operands: Mapping[str, object], *,
    out: object = None, config: Config | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Compute graph(a @ b); `config` overrides the tuned (or default) tile configuration."""
    interpret = interpreting()
    key = _call_key(graph, a, b, operands, out, config)
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        with build_lock:  # one thread at a time builds (and tunes, compiles): coda.runtime.threads
            call = validate(graph, a, b, operands, out, interpret)
            cfg = config or _pick_config(call, interpret)
            check_config(graph, cfg)
            plan = make_plan(call, cfg, interpret)
            if key is not None:
                if len(_plans) >= _MAX_PLANS:
                    _plans.clear()
                _plans[key] = plan
            return plan.execute(call.a, call.b, call.operands, call.out)[0]
    stats["memory_hits"] += 1
    return plan.execute(a, b, operands, _out_dict(graph, out))[0]


# Validated calls by everything validation looks at (tensor metadata, operand forms, out=,
# config, tuning mode): a repeated call skips validation, specialization and config choice.
_plans: dict[tuple, Plan] = {}
_MAX_PLANS = 4096


def _meta(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return (v.shape, v.stride(), v.dtype, v.device, v.data_ptr() % 16)
    return type(v)


def _call_key(graph: Graph, a: object, b: object, operands: Mapping[str, object], out: object,
              config: Config | None) -> tuple | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if out is None or isinstance(out, torch.Tensor):
        outs: object = _meta(out)
    elif isinstance(out, dict):
        outs = tuple((k, _meta(v)) for k, v in out.items())
    else:
        return None
    ops = tuple((k, _meta(v)) for k, v in operands.items())
    return (graph.hash, _meta(a), _meta(b), ops, outs, config, autotune.mode())


def _out_dict(graph: Graph, out: object) -> dict:
    if out is None:
        return {}
    if isinstance(out, torch.Tensor):
        return {graph.outputs[0].name: out}
    return out  # type: ignore[return-value]


# (graph hash, M bucket, N, K, specialization fields) -> chosen config, for this process.
_chosen: dict[tuple, Config] = {}


def _memo(call: Call, fields: tuple) -> tuple:
    """The in-process key of a config choice: the tuning key's parts, before any hashing."""
    return (call.graph.hash, autotune.m_bucket(call.m), call.n, call.k, fields, autotune.mode())


def _pick_config(call: Call, interpret: bool) -> Config:
    graph, m, n, k = call.graph, call.m, call.n, call.k
    if interpret:
        return default_config(graph, call.in_dtype, True, m, n, k)
    fields = _spec_fields(call, interpret)
    memo = _memo(call, fields)
    cfg = _chosen.get(memo)
    if cfg is not None:
        return cfg
    key = autotune.TuneKey(
        graph=graph.hash, m_bucket=autotune.m_bucket(m), n=n, k=k, spec=_make_spec(fields).key(),
        gpu=device_name(call.a.device), triton=triton.__version__, coda=__version__, template=TEMPLATE_VERSION,
    )
    # Tuning runs the fused kernel on the caller's inputs into scratch outputs of the same
    # dtypes, so out= tensors (possibly aliasing operands) are never touched.
    scratch = replace(call, out={name: torch.empty_like(t) for name, t in call.out.items()})
    compiled: dict[Config, object] = {}

    def launch(c: Config) -> None:
        compiled[c] = _launch(scratch, c, interpret)[1]

    def spills(c: Config) -> int | None:
        return getattr(compiled.get(c), "n_spills", None)

    size = call.a.element_size()
    cfg = _chosen[memo] = autotune.choose(graph, key, call.in_dtype, size, size, m, n, k, launch, spills)
    return cfg


def chosen_config(graph: Graph, a: torch.Tensor, b: torch.Tensor, operands: Mapping[str, object]) -> Config | None:
    """The config this process chose for such a call (after one has run), or None."""
    call = validate(graph, a, b, operands, None, interpreting())
    return _chosen.get(_memo(call, _spec_fields(call, False)))


def _launch(call: Call, cfg: Config, interpret: bool) -> tuple[torch.Tensor | dict[str, torch.Tensor], object]:
    """One validated launch (plan, kernel, finalize); returns (results, Triton's compiled kernel)."""
    return make_plan(call, cfg, interpret).execute(call.a, call.b, call.operands, call.out)


def make_plan(call: Call, cfg: Config, interpret: bool) -> Plan:
    spec, kernel = _kernel_for(call, interpret, cfg)
    return Plan.build(call, spec, kernel, cfg, num_programs(call.a.device))


def gemm(a: object, b: object, epilogue: object = None, *, out: object = None, **operands: object):
    """epilogue(a @ b) in one persistent GEMM kernel. See coda's README for the contract."""
    return guard.gemm(a, b, epilogue, out, operands)  # autograd, aliasing, torch.compile: coda.runtime.guard


def graph_of(epilogue: object) -> Graph:
    if epilogue is None:
        return PLAIN
    graph = getattr(epilogue, "graph", None)
    if not isinstance(graph, Graph):
        raise TypeError(
            f"coda.gemm: epilogue must be a @coda.epilogue function or None, got {type(epilogue).__name__}"
        )
    return graph


def source(graph: Graph, a: object, b: object, operands: Mapping[str, object], out: object = None) -> str:
    """The Triton source gemm() would run for these inputs."""
    interpret = interpreting()
    call = validate(graph, a, b, operands, out, interpret)
    cfg = default_config(graph, call.in_dtype, interpret, call.m, call.n, call.k)
    return generate(graph, specialize(call, interpret, cfg))
