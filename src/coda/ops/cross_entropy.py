"""linear_cross_entropy(x, W, target) = F.cross_entropy(F.linear(x, W).float(), target).

Without gradients: the LM-head GEMM's epilogue writes per-tile logsumexp and the target
logit (docs/ALGEBRA.md 4) of the logits rounded to x.dtype, as F.linear would store them, and
nothing of [tokens, vocab] size is stored.

With gradients the logits must be stored for backward anyway, and then a plain GEMM storing
them, followed by one row pass that takes the statistics and turns the logits in place into
their gradient G = (softmax - onehot) * w (w = 1/valid rows for "mean", 1 for "sum", 0 for
ignored rows), is faster on the H200 than the statistics epilogue storing logits followed by
the gradient pass (bench/results/profile_ops.md: the epilogue with the store costs the GEMM
about 2 ms at 8192 x 128256 x 2048, a second read of the logits about 0.5 ms). Backward is
the two GEMMs dx = dloss * G @ W and dW = dloss * G.T @ x (dloss as a Scalar epilogue):
three GEMMs in all, as unfused.
"""

from __future__ import annotations

import torch

from ..runtime import gemm
from .custom import fused_op
from .epilogues import lm_head, scaled
from .rowwise import cross_entropy_

_REDUCTIONS = ("mean", "sum")


def _check_targets(target: torch.Tensor, valid: torch.Tensor, v: int) -> None:
    """Every target is ignore_index or in [0, V), as F.cross_entropy requires. On the CPU an
    IndexError like PyTorch's; on the GPU a device-side assert (as F.cross_entropy's kernel
    asserts): a few tiny kernels over the [tokens] targets and no host synchronization."""
    in_range = (target >= 0) & (target < v)
    if target.device.type != "cuda":
        bad = valid & ~in_range
        if bad.any():
            raise IndexError(f"linear_cross_entropy: target {target[bad][0].item()} is out of bounds "
                             f"for {v} classes (and is not ignore_index)")
        return
    torch._assert_async((in_range | ~valid).all(), "linear_cross_entropy: a target is out of bounds")


def _fwd(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
         with_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, G) where G is the logits' gradient per unit dloss (empty without with_grad)."""
    valid = target != ignore_index
    _check_targets(target, valid, weight.shape[0])
    count = valid.sum()
    if with_grad:
        weight_row = (1.0 / count) if reduction == "mean" else torch.ones((), device=x.device)
        w = torch.where(valid, weight_row, 0.0).float()  # 0 for ignored rows (also when every row is)
        grad = gemm(x, weight.T)  # the logits, until cross_entropy_ overwrites them with G
        lse, target_logit = cross_entropy_(grad, target, w)
    else:
        stats = gemm(x, weight.T, lm_head(x.dtype), target=target)
        grad, lse, target_logit = x.new_empty(0), stats["lse"], stats["target_logit"]
    per_row = torch.where(valid, lse - target_logit, 0.0)
    loss = per_row.sum() / count if reduction == "mean" else per_row.sum()
    return loss, grad


def _fwd_fake(x, weight, target, ignore_index, reduction, with_grad):
    grad = x.new_empty(x.shape[0], weight.shape[0]) if with_grad else x.new_empty(0)
    return x.new_empty((), dtype=torch.float32), grad


def _save(x, weight, target, ignore_index, reduction, with_grad, *, out):
    return out[1], x, weight


def _bwd(dloss: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if grad.numel() == 0 and x.shape[0] and weight.shape[0]:
        raise RuntimeError("linear_cross_entropy: backward through a forward that ran without gradients "
                           "(x and weight did not require grad, or grad mode was off)")
    s = dloss.float().reshape(())
    return gemm(grad, weight, scaled, s=s), gemm(grad.T, x, scaled, s=s)


def _bwd_fake(dloss, grad, x, weight):
    return torch.empty_like(x), torch.empty_like(weight)


_op = fused_op("coda::linear_cross_entropy", forward=_fwd, fake=_fwd_fake, save=_save, backward=_bwd,
               backward_fake=_bwd_fake, grads=("x", "weight"))


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                         reduction: str = "mean") -> torch.Tensor:
    """F.cross_entropy(F.linear(x, weight).float(), target, ignore_index=..., reduction=...),
    for reduction "mean" or "sum", with gradients for x and weight.

    x: [..., D]; weight: [V, D]; target: [...] integer class ids. Returns a 0-d fp32 loss.
    As in PyTorch, "mean" over a batch whose targets are all ignore_index is nan.
    Memory: with gradients, the logits' gradient ([tokens, V] in x.dtype) is kept from forward
    to backward, as the unfused and torch.compile versions keep the logits; without, nothing
    of that size is allocated.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: x {list(x.shape)} and weight {list(weight.shape)} must be [..., D], [V, D]")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: target {list(target.shape)} must have x's leading shape {list(x.shape[:-1])}")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"linear_cross_entropy: target must hold integer class ids, got {target.dtype}")
    with_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    loss = _op(x.reshape(-1, x.shape[-1]), weight, target.reshape(-1), int(ignore_index), reduction, with_grad)
    return loss
