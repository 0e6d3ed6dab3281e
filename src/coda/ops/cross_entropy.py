"""linear_cross_entropy(x, W, target) = F.cross_entropy(F.linear(x, W).float(), target).

Forward: the LM-head GEMM's epilogue writes per-tile logsumexp and the target logit
(TRANSFORMER.md 4); the logits are never stored. Backward: the logits are recomputed by
the same GEMM, whose epilogue writes dl = (softmax - onehot) * scale, then dx = dl @ W and
dW = dl.T @ x. Logits stay fp32 in the epilogue (the reference rounds them to x.dtype
first): a difference of one rounding, inside bf16 tolerances.
"""

from __future__ import annotations

import torch

from ..runtime import gemm
from .epilogues import cross_entropy_grad, lm_head_stats

_REDUCTIONS = ("mean", "sum")


@torch.library.custom_op("coda::linear_cross_entropy_fwd", mutates_args=())
def _fwd(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
         reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    stats = gemm(x, weight.T, lm_head_stats, target=target)
    valid = target != ignore_index
    per_row = torch.where(valid, stats["lse"] - stats["target_logit"], 0.0)
    loss = per_row.sum() / valid.sum() if reduction == "mean" else per_row.sum()
    return loss, stats["lse"]


@_fwd.register_fake
def _(x, weight, target, ignore_index, reduction):
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("coda::linear_cross_entropy_bwd", mutates_args=())
def _bwd(dloss: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
         ignore_index: int, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    valid = target != ignore_index
    per_row = dloss.float() / valid.sum() if reduction == "mean" else dloss.float().expand(target.shape)
    scale = torch.where(valid, per_row, 0.0).contiguous()
    dl = gemm(x, weight.T, cross_entropy_grad, lse=lse, target=target, scale=scale)
    return gemm(dl, weight), gemm(dl.T, x)


@_bwd.register_fake
def _(dloss, x, weight, target, lse, ignore_index, reduction):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output) -> None:
    x, weight, target, ignore_index, reduction = inputs
    ctx.save_for_backward(x, weight, target, output[1])
    ctx.ignore_index, ctx.reduction = ignore_index, reduction


def _backward(ctx, dloss, _dlse):
    x, weight, target, lse = ctx.saved_tensors
    dx, dw = _bwd(dloss, x, weight, target, lse, ctx.ignore_index, ctx.reduction)
    return dx, dw, None, None, None


torch.library.register_autograd("coda::linear_cross_entropy_fwd", _backward, setup_context=_setup)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                         reduction: str = "mean") -> torch.Tensor:
    """F.cross_entropy(F.linear(x, weight).float(), target, ignore_index=..., reduction=...),
    for reduction "mean" or "sum", with gradients for x and weight.

    x: [..., D]; weight: [V, D]; target: [...] integer class ids. Returns a 0-d fp32 loss.
    As in PyTorch, "mean" over a batch whose targets are all ignore_index is nan.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: x {list(x.shape)} and weight {list(weight.shape)} must be [..., D], [V, D]")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: target {list(target.shape)} must have x's leading shape {list(x.shape[:-1])}")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"linear_cross_entropy: target must hold integer class ids, got {target.dtype}")
    loss, _ = _fwd(x.reshape(-1, x.shape[-1]), weight, target.reshape(-1), int(ignore_index), reduction)
    return loss
