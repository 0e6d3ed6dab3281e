"""The two ends of a model built from shifted-boundary blocks (docs/ALGEBRA.md 7):

* `first_segment`: from the embedding to layer 0's QKV projection. Nothing upstream can give the
  first norm its statistics, so one row pass (`rms_prep`) takes rstd and h = x * rstd * g, then the fused
  QKV GEMM applies RoPE (and the bias or the QK-norm: qkv_projection.py). Backward: RoPE backward (a
  row pass that also gives the norm's row term zdz; with QK-norm the recomputed QKV GEMM), the
  RMSNorm-backward GEMM, the weight GEMM.
* `last_segment`: from after the last attention to the final norm's output: the block's first three
  fused GEMMs with the final norm's weight in the third, then the row scale. The LM head and the
  loss follow in `coda.ops.linear_cross_entropy`. Backward: the final norm's backward (a row pass),
  then the block's gated-MLP- and RMSNorm-backward GEMMs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops import epilogues as E
from ..ops.custom import fused_op
from ..ops.rowwise import rms_backward, rms_prep, scale_rows
from ..runtime import gemm
from .llama_block import ffn_attn_backward, ffn_attn_forward, rope_freq_table
from .qkv_projection import qkv_backward, qkv_forward, saved_for_backward


def _freq(w_qkv: torch.Tensor, n_heads: int, n_kv_heads: int, rope_base: float, rope_scaling,
          rotary_dim: Optional[int]) -> torch.Tensor:
    head_dim = w_qkv.shape[0] // (n_heads + 2 * n_kv_heads)
    return rope_freq_table(head_dim, n_heads, n_kv_heads, rope_base, rope_scaling, w_qkv.device, rotary_dim)


# -- first: x -> qkv = rope(rms_norm(x, g) @ w_qkv.T) -------------------------------------------

def _first_fwd(x: torch.Tensor, pos: torch.Tensor, g_attn: torch.Tensor, w_qkv: torch.Tensor, b_qkv: list[torch.Tensor],
               qk_norm: list[torch.Tensor], n_heads: int, n_kv_heads: int, eps: float, rope_base: float,
               rope_scaling: Optional[list[float]],
               rotary_dim: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, rstd = rms_prep(x, g_attn, eps)  # h = F.rms_norm(x, g): rstd is applied already
    freq = _freq(w_qkv, n_heads, n_kv_heads, rope_base, rope_scaling, rotary_dim)
    return qkv_forward(h, None, pos, freq, w_qkv, b_qkv, qk_norm, n_heads, n_kv_heads, eps), rstd, h


def _first_fake(x, pos, g_attn, w_qkv, b_qkv, qk_norm, n_heads, n_kv_heads, eps, rope_base, rope_scaling,
                rotary_dim):
    return x.new_empty(x.shape[0], w_qkv.shape[0]), x.new_empty(x.shape[0], dtype=torch.float32), torch.empty_like(x)


def _first_save(x, pos, g_attn, w_qkv, b_qkv, qk_norm, n_heads, n_kv_heads, eps, rope_base, rope_scaling,
                rotary_dim, *, out):
    qkv, rstd, h = out
    return (x, pos, g_attn, w_qkv, b_qkv, qk_norm, rstd, saved_for_backward(h, qkv, qk_norm), n_heads, n_kv_heads,
            eps, rope_base, rope_scaling, rotary_dim)


def _first_bwd(d_qkv: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, g_attn: torch.Tensor, w_qkv: torch.Tensor,
               b_qkv: list[torch.Tensor], qk_norm: list[torch.Tensor], rstd: torch.Tensor, qkv_saved: torch.Tensor,
               n_heads: int, n_kv_heads: int, eps: float, rope_base: float,
               rope_scaling: Optional[list[float]], rotary_dim: Optional[int]) -> list[torch.Tensor]:
    freq = _freq(w_qkv, n_heads, n_kv_heads, rope_base, rope_scaling, rotary_dim)
    dz, zdz, d_attn_params = qkv_backward(d_qkv, qkv_saved, None, pos, freq, w_qkv, b_qkv, qk_norm, n_heads,
                                          n_kv_heads, eps)
    n = gemm(dz, w_qkv, E.rmsnorm_backward, x=x, norm_weight=g_attn, rstd=rstd, zdz_over_d=zdz / x.shape[-1])
    return [n["dx"], n["dg"].to(g_attn.dtype), gemm(dz.T, n["normed"]), *d_attn_params]


def _first_bwd_fake(d_qkv, x, pos, g_attn, w_qkv, b_qkv, qk_norm, rstd, qkv_saved, n_heads, n_kv_heads, eps,
                    rope_base, rope_scaling, rotary_dim):
    return [torch.empty_like(t) for t in (x, g_attn, w_qkv, *b_qkv, *qk_norm)]


_first = fused_op("coda::first_segment", forward=_first_fwd, fake=_first_fake, save=_first_save, backward=_first_bwd,
                  backward_fake=_first_bwd_fake, grads=("x", "g_attn", "w_qkv", "b_qkv", "qk_norm"))


def first_segment(x: torch.Tensor, pos: torch.Tensor, g_attn: torch.Tensor, w_qkv: torch.Tensor, *, n_heads: int,
                  n_kv_heads: int, eps: float, rope_base: float, rope_scaling: list[float] | None = None,
                  rotary_dim: int | None = None, b_qkv: torch.Tensor | None = None,
                  qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """qkv = rope(rms_norm(x, g_attn) @ w_qkv.T + b_qkv) for the fused, pair-permuted w_qkv (and
    b_qkv, permuted alike) of NativeBlockWeights; with qk_norm (the q and k norm weights, [head_dim]
    each in HF order) each q and k head is RMS-normalized (eps) before RoPE. x: [M, D], pos: [M]
    integer positions; `rotary_dim`: partial rotary (llama_block.inv_freq). Differentiable in x, g_attn,
    w_qkv, b_qkv, qk_norm."""
    return _first(x, pos, g_attn, w_qkv, [] if b_qkv is None else [b_qkv], [] if qk_norm is None else list(qk_norm),
                  n_heads, n_kv_heads, float(eps), float(rope_base),
                  None if rope_scaling is None else [float(v) for v in rope_scaling],
                  None if rotary_dim is None else int(rotary_dim))


# -- last: (attn_out, x0) -> rms_norm(x2, g_final) ----------------------------------------------

_SIX = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _last_fwd(attn_out: torch.Tensor, x0: torch.Tensor, wo: torch.Tensor, g_ffn: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, g_final: torch.Tensor, eps: float, activation: str) -> _SIX:
    x2, h2, rstd2, x1, rstd1, z1 = ffn_attn_forward(attn_out, x0, wo, g_ffn, w_gate_up, w_down, g_final, eps,
                                                    activation)
    normed = scale_rows(h2, rstd2)
    return normed, x2, rstd2, x1, rstd1, z1


def _last_fake(attn_out, x0, wo, g_ffn, w_gate_up, w_down, g_final, eps, activation):
    m, d = x0.shape
    rows = x0.new_empty(m, dtype=torch.float32)
    like = attn_out
    return (like.new_empty(m, d), like.new_empty(m, d), rows, like.new_empty(m, d), torch.empty_like(rows),
            like.new_empty(m, w_gate_up.shape[0]))


def _last_save(attn_out, x0, wo, g_ffn, w_gate_up, w_down, g_final, eps, activation, *, out):
    _, x2, rstd2, x1, rstd1, z1 = out
    return attn_out, x1, rstd1, z1, x2, rstd2, wo, g_ffn, w_gate_up, w_down, g_final, activation


def _last_bwd(d_normed: torch.Tensor, attn_out: torch.Tensor, x1: torch.Tensor, rstd1: torch.Tensor, z1: torch.Tensor,
              x2: torch.Tensor, rstd2: torch.Tensor, wo: torch.Tensor, g_ffn: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, g_final: torch.Tensor, activation: str) -> list[torch.Tensor]:
    # The final RMSNorm's backward: one row pass (dx2 = r*g*dy - r^2 * x2 * sum(normed * dy) / D, fp32).
    dx2, dg_final = rms_backward(d_normed, x2, g_final, rstd2)
    d_attn, d_x0, d_wo, dg_ffn, d_wgu, d_wdown = ffn_attn_backward(dx2, attn_out, x1, rstd1, z1, wo, g_ffn, w_gate_up,
                                                                   w_down, activation)
    return [d_attn, d_x0, d_wo, dg_ffn, d_wgu, d_wdown, dg_final.to(g_final.dtype)]


def _last_bwd_fake(d_normed, attn_out, x1, rstd1, z1, x2, rstd2, wo, g_ffn, w_gate_up, w_down, g_final, activation):
    return [torch.empty_like(t) for t in (attn_out, x2, wo, g_ffn, w_gate_up, w_down, g_final)]


_last = fused_op("coda::last_segment", forward=_last_fwd, fake=_last_fake, save=_last_save, backward=_last_bwd,
                 backward_fake=_last_bwd_fake, grads=("attn_out", "x0", "wo", "g_ffn", "w_gate_up", "w_down", "g_final"))


def last_segment(attn_out: torch.Tensor, x0: torch.Tensor, wo: torch.Tensor, g_ffn: torch.Tensor,
                 w_gate_up: torch.Tensor, w_down: torch.Tensor, g_final: torch.Tensor, eps: float,
                 activation: str = "silu") -> torch.Tensor:
    """rms_norm(x2, g_final) for x1 = x0 + attn_out @ wo.T, x2 = x1 + mlp(rms_norm(x1, g_ffn)), with
    w_gate_up interleaved (NativeBlockWeights) and the MLP's gate `activation` (an ops.epilogues.GATED
    name: "silu" SwiGLU, "gelu_tanh" GeGLU). Differentiable in every tensor."""
    E.gated(activation)  # a ValueError naming the activations there are
    return _last(attn_out, x0, wo, g_ffn, w_gate_up, w_down, g_final, float(eps), activation)
