"""The autotuner's logic on a CPU: pruning, keys, the on-disk cache, env switches.

Benchmarks are replaced by deterministic fake timings (the real `measure` needs a GPU);
everything else (candidate selection, the two rounds, cache files, retuning) is real.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import coda
from coda.runtime import autotune
from coda.runtime.autotune import TuneEntry, TuneKey
from coda.runtime.config import Config, default_config
from coda.runtime.resources import BARRIER_BYTES
from conftest import GPU


@coda.epilogue
def grouped(acc):
    return {"y": acc, "heads": coda.reduce_n(acc * acc, "sum", group=256)}


@coda.epilogue
def swiglu(acc):
    gate, up = coda.pairs(acc)
    return coda.silu(gate) * up


def key(**changes: object) -> TuneKey:
    base = dict(graph=swiglu.graph.hash, m_bucket=8192, n=16384, k=2048, spec="s", gpu="NVIDIA H200",
                triton="3.6.0", coda=coda.__version__, generator="g0", backends=("triton",))
    base.update(changes)
    return TuneKey(**base)


def fake_time(cfg: Config) -> float:
    """A deterministic 'benchmark': prefers 128x256, 4 stages, flatten on, TMA stores on (swiglu's
    default, 128x256 with 3 stages, is 9% slower: a winner the tuner keeps)."""
    t = 1.0 + abs(cfg.block_n - 256) / 1000 + abs(cfg.block_m - 128) / 1000 + abs(cfg.num_stages - 4) / 10
    return t - 0.01 * cfg.flatten - 0.02 * cfg.tma_store


@pytest.fixture
def fake_measure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Config]:
    """Replace the GPU timer, with a fresh tuning cache; `launch` records each config it is given."""
    launched: list[Config] = []
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))

    def measure(fn):
        fn()
        return fake_time(launched[-1])

    monkeypatch.setattr(autotune, "measure", measure)
    monkeypatch.setattr(autotune, "SESSION", autotune.Session())
    monkeypatch.setenv("CODA_AUTOTUNE", "1")
    monkeypatch.setenv("CODA_TUNE_QUIET", "1")
    return launched


def recording(launched: list[Config]) -> autotune.Launch:
    """A tuner launch that records each config it runs, on its build and on every relaunch timed."""
    def launch(cfg: Config):
        launched.append(cfg)
        return lambda: launched.append(cfg)
    return launch


def choose(launched: list[Config], graph=swiglu.graph, k: TuneKey | None = None) -> Config:
    return autotune.choose(graph, k or key(), "bfloat16", 2, 2, 8192, 16384, 2048, recording(launched),
                           lambda c: None)


# -- pruning -------------------------------------------------------------------------------

def test_prune_grouped_reduction_needs_whole_groups() -> None:
    small = Config(block_m=128, block_n=128, block_k=64, num_warps=8)
    assert "whole reduction groups" in autotune.prune_reason(grouped.graph, small, 2, 2, 8192, 8192)
    big = small.model_copy(update={"block_n": 256})
    assert autotune.prune_reason(grouped.graph, big, 2, 2, 8192, 8192) is None


def test_prune_shared_memory() -> None:
    cfg = Config(block_m=256, block_n=256, block_k=128, num_warps=8, num_stages=4, tma_store=False)
    assert autotune.smem_bytes(swiglu.graph, cfg, 2, 2) == 4 * 512 * 128 * 2 + BARRIER_BYTES
    assert "shared memory" in autotune.prune_reason(swiglu.graph, cfg.model_copy(update={"num_warps": 16}), 2, 2, 8192, 8192)


def test_prune_tma_store_staging_counts() -> None:
    cfg = Config(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, tma_store=False)
    assert autotune.prune_reason(grouped.graph, cfg, 2, 2, 8192, 8192) is None
    with_tma = cfg.model_copy(update={"tma_store": True})
    assert autotune.smem_bytes(grouped.graph, with_tma, 2, 2) == 4 * 384 * 64 * 2 + 128 * 256 * 2 + BARRIER_BYTES
    assert "shared memory" in autotune.prune_reason(grouped.graph, with_tma, 2, 2, 8192, 8192)


def test_prune_accumulator_registers() -> None:
    cfg = Config(block_m=256, block_n=256, block_k=64, num_warps=4, num_stages=2)
    assert "registers" in autotune.prune_reason(swiglu.graph, cfg, 2, 2, 8192, 8192)


def test_prune_tiles_far_larger_than_the_problem() -> None:
    cfg = Config(block_m=128, block_n=256, block_k=64, num_warps=8)
    assert "larger than the problem" in autotune.prune_reason(swiglu.graph, cfg, 2, 2, 16, 16384)
    small = Config(block_m=64, block_n=64, block_k=64)
    assert autotune.prune_reason(swiglu.graph, small, 2, 2, 16, 16) is None


def test_prune_tma_store_without_tile_outputs() -> None:
    only_red = coda.epilogue(lambda acc: coda.reduce_n(acc, "max"))
    cfg = Config(block_m=128, block_n=128, block_k=64, num_warps=8, tma_store=True)
    assert "no tile outputs" in autotune.prune_reason(only_red.graph, cfg, 2, 2, 8192, 8192)


def test_reduction_only_epilogues_keep_candidates(fake_measure: list[Config]) -> None:
    only_red = coda.epilogue(lambda acc: coda.reduce_n(acc, "logsumexp"))
    cfg = autotune.choose(only_red.graph, key(graph=only_red.graph.hash), "bfloat16", 2, 2, 8192, 16384, 2048,
                          recording(fake_measure), lambda c: None)
    assert not cfg.tma_store and not any(c.tma_store for c in fake_measure)


def test_config_space_is_pruned_per_graph() -> None:
    space = autotune.config_space("bfloat16")
    kept = [c for c in space if autotune.prune_reason(grouped.graph, c, 2, 2, 8192, 8192) is None]
    assert kept and all(c.block_n >= 256 for c in kept) and len(kept) < len(space)


# -- keys -------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("graph", grouped.graph.hash), ("m_bucket", 16384), ("n", 8192), ("k", 4096), ("spec", "other"),
    ("gpu", "NVIDIA H100"), ("triton", "3.5.0"), ("coda", "0.0.1"), ("generator", "g1"), ("backends", ("gluon-hopper", "triton")),
])
def test_every_key_field_changes_the_file(field: str, value: object) -> None:
    assert key().filename() != key(**{field: value}).filename()


def test_key_is_stable() -> None:
    assert key().filename() == key().filename()


@pytest.mark.parametrize("m,bucket", [(1, 1), (2, 2), (3, 4), (8192, 8192), (8193, 16384)])
def test_m_bucket(m: int, bucket: int) -> None:
    assert autotune.m_bucket(m) == bucket


# -- tuning and the cache -------------------------------------------------------------------

def test_tune_picks_fastest_and_stores_it(fake_measure: list[Config]) -> None:
    cfg = choose(fake_measure)
    assert (cfg.block_m, cfg.block_n, cfg.num_stages, cfg.flatten, cfg.tma_store) == (128, 256, 4, True, True)
    assert any(c.flatten for c in fake_measure) and not all(c.flatten for c in fake_measure)  # two rounds
    entry = autotune.load_entry(key())
    assert entry is not None and entry.config == cfg and entry.ms == pytest.approx(fake_time(cfg))


def test_row_group_round_times_distinct_orders_of_the_winner(fake_measure: list[Config],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autotune, "measure", lambda fn: (fn(), fake_time(fake_measure[-1]) - 0.001 * (fake_measure[-1].group_m == 16))[1])
    cfg = choose(fake_measure)
    assert cfg.group_m == 16 and (cfg.block_m, cfg.block_n, cfg.flatten, cfg.tma_store) == (128, 256, True, True)
    default = default_config(swiglu.graph, "bfloat16", False, 8192, 16384, 2048)
    duel = 2 * autotune.DUEL_ROUNDS
    assert fake_measure[-duel:] == [default, cfg] * autotune.DUEL_ROUNDS  # the default and the winner, alternately
    search = fake_measure[:-duel]
    groups = [c.group_m for c in search if c.model_copy(update={"group_m": 8}) == cfg.model_copy(update={"group_m": 8})]
    assert sorted(groups) == [4, 4, 8, 8, 16, 16, 64, 64]  # each group size once (a build, then its timing)


@pytest.mark.parametrize("m, expected", [(128, []), (512, [])])
def test_row_groups_equal_to_all_row_tiles_are_not_retimed(m: int, expected: list[int]) -> None:
    cfg = Config(block_m=128, block_n=256, block_k=64)
    assert [c.group_m for c in autotune.group_variants(cfg, m)] == expected


def test_row_group_variants_for_many_row_tiles() -> None:
    cfg = Config(block_m=128, block_n=256, block_k=64)
    assert [c.group_m for c in autotune.group_variants(cfg, 8192)] == [4, 16, 64]  # 64 row tiles
    assert [c.group_m for c in autotune.group_variants(cfg, 1024)] == [4]  # 8 row tiles: 16, 64 = 8


def test_cached_winner_is_reused_without_benchmarks(fake_measure: list[Config]) -> None:
    first = choose(fake_measure)
    fake_measure.clear()
    assert choose(fake_measure) == first
    assert fake_measure == []


def test_force_retunes(fake_measure: list[Config], monkeypatch: pytest.MonkeyPatch) -> None:
    choose(fake_measure)
    fake_measure.clear()
    monkeypatch.setenv("CODA_AUTOTUNE", "force")
    choose(fake_measure)
    assert fake_measure


def test_disabled_uses_default(fake_measure: list[Config], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODA_AUTOTUNE", "0")
    cfg = choose(fake_measure)
    assert fake_measure == [] and cfg == default_config(swiglu.graph, "bfloat16", False, 8192, 16384, 2048)


def test_bad_switch_value_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODA_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match="CODA_AUTOTUNE must be 0, 1 or force"):
        autotune.mode()


def test_default_setting_never_tunes(fake_measure: list[Config], monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, CODA_AUTOTUNE is 0: the default config, nothing launched to time, no file written."""
    monkeypatch.delenv("CODA_AUTOTUNE")
    assert autotune.mode() == "0"
    cfg = choose(fake_measure)
    assert fake_measure == [] and cfg == default_config(swiglu.graph, "bfloat16", False, 8192, 16384, 2048)
    assert autotune.load_entry(key()) is None


def test_default_is_timed_first(fake_measure: list[Config]) -> None:
    choose(fake_measure)
    assert fake_measure[:2] == [default_config(swiglu.graph, "bfloat16", False, 8192, 16384, 2048)] * 2  # build, time


@pytest.mark.parametrize("speed, kept, said", [
    (1.2, False, r"the default stays, the fastest timed: 1\.0000 ms; the next, .*, 1\.2000 ms \("),
    (0.98, False, r"the default stays: .*, the fastest in the search, took 0\.9800 ms against the default's "
                  r"1\.0000 ms timed in turns, not 3% faster \("),
    (0.97001, False, r"the default stays: .* took 0\.9700 ms"),
    (0.969, True, r"kept .*: 0\.9690 ms against the default's 1\.0000 ms \("),
    (0.5, True, r"kept .*: 0\.5000 ms against the default's 1\.0000 ms \(")])
def test_a_winner_must_beat_the_default_by_the_margin(fake_measure: list[Config], monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture, speed: float, kept: bool,
                                                      said: str) -> None:
    """Every other config takes `speed` times the default's time: it is kept only if that is more
    than 3% faster; otherwise the entry records that the default stays, and a later call reads it.
    The last line says which and against what."""
    default = default_config(swiglu.graph, "bfloat16", False, 8192, 16384, 2048)
    monkeypatch.delenv("CODA_TUNE_QUIET", raising=False)
    monkeypatch.setattr(autotune, "measure", lambda fn: (fn(), 1.0 if fake_measure[-1] == default else speed)[1])
    cfg = choose(fake_measure)
    entry = autotune.load_entry(key())
    assert entry is not None and entry.default_ms == 1.0
    if kept:
        assert cfg != default and entry.config == cfg and entry.ms == speed
    else:
        assert cfg == default and entry.config is None and entry.ms == 1.0
    assert re.search(said, capsys.readouterr().err.splitlines()[-1])
    fake_measure.clear()
    assert choose(fake_measure) == cfg and fake_measure == []  # read from the cache, nothing timed


def test_the_duel_decides_not_the_search(fake_measure: list[Config], monkeypatch: pytest.MonkeyPatch) -> None:
    """A config timed 10% faster during the search but no faster against the default at the end
    (say, the clock changed) is not kept."""
    default = default_config(swiglu.graph, "bfloat16", False, 8192, 16384, 2048)
    timings = iter(range(10**6))
    duel_start: list[int] = []

    def measure(fn) -> float:
        fn()
        i = next(timings)
        if fake_measure[-1] == default:
            if i > 0:  # the default again: the duel has begun
                duel_start.append(i)
            return 1.0
        return 1.0 if duel_start else 0.9

    monkeypatch.setattr(autotune, "measure", measure)
    assert choose(fake_measure) == default and duel_start
    assert autotune.load_entry(key()).config is None


def test_without_a_default_the_best_is_kept(fake_measure: list[Config], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no default config fits the call, the search alone decides (nothing to compare with)."""
    def no_default(*args: object) -> Config:
        raise ValueError("no config fits")

    monkeypatch.setattr(autotune, "default_config", no_default)
    cfg = choose(fake_measure)
    entry = autotune.load_entry(key())
    assert entry is not None and entry.config == cfg and entry.default_ms is None


def test_entry_of_the_previous_format_is_retuned(fake_measure: list[Config]) -> None:
    """Entries written before the default was a candidate (no default_ms) were never compared
    with it: they are not served."""
    path = autotune._path(key())
    path.parent.mkdir(parents=True, exist_ok=True)
    old = {"key": key().model_dump(), "config": Config(block_m=64, block_n=64, block_k=64).model_dump(), "ms": 0.1,
           "candidates": 1}
    path.write_text(json.dumps(old))
    assert autotune.load_entry(key()) is None
    choose(fake_measure)
    assert fake_measure and autotune.load_entry(key()) is not None


@pytest.mark.parametrize("garbage", ["", "{not json", '{"key": 1}', "[]"])
def test_corrupt_entry_is_ignored_and_rewritten(fake_measure: list[Config], garbage: str) -> None:
    path = autotune._path(key())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(garbage)
    cfg = choose(fake_measure)
    assert fake_measure  # retuned
    assert TuneEntry.model_validate_json(path.read_text()).config == cfg


def test_entry_for_another_key_is_ignored(fake_measure: list[Config]) -> None:
    other = TuneEntry(key=key(n=1), config=Config(block_m=64, block_n=64, block_k=64), ms=0.1, default_ms=0.2,
                      candidates=1)
    path = autotune._path(key())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(other.model_dump_json())
    assert choose(fake_measure).block_n == 256 and fake_measure


def test_stale_entry_is_retuned(fake_measure: list[Config]) -> None:
    k = key(graph=grouped.graph.hash)
    stale = TuneEntry(key=k, config=Config(block_m=128, block_n=64, block_k=64), ms=0.1, default_ms=0.2,
                      candidates=1)
    autotune.store_entry(stale)  # block_n=64 cannot hold groups of 256 columns
    cfg = choose(fake_measure, grouped.graph, k)
    assert fake_measure and cfg.block_n >= 256


def test_failing_configs_are_skipped(fake_measure: list[Config], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODA_TUNE_QUIET", "0")

    def launch(cfg: Config):
        if cfg.block_n == 256:
            raise RuntimeError("out of resources")
        return recording(fake_measure)(cfg)

    cfg = autotune.choose(swiglu.graph, key(), "bfloat16", 2, 2, 8192, 16384, 2048, launch, lambda c: None)
    assert cfg.block_n != 256


def test_spilling_configs_are_pruned(fake_measure: list[Config], monkeypatch: pytest.MonkeyPatch) -> None:
    """Configs that spill are built but not timed, except the default (what runs untuned), which
    here stays: the fastest config that does not spill is slower than it."""
    timed: list[Config] = []
    fake = autotune.measure
    monkeypatch.setattr(autotune, "measure", lambda fn: (ms := fake(fn), timed.append(fake_measure[-1]))[0])
    default = default_config(swiglu.graph, "bfloat16", False, 8192, 16384, 2048)
    cfg = autotune.choose(swiglu.graph, key(), "bfloat16", 2, 2, 8192, 16384, 2048, recording(fake_measure),
                          lambda c: 12 if c.block_n == 256 else 0)
    assert default.block_n == 256 and cfg == default
    assert {c for c in fake_measure if c.block_n == 256} - {default}  # spilling configs were built
    assert all(c.block_n != 256 for c in timed if c != default)  # but not timed


def test_when_every_config_uses_local_memory_the_fastest_wins(fake_measure: list[Config]) -> None:
    cfg = autotune.choose(swiglu.graph, key(), "bfloat16", 2, 2, 8192, 16384, 2048, recording(fake_measure),
                          lambda c: 32)
    assert (cfg.block_m, cfg.block_n, cfg.num_stages) == (128, 256, 4)


def test_tiny_problems_keep_candidates() -> None:
    space = autotune.config_space("bfloat16")
    assert any(autotune.prune_reason(swiglu.graph, c, 2, 2, 20, 22) is None for c in space)


def test_no_runnable_config_is_an_error(fake_measure: list[Config]) -> None:
    def launch(cfg: Config) -> None:
        raise RuntimeError("nothing compiles")

    with pytest.raises(RuntimeError, match="no config could run swiglu"):
        autotune.choose(swiglu.graph, key(), "bfloat16", 2, 2, 8192, 16384, 2048, launch, lambda c: None)


def test_progress_is_reported(fake_measure: list[Config], monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """A line per key (which of how many, and the time left once a key has been timed) and per
    config (its count in the round, the time left in the round), then what was kept."""
    monkeypatch.setenv("CODA_TUNE_QUIET", "0")
    autotune.SESSION.planned = 2
    choose(fake_measure)
    choose(fake_measure, k=key(n=8192))
    lines = capsys.readouterr().err.splitlines()
    headers = [line for line in lines if " configs + variants" in line]
    assert headers[0].startswith("[coda tune] key 1/2: swiglu M<=8192 N=16384 K=2048 on NVIDIA H200, ")
    assert "left for this and the other keys" not in headers[0]
    assert headers[1].startswith("[coda tune] key 2/2: swiglu M<=8192 N=8192 K=2048")
    assert re.search(r"\((about \d+ s|under 1 s) left for this and the other keys\)$", headers[1])
    timed = [line for line in lines if re.match(r"\[coda tune\]   \[\d+/\d+\] .*: \d+\.\d+ ms; ", line)]
    assert timed and all(re.search(r"(about \d+ s|under 1 s) left in this round$", line) for line in timed)
    assert "(default): " in timed[0]  # the default is timed first
    assert len(timed) == sum(entry.candidates for _, entry, _ in autotune.SESSION.tuned)
    assert sum(line.startswith("[coda tune] kept 128x256x64") for line in lines) == 2


# -- across processes ----------------------------------------------------------------------

_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import coda
    from coda.runtime import autotune
    from coda.runtime.config import Config

    @coda.epilogue
    def swiglu(acc):
        gate, up = coda.pairs(acc)
        return coda.silu(gate) * up

    calls = []
    def launch(cfg):
        calls.append(cfg)
        return lambda: calls.append(cfg)
    def measure(fn):
        fn()
        time.sleep(float(sys.argv[1]))
        return 1.0 + abs(calls[-1].block_n - 256) / 1000 + abs(calls[-1].num_stages - 4) / 10 - 0.01 * calls[-1].flatten
    autotune.measure = measure
    key = autotune.TuneKey(graph=swiglu.graph.hash, m_bucket=8192, n=16384, k=2048, spec="s", gpu="g",
                           triton="3.6.0", coda=coda.__version__, generator="g0", backends=("triton",))
    cfg = autotune.choose(swiglu.graph, key, "bfloat16", 2, 2, 8192, 16384, 2048, launch, lambda c: None)
    print(json.dumps({"config": cfg.model_dump(), "benchmarked": len(calls)}))
""")


def _spawn(tmp_path: Path, delay: float) -> subprocess.Popen:
    env = {**os.environ, "CODA_CACHE_DIR": str(tmp_path), "CODA_TUNE_QUIET": "1", "CODA_AUTOTUNE": "1"}
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, str(delay)], env=env, stdout=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_fresh_process_reuses_the_tuning_cache(tmp_path: Path) -> None:
    first = _result(_spawn(tmp_path, 0.0))
    second = _result(_spawn(tmp_path, 0.0))
    assert first["benchmarked"] > 0 and second["benchmarked"] == 0
    assert first["config"] == second["config"]


@pytest.mark.slow
def test_two_processes_tuning_at_once(tmp_path: Path) -> None:
    procs = [_spawn(tmp_path, 0.02), _spawn(tmp_path, 0.02)]
    results = [_result(p) for p in procs]
    assert results[0]["config"] == results[1]["config"]
    files = list((tmp_path / "tuning").glob("*.json"))
    assert len(files) == 1
    assert TuneEntry.model_validate_json(files[0].read_text()).config.model_dump() == results[0]["config"]
    assert not list((tmp_path / "tuning").glob(".*.tmp"))  # atomic writes leave no temporaries


@pytest.mark.slow
def test_tune_command(tmp_path: Path) -> None:
    """Without a GPU `coda tune` refuses clearly; with one it tunes and reports the winner
    (also under CODA_AUTOTUNE=0, which skips tuning in gemm() but not in the tune command)."""
    env = {**os.environ, "CODA_CACHE_DIR": str(tmp_path), "CODA_TUNE_QUIET": "1", "CODA_AUTOTUNE": "0"}
    proc = subprocess.run([sys.executable, "-m", "coda", "tune", "plain", "--shape", "256,256,256"],
                          capture_output=True, text=True, timeout=600, env=env)
    if GPU:
        assert proc.returncode == 0, proc.stderr
        assert "plain M=256 N=256 K=256 bf16: {'backend': " in proc.stdout and "'block_m'" in proc.stdout
        assert list((tmp_path / "tuning").glob("*.json"))
    else:
        assert proc.returncode == 2 and "tuning needs a CUDA GPU" in proc.stderr


def test_tma_stores_only_while_shared_memory_fits() -> None:
    """An fp32 out= tile would overflow shared memory beside a 3-stage 128x256 ring: it is stored
    through pointers instead, so the config still runs; a bf16 output keeps its TMA store."""
    import torch
    from coda.runtime.launch import PLAIN
    from coda.runtime.specialize import spec_fields as _spec_fields
    from coda.runtime.validate import validate

    a, b = torch.randn(256, 128).bfloat16(), torch.randn(128, 512).bfloat16()
    cfg = Config(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
    wide_out = validate(PLAIN, a, b, {}, torch.empty(256, 512), True)
    assert _spec_fields(wide_out, False, cfg)[7] == ()
    assert _spec_fields(validate(PLAIN, a, b, {}, None, True), False, cfg)[7] == ("out",)


def test_tma_tile_loads_share_the_shared_memory_budget() -> None:
    """The SwiGLU-backward epilogue (a width-2 Tile operand, a width-2 and a width-1 output) at
    128x128x64/4 stages with the tile loop flattened (the ring stays allocated through the
    epilogue): the z load and both TMA stores would need 294912 B beside the ring, over the
    227 KiB limit (an OutOfResources launch on the H200 before this was counted). The Tile load
    is kept, the stores fall back to pointers while they do not fit."""
    import torch
    from coda.ops.epilogues import swiglu_backward
    from coda.runtime.resources import HOPPER_SMEM_BYTES, ring_bytes, staging_bytes
    from coda.runtime import triton_backend
    from coda.runtime.specialize import call_smem_bytes
    from coda.runtime.specialize import spec_fields as _spec_fields
    from coda.runtime.validate import validate

    m, f, d = 256, 256, 64
    a, b = torch.randn(m, d).bfloat16(), torch.randn(d, f).bfloat16()
    z = torch.randn(m, 2 * f).bfloat16()
    cfg = Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, flatten=True)
    call = validate(swiglu_backward.graph, a, b, {"z": z}, None, True)
    fields = _spec_fields(call, False, cfg)
    tiles, tma_stores = fields[8], fields[7]
    assert tiles == ("z",)
    used = ring_bytes(cfg, 2) + staging_bytes(cfg, 2, 2) + sum(
        staging_bytes(cfg, {"dz": 2, "y": 1}[name], 2) for name in tma_stores)
    assert used <= call_smem_bytes(call, cfg) <= HOPPER_SMEM_BYTES
    assert len(tma_stores) < 2
    all_tma = ring_bytes(cfg, 2) + 2 * 128 * 256 * 2 + 128 * 128 * 2
    scratch = triton_backend.scratch_bytes(swiglu_backward.graph, cfg, False) + BARRIER_BYTES
    assert autotune.smem_bytes(swiglu_backward.graph, cfg, 2, 2) == all_tma + scratch
    assert "shared memory" in autotune.prune_reason(swiglu_backward.graph, cfg, 2, 2, 8192, 8192)


@pytest.mark.skipif(not GPU, reason="the real tuner times kernels on a GPU")
def test_tuning_on_the_gpu_times_kernels_not_launches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The tuner on a GPU: every candidate relaunched under CUDA-graph capture, a tiny GEMM timed at
    its kernel's few microseconds (timed call by call it measured the host's launch work, 0.1 ms and
    more), and the config kept computes the epilogue."""
    import torch

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CODA_AUTOTUNE", "force")
    monkeypatch.setenv("CODA_TUNE_QUIET", "1")
    monkeypatch.setattr(autotune, "SESSION", autotune.Session())
    times: list[float] = []
    real = autotune.measure
    monkeypatch.setattr(autotune, "measure", lambda fn: (ms := real(fn), times.append(ms))[0])
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    out = coda.gemm(a, b, swiglu)
    gate, up = (a.float() @ b.float()).view(256, 256, 2).unbind(-1)
    torch.testing.assert_close(out.float(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)
    entries = list((tmp_path / "tuning").glob("*.json"))
    assert len(entries) == 1 and TuneEntry.model_validate_json(entries[0].read_text()).candidates > 1
    assert times and min(times) < 0.05, f"the fastest candidate timed {min(times):.3f} ms: host work was timed"
