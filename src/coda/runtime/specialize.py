"""A call's specialization (backend, dtypes, layouts, what moves through TMA) and its kernel."""

from __future__ import annotations

import torch

from ..codegen import OperandForm, Specialization
from ..ir.nodes import StoreOutput
from ..ir.types import Kind
from . import tma
from .cache import load_kernel, stats
from .config import Config
from .device import smem_limit
from .resources import SharedMemory, Staged, staging
from .validate import IN_DTYPES, Call


def _wide(call: Call) -> bool:
    """Whether row offsets need int64: some tensor the epilogue indexes spans >= 2**31 elements."""
    tensors = [t for t in call.operands.values() if isinstance(t, torch.Tensor)] + list(call.out.values())
    spans = [sum((n - 1) * s for n, s in zip(t.shape, t.stride())) for t in tensors if t.numel()]
    outputs = [call.m * max(call.n, 1) * 2]  # outputs gemm allocates: [M, width*N], width <= 2
    return max(spans + outputs, default=0) >= 2**31 - 1


def _staging(call: Call, cfg: Config) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    """The Tile operands and tile outputs of this call that move through TMA with `cfg` (those TMA
    can move, while they fit beside the operand ring: `resources.staging`), and the kernel's
    shared memory then."""
    graph = call.graph
    tiles = [s for s in graph.operands if s.kind == Kind.TILE]
    loads = [Staged(s.name, s.frac_width, call.operands[s.name].element_size()) for s in tiles
             if tma.tile_ok(call, s.name, cfg)]
    outputs = [o for o in graph.outputs if isinstance(o, StoreOutput)]
    staged = {o.name: Staged(o.name, graph.node(o.x).frac_width, call.out_dtype(o).itemsize) for o in outputs}
    stores = [staged[o.name] for o in outputs if cfg.tma_store and tma.store_ok(call, o, cfg)]
    return staging(graph, cfg, call.a.element_size(), loads, stores, len(tiles), list(staged.values()))


def call_smem_bytes(call: Call, cfg: Config) -> int:
    """Shared memory of the kernel this call runs with `cfg` on a GPU."""
    return _staging(call, cfg)[2]


def smem_of(call: Call) -> SharedMemory:
    """The shared memory of this call's kernel under a config, and what its GPU allows a block
    (what the default must fit)."""
    return SharedMemory(lambda cfg: call_smem_bytes(call, cfg), smem_limit(call.a.device))


def spec_fields(call: Call, interpret: bool, cfg: Config | None = None) -> tuple:
    """The specialization as a plain tuple (a cheap per-call cache key)."""
    stores = [(o.name, IN_DTYPES[call.out_dtype(o)]) for o in call.graph.outputs if isinstance(o, StoreOutput)]
    tiles, tma_stores = (), ()
    if cfg is not None:
        tiles, tma_stores, _ = _staging(call, cfg)
    forms = tuple((f.name, f.dtype) for f in call.forms)
    backend = "triton" if cfg is None else cfg.backend
    return (backend, call.in_dtype, tma.operand_load(call.a), tma.operand_load(call.b), forms, tuple(stores),
            interpret, tma_stores, tiles, _wide(call), 1 if cfg is None else cfg.subtile,
            cfg is not None and cfg.epilogue_loop)


def make_spec(fields: tuple) -> Specialization:
    backend, in_dtype, a_load, b_load, forms, stores, interpret, tma_stores, tiles, wide, subtile, loop = fields
    return Specialization(
        backend=backend, in_dtype=in_dtype, a_load=a_load, b_load=b_load,
        operands=tuple(OperandForm(name=n, dtype=d) for n, d in forms),
        store_dtypes=stores, interpret=interpret, tma_stores=tma_stores, tma_tiles=tiles, wide=wide, subtile=subtile,
        epilogue_loop=loop,
    )


def specialize(call: Call, interpret: bool, cfg: Config | None = None) -> Specialization:
    return make_spec(spec_fields(call, interpret, cfg))


# (graph hash, specialization fields) -> (spec, kernel): the per-call lookup stays a
# tuple hash, so launch overhead does not grow with pydantic validation or hashing.
_kernels: dict[tuple, tuple[Specialization, object]] = {}


def kernel_for(call: Call, interpret: bool, cfg: Config) -> tuple[Specialization, object]:
    key = (call.graph.hash, spec_fields(call, interpret, cfg))
    hit = _kernels.get(key)
    if hit is not None:
        stats["memory_hits"] += 1
        return hit
    spec = make_spec(key[1])
    hit = _kernels[key] = (spec, load_kernel(call.graph, spec))
    return hit
