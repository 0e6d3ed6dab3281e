"""bench/first_call.py off the GPU: its --merge renders a measured JSON, the compile record it
reads (CODA_COMPILE_LOG) is written by first launches, and its tiny case runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import coda
from conftest import GPU, randn

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "first_call.py"
sys.path.insert(0, str(SCRIPT.parent))
first_call = pytest.importorskip("first_call")

DATA = {
    "meta": {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "commit": "abc1234", "protocol": "P."},
    "rows": [{"case": "llama_1b", "tuning_files": 0, "cold_first_step_s": 61.25, "warm_first_step_s": 4.5,
              "cold_to_first_step_s": 75.0, "warm_to_first_step_s": 12.0, "cold_import_s": 2.0, "warm_import_s": 1.9,
              "cold_setup_s": 11.75, "warm_setup_s": 5.6, "cold_second_step_s": 0.5, "warm_second_step_s": 0.4321},
             {"case": "block_d4096", "tuning_files": 0, "cold_first_step_s": None, "warm_first_step_s": 3.0,
              "cold_to_first_step_s": None, "warm_to_first_step_s": 9.0, "cold_import_s": None, "warm_import_s": 1.0,
              "cold_setup_s": None, "warm_setup_s": 5.0, "cold_second_step_s": None, "warm_second_step_s": None}],
    "compile": [{"case": "llama_1b", "kernel": "coda_rms_swiglu", "backend": "gluon-hopper",
                 "config": "gluon 128x128x64", "compile_s": 7.5, "warm_s": 0.25},
                {"case": "llama_1b", "kernel": "coda__identity", "backend": "triton", "config": "128x256x64",
                 "compile_s": 3.0, "warm_s": None}],
    "notes": ["block_d4096 cold: no step within 500 s"],
}


def test_merge_renders_the_measured_json(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(DATA))
    subprocess.run([sys.executable, str(SCRIPT), "--merge", str(tmp_path / "a.json"), "--out", str(tmp_path / "res"),
                    "--note", "One run."], check=True, capture_output=True, timeout=120)
    md = (tmp_path / "res" / "first_call.md").read_text()
    assert md.startswith("# first_call\n\nNVIDIA H200, torch 2.11.0, triton 3.6.0, commit abc1234.\n\nP.\n\nOne run.\n")
    assert "| llama_1b | 61.2 | 4.5 | 75.0 | 12.0 | 0.432 | 0 |" in md
    assert "| block_d4096 | - | 3.0 | - | 9.0 | - | 0 |" in md
    assert "* llama_1b: 2 first launches, 10.5 s" in md
    assert md.index("| llama_1b | coda_rms_swiglu | gluon-hopper | gluon 128x128x64 | 7.50 | 0.25 |") < md.index(
        "| llama_1b | coda__identity | triton | 128x256x64 | 3.00 | - |")
    assert md.rstrip().endswith("* block_d4096 cold: no step within 500 s")
    merged = json.loads((tmp_path / "res" / "first_call.json").read_text())
    assert merged["rows"] == DATA["rows"] and merged["meta"]["note"] == "One run."


def test_merge_joins_runs(tmp_path: Path) -> None:
    other = {**DATA, "rows": [dict(DATA["rows"][0], case="block_d2048")], "compile": [], "notes": []}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, data in zip(paths, (DATA, other)):
        path.write_text(json.dumps(data))
    joined = first_call.merge(paths, None)
    assert [r["case"] for r in joined["rows"]] == ["llama_1b", "block_d4096", "block_d2048"]
    assert joined["compile"] == DATA["compile"] and joined["notes"] == DATA["notes"]


def test_compile_rows_pair_cold_and_warm_launches_in_order() -> None:
    cold = [{"kernel": "k", "backend": "triton", "config": "c", "seconds": 5.0},
            {"kernel": "k", "backend": "triton", "config": "c", "seconds": 0.01},
            {"kernel": "j", "backend": "triton", "config": "c", "seconds": 2.0}]
    warm = [{"kernel": "k", "backend": "triton", "config": "c", "seconds": 0.2},
            {"kernel": "k", "backend": "triton", "config": "c", "seconds": 0.001}]
    rows = first_call.compile_rows("x", cold, warm)
    assert [(r["kernel"], r["compile_s"], r["warm_s"]) for r in rows] == [("k", 5.0, 0.2), ("k", 0.01, 0.001),
                                                                          ("j", 2.0, None)]


def test_compile_log_records_each_plans_first_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    @coda.epilogue
    def first_call_probe(acc, s: coda.Scalar):  # a graph no other test runs: its plans are new
        return acc * s - 0.5

    log = tmp_path / "compile.jsonl"
    a, b = randn(24, 16, dtype=torch.bfloat16), randn(16, 40, dtype=torch.bfloat16)
    coda.gemm(a, b, first_call_probe, s=2.0)  # not recorded: the variable is unset
    assert not log.exists()
    monkeypatch.setenv("CODA_COMPILE_LOG", str(log))
    a2 = randn(48, 16, dtype=torch.bfloat16)
    coda.gemm(a2, b, first_call_probe, s=2.0)  # a new plan: recorded
    coda.gemm(a2, b, first_call_probe, s=3.0)  # the same plan again: not recorded
    coda.gemm(a2, b.T.contiguous().T, first_call_probe, s=2.0)  # another layout, another plan
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 2, records
    for r in records:
        assert r["kernel"] == "coda_first_call_probe" and r["backend"] in ("triton", "gluon-hopper")
        assert r["seconds"] > 0 and "x" in r["config"]


@pytest.mark.skipif(GPU, reason="on a GPU the script measures its real cases")
def test_needs_a_gpu_for_the_real_cases(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("first_call.py measures on a CUDA GPU (--cases tiny runs anywhere); "
                                   "--merge runs anywhere")


@pytest.mark.slow
@pytest.mark.skipif(GPU, reason="on a GPU the script measures its real cases")
def test_tiny_case_runs_cold_then_warm(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(SCRIPT), "--cases", "tiny", "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=600)
    data = json.loads((tmp_path / "first_call.json").read_text())
    (row,) = data["rows"]
    assert data["notes"] == [] and row["tuning_files"] == 0  # nothing tuned by default
    for when in ("cold", "warm"):
        assert 0 < row[f"{when}_first_step_s"] < row[f"{when}_to_first_step_s"]
    assert data["compile"] and all(c["case"] == "tiny" and c["compile_s"] > 0 for c in data["compile"])
    assert all(c["warm_s"] is not None for c in data["compile"])  # the warm process launched the same plans
