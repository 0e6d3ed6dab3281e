"""coda.ops.fused_op: a new differentiable operator in a few lines (forward, backward, fakes,
what to save), traced by torch.compile and checked against autograd of plain PyTorch."""

from __future__ import annotations

import pytest
import torch

import coda
from coda.ops import epilogues as E
from conftest import DEVICE


def _fwd(x: torch.Tensor, weight: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    y = coda.gemm(x, weight.T, E.scaled, s=s)
    return y, y.sum(-1)  # one public output, one internal (saved for nothing but the test)


def _bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    dy = dy.contiguous()
    return coda.gemm(dy, weight, E.scaled, s=s), coda.gemm(dy.T, x, E.scaled, s=s)


scaled_linear = coda.ops.fused_op(
    "coda_test::scaled_linear",
    forward=_fwd,
    fake=lambda x, weight, s: (x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0])),
    save=lambda x, weight, s, *, out: (x, weight, s),
    backward=_bwd,
    backward_fake=lambda dy, x, weight, s: (torch.empty_like(x), torch.empty_like(weight)),
    grads=("x", "weight"),
)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_new_operator_is_a_few_lines(compiled: bool) -> None:
    x = torch.randn(9, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(12, 16, device=DEVICE, requires_grad=True)
    fn = torch.compile(scaled_linear, fullgraph=True, backend="aot_eager") if compiled else scaled_linear
    y = fn(x, w, 0.5)
    ref = 0.5 * x @ w.T
    torch.testing.assert_close(y, ref)
    dy = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)):
        torch.testing.assert_close(a, b)


def test_unknown_gradient_input_is_refused() -> None:
    with pytest.raises(ValueError, match=r"grads \['bias'\] are not inputs of forward"):
        coda.ops.fused_op("coda_test::bad", forward=_fwd, fake=None, save=None, backward=_bwd, backward_fake=None,
                          grads=("x", "bias"))
