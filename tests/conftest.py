"""Shared test helpers: the device tier, tolerances derived from dtype and K, input makers.

The same tests run on the CPU through Triton's interpreter (small shapes) and on a
GPU with CUDA tensors at larger shapes (`GPU` is true there).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

import coda  # noqa: F401  (chooses the interpreter before Triton is imported)
from coda.runtime import interpreting

# CI runs a fixed sequence of examples (a red run is reproducible); locally they vary.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

GPU = not interpreting()
DEVICE = torch.device("cuda" if GPU else "cpu")
EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def scale(cpu: int, gpu: int) -> int:
    """A test size: small under the interpreter, larger on the GPU."""
    return gpu if GPU else cpu


def tolerances(out_dtype: torch.dtype, k: int, amax_a: float, amax_b: float) -> tuple[float, float]:
    """(rtol, atol) for comparing a kernel output with the fp32 reference.

    Both sides see the same (already rounded) inputs, so what differs is fp32
    accumulation order over K (bounded by K * eps32 * max|a| * max|b|), a few fp32
    ulps of epilogue math, and the final rounding to the output dtype (one ulp).
    """
    eps32 = EPS[torch.float32]
    acc = 2.0 * k * eps32 * amax_a * amax_b
    rtol = 2.0 * EPS[out_dtype] + 64.0 * eps32
    return rtol, acc + 2.0 * EPS[out_dtype] * 1e-3


def assert_close(out: torch.Tensor, ref: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    k = a.shape[1]
    rtol, atol = tolerances(out.dtype, k, a.abs().max().item(), b.abs().max().item())
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of `a` against `b` (fp64 norms): how whole models and blocks are compared."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def token_batch(vocab: int, seq: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random token ids [batch, seq] and their labels, the first row's first three ignored
    (-100): a training batch for the tiny models."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def attention(config: object) -> str | None:
    """The attention a transformers test model runs: eager where the config caps attention scores
    (Gemma 2), since transformers before 5.2x ran Gemma 2 under SDPA by default, which drops the cap
    (the reference semantics are the capped scores); the class's default otherwise."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) is not None else None


def randn(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device = DEVICE) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


def matrix(rows: int, cols: int, dtype: torch.dtype, col_major: bool) -> torch.Tensor:
    """A [rows, cols] operand in row-major or column-major memory order (a transposed view)."""
    if col_major:
        return randn(cols, rows, dtype=dtype).T
    return randn(rows, cols, dtype=dtype)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test session writes generated kernels to its own cache directory."""
    if "CODA_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "coda-cache"))
