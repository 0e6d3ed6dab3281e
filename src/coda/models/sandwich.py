"""Residual streams whose norms sit on the attention and MLP outputs, as coda's ops: Gemma 2/3's
"sandwich" norms (docs/ALGEBRA.md 1a) and OLMo 2's post-norms.

    x1 = x0 + norm(attn_out @ wo.T, g_post_attn)
    x2 = x1 + norm(mlp(norm(x1, g_ffn)), g_post_ffn)

A norm of a GEMM's output needs the whole row of that output before the residual add, and one
output tile holds a slice of it, so each sandwich norm is a row pass after its GEMM (`coda.ops.rmsnorm`,
then the add): the honest cost over Llama's block, which folds its norms' statistics into the
residual GEMMs' epilogues. The MLP is `rmsnorm_gated_mlp` (the norm's row pass, the gate/up GEMM
with the GeGLU epilogue, the down GEMM); the output projection is a plain GEMM (cuBLAS: with the
norm out of reach there is nothing to fuse into it). Layer i+1's input norm and QKV projection
follow as `first_segment` (a row pass, then the QKV GEMM with its epilogue).

OLMo 2 has the same two output norms and no norm in front of the MLP (or of attention):

    x1 = x0 + norm(attn_out @ wo.T, g_post_attn)
    x2 = x1 + norm(mlp(x1), g_post_ffn)

with the plain SwiGLU MLP (`swiglu_mlp_interleaved`). Its next qkv: `whole_qk_norm_qkv`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.rmsnorm import rmsnorm
from ..ops.rmsnorm_gated_mlp import rmsnorm_gated_mlp
from ..ops.swiglu_mlp import swiglu_mlp_interleaved


def sandwich_residual(attn_out: torch.Tensor, x0: torch.Tensor, wo: torch.Tensor, g_post_attn: torch.Tensor,
                      g_ffn: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, g_post_ffn: torch.Tensor,
                      eps: float, activation: str) -> torch.Tensor:
    """x2 as above: attn_out [M, H*hd], x0 [M, D], w_gate_up interleaved (ops.layout), the norm
    gains g ([D]; Gemma's 1 + w). Rounds where transformers does: each norm's output, then each sum."""
    x1 = x0 + rmsnorm(F.linear(attn_out, wo), g_post_attn, eps)
    return x1 + rmsnorm(rmsnorm_gated_mlp(x1, g_ffn, w_gate_up, w_down, eps, activation), g_post_ffn, eps)


def post_norm_residual(attn_out: torch.Tensor, x0: torch.Tensor, wo: torch.Tensor, g_post_attn: torch.Tensor,
                       w_gate_up: torch.Tensor, w_down: torch.Tensor, g_post_ffn: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """OLMo 2's x2 as above (w_gate_up interleaved, as the model holds it)."""
    x1 = x0 + rmsnorm(F.linear(attn_out, wo), g_post_attn, eps)
    return x1 + rmsnorm(swiglu_mlp_interleaved(x1, w_gate_up, w_down), g_post_ffn, eps)
