"""The `coda` command's arguments: bad ones are a one-line error and exit status 2 (no
traceback), `--version` prints the package version, and `coda tune --hf-config` builds the
model's shape from a transformers config (tuning it needs a GPU)."""

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
from coda import cli, pretune
from conftest import GPU


def coda_cmd(*args: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coda", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line `coda argv` writes to stderr when it exits with status 2."""
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    return err


def test_version() -> None:
    proc = coda_cmd("--version")
    assert proc.returncode == 0 and proc.stdout == f"coda {coda.__version__}\n"


@pytest.mark.parametrize("value", ["0", "-3"])
def test_demo_rejects_non_positive_sizes(value: str) -> None:
    proc = coda_cmd("demo", "--m", value)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"coda demo: error: argument --m: must be a positive integer, got '{value}'\n"


@pytest.mark.parametrize("flag, value", [("--d", "x"), ("--ffn", "0"), ("--ffn", "2.5")])
def test_demo_sizes_are_positive_integers(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    assert f"argument {flag}: must be a positive integer, got '{value}'" in usage_error(capsys, "demo", flag, value)


@pytest.mark.parametrize("text", ["1,2", "1,2,3,4", "0,2,3", "1,-2,3", "a,b,c", ""])
def test_shapes_are_three_positive_integers(capsys: pytest.CaptureFixture[str], text: str) -> None:
    err = usage_error(capsys, "tune", "plain", "--shape", text)
    assert "argument --shape: takes M,N,K (three positive integers)" in err


def test_shape_and_setting_parse() -> None:
    assert cli.shape("8192, 2048,4096") == (8192, 2048, 4096)
    assert cli.setting("hidden_size=2048") == ("hidden_size", 2048)
    assert cli.setting("tie_word_embeddings=true") == ("tie_word_embeddings", True)
    assert cli.setting('rope_parameters={"rope_type": "default", "rope_theta": 5e5}') == (
        "rope_parameters", {"rope_type": "default", "rope_theta": 500000.0})
    assert cli.setting("hidden_act=silu") == ("hidden_act", "silu")


@pytest.mark.parametrize("argv, message", [
    (["tune", "plain"], "give epilogues and --shape M,N,K, or --hf-config with --batch and --seq"),
    (["tune", "--shape", "8,8,8"], "give epilogues and --shape M,N,K, or --hf-config with --batch and --seq"),
    (["tune", "plain", "--shape", "8,8,8", "--batch", "2"], "--set, --batch and --seq go with --hf-config"),
    (["tune", "--hf-config", "LlamaConfig", "--batch", "2"], "--hf-config needs --batch and --seq"),
    (["tune", "plain", "--hf-config", "LlamaConfig", "--batch", "2", "--seq", "8"], "give no epilogues, --shape"),
    (["tune", "--hf-config", "LlamaConfig", "--dtype", "fp16", "--batch", "2", "--seq", "8"], "--dtype or --int"),
    (["tune", "--hf-config", "LlamaConfig", "--batch", "0", "--seq", "8"], "argument --batch: must be a positive"),
    (["tune", "--hf-config", "LlamaConfig", "--set", "oops", "--batch", "2", "--seq", "8"],
     "argument --set: takes key=value, got 'oops'"),
    (["tune", "--hf-config", "NoSuchConfig", "--batch", "2", "--seq", "8"],
     "'NoSuchConfig' is neither a file nor a transformers config class"),
    (["tune", "--hf-config", "LlamaConfig", "--set", "hidden_sz=64", "--batch", "2", "--seq", "8"],
     "LlamaConfig has no field hidden_sz"),
    (["tune", "--hf-config", "LlamaConfig", "--set", "hidden_act=gelu", "--batch", "2", "--seq", "8"],
     "llama: hidden_act='gelu'"),
    (["tune", "nocolon", "--shape", "8,8,8"], "'nocolon' is not 'plain' or 'module:epilogue'"),
    (["tune", "coda:gemm", "--shape", "8,8,8"], "coda:gemm is not a @coda.epilogue (got function)"),
    (["tune", "no_such_module:x", "--shape", "8,8,8"], "cannot import no_such_module"),
])
def test_tune_usage_errors(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str],
                           message: str) -> None:
    # as on a GPU: without one, `--hf-config` is refused before the config is read (test_tune_model_needs_a_gpu)
    monkeypatch.setattr(pretune.runtime, "interpreting", lambda: False)
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own checks
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("coda tune: error: ") and message in err, err


def test_hf_config_from_a_class_with_overrides() -> None:
    config = pretune.hf_config("LlamaConfig", {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128})
    shape = pretune.model_shape(config)
    assert (shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers, shape.vocab_size) == (64, 96, 2, 128)
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.dim_per_head) == (4, 2, 16)


@pytest.mark.parametrize("as_dir", [False, True])
def test_hf_config_from_a_file_with_overrides(tmp_path: Path, as_dir: bool) -> None:
    import transformers

    transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
                             vocab_size=256, tie_word_embeddings=True).save_pretrained(tmp_path)
    path = tmp_path if as_dir else tmp_path / "config.json"
    shape = pretune.model_shape(pretune.hf_config(str(path), {"num_hidden_layers": 1}))
    got = (shape.hidden_size, shape.num_hidden_layers, shape.vocab_size, shape.tie_word_embeddings)
    assert got == (64, 1, 256, True)


def test_hf_config_from_a_broken_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(pretune.TuneError, match="cannot read a transformers config"):
        pretune.hf_config(str(path), {})


@pytest.mark.skipif(GPU, reason="the refusal without a GPU")
def test_tune_model_needs_a_gpu() -> None:
    proc = coda_cmd("tune", "--hf-config", "LlamaConfig", "--set", "hidden_size=64", "--set", "num_attention_heads=4",
                    "--batch", "2", "--seq", "8")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "coda tune: error: tuning needs a CUDA GPU (kernels here run in Triton's interpreter)")


_TUNE_MODEL = textwrap.dedent("""
    import sys
    from coda import cli
    from coda.runtime import autotune

    # only the default of each key, so that the test times one config per key
    autotune.config_space = lambda *args: []
    autotune.option_variants = lambda cfg: []
    autotune.group_variants = lambda cfg, m: []
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.mark.skipif(not GPU, reason="builds the model on a GPU")
def test_tune_model_tunes_every_key_of_the_step(tmp_path: Path) -> None:
    """A tiny Llama's step: every GEMM key it asks about is tuned once (the search cut down to
    the default alone, which therefore stays), and a second run finds nothing left to tune."""
    env = {**os.environ, "CODA_CACHE_DIR": str(tmp_path), "CODA_TUNE_QUIET": "1"}
    argv = ["--hf-config", "LlamaConfig", "--set", "hidden_size=128", "--set", "intermediate_size=256",
            "--set", "num_attention_heads=4", "--set", "num_key_value_heads=2", "--set", "num_hidden_layers=2",
            "--set", "vocab_size=512", "--batch", "2", "--seq", "64"]

    def run() -> list[str]:
        proc = subprocess.run([sys.executable, "-c", _TUNE_MODEL, "tune", *argv], capture_output=True, text=True,
                              timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    first = run()
    counts = re.match(r"\[coda tune\] (\d+) GEMM keys in a 2x64 step, (\d+) to tune \(", first[0])
    assert counts and int(counts[1]) == int(counts[2]) > 5, first[0]
    planned = int(counts[2])
    assert len(first) == planned + 2 and first[-1].startswith(f"{planned} keys tuned in ")
    assert all(": default, " in line for line in first[1:-1])
    entries = [json.loads(p.read_text()) for p in (tmp_path / "tuning").glob("*.json")]
    assert len(entries) == planned and all(e["config"] is None for e in entries)
    second = run()
    assert f"{planned} GEMM keys in a 2x64 step, 0 to tune (" in second[0] and second[-1].startswith("0 keys tuned")
