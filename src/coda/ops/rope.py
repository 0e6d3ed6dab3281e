"""RoPE as row passes, forward and backward, where no GEMM epilogue can rotate:

* rope(q, k, cos, sin): transformers' apply_rotary_pos_emb as one row pass per tensor, for
  `coda.patch` (HF computes it as about five elementwise kernels per tensor each way: two
  products, rotate_half's slice, negation and concatenation, a sum).
* rope_pairs(x, pos, freq): the rotation of adjacent column pairs, the layout of coda's own QKV
  rows (ops.layout.permute_rope_rows), with the angles from positions, for q and k rotated outside
  a GEMM. coda's model rotates inside its QKV GEMM's epilogue, and OLMo 2's q and k (after their
  whole-width norms, which need whole rows) in its own op (models.qkv_projection), on the same row
  pass.

The rotation is computed in fp32 and rounded once (HF rounds each product and the sum in the
activations' dtype). cos and sin get no gradient: HF's rotary embedding computes them from
positions and a buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .custom import FusedOp, fused_op
from .rowwise import rope_halves, rope_pairs as rope_pairs_rows


def _rotation_op(name: str, rotate: Callable[..., torch.Tensor]) -> FusedOp:
    """x rotated by `rotate(x, u, v)`, the angles given by u and v (no gradient); backward rotates
    the output's gradient back (`inverse=True`: a rotation's transpose is its inverse)."""

    def forward(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
        return (rotate(x, u, v),)

    def fake(x, u, v):
        return (torch.empty(x.shape, dtype=x.dtype, device=x.device),)

    def save(x, u, v, *, out):
        return u, v

    def backward(dy: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
        return (rotate(dy, u, v, inverse=True),)

    return fused_op(name, forward=forward, fake=fake, save=save, backward=backward, backward_fake=fake, grads=("x",))


_op = _rotation_op("coda::rope_halves", rope_halves)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated as transformers' apply_rotary_pos_emb(q, k, cos, sin) rotates them: q [B, H, S, D],
    k [B, KV, S, D], cos and sin [B or 1, S, R] (R even, at most D: columns from R on pass through,
    as Phi-3's partial rotary). The outputs have the inputs' dtype and layout ([B, heads, S, D])."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(f"rope: q {list(q.shape)}, k {list(k.shape)}, cos {list(cos.shape)} and sin "
                         f"{list(sin.shape)} must be [B, H, S, D], [B, KV, S, D], [B, S, R] and [B, S, R]")
    batch, _, seq, _ = q.shape
    rows = [t.expand(batch, seq, t.shape[-1]).reshape(batch * seq, t.shape[-1]) for t in (cos, sin)]

    def one(x: torch.Tensor) -> torch.Tensor:
        tokens = x.transpose(1, 2).reshape(batch * seq, x.shape[1], x.shape[3])  # a view for HF's layout
        return _op(tokens, *rows).view(batch, seq, x.shape[1], x.shape[3]).transpose(1, 2)

    return one(q), one(k)


_pairs_op = _rotation_op("coda::rope_pairs", rope_pairs_rows)


def rope_pairs(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """x [T, 2P] with each adjacent column pair (2i, 2i+1) rotated by pos[t] * freq[i], in fp32 and
    rounded once (pos [T], freq [P] fp32; neither gets a gradient). Heads side by side take freq
    repeated per head. Returns a contiguous [T, 2P] of x's dtype."""
    return _pairs_op(x, pos, freq)
