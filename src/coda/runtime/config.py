"""Tile configurations: the model, its checks against a program, and what both backends share
in choosing a call's default (the autotuner refines these): the code budget and the fit to the
GPU. Each backend's own rules and default live in its module (`backends.backend_of`)."""

from __future__ import annotations

import itertools
import logging
from fractions import Fraction

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..ir.graph import Graph
from ..ir.nodes import ReduceOutput
from ..ir.primitives import Backend
from .backends import backend_of
from .resources import SharedMemory, misfit, run_smem_bytes

log = logging.getLogger("coda")

GLUON_CONSUMERS = 2  # gluon-hopper: consumer warpgroups, each with its own TMA store staging


def _pow2(x: int) -> bool:
    return x >= 1 and not x & (x - 1)


class Config(BaseModel):
    """One kernel launch configuration (block sizes must be powers of two; its backend's module
    checks the rest: `check`)."""

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
    # the default for width-2 epilogues (`gluon_backend._default`), tried both ways by the tuner
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
        backend_of(self.backend).check(self)
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


def default_config(graph: Graph, in_dtype: str, interpret: bool, m: int, n: int, k: int,
                   backend: Backend = "triton", smem: SharedMemory | None = None) -> Config:
    """A reasonable config without tuning: `backend`'s own (its module's `default_config`), on a
    GPU within the code budget and one that fits it (`fit_default`)."""
    return backend_of(backend).default_config(graph, in_dtype, interpret, m, n, k, smem)


def fit_default(graph: Graph, cfg: Config, in_size: int, smem: SharedMemory | None) -> Config:
    """A backend's default `cfg` within the code budget (`within_budget`) and fitted to the GPU
    (`fitted`), its shared memory and the GPU's limit by `smem` (by default: Tile operands and
    tile outputs of `in_size` bytes, all of them TMA-legal, on sm_90)."""
    smem = smem or SharedMemory(lambda c: run_smem_bytes(graph, c, in_size, in_size))
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
    """The epilogue code of graph's kernel under cfg (`codegen.size.code_size`), as its backend
    holds copies of the epilogue (its module's `epilogue_code`)."""
    return backend_of(cfg.backend).epilogue_code(graph, cfg)


def within_budget(graph: Graph, cfg: Config) -> Config:
    """cfg, or where its epilogue code is over CODE_BUDGET a config that holds less, by its
    backend's steps (its module's `budget_step`: gluon-hopper loops over its subtiles, Triton drops
    the flattened loop's second copy, then halves subtiles and tiles, whole groups kept). A program
    the budget is out of reach for (groups so wide that one subtile's elements alone exceed it)
    keeps cfg. Only epilogues far heavier than a Transformer block's get here; their speed matters
    less than a first call that does not take minutes."""
    need = max(16, min_block_n(graph))
    steps = [cfg]
    while epilogue_code(graph, steps[-1]) > CODE_BUDGET:
        update = backend_of(steps[-1].backend).budget_step(steps[-1], need)
        if update is None:
            break
        steps.append(steps[-1].model_copy(update=update))
    return steps[-1] if epilogue_code(graph, steps[-1]) <= CODE_BUDGET else cfg


def _halvings(x: int, low: int) -> list[int]:
    return [x >> i for i in range(x.bit_length()) if x >> i >= low]


def _below(cfg: Config, need: int) -> list[dict[str, object]]:
    """Configs no larger than `cfg` whose epilogue subtiles hold `need` columns, largest first:
    pipelined (2+ stages) before not, then by tile area, K step, stages, the schedule and
    subtile width closest to cfg's (stages down to its backend's `MIN_STAGES`)."""
    low = backend_of(cfg.backend).MIN_STAGES
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


def _search(graph: Graph, cfg: Config, smem: SharedMemory, need: int) -> tuple[Config | None, str | None]:
    """The first legal config of `_below(cfg, need)` that fits, else (None, why the smallest
    legal one does not; None when none is legal)."""
    why = None
    for update in _below(cfg, need):
        try:
            c = Config.model_validate({**cfg.model_dump(), **update})
        except ValidationError:
            continue
        why = misfit(c, smem(c), smem.limit)
        if why is None:
            return c, None
    return None, why


def fitted(graph: Graph, cfg: Config, smem: SharedMemory) -> Config:
    """`cfg` if it fits the GPU (`resources.misfit`, its shared memory and the limit by `smem`), else the
    largest config below it that does and still holds whole reduction groups (`_below`); a
    debug log says which runs instead. Raises ValueError, before anything launches, naming the
    grouped reductions and Tile operands and the largest groups that would fit, when none does."""
    if misfit(cfg, smem(cfg), smem.limit) is None:
        return cfg
    need = min_block_n(graph)
    found, why = _search(graph, cfg, smem, need)
    if found is not None:
        log.debug("coda: %s: the default %s config (%s) does not fit the GPU: %s; running %s instead", graph.name,
                  cfg.backend, _shape(cfg), misfit(cfg, smem(cfg), smem.limit), _shape(found))
        return found
    raise ValueError(_no_fit(graph, cfg, smem, need, why))


def _shape(cfg: Config) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}, {cfg.num_stages} stages, subtile {cfg.subtile}"
            f"{', cooperative' if cfg.cooperative else ''}")


def _no_fit(graph: Graph, cfg: Config, smem: SharedMemory, need: int, why: str | None) -> str:
    """The sentence for a program no config of cfg's backend can run on the GPU."""
    groups = [o for o in graph.outputs if isinstance(o, ReduceOutput) and o.group is not None]
    tiles = [s.name for s in graph.operands if s.kind.value == "tile"]
    text = f"no {cfg.backend} config can run epilogue {graph.name!r} on this GPU: "
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


