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

The options (label smoothing, z-loss, final logit softcapping; docs/ALGEBRA.md 4) are steps in
that epilogue and that row pass, generated only when set: a call without them runs the plain
kernels. reduction="none" returns the per-row losses; its backward scales G's rows by the
upstream per-row gradient (dx: a VecM epilogue; dW: x's rows, which are that GEMM's K).
"""

from __future__ import annotations

import math

import torch

from ..runtime import gemm
from .custom import fused_op
from .epilogues import lm_head, row_scale, scaled
from .rowwise import cross_entropy_

_REDUCTIONS = ("mean", "sum", "none")


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


def _check_options(reduction: str, label_smoothing: float, lse_square_scale: float, softcap: float | None) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    for name, value in (("label_smoothing", label_smoothing), ("lse_square_scale", lse_square_scale),
                        ("softcap", 1.0 if softcap is None else softcap)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"linear_cross_entropy: {name} must be a Python number, got {type(value).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"linear_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (math.isfinite(lse_square_scale) and lse_square_scale >= 0.0):
        raise ValueError(f"linear_cross_entropy: lse_square_scale must be finite and >= 0, got {lse_square_scale}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0.0):
        raise ValueError(f"linear_cross_entropy: softcap must be None or finite and > 0, got {softcap}")


def _smoothed_target(label_smoothing: float, v: int) -> tuple[float, float] | None:
    """(q at the target class, q elsewhere) of the smoothed target q = (1 - eps) onehot + eps / V,
    or None without smoothing (the plain kernels then run)."""
    if label_smoothing == 0.0:
        return None
    return 1.0 - label_smoothing + label_smoothing / v, label_smoothing / v


def _fwd(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
         label_smoothing: float, lse_square_scale: float, softcap: float | None,
         with_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, G) where G is the logits' gradient per unit dloss (empty without with_grad)."""
    valid = target != ignore_index
    _check_targets(target, valid, weight.shape[0])
    count = valid.sum()
    smoothing = _smoothed_target(label_smoothing, weight.shape[0])
    if with_grad:
        weight_row = (1.0 / count) if reduction == "mean" else torch.ones((), device=x.device)
        w = torch.where(valid, weight_row, 0.0).float()  # 0 for ignored rows (also when every row is)
        grad = gemm(x, weight.T)  # the logits, until cross_entropy_ overwrites them with G
        lse, target_logit = cross_entropy_(grad, target, w, softcap=softcap, smoothing=smoothing,
                                           lse_square_scale=lse_square_scale)
    else:
        options = {} if softcap is None else {"softcap": softcap}
        if smoothing is not None:
            options["on_target"], options["off_target"] = smoothing
        epilogue = lm_head(x.dtype, softcap=softcap is not None, smoothing=smoothing is not None)
        stats = gemm(x, weight.T, epilogue, target=target, **options)
        grad, lse, target_logit = x.new_empty(0), stats["lse"], stats["target_logit"]
    per_row = lse - target_logit  # with smoothing, target_logit is sum_j q_j z_j
    if lse_square_scale:
        per_row = per_row + lse_square_scale * lse * lse
    per_row = torch.where(valid, per_row, 0.0)
    if reduction == "none":
        return per_row, grad
    return (per_row.sum() / count if reduction == "mean" else per_row.sum()), grad


def _fwd_fake(x, weight, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, with_grad):
    grad = x.new_empty(x.shape[0], weight.shape[0]) if with_grad else x.new_empty(0)
    return x.new_empty(target.shape if reduction == "none" else (), dtype=torch.float32), grad


def _save(x, weight, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, with_grad, *, out):
    return out[1], x, weight


def _bwd(dloss: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dloss is 0-d ("mean", "sum": a Scalar epilogue) or one value per row ("none": rows of G
    scale by it; for dW = G.T @ x those rows are the GEMM's K, so x's rows scale instead)."""
    if grad.numel() == 0 and x.shape[0] and weight.shape[0]:
        raise RuntimeError("linear_cross_entropy: backward through a forward that ran without gradients "
                           "(x and weight did not require grad, or grad mode was off)")
    if dloss.dim() == 0:
        s = dloss.float()
        return gemm(grad, weight, scaled, s=s), gemm(grad.T, x, scaled, s=s)
    d = dloss.float().contiguous()
    return gemm(grad, weight, row_scale, rstd=d), gemm(grad.T, (x.float() * d[:, None]).to(x.dtype))


def _bwd_fake(dloss, grad, x, weight):
    return torch.empty_like(x), torch.empty_like(weight)


_op = fused_op("coda::linear_cross_entropy", forward=_fwd, fake=_fwd_fake, save=_save, backward=_bwd,
               backward_fake=_bwd_fake, grads=("x", "weight"))


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                         softcap: float | None = None) -> torch.Tensor:
    """F.cross_entropy(z, target, ignore_index=..., reduction=..., label_smoothing=...) with
    z = F.linear(x, weight).float(), or softcap * tanh(z / softcap) when softcap is given (Gemma 2's
    final logit softcapping), plus the z-loss lse_square_scale * logsumexp(z)^2 of every row whose
    target is not ignore_index (PaLM; averaged with the rest under "mean"). Gradients for x and weight.

    x: [..., D]; weight: [V, D]; target: [...] integer class ids. Returns a 0-d fp32 loss, or for
    reduction "none" the fp32 per-row losses of target's shape (0 where ignored).
    As in PyTorch, "mean" over a batch whose targets are all ignore_index is nan.
    Memory: with gradients, the logits' gradient ([tokens, V] in x.dtype) is kept from forward
    to backward, as the unfused and torch.compile versions keep the logits; without, nothing
    of that size is allocated.
    """
    _check_options(reduction, label_smoothing, lse_square_scale, softcap)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: x {list(x.shape)} and weight {list(weight.shape)} must be [..., D], [V, D]")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: target {list(target.shape)} must have x's leading shape {list(x.shape[:-1])}")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"linear_cross_entropy: target must hold integer class ids, got {target.dtype}")
    with_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    loss = _op(x.reshape(-1, x.shape[-1]), weight, target.reshape(-1), int(ignore_index), reduction,
               float(label_smoothing), float(lse_square_scale), None if softcap is None else float(softcap), with_grad)
    return loss.reshape(target.shape) if reduction == "none" else loss
