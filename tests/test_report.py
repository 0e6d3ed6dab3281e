"""bench/report.py: the results page is what the committed JSON gives (a stale page fails), it names
every results file it summarizes, and its figures are read from those files, not written into it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import report  # noqa: E402


def test_committed_page_is_the_generated_one() -> None:
    assert (ROOT / "docs" / "PERFORMANCE.md").read_text() == report.render(), "run: python bench/report.py"


def test_page_lists_every_results_file_it_summarizes() -> None:
    page = report.render()
    listed = page.split("## Results files summarized here")[1]
    for s in report.SECTIONS:
        assert (report.RESULTS / s.file).is_file()
        assert f"From `bench/results/{s.file}`:" in page and f"* `bench/results/{s.file}`" in listed
        assert "```bash" in page.split(f"## {s.title}")[1].split("\n## ")[0]  # how to measure it again
    assert listed.count("* `bench/results/") == len(report.SECTIONS)
    tools = page.split("## Investigation tools")[1].split("\n## ")[0]
    for tool in report.TOOLS.iterdir():
        if tool.suffix in (".py", ".sh"):
            assert f"* `bench/tools/{tool.name}`: " in tools


@pytest.fixture
def results_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The summarized results files, copied where a test may change them."""
    for s in report.SECTIONS:
        (tmp_path / s.file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(report.RESULTS / s.file, tmp_path / s.file)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    return tmp_path


def test_figures_and_provenance_come_from_the_files(results_copy: Path) -> None:
    path = results_copy / "gemm_epilogues.json"
    data = json.loads(path.read_text())
    swiglu = next(s for s in data["summary"] if s["op"] == "swiglu")
    swiglu["ms_coda"], swiglu["eager/coda"] = 0.4321, 9.87
    data["meta"]["commit"], data["meta"]["gpu"] = "abc1234", "Some GPU"
    path.write_text(json.dumps(data))
    section = report.render().split("## Fused GEMMs")[1].split("\n## ")[0]
    assert "Some GPU; torch 2.11.0+cu130, triton 3.6.0, Liger-Kernel 0.8.5; commit abc1234." in section
    row = f"| swiglu | {swiglu['M']} | {swiglu['N']} | {swiglu['K']} | {swiglu['ms_cublas_gemm']:.3f} | 0.432 |"
    assert row in section and "| 9.87 |" in section


def test_training_shows_train_json_with_its_skipped_rows(results_copy: Path) -> None:
    """The training section reads bench/train.py's train.json: its provenance and a skipped row show."""
    (training,) = [s for s in report.SECTIONS if s.file == "train.json"]
    row = {"model": "qwen3-1.7b", "seq": 4096, "batch": 2, "packed": False, "variant": "coda", "skipped": "ValueError: x"}
    meta = {"gpu": "G", "torch": "T", "commit": "c0ffee0", "protocol": "p"}
    (results_copy / "train.json").write_text(json.dumps({"meta": meta, "rows": [row], "notes": []}))
    section = report.render().split("## End-to-end training")[1].split("\n## ")[0]
    assert "From `bench/results/train.json`: G; torch T; commit c0ffee0." in section
    assert "| qwen3-1.7b | 2 x 4096 | no | coda | skipped |" in section
