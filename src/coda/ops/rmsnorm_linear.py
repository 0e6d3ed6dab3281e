"""rmsnorm_linear(x, g, W) = F.linear(F.rms_norm(x, g), W), with the norm inside the GEMMs.

Forward: one row pass gives rstd and h = x*rstd*g (the norm's output, rounded once to
x.dtype as F.rms_norm stores it), then a plain GEMM h @ W.T. (In a block the producer GEMM's
epilogue writes h = x*g before rstd is known and the consumer scales rows in its epilogue,
docs/ALGEBRA.md 1; standalone, the row pass knows rstd, and x*g alone can overflow fp16.)
Backward: one GEMM dy @ W whose epilogue gives u = r*g*gq, the normalized input, the row
term zdz = sum_j y_j gq_j and dg partials (section 5; dy comes from the caller, so zdz is
reduced here rather than where dy was made), a row pass dx = u - r^2 * x * zdz / D, then
dW = dy.T @ normed.
"""

from __future__ import annotations

import torch

from ..runtime import gemm
from .custom import fused_op
from .epilogues import rmsnorm_backward_rowterm
from .rowwise import rms_input_grad, rms_prep


def _check(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or norm_weight.shape != (x.shape[-1],) or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"rmsnorm_linear: x {list(x.shape)}, norm_weight {list(norm_weight.shape)} and weight "
            f"{list(weight.shape)} must be [..., D], [D] and [N, D]"
        )


def _fwd(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h, rstd = rms_prep(x, norm_weight, eps)  # h = F.rms_norm(x): rstd is known in this pass already
    return gemm(h, weight.T), rstd


def _fwd_fake(x, norm_weight, weight, eps):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], dtype=torch.float32)


def _save(x, norm_weight, weight, eps, *, out):
    return x, norm_weight, weight, out[1]


def _bwd(dy: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
         rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dy = dy.contiguous()
    u = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    out = gemm(dy, weight, rmsnorm_backward_rowterm, out={"u": u}, x=x, norm_weight=norm_weight, rstd=rstd)
    dx = rms_input_grad(u, x, rstd * rstd * out["zdz"] / x.shape[-1])
    dw = gemm(dy.T, out["normed"])
    return dx, out["dg"].to(norm_weight.dtype), dw


def _bwd_fake(dy, x, norm_weight, weight, rstd):
    return torch.empty_like(x), torch.empty_like(norm_weight), torch.empty_like(weight)


_op = fused_op("coda::rmsnorm_linear", forward=_fwd, fake=_fwd_fake, save=_save, backward=_bwd,
               backward_fake=_bwd_fake, grads=("x", "norm_weight", "weight"))


def rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """F.linear(F.rms_norm(x, (D,), norm_weight, eps), weight) with gradients for all three.

    x: [..., D]; norm_weight: [D]; weight: [N, D] (nn.Linear layout). Returns [..., N].
    """
    _check(x, norm_weight, weight)
    lead = x.shape[:-1]
    y = _op(x.reshape(-1, x.shape[-1]), norm_weight, weight, float(eps))
    return y.reshape(*lead, weight.shape[0])
