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

With a large vocabulary, holding G from forward to backward costs more memory than computing
the gradients in forward: where G would be more than twice an fp32 [V, D] (`chunk_rows`; Gemma
3's V = 262144 at 2 x 4096 tokens: 4.3 GB in bf16), equal chunks of tokens whose logits take at
most about one fp32 [V, D] (2 * D tokens in bf16) each run the same three GEMMs: dx into an fp32
[tokens, D], dW accumulated in place into an fp32 [V, D] (coda.gemm's in-place accumulation);
backward scales both by dloss and rounds once (`scale_cast`). Memory at the LM head: one chunk's
logits, dW and dx (2.3 GB for Gemma 3 1B: 4 chunks of 2048 tokens) in place of G. Work: the same
GEMMs, plus dW's fp32 reads and writes, one a chunk, and dx's GEMM, whose long K (V) runs on a
chunk's few output tiles (16 x 5 for Gemma 3 at 128 x 256 tiles, against 132 SMs): its cost on
the H200 is yet to be measured. reduction="none" always keeps G: its upstream gradient is per
row, unknown in forward.

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
from .epilogues import accumulate, lm_head, row_scale, scaled
from .rowwise import cross_entropy_, scale_cast, scale_rows

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


def chunk_rows(tokens: int, vocab: int, dim: int, itemsize: int) -> int | None:
    """Rows a chunk when the gradients are computed in forward (module docstring), or None to
    keep G whole: chunks where G ([tokens, vocab], `itemsize` bytes) would take more than twice
    an fp32 [vocab, dim]; as few chunks as keep each chunk's logits within about one, of equal
    rows (whole 128-row tiles: no small last chunk, whose GEMMs would leave most SMs idle)."""
    if tokens * itemsize <= 8 * dim:
        return None
    most = max(1, -(-4 * dim // itemsize // 128)) * 128
    chunks = -(-tokens // most)
    return -(-tokens // (chunks * 128)) * 128


def _chunked(x: torch.Tensor, weight: torch.Tensor, reduction: str) -> int | None:
    """This call's rows a chunk, or None to keep G ("none" always does: its upstream gradient is
    per row)."""
    return None if reduction == "none" else chunk_rows(x.shape[0], weight.shape[0], x.shape[1], x.element_size())


def _fwd(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
         label_smoothing: float, lse_square_scale: float, softcap: float | None,
         with_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, G, dx, dW): G the logits' gradient per unit dloss, or dx and dW (fp32) per unit dloss
    where they are computed in forward, chunked (empty where not computed)."""
    valid = target != ignore_index
    _check_targets(target, valid, weight.shape[0])
    count = valid.sum()
    smoothing = _smoothed_target(label_smoothing, weight.shape[0])
    grad, dx, dw = (x.new_empty(0) for _ in range(3))  # three tensors: a custom op's outputs may not alias
    if with_grad:
        weight_row = (1.0 / count) if reduction == "mean" else torch.ones((), device=x.device)
        w = torch.where(valid, weight_row, 0.0).float()  # 0 for ignored rows (also when every row is)
        options = dict(softcap=softcap, smoothing=smoothing, lse_square_scale=lse_square_scale)
        rows = _chunked(x, weight, reduction)
        if rows is None:
            grad = gemm(x, weight.T)  # the logits, until cross_entropy_ overwrites them with G
            lse, target_logit = cross_entropy_(grad, target, w, **options)
        else:
            lse, target_logit, dx, dw = _grads_in_chunks(x, weight, target, w, rows, options)
    else:
        options = {} if softcap is None else {"softcap": softcap}
        if smoothing is not None:
            options["on_target"], options["off_target"] = smoothing
        epilogue = lm_head(x.dtype, softcap=softcap is not None, smoothing=smoothing is not None)
        stats = gemm(x, weight.T, epilogue, target=target, **options)
        lse, target_logit = stats["lse"], stats["target_logit"]
    per_row = lse - target_logit  # with smoothing, target_logit is sum_j q_j z_j
    if lse_square_scale:
        per_row = per_row + lse_square_scale * lse * lse
    per_row = torch.where(valid, per_row, 0.0)
    if reduction == "none":
        return per_row, grad, dx, dw
    return (per_row.sum() / count if reduction == "mean" else per_row.sum()), grad, dx, dw


def _grads_in_chunks(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, w: torch.Tensor, rows: int,
                     options: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, target logit, dx, dW) per unit dloss, `rows` tokens at a time: each chunk's logits
    become its G in place, then dx's rows = G @ W and dW += G.T @ x's rows, fp32."""
    tokens, dim = x.shape
    dx = torch.empty(tokens, dim, dtype=torch.float32, device=x.device)
    dw = torch.empty(weight.shape, dtype=torch.float32, device=x.device)
    lse, target_logit = [], []
    for start in range(0, tokens, rows):
        part = slice(start, start + rows)
        g = gemm(x[part], weight.T)
        stats = cross_entropy_(g, target[part], w[part], **options)
        gemm(g, weight, out=dx[part])
        if start == 0:
            gemm(g.T, x[part], out=dw)
        else:
            gemm(g.T, x[part], accumulate, total=dw, out=dw)
        lse.append(stats[0])
        target_logit.append(stats[1])
    return torch.cat(lse), torch.cat(target_logit), dx, dw


def _fwd_fake(x, weight, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, with_grad):
    grad, dx, dw = (x.new_empty(0) for _ in range(3))  # three tensors: a custom op's outputs may not alias
    if with_grad:
        if _chunked(x, weight, reduction) is None:
            grad = x.new_empty(x.shape[0], weight.shape[0])
        else:
            dx, dw = x.new_empty(x.shape, dtype=torch.float32), weight.new_empty(weight.shape, dtype=torch.float32)
    return x.new_empty(target.shape if reduction == "none" else (), dtype=torch.float32), grad, dx, dw


def _save(x, weight, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, with_grad, *, out):
    return out[1], out[2], out[3], x, weight


def _bwd(dloss: torch.Tensor, grad: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor, x: torch.Tensor,
         weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dloss is 0-d ("mean", "sum": a Scalar epilogue, or the scale of dx and dW computed in
    forward) or one value per row ("none": rows of G scale by it; for dW = G.T @ x those rows are
    the GEMM's K, so x's rows scale instead)."""
    if dw.dim() == 2:  # computed in forward, chunked
        s = dloss.float()
        return scale_cast(dx, s, x.dtype), scale_cast(dw, s, weight.dtype)
    if grad.numel() == 0 and x.shape[0] and weight.shape[0]:
        raise RuntimeError("linear_cross_entropy: backward through a forward that ran without gradients "
                           "(x and weight did not require grad, or grad mode was off)")
    if dloss.dim() == 0:
        s = dloss.float()
        return gemm(grad, weight, scaled, s=s), gemm(grad.T, x, scaled, s=s)
    d = dloss.float().contiguous()
    return gemm(grad, weight, row_scale, rstd=d), gemm(grad.T, scale_rows(x, d))


def _bwd_fake(dloss, grad, dx, dw, x, weight):
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
    to backward, as the unfused and torch.compile versions keep the logits, unless that is more
    than twice an fp32 [V, D]: then dx and dW are computed in forward, a chunk of tokens at a
    time, and kept in fp32 (module docstring); without gradients nothing of that size is allocated.
    """
    _check_options(reduction, label_smoothing, lse_square_scale, softcap)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: x {list(x.shape)} and weight {list(weight.shape)} must be [..., D], [V, D]")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: target {list(target.shape)} must have x's leading shape {list(x.shape[:-1])}")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"linear_cross_entropy: target must hold integer class ids, got {target.dtype}")
    with_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    loss = _op(x.reshape(target.numel(), x.shape[-1]), weight, target.reshape(-1), int(ignore_index), reduction,
               float(label_smoothing), float(lse_square_scale), None if softcap is None else float(softcap), with_grad)
    return loss.reshape(target.shape) if reduction == "none" else loss
