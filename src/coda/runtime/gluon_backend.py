"""The gluon-hopper backend: everything particular to it, in the order a call meets it.

Top to bottom: whether it can run a call (`unsupported`: an sm_90 GPU, a default config that holds
the program's groups and fits, the codegen's own limits); the configs it runs (`check`, the Config
model's rule); its default config (`default_config`: the tile, schedule and subtiles measured best
on the H200, then the shared code budget and fit to the GPU); how the code budget shrinks a config
(`epilogue_code`, `budget_step`); its resources (`MIN_STAGES` for the fit search, the register
split, and `shared_bytes`: the epilogue loader's rings, each consumer's store staging, the
compiler's scratch); what a launch and an AOT compile pass its kernel (`STRIDE_ARGS`,
`constexprs`, `launch_options`, the TMA boxes' `shared_layout`, `ast_source`); its tuning space
(`space`, `options`, `LABEL`). Shared code reaches this module through
`backends.backend_of("gluon-hopper")`.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence

import torch
from pydantic import ValidationError

from .. import codegen
from ..codegen.size import code_size
from ..ir.graph import Graph
from ..ir.nodes import ReduceOutput, StoreOutput
from .config import GLUON_CONSUMERS, Config, fit_default, min_block_n
from .resources import BARRIER_BYTES, HOPPER_SMEM_BYTES, SharedMemory, Staged, ring_bytes, smem_bytes, staging_bytes
from .specialize import make_spec, smem_of, spec_fields
from .validate import Call


# -- whether it can run a call, the configs it runs, its default -----------------------------------

def unsupported(call: Call, interpret: bool) -> str | None:
    """Why gluon-hopper cannot run this call (None: it can)."""
    if interpret:
        return "Gluon kernels do not run under Triton's interpreter"
    major, minor = torch.cuda.get_device_capability(call.a.device)
    if (major, minor) != (9, 0):
        return f"the GPU is sm_{major}{minor}; gluon-hopper is for sm_90"
    try:
        cfg = default_config(call.graph, call.in_dtype, False, call.m, call.n, call.k, smem_of(call))
    except ValueError as exc:  # no gluon-hopper config holds its groups or fits the GPU: the sentence says which
        return str(exc)
    return codegen.unsupported(call.graph, make_spec(spec_fields(call, False, cfg)))


def check(cfg: Config) -> None:
    """Raise ValueError where cfg is no gluon-hopper config (the Config model asks)."""
    if cfg.num_warps != 4 or cfg.flatten:
        raise ValueError("Config: gluon-hopper runs one warpgroup per consumer (num_warps=4) and has no "
                         "flattened tile loop (flatten=False)")
    if cfg.cooperative and cfg.block_m != 128:
        raise ValueError(f"Config: the cooperative schedule splits a tile of block_m 128 into the two "
                         f"consumers' 64 rows (a wgmma's), got block_m {cfg.block_m}")
    if cfg.block_m not in (64, 128) or cfg.epi_n > 256 or cfg.epi_m * cfg.block_n > 128 * 128:
        raise ValueError(f"Config: gluon-hopper tiles need block_m 64 or 128, at most 256 columns per "
                         f"subtile and (rows per consumer) * block_n <= 16384 (two accumulators in "
                         f"registers), got {cfg.block_m}x{cfg.block_n} subtile {cfg.subtile}"
                         f"{' cooperative' if cfg.cooperative else ''}")


def default_config(graph: Graph, in_dtype: str, interpret: bool, m: int, n: int, k: int,
                   smem: SharedMemory | None = None) -> Config:
    """`_default` within the code budget and fitted to the GPU (`config.fit_default`, `smem`
    measuring a config's shared memory); `interpret` changes nothing: Gluon kernels do not run
    under the interpreter (`unsupported`)."""
    size = 4 if in_dtype == "float32" else 2
    return fit_default(graph, _default(graph, size, m, n, k), size, smem)


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


def _default(graph: Graph, in_size: int, m: int, n: int, k: int) -> Config:
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
        cfg = _config(block_m=64 if wide or block_n > 128 else 128, block_n=block_n, num_stages=4,
                      subtile=subtile, epilogue_loop=loop)
        if cfg is not None and smem_bytes(graph, cfg, in_size, in_size) <= HOPPER_SMEM_BYTES:
            return cfg
        fallback = fallback or (cfg and cfg.model_copy(update={"num_stages": 3}))
    if fallback is None:
        groups = ", ".join(f"{what} sums groups of {group} columns" for what, group, _ in graph.column_groups())
        raise ValueError(f"gluon-hopper cannot run epilogue {graph.name!r}: {groups}, and its epilogue subtiles "
                         f"hold at most 256 columns (of a 64-row tile), {need} needed")
    return fallback


def _config(**fields: object) -> Config | None:
    """A gluon-hopper config with a 64-deep K step, or None where its tile is not legal."""
    try:
        return Config(backend="gluon-hopper", block_k=64, num_warps=4, **fields)
    except ValidationError:
        return None


# -- the code budget -------------------------------------------------------------------------------

def epilogue_code(graph: Graph, cfg: Config) -> float:
    """The epilogue code of graph's kernel under cfg: the consumers each hold a copy of the
    epilogue (one, as a loop, or one a subtile) over EPI_M x EPI_N elements in 128 threads."""
    return code_size(graph, cfg.backend, cfg.epi_m * cfg.epi_n // 128,
                     GLUON_CONSUMERS * (1 if cfg.epilogue_loop else cfg.subtile))


def budget_step(cfg: Config, need: int) -> dict[str, object] | None:
    """The next step toward less epilogue code (`config.within_budget`), or None where none is
    left: run the epilogue as one loop over its subtiles, then on narrower ones (holding `need`
    columns)."""
    if not cfg.epilogue_loop and cfg.subtile > 1:
        return {"epilogue_loop": True}
    if cfg.epi_n // 2 >= need:
        return {"subtile": cfg.subtile * 2, "epilogue_loop": True}
    return None


# -- resources: what the fit search may lower, registers, shared memory ----------------------------

MIN_STAGES = 2  # the fit search keeps 2+ stages: the loader's ring
CONSUMER_REGS = 232  # registers per consumer thread (setmaxnreg), the loaders take 40
MAXNREG = 168  # registers per thread at launch: 3 warpgroups share the 64K register file


def tile_load_bytes(cfg: Config, width: Fraction, size: int) -> int:
    """Shared memory for one TMA-read Tile operand: the epilogue loader keeps a ring of
    `epi_stages` subtiles (one ring per consumer when they share tiles)."""
    slots = cfg.epi_stages * cfg.split_m
    return slots * staging_bytes(cfg, width, size)


def store_bytes(cfg: Config, width: Fraction, size: int) -> int:
    """Shared memory for one TMA-stored tile output: `store_buffers` subtiles per consumer."""
    copies = GLUON_CONSUMERS * cfg.store_buffers
    return copies * staging_bytes(cfg, width, size)


def scratch_bytes(graph: Graph, cfg: Config) -> int:
    """Shared memory the compiler takes for the epilogue's cross-warp traffic: sums over rows
    (reduce_m: the 4 warps' partial columns) and grouped reductions (their [rows, groups] result
    changes layout), each one fp32 subtile at most; pairs, interleave and subtiles take none
    (their layouts split and join in registers)."""
    moves = any(isinstance(o, ReduceOutput) and (o.axis == "m" or o.group is not None) for o in graph.outputs)
    return cfg.epi_m * cfg.epi_n * 4 if moves else 0


def shared_bytes(graph: Graph, cfg: Config, in_size: int, loads: Sequence[Staged], stores: Sequence[Staged],
                 pointer_tiles: bool, pointer_stores: Sequence[Staged]) -> int:
    """Shared memory of the kernel whose `loads` and `stores` move through TMA
    (`resources.shared_bytes`; `pointer_tiles` and `pointer_stores` count nothing here: the
    kernel stores from registers in the layout it chose, sm_90 compiles show no scratch): the
    ring, each staged Tile's and output's copies, the scratch and the barriers, all allocated at
    once."""
    ring = ring_bytes(cfg, in_size)
    loaded = sum(tile_load_bytes(cfg, s.width, s.size) for s in loads)
    stored = sum(store_bytes(cfg, s.width, s.size) for s in stores)
    return ring + loaded + stored + scratch_bytes(graph, cfg) + BARRIER_BYTES


# -- what a launch and an AOT compile pass the kernel ----------------------------------------------

STRIDE_ARGS: tuple[str, ...] = ()  # a and b come through TMA descriptors only


def constexprs(cfg: Config, a_col: bool, b_col: bool) -> dict[str, object]:
    """The constexprs a gluon-hopper kernel takes beyond the tile sizes (the launch and the AOT
    compile pass the same ones)."""
    return {"STAGES": cfg.num_stages, "E_STAGES": cfg.epi_stages, "STAGE_BUFS": cfg.store_buffers, "A_COL": a_col,
            "B_COL": b_col, "CONSUMER_REGS": CONSUMER_REGS, "SPLIT_M": cfg.split_m}


def launch_options(cfg: Config) -> dict[str, object]:
    """Triton's options for the kernel beyond num_warps (the launch and the AOT compile pass the
    same ones)."""
    return {"maxnreg": MAXNREG}


def shared_layout(block: list[int], dtype: str) -> object:
    """The NVMMA shared layout of a Gluon TMA box (what the kernel's buffers are allocated with);
    `dtype` is coda's dtype name (validate.OPERAND_DTYPES), which Gluon's dtypes share."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(block, getattr(gl, dtype))


def ast_source(**fields: object) -> object:
    """What an AOT compile (`aot.compile_hopper`) hands triton.compile: the kernel, its signature,
    constexprs and attributes in `fields`."""
    from triton.experimental.gluon._runtime import GluonASTSource

    return GluonASTSource(**fields)


# -- the tuner -------------------------------------------------------------------------------------

def space(in_dtype: str) -> list[Config]:
    """The tuner's round-one candidates (bf16 and fp16 alike): 128x128 or 64x256 per consumer
    (two accumulators must fit the registers), ring depth, epilogue subtiles (register slices of
    the accumulator); ping-pong, or both consumers on one 128x256 tile (cooperative: fewer operand
    bytes per FLOP, the epilogue not hidden)."""
    # The H200 sweep at template v2 (bench/results/block_kernels_sweep_2fa4523.md): 128x128 with
    # a 4-slot ring and 32-column subtiles wins or ties nearly everywhere; 3 slots lose 20-40%.
    tiles = [(128, 128, 64, 4, 4, False), (128, 128, 64, 4, 2, False), (128, 128, 64, 5, 4, False),
             (128, 128, 64, 4, 1, False), (64, 256, 64, 4, 4, False), (128, 128, 128, 3, 4, False),
             (128, 256, 64, 3, 8, True), (128, 256, 64, 4, 8, True)]
    return [Config(backend="gluon-hopper", block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=4, num_stages=s,
                   subtile=sub, cooperative=coop) for bm, bn, bk, s, sub, coop in tiles]


def options(cfg: Config) -> tuple[tuple[bool, ...], tuple[int, ...], tuple[bool, ...]]:
    """The tuner's round-two choices of flatten, subtile and epilogue_loop on a good tile
    (`autotune.option_variants`): no flattened loop; its subtiles are register slices, so narrower
    ones cost no MMA width; the epilogue unrolled and as one loop."""
    return (False,), tuple(sub for sub in (2, 4, 8) if cfg.block_n // sub >= 16), (False, True)


LABEL = "gluon "  # how the tuner's progress lines and `coda tune`'s report name its configs
