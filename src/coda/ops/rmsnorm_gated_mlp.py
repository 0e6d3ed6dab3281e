"""A norm and the gated MLP behind it, with the norm inside the GEMMs:
rmsnorm_swiglu_mlp (Llama's post-attention norm + SwiGLU MLP) and rmsnorm_geglu_mlp (Gemma's
pre-feedforward norm + GeGLU MLP). The two differ only in the pair epilogues of the gate/up GEMM
and of the backward's first GEMM (docs/ALGEBRA.md 2, 2a, 6).

Forward: one row pass (rstd, h = x*rstd*g, F.rms_norm's output: x*g alone can overflow fp16),
the gate/up GEMM applying the activation in its epilogue, the down GEMM. Backward: the
activation-backward GEMM also reduces the norm's row term zdz (section 6), so the
RMSNorm-backward GEMM gives dx directly (section 5).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..runtime import gemm
from . import epilogues as E
from .custom import fused_op
from .layout import gate_up_grads, gate_up_rows
from .rowwise import rms_prep


def _gated_mlp(epilogues: E.Gated) -> Callable[..., torch.Tensor]:
    """The fused op `coda::rmsnorm_{name}_mlp`: `epilogues.save` gives {z, y} from the gate/up GEMM,
    `epilogues.backward_zdz` gives {dz, y, zdz} from dY @ W_down and the saved z. `gate_up`:
    [w_gate_up] interleaved (ops.layout.interleave_gate_up, as coda's models hold it) or [w_gate, w_up]."""
    name, save, backward_zdz = f"rmsnorm_{epilogues.name}_mlp", epilogues.save, epilogues.backward_zdz

    def fwd(x: torch.Tensor, norm_weight: torch.Tensor, gate_up: list[torch.Tensor], w_down: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, rstd = rms_prep(x, norm_weight, eps)  # h = F.rms_norm(x, g): rstd is applied already
        c = gemm(h, gate_up_rows(gate_up).T, save)
        return gemm(c["y"], w_down.T), c["z"], rstd

    def fwd_fake(x, norm_weight, gate_up, w_down, eps):
        m = x.shape[0]
        return x.new_empty(m, w_down.shape[0]), x.new_empty(m, 2 * w_down.shape[1]), x.new_empty(m, dtype=torch.float32)

    def save_for_backward(x, norm_weight, gate_up, w_down, eps, *, out):
        return x, norm_weight, gate_up, w_down, out[1], out[2]

    def bwd(dout: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, gate_up: list[torch.Tensor],
            w_down: torch.Tensor, z: torch.Tensor, rstd: torch.Tensor) -> list[torch.Tensor]:
        dout = dout.contiguous()
        sb = gemm(dout, w_down, backward_zdz, z=z)
        dw_down = gemm(dout.T, sb["y"])
        n = gemm(sb["dz"], gate_up_rows(gate_up), E.rmsnorm_backward, x=x, norm_weight=norm_weight, rstd=rstd,
                 zdz_over_d=sb["zdz"] / x.shape[-1])
        d_gate_up = gate_up_grads(gemm(sb["dz"].T, n["normed"]), gate_up)
        return [n["dx"], n["dg"].to(norm_weight.dtype), *d_gate_up, dw_down]

    def bwd_fake(dout, x, norm_weight, gate_up, w_down, z, rstd):
        return [torch.empty_like(t) for t in (x, norm_weight, *gate_up, w_down)]

    op = fused_op(f"coda::{name}", forward=fwd, fake=fwd_fake, save=save_for_backward, backward=bwd,
                  backward_fake=bwd_fake, grads=("x", "norm_weight", "gate_up", "w_down"))

    def run(x: torch.Tensor, norm_weight: torch.Tensor, gate_up: list[torch.Tensor], w_down: torch.Tensor,
            eps: float) -> torch.Tensor:
        d, f = x.shape[-1], w_down.shape[-1]
        rows = [2 * f] if len(gate_up) == 1 else [f, f]
        if norm_weight.shape != (d,) or [list(w.shape) for w in gate_up] != [[r, d] for r in rows] \
                or w_down.shape != (d, f):
            raise ValueError(
                f"{name}: x {list(x.shape)}, norm_weight {list(norm_weight.shape)}, gate/up "
                f"{[list(w.shape) for w in gate_up]}, w_down {list(w_down.shape)} must be [..., D], [D], "
                f"[[2F, D]] or [[F, D], [F, D]], [D, F]")
        return op(x.reshape(-1, d), norm_weight, list(gate_up), w_down, float(eps)).reshape(x.shape)

    return run


_OPS = {activation: _gated_mlp(epilogues) for activation, epilogues in E.GATED.items()}


def rmsnorm_gated_mlp(x: torch.Tensor, norm_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      eps: float, activation: str) -> torch.Tensor:
    """The norm + gated MLP on coda's interleaved gate/up weight [2F, D] (ops.layout.interleave_gate_up),
    as a model holds it: `activation` "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
    E.gated(activation)  # a ValueError naming the activations there are
    return _OPS[activation](x, norm_weight, [w_gate_up], w_down, eps)


def rmsnorm_swiglu_mlp(x: torch.Tensor, norm_weight: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                       w_down: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """swiglu_mlp(F.rms_norm(x, (D,), norm_weight, eps), w_gate, w_up, w_down), with gradients for all.

    x: [..., D]; norm_weight: [D]; w_gate, w_up: [F, D]; w_down: [D, F]. Returns [..., D]."""
    return _OPS["silu"](x, norm_weight, [w_gate, w_up], w_down, eps)


def rmsnorm_geglu_mlp(x: torch.Tensor, norm_weight: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                      w_down: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """F.linear(F.gelu(F.linear(h, w_gate), approximate="tanh") * F.linear(h, w_up), w_down) with
    h = F.rms_norm(x, (D,), norm_weight, eps): Gemma's MLP and the norm in front of it, with
    gradients for all. Shapes as rmsnorm_swiglu_mlp."""
    return _OPS["gelu_tanh"](x, norm_weight, [w_gate, w_up], w_down, eps)
