"""bench/train.py's CPU smoke mode (--tiny): the driver runs each variant in a process of its own and
writes the rows; a coda variant for a family coda refuses is a skipped row with its reason; a variant
that cannot run (Liger without a GPU) becomes a note; --merge renders the table. The numbers mean
nothing here, the wiring does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import train  # noqa: E402

from conftest import GPU  # noqa: E402

ROW_KEYS = {"model", "seq", "batch", "packed", "variant", "step_ms", "tokens_per_s", "peak_mem_gib"}


def run(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "train.py"), *args], env=env, cwd=ROOT, timeout=900,
                          capture_output=True, text=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def timed_or_refused(row: dict, model_type: str) -> bool:
    """A coda variant of a family other than Llama: measured where this coda supports the family,
    else skipped with the library's reason, which names the family."""
    return row.get("tokens_per_s", 0) > 0 if "skipped" not in row else model_type in row["skipped"]


@pytest.mark.slow
@pytest.mark.skipif(GPU, reason="the CPU smoke mode; on a GPU the script itself is the test")
def test_tiny_run_writes_rows_skips_and_notes_and_merges(tmp_path: Path) -> None:
    run("--tiny", "--models", "llama3.2-1b,qwen3-1.7b", "--variants", "coda,hf_liger", "--packed", "--out", str(tmp_path))
    run("--tiny", "--models", "gemma3-1b", "--variants", "hf_eager,coda_patch", "--out", str(tmp_path))
    data = json.loads((tmp_path / "train.json").read_text())
    rows = {(r["model"], r["variant"]): r for r in data["rows"]}
    assert set(rows) == {("llama3.2-1b", "coda"), ("qwen3-1.7b", "coda"), ("gemma3-1b", "hf_eager"),
                         ("gemma3-1b", "coda_patch")}
    for r in (rows["llama3.2-1b", "coda"], rows["gemma3-1b", "hf_eager"]):
        assert ROW_KEYS <= set(r) and (r["batch"], r["seq"]) == (2, 8) and r["tokens_per_s"] > 0
    # checked before timed: against transformers' fp32 logits, within the bound or twice its own bf16 error
    coda_row, hf_row = rows["llama3.2-1b", "coda"], rows["gemma3-1b", "hf_eager"]
    assert 0 < coda_row["logits_fp32_err"] < max(train.CHECK_TOLERANCE, 2 * coda_row["hf_logits_fp32_err"])
    assert 0 < coda_row["logits_rel_err"] < train.CHECK_TOLERANCE
    assert hf_row["logits_rel_err"] == 0 and hf_row["logits_fp32_err"] == hf_row["hf_logits_fp32_err"] > 0
    assert rows["llama3.2-1b", "coda"]["packed"] is True and rows["gemma3-1b", "hf_eager"]["packed"] is False
    assert timed_or_refused(rows["qwen3-1.7b", "coda"], "qwen3")
    assert timed_or_refused(rows["gemma3-1b", "coda_patch"], "gemma3_text")
    assert {n.split(":")[0] for n in data["notes"]} == {"llama3.2-1b 2x8 packed hf_liger", "qwen3-1.7b 2x8 packed hf_liger"}
    assert data["meta"]["gpu"] == "cpu" and data["meta"]["commit"]
    out = tmp_path / "results"
    run("--merge", str(tmp_path / "train.json"), "--out", str(out), "--note", "smoke")
    md = (out / "train.md").read_text()
    assert "| llama3.2-1b (2 layers) | 2 x 8 | yes | coda |" in md and "| gemma3-1b (2 layers) | 2 x 8 | no | hf_eager |" in md
    assert "smoke" in md and "* llama3.2-1b 2x8 packed hf_liger: exit 1" in md
    skipped = [r for r in data["rows"] if "skipped" in r]
    assert all(f"* skipped: {r['model']} 2 x 8 {r['variant']}: {r['skipped']}" in md for r in skipped)


def test_packed_batches_restart_positions_per_document() -> None:
    """--packed: documents of seq/8 to seq/2 tokens (the last one cut at the row's end), positions
    0.. within each, and the first token of each later document is not a target."""
    (step,) = train.batches(vocab=100, batch=3, seq=256, packed=True, device="cpu", count=1)
    for pos, labels in zip(step["position_ids"].tolist(), step["labels"].tolist()):
        starts = [i for i, p in enumerate(pos) if p == 0]
        lengths = [b - a for a, b in zip(starts, starts[1:] + [len(pos)])]
        assert starts[0] == 0 and len(starts) >= 2
        assert all(32 <= n <= 128 for n in lengths[:-1]) and 1 <= lengths[-1] <= 128
        assert all(pos[i] == pos[i - 1] + 1 for i in range(1, len(pos)) if i not in starts)
        assert [i for i, t in enumerate(labels) if t == -100] == starts[1:]
    (plain,) = train.batches(vocab=100, batch=3, seq=256, packed=False, device="cpu", count=1)
    assert set(plain) == {"input_ids", "labels"} and (plain["labels"] == plain["input_ids"]).all()


def test_logits_check_measures_the_distance_to_transformers() -> None:
    """The check each variant passes before it is timed: its logits' relative errors against
    transformers' on the same inputs (here a model 10% off everywhere), from one forward."""
    import types

    import torch

    reference = torch.randn(1, 8, 32)
    seen = {}

    def off(**inputs):
        seen.update(inputs)
        seen["calls"] = seen.get("calls", 0) + 1
        return types.SimpleNamespace(logits=reference * 1.1)

    assert train.logits_errors(off, {"input_ids": torch.ones(1, 8)}, reference, reference * 1.1) == \
        [pytest.approx(0.1, rel=1e-5), 0.0]
    assert set(seen) == {"input_ids", "calls"} and seen["calls"] == 1


def test_kernel_categories() -> None:
    c = train.category
    assert c("coda_rms_swiglu") == c("sm90_xmma_gemm_bf16bf16_bf16f32") == c("nvjet_tst_128x256") == "gemms"
    assert c("flash_fwd_kernel") == c("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel") == "attention"
    assert c("_rms_prep_kernel") == c("vectorized_elementwise_kernel") == c("_cross_entropy_kernel") == "other"


def test_merge_keeps_each_rows_gpu_and_commit_and_takes_ratios_within_them(tmp_path: Path) -> None:
    """Device calls may land on different GPUs and commits: merged rows keep their run's GPU and commit,
    the table gets a column for each that varies, and a variant is compared only with the peers measured
    on its own GPU at its own commit (a later run of a peer does not make an older row's ratio)."""
    def part(name: str, gpu: str, commit: str, runs: dict[str, float]) -> Path:
        rows = [{"model": "m", "seq": 8, "batch": 2, "packed": False, "variant": v, "step_ms": 16e3 / t,
                 "tokens_per_s": t, "peak_mem_gib": 1.0} for v, t in runs.items()]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"meta": {"gpu": gpu, "torch": "t", "protocol": "p", "commit": commit},
                                    "rows": rows}))
        return path

    train.merge([part("a", "A100", "c1", {"hf_eager": 1000.0, "coda": 1500.0}),
                 part("h", "H200", "c1", {"hf_eager": 2000.0, "coda": 5000.0, "coda_compile": 6000.0}),
                 part("h2", "H200", "c2", {"hf_eager": 3000.0, "coda": 4500.0})], tmp_path / "out", None)
    data = json.loads((tmp_path / "out" / "train.json").read_text())
    assert [(r["gpu"], r["commit"], r["variant"]) for r in data["rows"]] == [  # listed by GPU, commit, variant
        ("A100", "c1", "hf_eager"), ("A100", "c1", "coda"), ("H200", "c1", "coda_compile"),
        ("H200", "c2", "hf_eager"), ("H200", "c2", "coda")]
    assert data["meta"]["gpu"] == "A100 and H200"
    md = (tmp_path / "out" / "train.md").read_text()
    assert "| GPU | commit | model |" in md
    assert "| A100 | c1 | m | 2 x 8 | no | coda |" in md and "| 1.50 | - |" in md  # 1500 / 1000, not / 2000
    assert "| H200 | c2 | m | 2 x 8 | no | coda |" in md and "| 1.50 | - |" in md  # 4500 / 3000
    compiled = next(line for line in md.splitlines() if "| coda_compile |" in line)
    assert compiled.endswith("| - | - | - |")  # its c1 hf_eager was replaced by c2's
