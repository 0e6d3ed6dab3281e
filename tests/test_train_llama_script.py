"""bench/train_llama.py's CPU smoke mode (--tiny): the driver runs each variant in a process of its
own and writes the issue's rows; a variant that cannot run (Liger without a GPU) becomes a note; the
loss curve and the merged table come out. The numbers mean nothing here, the wiring does."""

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

import train_llama  # noqa: E402

from conftest import GPU  # noqa: E402


def run(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, str(ROOT / "bench" / "train_llama.py"), *args], check=True, env=env, cwd=ROOT,
                   timeout=600, capture_output=True)


@pytest.mark.slow
@pytest.mark.skipif(GPU, reason="the CPU smoke mode; on a GPU the script itself is the test")
def test_tiny_run_writes_the_issue_rows(tmp_path: Path) -> None:
    run("--tiny", "--variants", "coda_compile,hf_liger", "--warmup", "0", "--out", str(tmp_path))
    run("--tiny", "--loss-curve", "2", "--out", str(tmp_path))
    run("--tiny", "--loss-curve", "2", "--clip", "1.0", "--variants", "hf_fp32,coda", "--out", str(tmp_path))
    data = json.loads((tmp_path / "train_llama.json").read_text())
    timed = [r for r in data["rows"] if "step_ms" in r]
    assert {r["variant"] for r in timed} == {"coda_compile"}
    for r in timed:
        assert {"model", "seq", "batch", "variant", "step_ms", "tokens_per_s", "peak_mem_gib"} <= set(r)
        assert (r["model"], r["batch"], r["seq"]) == ("tiny", 2, 8) and r["tokens_per_s"] > 0
    curves = {r["variant"]: r["losses"] for r in data["rows"] if "losses" in r and "clip" not in r}
    assert set(curves) == {"hf_eager", "coda"} and all(len(c) == 2 for c in curves.values())
    assert abs(curves["coda"][0] - curves["hf_eager"][0]) < 0.05  # one init, bf16
    clipped = {r["variant"]: r for r in data["rows"] if r.get("clip") == 1.0}
    assert set(clipped) == {"hf_fp32", "coda"}  # the clipped curves sit beside the unclipped ones
    assert all(len(r["losses"]) == len(r["grad_norms"]) == 2 for r in clipped.values())
    assert abs(clipped["coda"]["losses"][0] - clipped["hf_fp32"]["losses"][0]) < 0.05  # same weights, fp32 vs bf16
    assert any(n.startswith("tiny 2x8 hf_liger:") for n in data["notes"])
    out = tmp_path / "results"
    run("--merge", str(tmp_path / "train_llama.json"), "--out", str(out), "--note", "smoke")
    md = (out / "train_llama.md").read_text()
    assert "| tiny (2 layers) | 2 x 8 | coda_compile |" in md and "smoke" in md
    no_clip, clip = md.split("Loss curves, no clipping")[1].split("Loss curves, gradient norm clipped to 1.0")
    assert "| coda | 2 | " in no_clip and "| hf_eager | 2 | 0.0000 / 0.0000 / 0.0000 |" in no_clip
    assert "vs hf_fp32" in clip and "| hf_fp32 | 2 | 0.0000 / 0.0000 / 0.0000 |" in clip


def test_kernel_categories() -> None:
    c = train_llama.category
    assert c("coda_rms_swiglu") == c("sm90_xmma_gemm_bf16bf16_bf16f32") == c("nvjet_tst_128x256") == "gemms"
    assert c("flash_fwd_kernel") == c("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel") == "attention"
    assert c("_rms_prep_kernel") == c("vectorized_elementwise_kernel") == c("_cross_entropy_kernel") == "other"
