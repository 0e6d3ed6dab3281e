"""gemm(): validate, specialize, fetch the kernel, launch, finalize reductions."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..codegen import OperandForm, Specialization, generate, operand_args, output_args
from ..ir.graph import Graph
from ..ir.nodes import ReduceOutput, StoreOutput
from ..ir.trace import trace
from ..ir.types import Kind
from .. import __version__
from ..templates import TEMPLATE_VERSION
from . import autotune
from .cache import load_kernel, stats
from .config import Config, check_config, default_config
from .device import device_name, interpreting, num_programs
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


def _tma_store_ok(call: Call, o: StoreOutput, cfg: Config) -> bool:
    """A TMA store needs an aligned row-major target and a box of at most 256 per dim."""
    cols = cfg.block_n * call.graph.node(o.x).frac_width
    if cols > 256 or cfg.block_m > 256:
        return False
    t = call.out.get(o.name)
    if t is None:  # gemm() allocates it row-major; only the row pitch can break alignment
        row_bytes = call.output_shape(o)[1] * call.out_dtype(o).itemsize
        return row_bytes % 16 == 0
    return _tma_ok(t, 1)


def _spec_fields(call: Call, interpret: bool, cfg: Config | None = None) -> tuple:
    stores, tma = [], []
    for o in call.graph.outputs:
        if isinstance(o, StoreOutput):
            stores.append((o.name, IN_DTYPES[call.out_dtype(o)]))
            if cfg is not None and cfg.tma_store and _tma_store_ok(call, o, cfg):
                tma.append(o.name)
    forms = tuple((f.name, f.dtype) for f in call.forms)
    return (call.in_dtype, operand_load(call.a), operand_load(call.b), forms, tuple(stores), interpret, tuple(tma))


def _make_spec(fields: tuple) -> Specialization:
    in_dtype, a_load, b_load, forms, stores, interpret, tma = fields
    return Specialization(
        in_dtype=in_dtype, a_load=a_load, b_load=b_load,
        operands=tuple(OperandForm(name=n, dtype=d) for n, d in forms),
        store_dtypes=stores, interpret=interpret, tma_stores=tma,
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


def _descriptor(t: torch.Tensor, mode: str, rows: int, cols: int) -> object:
    if mode == "tma_row":
        return TensorDescriptor.from_tensor(t, [rows, cols])
    if mode == "tma_col":
        return TensorDescriptor.from_tensor(t.T, [cols, rows])
    return t


def run(
    graph: Graph, a: object, b: object, operands: Mapping[str, object], *,
    out: object = None, config: Config | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Compute graph(a @ b); `config` overrides the tuned (or default) tile configuration."""
    interpret = interpreting()
    call = validate(graph, a, b, operands, out, interpret)
    cfg = config or _pick_config(call, interpret)
    check_config(graph, cfg)
    return _launch(call, cfg, interpret)[0]


# (graph hash, M bucket, N, K, specialization fields) -> chosen config, for this process.
_chosen: dict[tuple, Config] = {}


def _pick_config(call: Call, interpret: bool) -> Config:
    graph, m, n, k = call.graph, call.m, call.n, call.k
    if interpret:
        return default_config(graph, call.in_dtype, True, m, n, k)
    fields = _spec_fields(call, interpret)
    memo = (graph.hash, autotune.m_bucket(m), n, k, fields, autotune.mode())
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


def _launch(call: Call, cfg: Config, interpret: bool) -> tuple[torch.Tensor | dict[str, torch.Tensor], object]:
    """One kernel launch plus the reduction finalize; returns (results, Triton's compiled kernel)."""
    graph = call.graph
    spec, kernel = _kernel_for(call, interpret, cfg)

    m, n, k = call.m, call.n, call.k
    tiles_m = -(-m // cfg.block_m)
    tiles_n = -(-n // cfg.block_n)
    device = call.a.device
    args: dict[str, object] = {
        "a_src": _descriptor(call.a, spec.a_load, cfg.block_m, cfg.block_k),
        "b_src": _descriptor(call.b, spec.b_load, cfg.block_k, cfg.block_n),
        "M": m, "N": n, "K": k,
        "stride_am": call.a.stride(0), "stride_ak": call.a.stride(1),
        "stride_bk": call.b.stride(0), "stride_bn": call.b.stride(1),
    }
    forms = {f.name: f for f in spec.operands}
    for s in graph.operands:
        names = operand_args(s, forms[s.name])
        value = call.operands[s.name]
        if s.kind == Kind.SCALAR:
            args[names[0]] = value
        elif s.kind == Kind.TILE:
            args.update(zip(names, (value, value.stride(0), value.stride(1))))
        else:
            args.update(zip(names, (value, value.stride(0))))

    results: dict[str, torch.Tensor] = {}
    finalize: list[tuple[ReduceOutput, torch.Tensor]] = []
    for o in graph.outputs:
        names = output_args(o)
        shape = call.output_shape(o)
        target = call.out.get(o.name)
        if isinstance(o, StoreOutput):
            t = target if target is not None else torch.empty(shape, dtype=call.a.dtype, device=device)
            dst = t
            if o.name in spec.tma_stores:
                dst = TensorDescriptor.from_tensor(t, [cfg.block_m, int(cfg.block_n * graph.node(o.x).frac_width)])
            args.update(zip(names, (dst, t.stride(0), t.stride(1))))
            results[o.name] = t
        elif o.group is not None:
            t = target if target is not None else torch.empty(shape, dtype=torch.float32, device=device)
            args.update(zip(names, (t, t.stride(0), t.stride(1))))
            results[o.name] = t
        else:
            parts = (m, tiles_n) if o.axis == "n" else (tiles_m, shape[0])
            partial = torch.empty(parts, dtype=torch.float32, device=device)
            args[names[0]] = partial
            finalize.append((o, partial))
            results[o.name] = target if target is not None else torch.empty(shape, dtype=torch.float32, device=device)

    grid = (min(num_programs(device), tiles_m * tiles_n),)
    compiled = kernel[grid](
        **args,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, NUM_SMS=grid[0], FLATTEN=cfg.flatten,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    for o, partial in finalize:
        dst = results[o.name]
        if o.axis == "m":
            torch.sum(partial, dim=0, out=dst)
        elif o.op == "sum":
            torch.sum(partial, dim=1, out=dst)
        elif o.op == "max":
            torch.amax(partial, dim=1, out=dst)
        else:
            torch.logsumexp(partial, dim=1, out=dst)
    if graph.single:
        return results[graph.outputs[0].name], compiled
    return results, compiled


def gemm(a: object, b: object, epilogue: object = None, *, out: object = None, **operands: object):
    """epilogue(a @ b) in one persistent GEMM kernel. See coda's README for the contract."""
    return run(graph_of(epilogue), a, b, operands, out=out)


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
