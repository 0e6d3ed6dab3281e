"""The autotuner: pick a tile config per (graph, shape bucket, dtypes, layouts, GPU).

Candidates come from a Hopper config space, pruned before any benchmark by what
cannot work (shared memory, accumulator registers, pair and group constraints),
then, once compiled, by what the compiler reports: a config with local memory (register
spills) is not benchmarked unless every config spills. Each survivor is benchmarked *with the
epilogue fused in* on the caller's own inputs. Winners are stored one JSON file per
key under `$CODA_CACHE_DIR/tuning/`, written atomically; an unreadable or stale
entry is ignored and retuned.

`CODA_AUTOTUNE`: `1` (default on a GPU) tunes on the first call of each key;
`0` skips tuning and uses the default config; `force` retunes even when cached.
`CODA_TUNE_QUIET=1` silences the progress lines (written to stderr).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from typing import Callable

import triton
from pydantic import BaseModel, ConfigDict, ValidationError

from ..ir.graph import Graph
from ..ir.nodes import PairNode, StoreOutput
from .cache import atomic_write, cache_dir
from .env import env_flag
from .config import Config, check_config, default_config, min_block_n
from .resources import misfit, smem_bytes


class TuneKey(BaseModel):
    """Everything a tuned winner depends on."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    graph: str
    m_bucket: int
    n: int
    k: int
    spec: str  # dtypes, layouts and operand forms (Specialization.key())
    gpu: str
    triton: str
    coda: str
    generator: str  # coda.runtime.fingerprint.GENERATOR
    backends: tuple[str, ...]  # the backends searched

    def filename(self) -> str:
        text = json.dumps(self.model_dump(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24] + ".json"


class TuneEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: TuneKey
    config: Config
    ms: float
    candidates: int


def m_bucket(m: int) -> int:
    """Token counts vary between calls; weights (N, K) do not. Bucket M by powers of two."""
    return 1 << max(m - 1, 0).bit_length()


def mode() -> str:
    value = os.environ.get("CODA_AUTOTUNE", "1").strip().lower()
    if value not in ("0", "1", "force"):
        raise ValueError(f"CODA_AUTOTUNE must be 0, 1 or force, got {value!r}")
    return value


def config_space(in_dtype: str, backends: tuple[str, ...] = ("triton",)) -> list[Config]:
    """Round-one Hopper candidates (tile, warps, stages) of each backend; round two varies the options."""
    space = _gluon_space() if "gluon-hopper" in backends else []
    return space + (_triton_space(in_dtype) if "triton" in backends else [])


def _gluon_space() -> list[Config]:
    """gluon-hopper: 128x128 or 64x256 per consumer (two accumulators must fit the registers),
    ring depth, epilogue subtiles (register slices of the accumulator); ping-pong, or both
    consumers on one 128x256 tile (cooperative: fewer operand bytes per FLOP, the epilogue not
    hidden)."""
    # The H200 sweep at template v2 (bench/results/block_kernels_sweep_2fa4523.md): 128x128 with
    # a 4-slot ring and 32-column subtiles wins or ties nearly everywhere; 3 slots lose 20-40%.
    tiles = [(128, 128, 64, 4, 4, False), (128, 128, 64, 4, 2, False), (128, 128, 64, 5, 4, False),
             (128, 128, 64, 4, 1, False), (64, 256, 64, 4, 4, False), (128, 128, 128, 3, 4, False),
             (128, 256, 64, 3, 8, True), (128, 256, 64, 4, 8, True)]
    return [Config(backend="gluon-hopper", block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=4, num_stages=s,
                   subtile=sub, cooperative=coop) for bm, bn, bk, s, sub, coop in tiles]


def _triton_space(in_dtype: str) -> list[Config]:
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


def option_variants(cfg: Config) -> list[Config]:
    """Round two: the template options (flattened tile loop, TMA stores, epilogue subtiles, and on
    gluon-hopper the epilogue as one loop over its subtiles) on a good tile."""
    gluon = cfg.backend == "gluon-hopper"
    if gluon:  # its subtiles are register slices: narrower ones cost no MMA width
        subtiles = tuple(sub for sub in (2, 4, 8) if cfg.block_n // sub >= 16)
    else:
        subtiles = (1, 2) if cfg.block_n >= 128 else (1,)
    flattens = (False,) if gluon else (False, True)
    loops = (False, True) if gluon else (False,)
    return [
        cfg.model_copy(update={"flatten": f, "tma_store": t, "subtile": sub, "epilogue_loop": loop})
        for f, t, sub, loop in itertools.product(flattens, (False, True), subtiles, loops)
        if (f, t, sub, loop) != (cfg.flatten, cfg.tma_store, cfg.subtile, cfg.epilogue_loop)
    ]


GROUPS = (4, 8, 16, 64)


def group_variants(cfg: Config, m: int) -> list[Config]:
    """Round three: the winner with other row-group sizes. GROUP_M row tiles share each column
    tile of B while it is in L2; a wide B (an LM head's [V, D] weight) is read from memory once
    per group, so a larger group reads it fewer times, at the price of more of A live in L2.
    Groups of at least all row tiles are one order: only distinct orders are timed."""
    tiles_m = -(-m // cfg.block_m)
    seen = {min(cfg.group_m, tiles_m)}
    out = []
    for g in GROUPS:
        if min(g, tiles_m) not in seen:
            seen.add(min(g, tiles_m))
            out.append(cfg.model_copy(update={"group_m": g}))
    return out


def prune_reason(graph: Graph, cfg: Config, in_size: int, out_size: int, m: int, n: int) -> str | None:
    """Why cfg cannot (or need not) run this graph, or None if it is a candidate."""
    if cfg.epi_n < min_block_n(graph):
        return (f"block_n {cfg.block_n} / subtile {cfg.subtile} cannot hold whole reduction groups "
                f"(needs {min_block_n(graph)})")
    for node in graph.nodes:
        if isinstance(node, PairNode):
            cols = cfg.epi_n * graph.node(node.x).frac_width
            if cols < 2 or cols % 2:
                return f"pairs need an even column count per tile, got {cols}"
    too_large = misfit(cfg, smem_bytes(graph, cfg, in_size, out_size))
    if too_large is not None:
        return too_large
    if cfg.block_m > 64 and cfg.block_m > 2 * m or cfg.block_n > 64 and cfg.block_n > 2 * n:
        return "tile far larger than the problem"
    if cfg.tma_store and not any(isinstance(o, StoreOutput) for o in graph.outputs):
        return "no tile outputs to store through TMA"
    return None


def _path(key: TuneKey):
    return cache_dir() / "tuning" / key.filename()


def load_entry(key: TuneKey) -> TuneEntry | None:
    """The cached winner, or None when missing, unreadable, for another key, or invalid now."""
    path = _path(key)
    try:
        entry = TuneEntry.model_validate_json(path.read_text())
    except (OSError, ValueError, ValidationError):
        return None
    if entry.key != key:
        return None
    return entry


def store_entry(entry: TuneEntry) -> None:
    atomic_write(_path(entry.key), entry.model_dump_json(indent=1))


def _say(msg: str) -> None:
    if not env_flag("CODA_TUNE_QUIET"):
        print(f"[coda tune] {msg}", file=sys.stderr, flush=True)


def measure(fn: Callable[[], object]) -> float:
    """Median ms of fn on the GPU (the tests replace this to check the logic on a CPU)."""
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _label(cfg: Config) -> str:
    return (f"{'gluon ' if cfg.backend == 'gluon-hopper' else ''}{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
            f"{' flat' if cfg.flatten else ''}{' tma-store' if cfg.tma_store else ''}"
            f"{f' sub{cfg.subtile}' if cfg.subtile > 1 else ''}{f' group{cfg.group_m}' if cfg.group_m != 8 else ''}"
            f"{' loop' if cfg.epilogue_loop else ''}{' coop' if cfg.cooperative else ''}")


def tune(
    graph: Graph, key: TuneKey, configs: list[Config], launch: Callable[[Config], object],
    spills: Callable[[Config], int | None] = lambda cfg: None,
    keep: Callable[[Config], bool] = lambda cfg: True, top: int = 2,
) -> TuneEntry:
    """Benchmark configs with `launch(cfg)` (the fused kernel on the caller's inputs), then the
    option variants of the `top` best that `keep` admits, then the best one's row-group sizes;
    store and return the winner."""
    _say(f"tuning {graph.name} M<={key.m_bucket} N={key.n} K={key.k} on {key.gpu}: {len(configs)} configs + variants")
    timings: dict[Config, float] = {}
    spilling: list[Config] = []  # compiled, but with local memory: benchmarked only if nothing else runs
    t0 = time.time()

    def bench(batch: list[Config], check_spills: bool = True) -> None:
        for i, cfg in enumerate(batch, 1):
            try:
                launch(cfg)  # compiles; errors (e.g. out of resources) drop the config
                spilled = spills(cfg) if check_spills else None
                if spilled:
                    spilling.append(cfg)
                    _say(f"  [{i}/{len(batch)}] {_label(cfg)}: pruned, {spilled} B of local memory (spills)")
                    continue
                ms = measure(lambda: launch(cfg))
            except Exception as exc:  # noqa: BLE001 - a config that fails to build is pruned, not fatal
                _say(f"  [{i}/{len(batch)}] {_label(cfg)}: skipped ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            timings[cfg] = ms
            _say(f"  [{i}/{len(batch)}] {_label(cfg)}: {ms:.4f} ms")

    bench(configs)
    if not timings and spilling:  # every config spills: the fastest of those is still the answer
        _say("every config spills; timing them anyway")
        bench(spilling, check_spills=False)
    leaders = sorted(timings, key=timings.get)[:top]
    # Leaders that differ only in an option share variants: each runs once.
    variants = dict.fromkeys(v for c in leaders for v in option_variants(c) if keep(v))
    bench([v for v in variants if v not in timings and v not in spilling])
    if not timings:
        raise RuntimeError(f"coda: no config could run {graph.name} for M<={key.m_bucket} N={key.n} K={key.k}")
    best = min(timings, key=timings.get)
    bench([v for v in group_variants(best, key.m_bucket) if v not in timings and v not in spilling])
    best = min(timings, key=timings.get)
    entry = TuneEntry(key=key, config=best, ms=timings[best], candidates=len(timings))
    store_entry(entry)
    _say(f"best {_label(best)} at {timings[best]:.4f} ms ({time.time() - t0:.0f} s, {len(timings)} timed)")
    return entry


def choose(
    graph: Graph, key: TuneKey, in_dtype: str, in_size: int, out_size: int, m: int, n: int, k: int,
    launch: Callable[[Config], object], spills: Callable[[Config], int | None],
    smem: Callable[[Config], int] | None = None,
) -> Config:
    """The config for this call: cached winner, fresh tuning over `key.backends`, or the
    default (CODA_AUTOTUNE=0) of the first of them, fitted by `smem` (default_config)."""
    setting = mode()
    if setting == "0":
        return default_config(graph, in_dtype, False, m, n, k, key.backends[0], smem)
    if setting == "1":
        entry = load_entry(key)
        if entry is not None:
            try:
                check_config(graph, entry.config)
                return entry.config
            except ValueError:
                _say(f"cached config for {graph.name} no longer valid; retuning")

    def keep(cfg: Config) -> bool:
        return prune_reason(graph, cfg, in_size, out_size, m, n) is None

    space = config_space(in_dtype, key.backends)
    if not any(isinstance(o, StoreOutput) for o in graph.outputs):  # nothing to store through TMA
        space = [c.model_copy(update={"tma_store": False}) for c in space]
    configs = [c for c in space if keep(c)]
    return tune(graph, key, configs, launch, spills, keep).config


__all__ = ["TuneKey", "TuneEntry", "m_bucket", "mode", "config_space", "option_variants", "group_variants", "prune_reason",
           "smem_bytes", "load_entry", "store_entry", "measure", "tune", "choose"]
