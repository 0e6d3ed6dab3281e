"""Environment variables, the cache directory and Config values: errors that name the cause,
and a cache that cannot be written does not fail calls."""

import warnings
from pathlib import Path

import pydantic
import pytest
import torch

import coda
from coda.runtime import autotune, cache_dir, env
from coda.runtime.autotune import TuneEntry
from coda.runtime.device import num_programs
from conftest import GPU, assert_close, randn


@pytest.mark.parametrize("bad", [dict(num_warps=0), dict(num_warps=3), dict(num_warps=64), dict(num_stages=0),
                                 dict(num_stages=-1), dict(group_m=0), dict(block_m=24), dict(subtile=3),
                                 dict(block_n=16, subtile=2)])
def test_config_refuses_impossible_values(bad):
    with pytest.raises(pydantic.ValidationError, match="|".join(bad)):
        coda.Config(**{"block_m": 16, "block_n": 32, "block_k": 16, **bad})


def test_config_accepts_possible_values():
    for w in (1, 2, 4, 8, 16, 32):
        coda.Config(block_m=16, block_n=16, block_k=16, num_warps=w, num_stages=1, group_m=1)


def test_bad_config_in_tuning_file_is_ignored(tmp_path, monkeypatch):
    """A tuning file whose config is impossible (num_warps=3) is not served: it is retuned."""
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    key = autotune.TuneKey(graph="g", m_bucket=64, n=64, k=64, spec="s", gpu="x", triton="t", coda="c", generator="g", backends=("triton",))
    good = TuneEntry(key=key, config=coda.Config(block_m=64, block_n=64, block_k=64), ms=1.0, default_ms=1.1, candidates=1)
    autotune.store_entry(good)
    assert autotune.load_entry(key) == good
    path = autotune._path(key)
    path.write_text(path.read_text().replace('"num_warps": 4', '"num_warps": 3'))
    assert '"num_warps": 3' in path.read_text()
    assert autotune.load_entry(key) is None  # ignored, so choose() retunes


@pytest.mark.parametrize("value", ["three", "2.5", "0", "-1"])
def test_interpret_programs_malformed(monkeypatch, value):
    monkeypatch.setenv("CODA_INTERPRET_PROGRAMS", value)
    with pytest.raises(ValueError, match="CODA_INTERPRET_PROGRAMS"):
        env.env_int("CODA_INTERPRET_PROGRAMS", 3)
    if not GPU:
        with pytest.raises(ValueError, match="CODA_INTERPRET_PROGRAMS"):
            num_programs(torch.device("cpu"))


def test_interpret_programs_valid(monkeypatch):
    monkeypatch.setenv("CODA_INTERPRET_PROGRAMS", " 5 ")
    assert env.env_int("CODA_INTERPRET_PROGRAMS", 3) == 5


def test_tune_quiet_malformed(monkeypatch):
    monkeypatch.setenv("CODA_TUNE_QUIET", "maybe")
    with pytest.raises(ValueError, match="CODA_TUNE_QUIET"):
        autotune._say("x")
    for v, quiet in [("1", True), ("true", True), ("0", False), ("", False), ("off", False)]:
        monkeypatch.setenv("CODA_TUNE_QUIET", v)
        assert env.env_flag("CODA_TUNE_QUIET") is quiet


def test_autotune_malformed(monkeypatch):
    monkeypatch.setenv("CODA_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="CODA_AUTOTUNE"):
        autotune.mode()


def test_cache_dir_expands_user(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CODA_CACHE_DIR", "~/coda-x")
    assert cache_dir() == tmp_path / "coda-x"


def _unwritable(tmp_path: Path) -> Path:
    """A cache directory that cannot be created: its parent is a regular file (works as root too)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    return blocker / "cache"


def test_unwritable_cache_dir_falls_back_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CODA_CACHE_DIR", str(_unwritable(tmp_path)))

    @coda.epilogue
    def fresh_for_readonly_cache(acc, s: coda.Scalar):  # a graph no other test generated
        return acc * s + 0.125

    a, b = randn(16, 16), randn(16, 16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = coda.gemm(a, b, fresh_for_readonly_cache, s=3.0)
        coda.gemm(a, b.T.contiguous().T, fresh_for_readonly_cache, s=3.0)  # another kernel: no second warning
    assert_close(out, fresh_for_readonly_cache.reference(a, b, s=3.0), a, b, "fallback cache")
    msgs = [str(w.message) for w in seen if "not writable" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert list((cache_dir() / "kernels").glob("coda_*.py"))  # the kernels went to the fallback


def test_readonly_cache_dir(monkeypatch, tmp_path):
    """A read-only directory (skipped as root, who may write anyway)."""
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes read-only directories")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    monkeypatch.setenv("CODA_CACHE_DIR", str(ro))
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert cache_dir() != ro
