"""rmsnorm(x, g) = F.rms_norm(x, (D,), g, eps) as two row passes, for a norm coda cannot move
into a GEMM: one whose output feeds GEMMs coda does not run (a Hugging Face attention's three
separate q/k/v projections under `coda.patch`). Where the norm feeds one coda GEMM,
`rmsnorm_linear` moves it inside that GEMM instead.

Forward: `rms_prep` (rstd and h = x*rstd*g, rounded once). Backward: `rms_backward` (dx per row,
dg from per-program partials).
"""

from __future__ import annotations

import torch

from .custom import fused_op
from .rowwise import rms_backward, rms_prep


def _fwd(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_prep(x, norm_weight, eps)


def _fwd_fake(x, norm_weight, eps):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


def _save(x, norm_weight, eps, *, out):
    return x, norm_weight, out[1]


def _bwd(dy: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor,
         rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dg = rms_backward(dy, x, norm_weight, rstd)
    return dx, dg.to(norm_weight.dtype)


def _bwd_fake(dy, x, norm_weight, rstd):
    return torch.empty_like(x), torch.empty_like(norm_weight)


_op = fused_op("coda::rmsnorm", forward=_fwd, fake=_fwd_fake, save=_save, backward=_bwd,
               backward_fake=_bwd_fake, grads=("x", "norm_weight"))


def rmsnorm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """F.rms_norm(x, (D,), norm_weight, eps), with gradients for both. x: [..., D]; norm_weight: [D]."""
    d = x.shape[-1] if x.dim() else 0
    if x.dim() < 1 or norm_weight.shape != (d,):
        raise ValueError(f"rmsnorm: x {list(x.shape)} and norm_weight {list(norm_weight.shape)} must be [..., D] and [D]")
    return _op(x.reshape(-1, d), norm_weight, float(eps)).reshape(x.shape)
