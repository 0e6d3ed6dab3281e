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
from .layout import gate_up_grads, gate_up_rows


def _fwd(x: torch.Tensor, gate_up: list[torch.Tensor], w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = gemm(x, gate_up_rows(gate_up).T, swiglu_save)
    return gemm(h["y"], w_down.T), h["z"]


def _fwd_fake(x, gate_up, w_down):
    return x.new_empty(x.shape[0], w_down.shape[0]), x.new_empty(x.shape[0], 2 * w_down.shape[1])


def _save(x, gate_up, w_down, *, out):
    return x, out[1], gate_up, w_down


def _bwd(dout: torch.Tensor, x: torch.Tensor, z: torch.Tensor, gate_up: list[torch.Tensor],
         w_down: torch.Tensor) -> list[torch.Tensor]:
    back = gemm(dout, w_down, swiglu_backward, z=z)
    dw_down = gemm(dout.T, back["y"])
    dx = gemm(back["dz"], gate_up_rows(gate_up))
    return [dx, *gate_up_grads(gemm(back["dz"].T, x), gate_up), dw_down]


def _bwd_fake(dout, x, z, gate_up, w_down):
    return [torch.empty_like(t) for t in (x, *gate_up, w_down)]


_op = fused_op("coda::swiglu_mlp", forward=_fwd, fake=_fwd_fake, save=_save, backward=_bwd, backward_fake=_bwd_fake,
               grads=("x", "gate_up", "w_down"))


def _run(x: torch.Tensor, gate_up: list[torch.Tensor], w_down: torch.Tensor) -> torch.Tensor:
    d, f = x.shape[-1], w_down.shape[-1]
    rows = [2 * f] if len(gate_up) == 1 else [f, f]
    if [list(w.shape) for w in gate_up] != [[r, d] for r in rows] or w_down.shape != (d, f):
        raise ValueError(
            f"swiglu_mlp: x {list(x.shape)}, gate/up {[list(w.shape) for w in gate_up]}, w_down {list(w_down.shape)} "
            f"must be [..., D], [[F, D], [F, D]] (or [[2F, D]] interleaved), [D, F]")
    return _op(x.reshape(-1, d), list(gate_up), w_down).reshape(*x.shape[:-1], d)


def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down), with gradients.

    x: [..., D]; w_gate, w_up: [F, D]; w_down: [D, F] (nn.Linear layouts). Returns [..., D].
    """
    return _run(x, [w_gate, w_up], w_down)


def swiglu_mlp_interleaved(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The same on coda's interleaved gate/up weight [2F, D] (ops.layout.interleave_gate_up), as a
    model holds it: no per-call interleaving copy, and its gradient comes in that layout."""
    return _run(x, [w_gate_up], w_down)
