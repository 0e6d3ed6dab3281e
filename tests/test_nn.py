"""coda.nn modules: the unfused PyTorch modules' parameter shapes, the fused forward, gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import coda
from conftest import DEVICE


def test_rmsnorm_linear_module() -> None:
    m = coda.nn.RMSNormLinear(16, 24, eps=1e-5, device=DEVICE)
    assert m.norm_weight.shape == (16,) and m.weight.shape == (24, 16)
    x = torch.randn(3, 5, 16, device=DEVICE, requires_grad=True)
    y = m(x)
    ref = F.linear(F.rms_norm(x, (16,), m.norm_weight, 1e-5), m.weight)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert m.weight.grad is not None and m.norm_weight.grad is not None and x.grad is not None


def test_swiglu_mlp_module() -> None:
    m = coda.nn.SwiGLUMLP(16, 20, device=DEVICE)
    assert m.w_gate.shape == m.w_up.shape == (20, 16) and m.w_down.shape == (16, 20)
    x = torch.randn(7, 16, device=DEVICE)
    ref = F.linear(F.silu(F.linear(x, m.w_gate)) * F.linear(x, m.w_up), m.w_down)
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)


def test_linear_cross_entropy_module() -> None:
    m = coda.nn.LinearCrossEntropy(16, 30, reduction="sum", device=DEVICE)
    x, t = torch.randn(2, 4, 16, device=DEVICE), torch.randint(0, 30, (2, 4), device=DEVICE)
    ref = F.cross_entropy(F.linear(x, m.weight).reshape(-1, 30), t.reshape(-1), reduction="sum")
    torch.testing.assert_close(m(x, t), ref, rtol=1e-5, atol=1e-5)


def test_linear_cross_entropy_module_passes_the_options() -> None:
    m = coda.nn.LinearCrossEntropy(16, 30, reduction="none", label_smoothing=0.1, lse_square_scale=0.05, softcap=2.0,
                                   device=DEVICE)
    x, t = torch.randn(2, 4, 16, device=DEVICE), torch.randint(0, 30, (2, 4), device=DEVICE)
    z = 2.0 * torch.tanh(F.linear(x, m.weight) / 2.0)
    ref = F.cross_entropy(z.transpose(1, 2), t, reduction="none", label_smoothing=0.1) + 0.05 * torch.logsumexp(z, -1) ** 2
    torch.testing.assert_close(m(x, t), ref, rtol=1e-5, atol=1e-5)
