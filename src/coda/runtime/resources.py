"""What a config needs of an sm_90 GPU under each template, and whether that fits.

One model for both templates: shared memory (the operand ring, TMA staging of Tile operands and
tile outputs, the compiler's scratch for the epilogue's layout changes and cross-warp
reductions, barriers) and accumulator registers. Each number is an upper bound of what Triton
3.6 allocates, checked against sm_90 AOT compiles specialized as the JIT specializes a launch
(tests/test_resources.py). The default choice, the tuner's pruning, the TMA staging choice and
the check before every GPU launch all ask this module. Here are the parts both templates share;
each backend's module adds up its own kernel's shared memory (its `shared_bytes`: how many
staging copies it keeps, what its compiler takes as scratch).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Callable, Sequence

from ..ir.graph import Graph
from ..ir.nodes import StoreOutput
from .backends import backend_of

if TYPE_CHECKING:
    from .config import Config

HOPPER_SMEM_BYTES = 232448  # shared memory a block may use on sm_90 (227 KiB, opt-in)
MAX_ACC_REGS = 128  # fp32 accumulator registers per thread we allow before the epilogue's own
# mbarriers and the tile-id ring beside the explicit buffers: 16-56 bytes in sm_90 compiles
BARRIER_BYTES = 1024


def ring_bytes(cfg: Config, in_size: int) -> int:
    """Shared memory of the pipelined A/B operand ring (every stage is allocated, also in Triton)."""
    return cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * in_size


def staging_bytes(cfg: Config, width: Fraction, out_size: int) -> int:
    """Shared memory staging one TMA-loaded or TMA-stored epilogue tile of the given width (one
    subtile's: the subtiles of a tile reuse the buffer, as sm_90 compiles show)."""
    return cfg.epi_m * int(cfg.epi_n * width) * out_size


@dataclass(frozen=True)
class SharedMemory:
    """What a config must fit: its kernel's shared memory under a config (`need`, called as
    `smem(cfg)`), and what one block may use on the GPU that runs it (`limit`; sm_90's where the
    kernel is compiled for sm_90 off the GPU)."""

    need: Callable[[Config], int]
    limit: int = HOPPER_SMEM_BYTES

    def __call__(self, cfg: Config) -> int:
        return self.need(cfg)


@dataclass(frozen=True)
class Staged:
    """A Tile operand or tile output that may move through TMA: its name, width and item size."""

    name: str
    width: Fraction
    size: int


def shared_bytes(graph: Graph, cfg: Config, in_size: int, loads: Sequence[Staged], stores: Sequence[Staged],
                 pointer_tiles: bool, pointer_stores: Sequence[Staged]) -> int:
    """Shared memory of a kernel whose `loads` and `stores` move through TMA (`pointer_tiles`:
    some Tile operand does not; `pointer_stores`: the tile outputs that do not), as its backend
    adds it up (its module's `shared_bytes`)."""
    return backend_of(cfg.backend).shared_bytes(graph, cfg, in_size, loads, stores, pointer_tiles, pointer_stores)


def staging(graph: Graph, cfg: Config, in_size: int, loads: Sequence[Staged], stores: Sequence[Staged],
            tiles: int, outputs: Sequence[Staged]) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    """Which of the TMA-legal `loads` and `stores` move through TMA, and the shared memory then:
    all of them where that fits, else Tile loads first, then stores, each while it fits (the
    rest use pointers, so that their staging never makes a config fail). `tiles`: the graph's
    Tile operands, those not in `loads` being read through pointers; `outputs`: every tile
    output, those not in `stores` being stored through pointers."""
    def total(kept_loads: Sequence[Staged], kept_stores: Sequence[Staged]) -> int:
        names = {s.name for s in kept_stores}
        return shared_bytes(graph, cfg, in_size, kept_loads, kept_stores, len(kept_loads) < tiles,
                            [o for o in outputs if o.name not in names])

    best = total(loads, stores)
    if best <= HOPPER_SMEM_BYTES:
        return tuple(s.name for s in loads), tuple(s.name for s in stores), best
    kept_loads: list[Staged] = []
    kept_stores: list[Staged] = []
    for s in loads:
        if total(kept_loads + [s], []) <= HOPPER_SMEM_BYTES:
            kept_loads.append(s)
    for s in stores:
        if total(kept_loads, kept_stores + [s]) <= HOPPER_SMEM_BYTES:
            kept_stores.append(s)
    return tuple(s.name for s in kept_loads), tuple(s.name for s in kept_stores), total(kept_loads, kept_stores)


def _staged(graph: Graph, cfg: Config, in_size: int, out_size: int) -> tuple[list[Staged], list[Staged], list[Staged]]:
    """Every Tile operand (of `in_size` bytes), the tile outputs stored through TMA (all of them
    with tma_store, else none) and every tile output (of `out_size` bytes)."""
    loads = [Staged(s.name, s.frac_width, in_size) for s in graph.operands if s.kind.value == "tile"]
    outputs = [Staged(o.name, graph.node(o.x).frac_width, out_size) for o in graph.outputs
               if isinstance(o, StoreOutput)]
    return loads, outputs if cfg.tma_store else [], outputs


def smem_bytes(graph: Graph, cfg: Config, in_size: int, out_size: int) -> int:
    """Shared memory of the kernel with every Tile operand of `in_size` bytes loaded and (with
    tma_store) every tile output of `out_size` stored through TMA: what the tuner admits."""
    loads, stores, outputs = _staged(graph, cfg, in_size, out_size)
    return shared_bytes(graph, cfg, in_size, loads, stores, False, [] if stores else outputs)


def run_smem_bytes(graph: Graph, cfg: Config, in_size: int, out_size: int) -> int:
    """Shared memory of the kernel the runtime runs for such operands and outputs, all of them
    TMA-legal: staged while they fit (`staging`), the rest through pointers."""
    loads, stores, outputs = _staged(graph, cfg, in_size, out_size)
    return staging(graph, cfg, in_size, loads, stores, len(loads), outputs)[2]


def acc_regs(cfg: Config) -> int:
    """fp32 accumulator registers per thread (gluon-hopper: per consumer warpgroup)."""
    return cfg.epi_m * cfg.block_n // (32 * cfg.num_warps)


def misfit(cfg: Config, smem: int, limit: int = HOPPER_SMEM_BYTES) -> str | None:
    """Why `cfg`, needing `smem` bytes of shared memory, does not fit a GPU whose blocks may use
    `limit` bytes (sm_90's by default), or None."""
    if acc_regs(cfg) > MAX_ACC_REGS:
        return f"its accumulator needs {acc_regs(cfg)} registers a thread (at most {MAX_ACC_REGS})"
    if smem > limit:
        return f"it needs {smem} bytes of shared memory (at most {limit} on this GPU)"
    return None
