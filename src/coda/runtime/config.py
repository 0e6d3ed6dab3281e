"""Tile configurations and the default choice for a call (the autotuner refines these)."""

from __future__ import annotations

import itertools
import logging
from fractions import Fraction
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..codegen.size import code_size
from ..ir.graph import Graph
from ..ir.nodes import ReduceOutput, StoreOutput
from ..ir.primitives import Backend
from .resources import GLUON_CONSUMER_REGS, GLUON_CONSUMERS, HOPPER_SMEM_BYTES, misfit, run_smem_bytes, smem_bytes

log = logging.getLogger("coda")


def _pow2(x: int) -> bool:
    return x >= 1 and not x & (x - 1)


class Config(BaseModel):
    """One kernel launch configuration (block sizes must be powers of two)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    backend: Backend = "triton"  # gluon-hopper: warp-specialized (num_warps is then 4: one consumer warpgroup)
    block_m: int = Field(ge=16)
    block_n: int = Field(ge=16)
    block_k: int = Field(ge=16)
    group_m: int = Field(default=8, ge=1)
    num_warps: int = 4  # a power of two, 1..32 (Triton's limit: 1024 threads per block)
    num_stages: int = Field(default=3, ge=1)
    flatten: bool = False  # tl.range(flatten=True): pipeline across the tile loop too
    tma_store: bool = True  # store tile outputs through TMA descriptors where legal (no pointer tiles)
    # The epilogue runs on BLOCK_N // subtile columns at a time: a heavy epilogue's temporaries
    # then need a fraction of the registers, so it can follow a wide (128x256) accumulator.
    subtile: int = Field(default=1, ge=1)
    # gluon-hopper only: the Tile-operand ring's slots (subtiles the epilogue loader may run
    # ahead) and each consumer's TMA store staging buffers (2: a subtile's stores drain while
    # the next subtile is written)
    epi_stages: int = Field(default=2, ge=1, le=8)
    store_buffers: int = Field(default=1, ge=1, le=2)
    # gluon-hopper only: run the epilogue as one loop over its subtiles instead of one copy a
    # subtile (a third of the code, and no spills, in sm_90 compiles of the SwiGLU backward):
    # the default for width-2 epilogues (`_gluon_default`), tried both ways by the tuner
    epilogue_loop: bool = False
    # gluon-hopper only: both consumer warpgroups on every tile, block_m // 2 rows each (the
    # cooperative schedule), instead of alternate tiles (ping-pong). The epilogue no longer
    # runs under the other consumer's K loop, but a 128x256 tile reads a quarter fewer operand
    # bytes per FLOP than 128x128 ones: for long K and light epilogues.
    cooperative: bool = False

    @field_validator("num_warps")
    @classmethod
    def _warps(cls, v: int) -> int:
        if not (_pow2(v) and v <= 32):
            raise ValueError(f"Config.num_warps must be a power of two from 1 to 32, got {v}")
        return v

    @field_validator("block_m", "block_n", "block_k", "subtile")
    @classmethod
    def _pow2_field(cls, v: int, info) -> int:
        if not _pow2(v):
            raise ValueError(f"Config.{info.field_name} must be a power of two, got {v}")
        return v

    @model_validator(mode="after")
    def _subtiles(self) -> "Config":
        if self.epi_n < 16:
            raise ValueError(f"Config.subtile={self.subtile} leaves {self.epi_n} columns per epilogue subtile; at least 16")
        if self.backend != "gluon-hopper":
            if self.epi_stages != 2 or self.store_buffers != 1 or self.epilogue_loop or self.cooperative:
                raise ValueError("Config: epi_stages, store_buffers, epilogue_loop and cooperative are gluon-hopper "
                                 "options")
        else:
            if self.num_warps != 4 or self.flatten:
                raise ValueError("Config: gluon-hopper runs one warpgroup per consumer (num_warps=4) and has no "
                                 "flattened tile loop (flatten=False)")
            if self.cooperative and self.block_m != 128:
                raise ValueError(f"Config: the cooperative schedule splits a tile of block_m 128 into the two "
                                 f"consumers' 64 rows (a wgmma's), got block_m {self.block_m}")
            if self.block_m not in (64, 128) or self.epi_n > 256 or self.epi_m * self.block_n > 128 * 128:
                raise ValueError(f"Config: gluon-hopper tiles need block_m 64 or 128, at most 256 columns per "
                                 f"subtile and (rows per consumer) * block_n <= 16384 (two accumulators in "
                                 f"registers), got {self.block_m}x{self.block_n} subtile {self.subtile}"
                                 f"{' cooperative' if self.cooperative else ''}")
        return self

    @property
    def epi_n(self) -> int:
        """Columns of one epilogue subtile."""
        return self.block_n // self.subtile

    @property
    def split_m(self) -> int:
        """Consumers sharing each tile (gluon-hopper's SPLIT_M): all of them when cooperative."""
        return GLUON_CONSUMERS if self.cooperative else 1

    @property
    def epi_m(self) -> int:
        """Rows of one consumer's accumulator: the epilogue's tile height (its TMA boxes, its
        reduce_m partials)."""
        return self.block_m // self.split_m


def gluon_constexprs(cfg: Config, a_col: bool, b_col: bool) -> dict[str, object]:
    """The constexprs a gluon-hopper kernel takes beyond the tile sizes (the launch and the AOT
    compile pass the same ones)."""
    return {"STAGES": cfg.num_stages, "E_STAGES": cfg.epi_stages, "STAGE_BUFS": cfg.store_buffers, "A_COL": a_col,
            "B_COL": b_col, "CONSUMER_REGS": GLUON_CONSUMER_REGS, "SPLIT_M": cfg.split_m}


def min_block_n(graph: Graph) -> int:
    """The fewest columns an epilogue (sub)tile may have: whole groups of every grouped reduction
    (outputs and group_sum / group_max values)."""
    need = 16
    for _, group, width in graph.column_groups():
        need = max(need, int(Fraction(group) / width))
    return need


def check_config(graph: Graph, config: Config) -> None:
    """Raise if a config cannot run this graph (grouped reductions need whole groups per tile)."""
    need = min_block_n(graph)
    if config.epi_n < need:
        raise ValueError(f"Config.block_n={config.block_n} with subtile={config.subtile} is too small: grouped "
                         f"reductions need block_n // subtile >= {need}")


def _heavy(graph: Graph) -> bool:
    """Tile operands or several outputs: a 128x256 tile would spill, and a 128x128 one without
    epilogue subtiles does for the SwiGLU backward (seen in sm_90 AOT compiles)."""
    stores = sum(isinstance(o, StoreOutput) for o in graph.outputs)
    return stores > 1 or len(graph.outputs) > 2 or any(s.kind.value == "tile" for s in graph.operands)


def default_config(graph: Graph, in_dtype: str, interpret: bool, m: int, n: int, k: int,
                   backend: Backend = "triton", smem: Callable[[Config], int] | None = None) -> Config:
    """A reasonable config without tuning; on a GPU one that fits it (`fitted`), its shared
    memory measured by `smem` (by default: Tile operands and tile outputs of a's dtype, all of
    them TMA-legal)."""
    size = 4 if in_dtype == "float32" else 2
    need = min_block_n(graph)
    if backend == "gluon-hopper":
        cfg = _gluon_default(graph, size, m, n, k)
    elif interpret:  # no shared memory to fit
        block = 16 if max(m, n) <= 64 else 32
        cfg = Config(block_m=block, block_n=block, block_k=16 if k <= 64 else 32, group_m=2)
        return cfg.model_copy(update={"block_n": need}) if cfg.epi_n < need else cfg
    elif in_dtype == "float32":
        cfg = Config(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    elif graph.uses_width(Fraction(2)) or _heavy(graph):  # keep the epilogue's tiles in registers
        cfg = Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, flatten=True, subtile=2)
    else:  # the H200 sweep's most robust winner (bench/results/sweep)
        cfg = Config(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, flatten=True)
    if cfg.epi_n < need:
        cfg = cfg.model_copy(update={"block_n": need * cfg.subtile})
    smem = smem or (lambda c: run_smem_bytes(graph, c, size, size))
    budgeted = within_budget(graph, cfg)
    try:
        return fitted(graph, budgeted, smem)
    except ValueError:  # no config below the budgeted one fits: the budget never refuses a program
        if budgeted == cfg:
            raise
        return fitted(graph, cfg, smem)


# The most epilogue code (`codegen.size.code_size`) a default config's kernel may hold, so that a
# first call compiles in seconds. Every epilogue of coda.ops.epilogues stays under it at its own
# default (the largest: qknorm_rope_backward, 28544), so the budget changes none of them
# (tests/test_compile_time.py). Over it, sm_90 compiles on the CPU took 25-86 s and more (the
# time in LLVM's O3 growing faster than the code): docs/DESIGN.md, its paragraph on compile time.
CODE_BUDGET = 32768


def epilogue_code(graph: Graph, cfg: Config) -> float:
    """The epilogue code of graph's kernel under cfg: Gluon's consumers each hold a copy of the
    epilogue (one, as a loop, or one a subtile) over EPI_M x EPI_N elements in 128 threads; a Triton
    kernel holds one a subtile over BLOCK_M x EPI_N in its warps, twice when its tile loop is
    flattened (the pipeliner peels a second copy of the epilogue)."""
    if cfg.backend == "gluon-hopper":
        return code_size(graph, cfg.backend, cfg.epi_m * cfg.epi_n // 128,
                         GLUON_CONSUMERS * (1 if cfg.epilogue_loop else cfg.subtile))
    return code_size(graph, cfg.backend, cfg.block_m * cfg.epi_n // (32 * cfg.num_warps),
                     cfg.subtile * (2 if cfg.flatten else 1))


def within_budget(graph: Graph, cfg: Config) -> Config:
    """cfg, or where its epilogue code is over CODE_BUDGET a config that holds less: gluon-hopper
    runs the epilogue as one loop over its subtiles (then on narrower ones), Triton drops the
    flattened loop's second copy (then halves subtiles and tiles, whole groups kept). A program the
    budget is out of reach for (groups so wide that one subtile's elements alone exceed it) keeps
    cfg. Only epilogues far heavier than a Transformer block's get here; their speed matters less
    than a first call that does not take minutes."""
    need = max(16, min_block_n(graph))
    steps = [cfg]
    while epilogue_code(graph, steps[-1]) > CODE_BUDGET:
        c = steps[-1]
        if c.backend == "gluon-hopper":
            if not c.epilogue_loop and c.subtile > 1:
                update: dict[str, object] = {"epilogue_loop": True}
            elif c.epi_n // 2 >= need:
                update = {"subtile": c.subtile * 2, "epilogue_loop": True}
            else:
                break
        elif c.flatten:
            update = {"flatten": False}
        elif c.subtile > 1:
            update = {"subtile": c.subtile // 2, "block_n": c.block_n // 2}
        elif c.block_n // 2 >= need:
            update = {"block_n": c.block_n // 2}
        elif c.block_m > 64:
            update = {"block_m": c.block_m // 2}
        else:
            break
        steps.append(c.model_copy(update=update))
    return steps[-1] if epilogue_code(graph, steps[-1]) <= CODE_BUDGET else cfg


def _halvings(x: int, low: int) -> list[int]:
    return [x >> i for i in range(x.bit_length()) if x >> i >= low]


def _below(cfg: Config, need: int) -> list[dict[str, object]]:
    """Configs no larger than `cfg` whose epilogue subtiles hold `need` columns, largest first:
    pipelined (2+ stages) before not, then by tile area, K step, stages, the schedule and
    subtile width closest to cfg's (gluon-hopper keeps 2+ stages: its loader's ring)."""
    low = 2 if cfg.backend == "gluon-hopper" else 1
    options = []
    for bm, bn, bk, stages, coop in itertools.product(
            _halvings(cfg.block_m, 16), _halvings(cfg.block_n, max(16, need)), _halvings(cfg.block_k, 16),
            range(cfg.num_stages, low - 1, -1), {cfg.cooperative, False}):
        for sub in _halvings(bn // max(16, need), 1):
            rank = (stages >= 2, bm * bn, bk, stages, coop == cfg.cooperative,
                    -abs(sub.bit_length() - cfg.subtile.bit_length()), bm)
            options.append((rank, {"block_m": bm, "block_n": bn, "block_k": bk, "num_stages": stages,
                                   "cooperative": coop, "subtile": sub}))
    options.sort(key=lambda o: o[0], reverse=True)
    return [update for _, update in options]


def _search(graph: Graph, cfg: Config, smem: Callable[[Config], int], need: int) -> tuple[Config | None, str | None]:
    """The first legal config of `_below(cfg, need)` that fits, else (None, why the smallest
    legal one does not; None when none is legal)."""
    why = None
    for update in _below(cfg, need):
        try:
            c = Config.model_validate({**cfg.model_dump(), **update})
        except ValidationError:
            continue
        why = misfit(c, smem(c))
        if why is None:
            return c, None
    return None, why


def fitted(graph: Graph, cfg: Config, smem: Callable[[Config], int]) -> Config:
    """`cfg` if it fits an sm_90 GPU (`resources.misfit`, its shared memory by `smem`), else the
    largest config below it that does and still holds whole reduction groups (`_below`); a
    debug log says which runs instead. Raises ValueError, before anything launches, naming the
    grouped reductions and Tile operands and the largest groups that would fit, when none does."""
    if misfit(cfg, smem(cfg)) is None:
        return cfg
    need = min_block_n(graph)
    found, why = _search(graph, cfg, smem, need)
    if found is not None:
        log.debug("coda: %s: the default %s config (%s) does not fit the GPU: %s; running %s instead", graph.name,
                  cfg.backend, _shape(cfg), misfit(cfg, smem(cfg)), _shape(found))
        return found
    raise ValueError(_no_fit(graph, cfg, smem, need, why))


def _shape(cfg: Config) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}, {cfg.num_stages} stages, subtile {cfg.subtile}"
            f"{', cooperative' if cfg.cooperative else ''}")


def _no_fit(graph: Graph, cfg: Config, smem: Callable[[Config], int], need: int, why: str | None) -> str:
    """The sentence for a program no config of cfg's backend can run on sm_90."""
    groups = [o for o in graph.outputs if isinstance(o, ReduceOutput) and o.group is not None]
    tiles = [s.name for s in graph.operands if s.kind.value == "tile"]
    text = f"no {cfg.backend} config can run epilogue {graph.name!r} on an sm_90 GPU: "
    if why is None:
        text += f"none of its tiles holds {need} columns in one epilogue subtile"
    else:
        text += f"the smallest tile that holds whole groups does not fit, {why}"
    if groups:
        text += "; " + ", ".join(f"reduction {o.name!r} sums groups of {o.group} columns" for o in groups)
    if tiles and why is not None and "shared memory" in why:
        text += f"; Tile operand(s) {', '.join(map(repr, tiles))} are staged or converted in shared memory"
    smaller = next((cols for cols in _halvings(need // 2, 16) if _search(graph, cfg, smem, cols)[0] is not None), None)
    if groups and smaller is not None:
        widths = {o.name: graph.node(o.x).frac_width for o in groups}
        text += "; it would fit with " + ", ".join(f"group <= {int(smaller * widths[o.name])} for {o.name!r}"
                                                  for o in groups if o.group > smaller * widths[o.name])
    return text


# From this depth on, and for the plain GEMM at any depth, gluon-hopper defaults to the cooperative
# schedule: on the H200 (bench/results/epilogue_cost/coop_ksweep_d2048.md,
# coop_block_d2048.md, coop_block_d4096.md) the plain GEMM ran at
# 0.98-1.05x cuBLAS cooperative against 1.04-1.09x ping-pong (K = 2048..16384), and the residual
# and RMSNorm-backward epilogues at 1.04-1.10x against 1.12-1.13x from K = 8192; at the block's
# shorter K ping-pong's hidden epilogue wins (e.g. RoPE 1.12 vs 1.19 at K = 2048).
COOPERATIVE_MIN_K = 8192

# The default's picture of the GPU for tile rounds: an H100 SXM's or H200's SMs. A wrong count
# only makes the default a worse guess (tuning measures); the grid itself is the device's.
HOPPER_SMS = 132
# Ping-pong's plain K loop against cooperative's from K = 2048 on (coop_ksweep_d2048.md,
# ksweep_d2048.md: 1.04-1.10x against 0.98-1.05x cuBLAS), the upper end, so that only a clear
# win in tile rounds leaves the cooperative schedule.
PINGPONG_KLOOP_COST = 1.10


def cooperative_rounds_lose(m: int, n: int) -> bool:
    """True when the cooperative 128x256 tiles leave the persistent grid's busiest SM clearly more
    work than ping-pong's 128x128: each SM runs its tiles one after another, a cooperative tile
    being two ping-pong tiles' work. [3072, 2048, K] (D=2048's qkv weight gradient) is the case:
    192 cooperative tiles take 2 rounds on 132 SMs, 4 units, against ping-pong's 384 in 3, and the
    H200 measured its cooperative plain GEMM at 1.16x cuBLAS (block_kernels.md, caf40b4)."""
    rows = -(-m // 128)
    coop_rounds = -(-(rows * -(-n // 256)) // HOPPER_SMS)
    pingpong_rounds = -(-(rows * -(-n // 128)) // HOPPER_SMS)
    return PINGPONG_KLOOP_COST * pingpong_rounds < 2 * coop_rounds


def _gluon_default(graph: Graph, in_size: int, m: int, n: int, k: int) -> Config:
    """128x128 tiles per consumer (a 128-register accumulator each, full-width MMAs) behind a
    4-slot ring, the best gluon-hopper tile in the H200 sweep (bench/results/block_kernels.json).
    The epilogue runs on register slices of the accumulator: 32-column subtiles (the fewest
    spills in sm_90 compiles of the block's epilogues), 16 where that is what lets every Tile
    operand and tile output move through TMA beside the ring; none for reductions alone.
    Wider reduction groups take wider subtiles (and 64-row tiles from 64-column groups on).
    Epilogues that read or write width-2 tiles (the SwiGLU backward) run as one loop over the
    subtiles: the H200 measured 2.18x -> 1.36x cuBLAS for it at D=2048, where rms_rope and the
    RMSNorm backward gained nothing (bench/results/epilogue_cost/loop_d2048.md).
    The plain GEMM, and any epilogue from K = COOPERATIVE_MIN_K on, take the cooperative
    schedule on a 128x256 tile (32-column subtiles: no spills in sm_90 compiles of the block's
    epilogues, where 64-column ones spill) where it fits shared memory, unless its tiles would
    leave the grid's busiest SM clearly more work (`cooperative_rounds_lose`)."""
    need = min_block_n(graph)
    loop = graph.uses_width(Fraction(2))
    plain = not graph.operands and len(graph.outputs) == 1 and isinstance(graph.outputs[0], StoreOutput)
    if (plain or k >= COOPERATIVE_MIN_K) and need <= 32 and not cooperative_rounds_lose(m, n):
        cfg = Config(backend="gluon-hopper", block_m=128, block_n=256, block_k=64, num_warps=4, num_stages=3,
                     subtile=8, epilogue_loop=loop, cooperative=True)
        if smem_bytes(graph, cfg, in_size, in_size) <= HOPPER_SMEM_BYTES:
            return cfg
    if not any(isinstance(o, StoreOutput) for o in graph.outputs) and need <= 128:
        # reductions alone (an LM head's statistics): one subtile writes a quarter of the
        # partials, and nothing is staged
        return Config(backend="gluon-hopper", block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4)
    fallback = None
    # Groups of 64 columns or more (QK-norm's heads) take 64-row tiles of two subtiles of one group
    # each, else one: in sm_90 compiles the head_dim 64 QK-norm epilogues (forward; backward) spill
    # nothing at 64x128, 92 and 228 bytes at 64x256 in 4 subtiles, 48 and 2284 at 128x128 in 2; the
    # head_dim 128 backward 652 at 64x128 in 1, 2996 at 64x256 in 2 (3 stages: 4 do not fit).
    # Narrower groups: 32-column subtiles, 2 and 1 for groups too wide for 4 of a 64x256 tile.
    wide = need >= 64
    for subtile in (2, 1) if wide else (4, 8, 2, 1):
        block_n = max(128, need * subtile)
        cfg = _gluon_config(block_m=64 if wide or block_n > 128 else 128, block_n=block_n, num_stages=4,
                            subtile=subtile, epilogue_loop=loop)
        if cfg is not None and smem_bytes(graph, cfg, in_size, in_size) <= HOPPER_SMEM_BYTES:
            return cfg
        fallback = fallback or (cfg and cfg.model_copy(update={"num_stages": 3}))
    if fallback is None:
        groups = ", ".join(f"{what} sums groups of {group} columns" for what, group, _ in graph.column_groups())
        raise ValueError(f"gluon-hopper cannot run epilogue {graph.name!r}: {groups}, and its epilogue subtiles "
                         f"hold at most 256 columns (of a 64-row tile), {need} needed")
    return fallback


def _gluon_config(**fields: object) -> Config | None:
    """A gluon-hopper config with a 64-deep K step, or None where its tile is not legal."""
    try:
        return Config(backend="gluon-hopper", block_k=64, num_warps=4, **fields)
    except ValidationError:
        return None
