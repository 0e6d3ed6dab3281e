"""The triton backend: everything particular to it, in the order a call meets it.

Top to bottom: the configs it runs (`check`, the Config model's rule); its default config
(`default_config`: small tiles under the interpreter, else the tile the H200 sweep found most
robust, then the shared code budget and fit to the GPU); how the code budget shrinks a config
(`epilogue_code`, `budget_step`); its resources (`MIN_STAGES` for the fit search, and
`shared_bytes`: one staging subtile per TMA-moved tile, the compiler's scratch, the ring freed
for the epilogue when the tile loop is not flattened); what a launch and an AOT compile pass its
kernel (`STRIDE_ARGS`, `constexprs`, `launch_options`, `shared_layout`, `ast_source`); its tuning
space (`space`, `options`, `LABEL`). Triton runs every program, on any GPU and under the
interpreter. Shared code reaches this module through `backends.backend_of("triton")`.
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Sequence

from ..codegen.size import code_size
from ..ir.graph import Graph
from ..ir.nodes import ReduceOutput, StoreOutput
from .config import Config, fit_default, min_block_n
from .resources import BARRIER_BYTES, SharedMemory, Staged, ring_bytes, staging_bytes


# -- the configs it runs, its default --------------------------------------------------------------

def check(cfg: Config) -> None:
    """Raise ValueError where cfg sets an option only gluon-hopper has (the Config model asks)."""
    if cfg.epi_stages != 2 or cfg.store_buffers != 1 or cfg.epilogue_loop or cfg.cooperative:
        raise ValueError("Config: epi_stages, store_buffers, epilogue_loop and cooperative are gluon-hopper "
                         "options")


def default_config(graph: Graph, in_dtype: str, interpret: bool, m: int, n: int, k: int,
                   smem: SharedMemory | None = None) -> Config:
    """Under the interpreter small tiles (no shared memory to fit); on a GPU a tile by dtype and
    epilogue, widened to hold whole groups, within the code budget and fitted to the GPU
    (`config.fit_default`, `smem` measuring a config's shared memory)."""
    size = 4 if in_dtype == "float32" else 2
    need = min_block_n(graph)
    if interpret:  # no shared memory to fit
        block = 16 if max(m, n) <= 64 else 32
        cfg = Config(block_m=block, block_n=block, block_k=16 if k <= 64 else 32, group_m=2)
        return cfg.model_copy(update={"block_n": need}) if cfg.epi_n < need else cfg
    if in_dtype == "float32":
        cfg = Config(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    elif graph.uses_width(Fraction(2)) or _heavy(graph):  # keep the epilogue's tiles in registers
        cfg = Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, flatten=True, subtile=2)
    else:  # the H200 sweep's most robust winner (bench/results/sweep)
        cfg = Config(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, flatten=True)
    if cfg.epi_n < need:
        cfg = cfg.model_copy(update={"block_n": need * cfg.subtile})
    return fit_default(graph, cfg, size, smem)


def _heavy(graph: Graph) -> bool:
    """Tile operands or several outputs: a 128x256 tile would spill, and a 128x128 one without
    epilogue subtiles does for the SwiGLU backward (seen in sm_90 AOT compiles)."""
    stores = sum(isinstance(o, StoreOutput) for o in graph.outputs)
    return stores > 1 or len(graph.outputs) > 2 or any(s.kind.value == "tile" for s in graph.operands)


# -- the code budget -------------------------------------------------------------------------------

def epilogue_code(graph: Graph, cfg: Config) -> float:
    """The epilogue code of graph's kernel under cfg: one copy of the epilogue a subtile over
    BLOCK_M x EPI_N elements in its warps, twice when its tile loop is flattened (the pipeliner
    peels a second copy of the epilogue)."""
    return code_size(graph, cfg.backend, cfg.block_m * cfg.epi_n // (32 * cfg.num_warps),
                     cfg.subtile * (2 if cfg.flatten else 1))


def budget_step(cfg: Config, need: int) -> dict[str, object] | None:
    """The next step toward less epilogue code (`config.within_budget`), or None where none is
    left: drop the flattened loop's second copy, then halve subtiles and tiles, each subtile still
    holding `need` columns."""
    if cfg.flatten:
        return {"flatten": False}
    if cfg.subtile > 1:
        return {"subtile": cfg.subtile // 2, "block_n": cfg.block_n // 2}
    if cfg.block_n // 2 >= need:
        return {"block_n": cfg.block_n // 2}
    if cfg.block_m > 64:
        return {"block_m": cfg.block_m // 2}
    return None


# -- resources: what the fit search may lower, shared memory ---------------------------------------

MIN_STAGES = 1  # the fit search may drop the K loop's pipelining


def _widest(graph: Graph) -> Fraction:
    widths = [n.frac_width for n in graph.nodes if n.kind.has_cols]
    return max(widths + [s.frac_width for s in graph.operands if s.kind.has_cols] + [Fraction(1)])


def scratch_bytes(graph: Graph, cfg: Config, pointer_tiles: bool) -> int:
    """Shared memory Triton's compiler takes for the epilogue beside its explicit buffers.
    A Tile operand read through pointers arrives in a vectorized layout, which the compiler
    converts to the accumulator's (or back) through shared memory: up to one fp32 subtile of
    the widest value (sm_90 compiles: 32 KB for a 128x256 grouped max beside a bf16 Tile, 128 KB
    for pairs of a width-2 Tile), none when Tiles come through TMA. Reductions exchange
    per-warp partials: a [rows or columns, warps] fp32 buffer at most. Row and column vectors
    (offsets, VecM/VecN operands) change layout too: one int64 vector at most (1 KB beside the
    explicit buffers in sm_90 compiles of the SwiGLU backward)."""
    cols = int(cfg.epi_n * _widest(graph))
    convert = cfg.epi_m * cols * 4 if pointer_tiles else 0
    reduce = (cfg.epi_m + cols) * cfg.num_warps * 4 if any(isinstance(o, ReduceOutput) for o in graph.outputs) else 0
    return convert + reduce + 8 * max(cfg.epi_m, cols)


def store_convert_bytes(cfg: Config, pointer_stores: Sequence[Staged]) -> int:
    """Shared memory through which tile outputs stored through pointers leave the accumulator's
    layout (for coalesced stores): one subtile of an output in its dtype, the outputs taking
    turns (sm_90 compiles of flattened loops: 128 KB for an fp32 128x256 output, 64 KB for two
    fp32 128x128 ones, 32 KB for a width-1/2 fp32 one from pairs)."""
    return max((staging_bytes(cfg, s.width, s.size) for s in pointer_stores), default=0)


def shared_bytes(graph: Graph, cfg: Config, in_size: int, loads: Sequence[Staged], stores: Sequence[Staged],
                 pointer_tiles: bool, pointer_stores: Sequence[Staged]) -> int:
    """Shared memory of the kernel whose `loads` and `stores` move through TMA, one subtile's
    staging each (`pointer_tiles`: some Tile operand does not; `pointer_stores`: the tile outputs
    that do not; `resources.shared_bytes`). Triton frees a non-flattened K loop's ring for the
    epilogue (its staged loads and scratch then share those bytes, sm_90 compiles show), but
    never the TMA stores' buffers, which drain while the next tile runs. The epilogue's Tiles are
    read from their staging before any output is stored (codegen's order), so the pointer
    stores' conversion reuses the loads' staging bytes (sm_90 compiles: the SwiGLU backward's dz
    through pointers beside a TMA-loaded z and y takes no more than its stores and loads)."""
    ring = ring_bytes(cfg, in_size)
    loaded = sum(staging_bytes(cfg, s.width, s.size) for s in loads)
    stored = sum(staging_bytes(cfg, s.width, s.size) for s in stores)
    epilogue = max(loaded, store_convert_bytes(cfg, pointer_stores)) + scratch_bytes(graph, cfg, pointer_tiles)
    if cfg.flatten:
        return ring + stored + epilogue + BARRIER_BYTES
    return stored + max(ring, epilogue) + BARRIER_BYTES


# -- what a launch and an AOT compile pass the kernel ----------------------------------------------

STRIDE_ARGS = ("stride_am", "stride_ak", "stride_bk", "stride_bn")  # a and b may be read through pointers


def constexprs(cfg: Config, a_col: bool, b_col: bool) -> dict[str, object]:
    """The constexprs a Triton kernel takes beyond the tile sizes (the launch and the AOT compile
    pass the same ones); a's and b's layouts (`a_col`, `b_col`) reach it as strides."""
    return {"FLATTEN": cfg.flatten}


def launch_options(cfg: Config) -> dict[str, object]:
    """Triton's options for the kernel beyond num_warps (the launch and the AOT compile pass the
    same ones)."""
    return {"num_stages": cfg.num_stages}


def shared_layout(block: list[int], dtype: str) -> None:
    """A Triton TMA box carries no shared layout (the compiler picks its own)."""
    return None


def ast_source(**fields: object) -> object:
    """What an AOT compile (`aot.compile_hopper`) hands triton.compile: the kernel, its signature,
    constexprs and attributes in `fields`."""
    from triton.compiler import ASTSource

    return ASTSource(**fields)


# -- the tuner -------------------------------------------------------------------------------------

def space(in_dtype: str) -> list[Config]:
    """The tuner's round-one candidates: tile, warps, stages (and subtiles of wide tiles)."""
    if in_dtype == "float32":  # IEEE fp32 dot runs on FMA units: small tiles only
        shapes = [(64, 64, 32, 4), (64, 128, 32, 4), (128, 64, 32, 4), (128, 128, 32, 8)]
        stages = (2, 3)
        return [Config(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=w, num_stages=s)
                for (bm, bn, bk, w), s in itertools.product(shapes, stages)]
    # bf16/fp16: the tiles that won on the H200 sweep (bench/results/sweep), and their neighbours;
    # 128x256 also with the epilogue in 128- and 64-column subtiles (heavy epilogues spill without:
    # sm_90 compiles of the SwiGLU- and RMSNorm-backward epilogues).
    tiles = [(128, 256, 64, 8, 3, 1), (128, 256, 64, 8, 4, 1), (128, 256, 64, 8, 3, 2), (128, 256, 64, 8, 3, 4),
             (128, 128, 64, 8, 4, 1),
             (128, 128, 64, 4, 4, 1), (256, 128, 64, 8, 3, 1), (128, 128, 128, 8, 3, 1), (64, 128, 64, 4, 4, 1),
             (64, 64, 64, 4, 3, 1)]
    return [Config(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=w, num_stages=s, subtile=sub)
            for bm, bn, bk, w, s, sub in tiles]


def options(cfg: Config) -> tuple[tuple[bool, ...], tuple[int, ...], tuple[bool, ...]]:
    """The tuner's round-two choices of flatten, subtile and epilogue_loop on a good tile
    (`autotune.option_variants`): the tile loop flattened or not, two subtiles of a wide tile."""
    return (False, True), ((1, 2) if cfg.block_n >= 128 else (1,)), (False,)


LABEL = ""  # how the tuner's progress lines and `coda tune`'s report name its configs (unmarked)
