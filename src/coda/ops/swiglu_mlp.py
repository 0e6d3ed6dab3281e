"""swiglu_mlp(x, W_gate, W_up, W_down) = F.linear(silu(x W_gate^T) * (x W_up^T), W_down).

Forward: one gate/up GEMM over interleaved weight rows whose epilogue stores the
pre-activation z and y = silu(gate) * up (docs/ALGEBRA.md 2), then the down GEMM.
Backward: d = dY @ W_down with the SwiGLU-backward epilogue (section 6: dz, recomputed y),
then plain GEMMs for dW_down, dx and dW_gate/up.
"""

from __future__ import annotations

import torch

from ..runtime import gemm
from .custom import fused_op
from .epilogues import swiglu_backward, swiglu_save
from .layout import interleave_gate_up, split_gate_up


def _fwd(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = gemm(x, interleave_gate_up(w_gate, w_up).T, swiglu_save)
    return gemm(h["y"], w_down.T), h["z"]


def _fwd_fake(x, w_gate, w_up, w_down):
    return x.new_empty(x.shape[0], w_down.shape[0]), x.new_empty(x.shape[0], 2 * w_gate.shape[0])


def _save(x, w_gate, w_up, w_down, *, out):
    return x, out[1], w_gate, w_up, w_down


def _bwd(dout: torch.Tensor, x: torch.Tensor, z: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
         w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    back = gemm(dout, w_down, swiglu_backward, z=z)
    dw_down = gemm(dout.T, back["y"])
    dx = gemm(back["dz"], interleave_gate_up(w_gate, w_up))
    dw_gate, dw_up = split_gate_up(gemm(back["dz"].T, x))
    return dx, dw_gate.contiguous(), dw_up.contiguous(), dw_down


def _bwd_fake(dout, x, z, w_gate, w_up, w_down):
    return torch.empty_like(x), torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down)


_op = fused_op("coda::swiglu_mlp", forward=_fwd, fake=_fwd_fake, save=_save, backward=_bwd, backward_fake=_bwd_fake,
               grads=("x", "w_gate", "w_up", "w_down"))


def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down), with gradients.

    x: [..., D]; w_gate, w_up: [F, D]; w_down: [D, F] (nn.Linear layouts). Returns [..., D].
    """
    d = x.shape[-1]
    if w_gate.shape != w_up.shape or w_gate.dim() != 2 or w_gate.shape[1] != d or w_down.shape != (d, w_gate.shape[0]):
        raise ValueError(
            f"swiglu_mlp: x {list(x.shape)}, w_gate {list(w_gate.shape)}, w_up {list(w_up.shape)}, w_down "
            f"{list(w_down.shape)} must be [..., D], [F, D], [F, D], [D, F]"
        )
    out = _op(x.reshape(-1, d), w_gate, w_up, w_down)
    return out.reshape(*x.shape[:-1], d)
