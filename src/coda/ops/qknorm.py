"""QK-norm's per-column operands and weight gradients in the fused QKV layout (docs/ALGEBRA.md
section 3a): q heads, then k heads (each pair-permuted for RoPE), then v heads."""

from __future__ import annotations

import torch


def _pairs(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A [head_dim] weight (HF order) as [head_dim / 2, 2] pairs (i, i + head_dim / 2): flattened,
    the pair-adjacent order of `rope_pair_permutation` (a view, no index tensor)."""
    return w.view(2, head_dim // 2).t()


def qknorm_columns(q_weight: torch.Tensor, k_weight: torch.Tensor, n_heads: int, n_kv_heads: int,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(qk_weight, qk_mask), each [(n_heads + 2 * n_kv_heads) * head_dim], for
    epilogues.rms_qknorm_rope / qknorm_rope_backward: the [head_dim] q and k norm weights (HF
    order; Gemma's (1 + w) already added) pair-permuted and repeated per head, fp32, with 1 on v's
    columns; the mask is True on q and k columns. Built from views in one concatenation: this
    runs on every forward and backward of a QK-norm layer, and each extra op is a launch."""
    head_dim = q_weight.shape[-1]
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,) or head_dim % 2:
        raise ValueError(f"qknorm_columns: q and k norm weights must be [head_dim] with head_dim even, "
                         f"got {list(q_weight.shape)} and {list(k_weight.shape)}")
    half = head_dim // 2
    ones = torch.ones((), dtype=torch.float32, device=q_weight.device).expand(n_kv_heads, half, 2)
    weight = torch.cat([_pairs(q_weight, head_dim).expand(n_heads, half, 2),
                        _pairs(k_weight, head_dim).expand(n_kv_heads, half, 2), ones]).view(-1)
    qk_cols = (n_heads + n_kv_heads) * head_dim
    mask = torch.arange(weight.shape[0], device=q_weight.device) < qk_cols
    return weight, mask


def qknorm_weight_grads(dw: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The q and k norm weights' gradients ([head_dim] each, HF order, fp32) from the backward
    epilogue's per-column `dw` ([(n_heads + 2 * n_kv_heads) * head_dim]): summed over heads, then
    un-permuted."""
    if dw.shape != ((n_heads + 2 * n_kv_heads) * head_dim,):
        raise ValueError(f"qknorm_weight_grads: dw must be [(n_heads + 2 * n_kv_heads) * head_dim], got {list(dw.shape)}")
    q_cols, half = n_heads * head_dim, head_dim // 2
    dwq = dw[:q_cols].view(n_heads, half, 2).sum(0)
    dwk = dw[q_cols:q_cols + n_kv_heads * head_dim].view(n_kv_heads, half, 2).sum(0)
    return dwq.t().reshape(head_dim), dwk.t().reshape(head_dim)
