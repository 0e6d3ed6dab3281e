"""The autotuner: pick a tile config per (graph, shape bucket, dtypes, layouts, GPU).

Candidates come from a Hopper config space, pruned before any benchmark by what
cannot work (shared memory, accumulator registers, pair and group constraints),
then, once compiled, by what the compiler reports: a config with local memory (register
spills) is not benchmarked unless every config spills. Each survivor is benchmarked *with the
epilogue fused in* on the caller's own inputs, beside the default config (the one an untuned
call runs). A winner is kept only where it beats the default by MARGIN, the two timed
alternately at the end; otherwise the key records that the default stays. Entries are stored
one JSON file per key under `$CODA_CACHE_DIR/tuning/`, written atomically; an unreadable or
stale entry is ignored and retuned.

`CODA_AUTOTUNE`: `0` (the default) never tunes and runs the default config, so that no call
stalls on tuning (on the H200 the tuner took ~400 s for the 12 keys of one block step, which then
ran no faster than untuned); `1` tunes each key on its first call (or reads the key's cached
entry); `force` retunes even when cached. `coda tune` tunes ahead of time.
`CODA_TUNE_QUIET=1` silences the progress lines (written to stderr).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import triton
from pydantic import BaseModel, ConfigDict, ValidationError

from ..ir.graph import Graph
from ..ir.nodes import PairNode, StoreOutput
from .backends import backend_of
from .cache import atomic_write, cache_dir
from .env import env_flag
from .config import Config, check_config, default_config, min_block_n
from .resources import HOPPER_SMEM_BYTES, SharedMemory, misfit, smem_bytes

MARGIN = 0.03  # a tuned config must be this much faster than the default to be kept
DUEL_ROUNDS = 3  # alternating timings of the default and the best at the end


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
    """A key's tuning result. `config` None: nothing beat the default config by MARGIN, so the
    default runs (the default of the call's own M, as an untuned call would run it)."""

    model_config = ConfigDict(extra="forbid")
    key: TuneKey
    config: Config | None
    ms: float  # the kept config's median (the default's when config is None)
    default_ms: float | None  # the default's, timed in the same process (None: it could not run)
    candidates: int


@dataclass
class Session:
    """This process's tuning, for progress lines and `coda tune`'s report: every key a call
    asked about (tuned or not), how many keys `coda tune` expects to tune, and each result."""

    asked: set[TuneKey] = field(default_factory=set)
    planned: int = 0
    tuned: list[tuple[str, TuneEntry, float]] = field(default_factory=list)  # graph name, entry, seconds


SESSION = Session()


def m_bucket(m: int) -> int:
    """Token counts vary between calls; weights (N, K) do not. Bucket M by powers of two."""
    return 1 << max(m - 1, 0).bit_length()


def mode() -> str:
    value = os.environ.get("CODA_AUTOTUNE", "0").strip().lower()
    if value not in ("0", "1", "force"):
        raise ValueError(f"CODA_AUTOTUNE must be 0, 1 or force, got {value!r}")
    return value


def config_space(in_dtype: str, backends: tuple[str, ...] = ("triton",)) -> list[Config]:
    """Round-one Hopper candidates (tile, warps, stages) of each backend (its module's `space`),
    gluon-hopper's first; round two varies the options."""
    return [cfg for name in ("gluon-hopper", "triton") if name in backends for cfg in backend_of(name).space(in_dtype)]


def option_variants(cfg: Config) -> list[Config]:
    """Round two: the template options (flattened tile loop, TMA stores, epilogue subtiles, and on
    gluon-hopper the epilogue as one loop over its subtiles) on a good tile, each as its backend
    tries it (its module's `options`)."""
    flattens, subtiles, loops = backend_of(cfg.backend).options(cfg)
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


def prune_reason(graph: Graph, cfg: Config, in_size: int, out_size: int, m: int, n: int,
                 limit: int = HOPPER_SMEM_BYTES) -> str | None:
    """Why cfg cannot (or need not) run this graph on a GPU whose blocks may use `limit` bytes of
    shared memory, or None if it is a candidate."""
    if cfg.epi_n < min_block_n(graph):
        return (f"block_n {cfg.block_n} / subtile {cfg.subtile} cannot hold whole reduction groups "
                f"(needs {min_block_n(graph)})")
    for node in graph.nodes:
        if isinstance(node, PairNode):
            cols = cfg.epi_n * graph.node(node.x).frac_width
            if cols < 2 or cols % 2:
                return f"pairs need an even column count per tile, got {cols}"
    too_large = misfit(cfg, smem_bytes(graph, cfg, in_size, out_size), limit)
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
    """Median ms of fn's kernels on the GPU, fn captured into a CUDA graph and replayed: no host work
    is timed. Timed launch by launch instead (each call's events around it), a kernel shorter than
    its launch's host work measured that work, which differs per config, and the tuner kept configs
    that launched faster, not ran faster (bench/results/tune_h100_f21f531/). (The tests replace
    this to check the logic on a CPU.)"""
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def label(cfg: Config) -> str:
    """A config in a few words, for progress lines and `coda tune`'s report."""
    return (f"{backend_of(cfg.backend).LABEL}{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
            f"{' flat' if cfg.flatten else ''}{' tma-store' if cfg.tma_store else ''}"
            f"{f' sub{cfg.subtile}' if cfg.subtile > 1 else ''}{f' group{cfg.group_m}' if cfg.group_m != 8 else ''}"
            f"{' loop' if cfg.epilogue_loop else ''}{' coop' if cfg.cooperative else ''}")


def _left(seconds: float) -> str:
    return f"about {seconds:.0f} s left" if seconds >= 1 else "under 1 s left"


def _header(graph: Graph, key: TuneKey, count: int) -> str:
    """The line opening a key's tuning: which key of how many, and the time left at the rate so far."""
    done = SESSION.tuned
    which = f"key {len(done) + 1}/{SESSION.planned}" if SESSION.planned > len(done) else f"key {len(done) + 1}"
    line = (f"{which}: {graph.name} M<={key.m_bucket} N={key.n} K={key.k} on {key.gpu}, "
            f"{count} configs + variants")
    if done and SESSION.planned > len(done):
        per_key = sum(sec for _, _, sec in done) / len(done)
        line += f" ({_left(per_key * (SESSION.planned - len(done)))} for this and the other keys)"
    return line


# A candidate's launch: build and run it once (compiling it), returning what runs it again.
Launch = Callable[[Config], Callable[[], object]]


def tune(
    graph: Graph, key: TuneKey, configs: list[Config], launch: Launch,
    spills: Callable[[Config], int | None] = lambda cfg: None,
    keep: Callable[[Config], bool] = lambda cfg: True, top: int = 2, default: Config | None = None,
) -> TuneEntry:
    """Benchmark `default` (what an untuned call runs) and configs with `launch(cfg)` (the fused
    kernel on the caller's inputs; the relaunch it returns is what is timed), then the option
    variants of the `top` best that `keep` admits, then the best one's row-group sizes. The best
    is kept only if, timed alternately with the default, it is MARGIN faster; store and return
    the entry."""
    first = ([default] if default is not None else []) + [c for c in configs if c != default]
    _say(_header(graph, key, len(first)))
    timings: dict[Config, float] = {}
    again: dict[Config, Callable[[], object]] = {}
    spilling: list[Config] = []  # compiled, but with local memory: benchmarked only if nothing else runs
    t0 = time.time()

    def run(cfg: Config, check_spills: bool) -> str:
        """Time one config into `timings` (or prune it); what happened, for its progress line."""
        try:
            again[cfg] = launch(cfg)  # compiles; errors (e.g. out of resources) drop the config
            # the default is timed even if it spills: it is what runs untuned
            spilled = spills(cfg) if check_spills and cfg != default else None
            if spilled:
                spilling.append(cfg)
                return f"pruned, {spilled} B of local memory (spills)"
            timings[cfg] = measure(again[cfg])
        except Exception as exc:  # noqa: BLE001 - a config that fails to build is pruned, not fatal
            return f"skipped ({type(exc).__name__}: {str(exc)[:80]})"
        return f"{timings[cfg]:.4f} ms"

    def bench(batch: list[Config], check_spills: bool = True) -> None:
        start = time.time()
        for i, cfg in enumerate(batch, 1):
            what = run(cfg, check_spills)
            eta = (time.time() - start) / i * (len(batch) - i)
            name = label(cfg) + (" (default)" if cfg == default else "")
            _say(f"  [{i}/{len(batch)}] {name}: {what}; {_left(eta)} in this round")

    bench(first)
    if spilling and not set(timings) - {default}:  # every config spills: the fastest is still the answer
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
    config, ms, default_ms, best_ms = _decide(best, timings, default, again)
    entry = TuneEntry(key=key, config=config, ms=ms, default_ms=default_ms, candidates=len(timings))
    store_entry(entry)
    seconds = time.time() - t0
    SESSION.tuned.append((graph.name, entry, seconds))
    _say(f"{_outcome(entry, best, best_ms, timings, default)} ({seconds:.0f} s, {len(timings)} timed)")
    return entry


def _outcome(entry: TuneEntry, best: Config, best_ms: float, timings: dict[Config, float],
             default: Config | None) -> str:
    """The tuning's result in a sentence: what runs from now on, and against what."""
    if entry.config is not None:
        against = "no default fits this call" if entry.default_ms is None else f"the default's {entry.default_ms:.4f} ms"
        return f"kept {label(best)}: {entry.ms:.4f} ms against {against}"
    if best == default:
        others = sorted((c for c in timings if c != default), key=timings.get)
        nearest = f"; the next, {label(others[0])}, {timings[others[0]]:.4f} ms" if others else ""
        return f"the default stays, the fastest timed: {entry.ms:.4f} ms{nearest}"
    return (f"the default stays: {label(best)}, the fastest in the search, took {best_ms:.4f} ms against the "
            f"default's {entry.default_ms:.4f} ms timed in turns, not {MARGIN:.0%} faster")


def _decide(best: Config, timings: dict[Config, float], default: Config | None,
            again: dict[Config, Callable[[], object]]) -> tuple[Config | None, float, float | None, float]:
    """(config kept or None for the default, its ms, the default's ms, best's ms): the default
    stays unless `best`, timed alternately with it (so that a clock drifting over the search
    favours neither), is MARGIN faster."""
    if default is None or default not in timings:  # no baseline: the default cannot run here
        return best, timings[best], None, timings[best]
    if best == default:
        return None, timings[default], timings[default], timings[default]
    pairs = [(measure(again[default]), measure(again[best])) for _ in range(DUEL_ROUNDS)]
    default_ms = sorted(d for d, _ in pairs)[DUEL_ROUNDS // 2]
    best_ms = sorted(b for _, b in pairs)[DUEL_ROUNDS // 2]
    if best_ms < default_ms * (1 - MARGIN):
        return best, best_ms, default_ms, best_ms
    return None, default_ms, default_ms, best_ms


def _baseline(graph: Graph, in_dtype: str, m: int, n: int, k: int, backend: str,
              smem: SharedMemory | None = None) -> Config | None:
    """The default config as the tuner times it, or None where no default fits the call. With no
    tile output the TMA-store flag changes nothing, and the space drops it: so does this."""
    try:
        cfg = default_config(graph, in_dtype, False, m, n, k, backend, smem)
    except ValueError as exc:
        _say(f"no default config for {graph.name} ({exc}); tuning without a baseline")
        return None
    if not any(isinstance(o, StoreOutput) for o in graph.outputs):
        cfg = cfg.model_copy(update={"tma_store": False})
    return cfg


def choose(
    graph: Graph, key: TuneKey, in_dtype: str, in_size: int, out_size: int, m: int, n: int, k: int,
    launch: Launch, spills: Callable[[Config], int | None],
    smem: SharedMemory | None = None,
) -> Config:
    """The config for this call: the default of the first of `key.backends`, fitted by `smem`
    (CODA_AUTOTUNE=0), or the key's cached entry, or a fresh tuning over `key.backends`."""
    SESSION.asked.add(key)
    setting = mode()
    if setting == "0":
        return default_config(graph, in_dtype, False, m, n, k, key.backends[0], smem)
    baseline = _baseline(graph, in_dtype, m, n, k, key.backends[0], smem)
    if setting == "1":
        entry = load_entry(key)
        if entry is not None and entry.config is None and baseline is not None:
            return baseline
        if entry is not None and entry.config is not None:
            try:
                check_config(graph, entry.config)
                return entry.config
            except ValueError:
                _say(f"cached config for {graph.name} no longer valid; retuning")

    def keep(cfg: Config) -> bool:
        return prune_reason(graph, cfg, in_size, out_size, m, n, smem.limit if smem else HOPPER_SMEM_BYTES) is None

    space = config_space(in_dtype, key.backends)
    if not any(isinstance(o, StoreOutput) for o in graph.outputs):  # nothing to store through TMA
        space = [c.model_copy(update={"tma_store": False}) for c in space]
    entry = tune(graph, key, [c for c in space if keep(c)], launch, spills, keep, default=baseline)
    if entry.config is not None:
        return entry.config
    assert baseline is not None  # the default stays only where it was timed
    return baseline


__all__ = ["TuneKey", "TuneEntry", "Session", "SESSION", "MARGIN", "m_bucket", "mode", "config_space",
           "option_variants", "group_variants", "prune_reason", "smem_bytes", "load_entry", "store_entry", "measure",
           "tune", "choose", "label", "Launch"]
