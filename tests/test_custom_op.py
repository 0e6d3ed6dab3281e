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


def _mix_fwd(xs: list[torch.Tensor], scales: list[torch.Tensor], w: torch.Tensor, c: list[float]) -> torch.Tensor:
    return sum(x * s for x, s in zip(xs, scales)) * w * c[0]  # one output, returned bare


def _mix_bwd(dy: torch.Tensor, xs: list[torch.Tensor], scales: list[torch.Tensor], w: torch.Tensor,
             c: list[float]) -> list[torch.Tensor]:
    return [dy * w * s * c[0] for s in scales] + [(dy * sum(x * s for x, s in zip(xs, scales))).sum(0) * c[0]]


mix = coda.ops.fused_op(
    "coda_test::mix", forward=_mix_fwd, fake=lambda xs, scales, w, c: torch.empty_like(xs[0]),
    save=lambda xs, scales, w, c, *, out: (xs, scales, w, c), backward=_mix_bwd,
    backward_fake=lambda dy, xs, scales, w, c: [torch.empty_like(x) for x in xs] + [torch.empty_like(w)],
    grads=("xs", "w"))  # scales: a list of tensors without gradients; c: a list of numbers


class _Passthrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("how", ["eager", "dispatch_mode", "compiled", "meta"])
def test_list_inputs_get_their_gradients_eager_traced_and_compiled(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Eager calls run the op's functions in one autograd.Function (the custom ops unused: the
    forward op is made to fail); under a dispatch mode and torch.compile the custom ops run, and
    on meta tensors their fake kernels. Each gives plain autograd's gradients (on meta: shapes),
    list inputs included."""
    xs = [torch.randn(5, 7, device=DEVICE, requires_grad=True) for _ in range(2)]
    scales = [torch.randn(7, device=DEVICE) for _ in range(2)]
    w = torch.randn(7, device=DEVICE, requires_grad=True)
    ref = (xs[0] * scales[0] + xs[1] * scales[1]) * w * 0.5
    dy = torch.randn_like(ref)
    if how == "eager":
        monkeypatch.setattr(mix, "forward", lambda *a: pytest.fail("the eager call went through the custom op"))
        y = mix(xs, scales, w, [0.5, 2.0])
    elif how == "dispatch_mode":
        with _Passthrough():
            y = mix(xs, scales, w, [0.5, 2.0])
    elif how == "compiled":
        y = torch.compile(mix, fullgraph=True, backend="aot_eager")(xs, scales, w, [0.5, 2.0])
    else:
        monkeypatch.setattr(mix, "_forward_fn", lambda *a: pytest.fail("meta tensors reached the op's function"))
        meta = [t.detach().to("meta").requires_grad_(t.requires_grad) for t in (*xs, *scales, w)]
        y = mix(meta[:2], meta[2:4], meta[4], [0.5, 2.0])
        assert y.shape == ref.shape and y.is_meta
        assert [g.shape for g in torch.autograd.grad(y, (*meta[:2], meta[4]), dy.to("meta"))] == [
            t.shape for t in (*xs, w)]
        return
    torch.testing.assert_close(y, ref)
    for a, b in zip(torch.autograd.grad(y, (*xs, w), dy), torch.autograd.grad(ref, (*xs, w), dy)):
        torch.testing.assert_close(a, b)
