"""The Transformer epilogues of docs/ALGEBRA.md, one per fused unit, forward and backward.

Each is a plain @coda.epilogue: its IR is printable (`.graph`), its reference checkable
(`.reference`). Statistics are fp32 (reductions always are; vector operands are passed fp32).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from ..epilogue import Epilogue, epilogue
from ..ir.trace import (
    col_index, cos, exp, group_sum, interleave, pairs, reduce_m, reduce_n, round_bf16, round_fp16, rsqrt, sigmoid, silu,
    sin, where,
)
from ..ir.types import Scalar, Tile, VecM, VecN


@epilogue
def residual_norm_stats(acc, residual: Tile, norm_weight: VecN):
    """Section 1, producer: x = acc + residual, h = x * g (next GEMM's input), per-row sum x^2."""
    x = acc + residual
    return {"x": x, "h": x * norm_weight, "sumsq": reduce_n(x * x, "sum")}


@epilogue
def row_scale(acc, rstd: VecM):
    """Section 1, consumer: the RMSNorm row scale applied after the matmul."""
    return acc * rstd


@epilogue
def scaled(acc, s: Scalar):
    """acc * s: a GEMM whose whole result scales by one number (a loss gradient, say)."""
    return acc * s


@epilogue
def accumulate(acc, total: Tile):
    """acc + total: with out= the very tensor `total`, a sum kept in place across GEMMs (the LM
    head's dW over chunks of tokens, fp32)."""
    return acc + total


@epilogue
def rms_swiglu(acc, rstd: VecM):
    """Section 2: z = acc * rstd (saved for backward), y = silu(gate) * up over interleaved pairs."""
    z = acc * rstd
    gate, up = pairs(z)
    return {"z": z, "y": silu(gate) * up}


@epilogue
def swiglu_save(acc):
    """Section 2 without a norm in front: z = acc (saved), y = silu(gate) * up."""
    gate, up = pairs(acc)
    return {"z": acc, "y": silu(gate) * up}


# F.gelu(approximate="tanh")'s constants: sqrt(2 / pi) and the cubic term's coefficient.
_GELU_K, _GELU_C = 0.7978845608028654, 0.044715


def _gelu_sigmoid(x):
    """s = sigmoid(2u), u = K (x + C x^3) (section 2a): 0.5 (1 + tanh u) = s, so gelu_tanh(x) = x s,
    and 1 - tanh^2 u = 4 s (1 - s) gives its derivative. The sigmoid SwiGLU uses, no tanh (coda.gelu
    is the erf GELU)."""
    return sigmoid(2.0 * _GELU_K * (x + _GELU_C * x * x * x))


@epilogue
def geglu_save(acc):
    """Section 2a (Gemma's MLP): z = acc (saved), y = gelu_tanh(gate) * up over interleaved pairs."""
    gate, up = pairs(acc)
    return {"z": acc, "y": gate * _gelu_sigmoid(gate) * up}


@epilogue
def rms_geglu(acc, rstd: VecM):
    """Section 2a in the block (Gemma 1): z = acc * rstd (saved), y = gelu_tanh(gate) * up; the row
    scale comes first, as in rms_swiglu, since gelu_tanh does not commute with it."""
    z = acc * rstd
    gate, up = pairs(z)
    return {"z": z, "y": gate * _gelu_sigmoid(gate) * up}


def _rotate(x, pos, freq):
    """Rotate each adjacent column pair (a, b) of x by theta = pos * freq (complex multiply by
    e^{i theta}); freq is 0 for the v columns, which pass unrotated."""
    a, b = pairs(x)
    theta = pos * freq
    c, s = cos(theta), sin(theta)
    return interleave(a * c - b * s, a * s + b * c)


@epilogue
def rms_rope(acc, rstd: VecM, pos: VecM, freq: VecN(width=0.5)):
    """Section 3: row scale (the producer stored x * g), then the RoPE rotation."""
    return _rotate(acc * rstd, pos, freq)


@epilogue
def rope(acc, pos: VecM, freq: VecN(width=0.5)):
    """Section 3 on an already normalized input (a row pass stored F.rms_norm's output)."""
    return _rotate(acc, pos, freq)


def _head_rstd(u, eps, head_dim: int):
    """Per row and head (head_dim consecutive columns), rsqrt(mean(u^2) + eps), in every column
    of the head: the QK-norm statistic as a value (a group reduction inside the epilogue)."""
    return rsqrt(group_sum(u * u, head_dim) * (1.0 / head_dim) + eps)


@cache
def rms_qknorm_rope(head_dim: int) -> Epilogue:
    """Section 3a, forward: the input norm's row scale u = acc * rstd, then per head on the q and
    k columns (qk_mask) RMSNorm with the per-column weight qk_weight, then RoPE; v columns are
    u unchanged (their freq is 0). One epilogue per head_dim (the group size is static)."""

    def fn(acc, rstd: VecM, qk_weight: VecN, qk_mask: VecN, eps: Scalar, pos: VecM, freq: VecN(width=0.5)):
        u = acc * rstd
        return _rotate(u * where(qk_mask, _head_rstd(u, eps, head_dim) * qk_weight, 1.0), pos, freq)

    fn.__name__ = f"rms_qknorm_rope_hd{head_dim}"
    return epilogue(fn)


@cache
def qknorm_rope_backward(head_dim: int) -> Epilogue:
    """Section 3a, backward, on the recomputed forward GEMM (acc = the same h @ Wqkv.T): u and the
    per-head r come back exactly, `grad` (dL/d qkv) is rotated back by -theta to dqn, then per
    q/k head du = r (w dqn) - r^3 u <u, w dqn> / d_h (v: du = dqn). Also zdz = u . du per row (the
    input RMSNorm backward's row term, section 5) and dw = per-column sums over rows of
    dqn * u * r on q/k columns (summed over heads in torch: `ops.qknorm.qknorm_weight_grads`)."""

    def fn(acc, grad: Tile, rstd: VecM, qk_weight: VecN, qk_mask: VecN, eps: Scalar, pos: VecM,
           freq: VecN(width=0.5)):
        u = acc * rstd
        r = _head_rstd(u, eps, head_dim)
        dqn = _rotate(grad, pos, -freq)  # the inverse rotation
        wd = qk_weight * dqn
        dot = group_sum(u * wd, head_dim)
        du = where(qk_mask, r * wd - r * r * r * u * dot * (1.0 / head_dim), dqn)
        return {"du": du, "zdz": reduce_n(u * du, "sum"), "dw": reduce_m(where(qk_mask, dqn * u * r, 0.0), "sum")}

    fn.__name__ = f"qknorm_rope_backward_hd{head_dim}"
    return epilogue(fn)


@epilogue
def rms_rope_bias(acc, rstd: VecM, bias: VecN, pos: VecM, freq: VecN(width=0.5)):
    """rms_rope with a projection bias (Qwen2's q/k/v) added before the rotation, in the
    projection's (pair-permuted) column order: rope(acc * rstd + bias)."""
    return _rotate(acc * rstd + bias, pos, freq)


@epilogue
def rope_bias(acc, bias: VecN, pos: VecM, freq: VecN(width=0.5)):
    """rope with a projection bias added before the rotation: rope(acc + bias)."""
    return _rotate(acc + bias, pos, freq)


@epilogue
def lm_head_stats(acc, target: VecM):
    """Section 4 forward: per-row logsumexp and target logit; the logits are never stored."""
    return {
        "lse": reduce_n(acc, "logsumexp"),
        "target_logit": reduce_n(where(col_index() == target, acc, 0.0), "sum"),
    }


def lm_head(dtype: torch.dtype, *, softcap: bool = False, smoothing: bool = False) -> Epilogue:
    """Section 4 forward as linear_cross_entropy runs it without gradients: lm_head_stats over
    the logits rounded to `dtype`, as F.linear would store them, so that the statistics match
    the unfused op's. With `softcap` the statistics are of z = softcap * tanh(l / softcap) (a
    Scalar operand); with `smoothing` "target_logit" is sum_j q_j z_j for the smoothed target
    q = on_target at the target and off_target elsewhere (Scalar operands). Each option set is
    its own epilogue, so the plain one does no more work than before."""
    return _lm_head_epilogue(dtype, softcap, smoothing)


_ROUNDING = {torch.bfloat16: ("bf16", round_bf16), torch.float16: ("fp16", round_fp16), torch.float32: ("fp32", None)}


@cache
def _lm_head_epilogue(dtype: torch.dtype, capped: bool, smoothed: bool) -> Epilogue:
    tag, rounding = _ROUNDING[dtype]

    def fn(acc, target, **scalars):
        z = acc if rounding is None else rounding(acc)
        if capped:
            # c * tanh(l / c) as 2c * sigmoid(2l / c) - c: the same to a few ulps of c, and on
            # sm_90 (gluon-hopper, test_aot_gluon) a quarter of the tanh form's register spills.
            c = scalars["softcap"]
            z = (2.0 * c) * sigmoid(z * (2.0 / c)) - c
        hit = col_index() == target
        picked = where(hit, scalars["on_target"], scalars["off_target"]) * z if smoothed else where(hit, z, 0.0)
        return {"lse": reduce_n(z, "logsumexp"), "target_logit": reduce_n(picked, "sum")}

    # The operands each option set declares (the options' Scalars by keyword).
    scalars = ["softcap"] * capped + ["on_target", "off_target"] * smoothed
    fn.__signature__ = inspect.Signature(
        [inspect.Parameter("acc", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         inspect.Parameter("target", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=VecM)]
        + [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=Scalar) for n in scalars])
    fn.__name__ = f"lm_head_stats_{tag}" + "_softcap" * capped + "_smooth" * smoothed
    return epilogue(fn)


@epilogue
def cross_entropy_grad(acc, lse: VecM, target: VecM, scale: VecM):
    """Section 4 backward: dl = (softmax(l) - onehot(target)) * scale, from recomputed logits."""
    return (exp(acc - lse) - where(col_index() == target, 1.0, 0.0)) * scale


@epilogue
def cross_entropy_grad_zdz(acc, lse: VecM, target: VecM, scale: VecM):
    """cross_entropy_grad when a final RMSNorm feeds the LM head: also zdz = sum_k l_k dl_k
    per row, the row term of that norm's backward (section 5)."""
    dl = (exp(acc - lse) - where(col_index() == target, 1.0, 0.0)) * scale
    return {"dl": dl, "zdz": reduce_n(acc * dl, "sum")}


@epilogue
def rmsnorm_backward(acc, x: Tile, norm_weight: VecN, rstd: VecM, zdz_over_d: VecM):
    """Section 5: acc = gq = dz @ W. dx = r*(g*gq) - r^2 * x * zdz/D; the normalized input
    r*x*g for the weight gradient; per-column partials of dg = sum_rows gq * r * x."""
    return {
        "dx": rstd * (norm_weight * acc) - rstd * rstd * x * zdz_over_d,
        "normed": rstd * x * norm_weight,
        "dg": reduce_m(acc * rstd * x, "sum"),
    }


@epilogue
def rmsnorm_backward_rowterm(acc, x: Tile, norm_weight: VecN, rstd: VecM):
    """Section 5 when no upstream epilogue produced zdz (a standalone RMSNorm + linear, whose dz
    comes from the caller): the GEMM reduces zdz = sum_j y_j gq_j itself (y = r*x*g, the norm's
    output), so dx = u - r^2 * x * zdz / D needs a row pass after it; u = r*g*gq (store it in
    fp32 through out= to round dx once)."""
    normed = rstd * x * norm_weight
    return {
        "u": rstd * (norm_weight * acc),
        "normed": normed,
        "zdz": reduce_n(normed * acc, "sum"),
        "dg": reduce_m(acc * rstd * x, "sum"),
    }


@epilogue
def rmsnorm_backward_residual(acc, grad: Tile, x: Tile, norm_weight: VecN, rstd: VecM, zdz_over_d: VecM):
    """Section 5 with the residual gradient: dx = grad + (the RMSNorm input gradient). It may be
    written in place over `grad` (pass it also as out=); the block writes a fresh tensor."""
    return {
        "dx": grad + rstd * (norm_weight * acc) - rstd * rstd * x * zdz_over_d,
        "normed": rstd * x * norm_weight,
        "dg": reduce_m(acc * rstd * x, "sum"),
    }


def _swiglu_grads(acc, z):
    """(gate, up, sigmoid(gate), dgate, dup) of section 6 from d = acc and the saved pre-activation z."""
    gate, up = pairs(z)
    s = sigmoid(gate)
    return gate, up, s, acc * up * s * (1.0 + gate * (1.0 - s)), acc * gate * s


@epilogue
def swiglu_backward(acc, z: Tile(width=2)):
    """Section 6: acc = d = dY @ W_down. dz = interleave(dgate, dup) (width 2) and y recomputed
    for dW_down."""
    gate, up, s, dgate, dup = _swiglu_grads(acc, z)
    return {"dz": interleave(dgate, dup), "y": gate * s * up}


@epilogue
def swiglu_backward_zdz(acc, z: Tile(width=2)):
    """swiglu_backward when an RMSNorm feeds the MLP: also zdz = sum(gate*dgate + up*dup) per row,
    that norm's backward row term (section 5)."""
    gate, up, s, dgate, dup = _swiglu_grads(acc, z)
    return {"dz": interleave(dgate, dup), "y": gate * s * up, "zdz": reduce_n(gate * dgate + up * dup, "sum")}


@epilogue
def geglu_backward_zdz(acc, z: Tile(width=2)):
    """Section 2a, backward, with an RMSNorm in front of the MLP: acc = d = dY @ W_down, dgate =
    d * up * gelu_tanh'(gate), dup = d * gelu_tanh(gate); y recomputed for dW_down; zdz = z . dz,
    that norm's row term (section 5)."""
    gate, up = pairs(z)
    s = _gelu_sigmoid(gate)
    g = gate * s
    dgate = acc * up * (s + 2.0 * _GELU_K * g * (1.0 - s) * (1.0 + 3.0 * _GELU_C * gate * gate))
    dup = acc * g
    return {"dz": interleave(dgate, dup), "y": g * up, "zdz": reduce_n(gate * dgate + up * dup, "sum")}


@dataclass(frozen=True)
class Gated:
    """A gated MLP's epilogues for one activation: what each fused MLP picks by activation name."""

    name: str  # in op names: coda::rmsnorm_{name}_mlp
    save: Epilogue  # z = acc, y = act(gate) * up (the input already normalized)
    rms_save: Epilogue  # the same after the norm's row scale z = acc * rstd (the block's h = x * g)
    backward_zdz: Epilogue  # dz, y and the row term zdz of the norm in front
    torch_act: Callable[[torch.Tensor], torch.Tensor]  # the activation in torch, for fp32 references


# The gate activations coda's gated MLPs compute, by the name models and ops take ("silu": SwiGLU,
# "gelu_tanh": GeGLU with F.gelu(approximate="tanh")).
GATED = {"silu": Gated("swiglu", swiglu_save, rms_swiglu, swiglu_backward_zdz, F.silu),
         "gelu_tanh": Gated("geglu", geglu_save, rms_geglu, geglu_backward_zdz,
                            functools.partial(F.gelu, approximate="tanh"))}


def gated(activation: str) -> Gated:
    """GATED[activation], or a ValueError naming the activations there are."""
    if activation not in GATED:
        raise ValueError(f"gated MLP: activation must be one of {sorted(GATED)}, got {activation!r}")
    return GATED[activation]
