"""Every script in examples/ runs at its default sizes (seconds on the CPU) and does what it says:
the custom epilogue matches its fp32 reference, the patched model's first loss is transformers' on
the same weights and training lowers it, the fine-tuned coda model's loss is transformers' before training
and again after its weights go back (under transformers' Trainer too, whose saved model loads), and the
FSDP2 run trains across two ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd: str, **env: str) -> str:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, **env}  # (the caller's path kept: the device installs wheels there)
    proc = subprocess.run([sys.executable, *cmd], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)", out, re.M)]


def test_custom_epilogue() -> None:
    out = run("examples/custom_epilogue.py")
    assert "out y = store" in out and "out row_max = reduce_n" in out  # the traced graph
    assert "ok: every output within 2e-02 of the fp32 reference" in out


@pytest.mark.slow
def test_train_hf_patch() -> None:
    out = run("examples/train_hf_patch.py", "--steps", "3")
    patched, before = re.search(r"patched (\d+) modules; loss on the same weights: transformers ([\d.]+)", out).groups()
    curve = losses(out)
    assert int(patched) > 0 and len(curve) == 3
    assert abs(curve[0] - float(before)) < 1e-3  # fp32: coda's ops compute transformers' loss
    assert curve[-1] < curve[0]


@pytest.mark.slow
@pytest.mark.parametrize("family,batching", [("qwen3", "pad"), ("gemma3_text", "pack")])
def test_finetune_from_hf(family: str, batching: str) -> None:
    out = run("examples/finetune_from_hf.py", "--family", family, "--batching", batching)
    ours, theirs = map(float, re.search(r"documents: loss ([\d.]+) \(transformers ([\d.]+)\)", out).groups())
    assert abs(ours - theirs) < 1e-3  # fp32, 4 printed decimals: coda's model computes transformers' loss
    curve = losses(out)
    assert len(curve) == 4 and curve[-1] < curve[0]
    theirs, ours = map(float, re.search(r"trained weights: loss ([\d.]+) \(coda ([\d.]+)\)", out).groups())
    assert abs(ours - theirs) < 1e-3 and ours < curve[0]  # the trained weights, back in transformers


@pytest.mark.slow
def test_finetune_from_hf_under_trainer(tmp_path: Path) -> None:
    """--loop trainer: the same fine-tune under transformers' Trainer; the saved transformers model loads."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    out = run("examples/finetune_from_hf.py", "--loop", "trainer", "--save", str(tmp_path))
    curve = losses(out)
    assert len(curve) == 4 and curve[-1] < curve[0]
    theirs, ours = map(float, re.search(r"trained weights: loss ([\d.]+) \(coda ([\d.]+)\)", out).groups())
    assert abs(ours - theirs) < 1e-3 and ours < curve[0]
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights


@pytest.mark.slow
@pytest.mark.skipif(numpy.lib.NumpyVersion(numpy.__version__) >= "2.4.0",
                    reason="the CPU ranks need Triton's interpreter, which needs numpy < 2.4")
def test_fsdp2_train_two_cpu_ranks() -> None:
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "examples/fsdp2_train.py",
              CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    curve = losses(out)
    assert len(curve) == 3 and "(mean over 2 ranks)" in out and curve[-1] < curve[0]
