"""rope(q, k, cos, sin): transformers' apply_rotary_pos_emb as one row pass per tensor, forward and
backward, for `coda.patch` (HF computes it as about five elementwise kernels per tensor each way:
two products, rotate_half's slice, negation and concatenation, a sum). coda's own model rotates
inside its QKV GEMM's epilogue instead.

The rotation is computed in fp32 and rounded once (HF rounds each product and the sum in the
activations' dtype). cos and sin get no gradient: HF's rotary embedding computes them from
positions and a buffer.
"""

from __future__ import annotations

import torch

from .custom import fused_op
from .rowwise import rope_halves


def _fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor]:
    return (rope_halves(x, cos, sin),)


def _fwd_fake(x, cos, sin):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),)


def _save(x, cos, sin, *, out):
    return cos, sin


def _bwd(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor]:
    return (rope_halves(dy, cos, sin, backward=True),)


def _bwd_fake(dy, cos, sin):
    return (torch.empty(dy.shape, dtype=dy.dtype, device=dy.device),)


_op = fused_op("coda::rope_halves", forward=_fwd, fake=_fwd_fake, save=_save, backward=_bwd,
               backward_fake=_bwd_fake, grads=("x",))


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
