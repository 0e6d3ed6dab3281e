"""QK-norm's per-column operands and weight gradients in the fused QKV layout (docs/ALGEBRA.md
section 3a): q heads, then k heads (each pair-permuted for RoPE), then v heads."""

from __future__ import annotations

import torch

from .layout import rope_pair_permutation


def qknorm_columns(q_weight: torch.Tensor, k_weight: torch.Tensor, n_heads: int, n_kv_heads: int,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(qk_weight, qk_mask), each [(n_heads + 2 * n_kv_heads) * head_dim], for
    epilogues.rms_qknorm_rope / qknorm_rope_backward: the [head_dim] q and k norm weights (HF
    order; Gemma's (1 + w) already added) pair-permuted and repeated per head, fp32, with 1 on v's
    columns; the mask is True on q and k columns."""
    head_dim = q_weight.shape[-1]
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,) or head_dim % 2:
        raise ValueError(f"qknorm_columns: q and k norm weights must be [head_dim] with head_dim even, "
                         f"got {list(q_weight.shape)} and {list(k_weight.shape)}")
    perm = rope_pair_permutation(1, head_dim, q_weight.device)
    v_cols = n_kv_heads * head_dim
    weight = torch.cat([q_weight.float()[perm].repeat(n_heads), k_weight.float()[perm].repeat(n_kv_heads),
                        torch.ones(v_cols, device=q_weight.device)])
    mask = torch.ones(weight.shape[0], dtype=torch.bool, device=q_weight.device)
    mask[weight.shape[0] - v_cols:] = False
    return weight, mask


def qknorm_weight_grads(dw: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The q and k norm weights' gradients ([head_dim] each, HF order, fp32) from the backward
    epilogue's per-column `dw` ([(n_heads + 2 * n_kv_heads) * head_dim]): summed over heads, then
    un-permuted."""
    if dw.shape != ((n_heads + 2 * n_kv_heads) * head_dim,):
        raise ValueError(f"qknorm_weight_grads: dw must be [(n_heads + 2 * n_kv_heads) * head_dim], got {list(dw.shape)}")
    perm = rope_pair_permutation(1, head_dim, dw.device)
    q_cols = n_heads * head_dim
    dwq = torch.empty(head_dim, dtype=dw.dtype, device=dw.device)
    dwk = torch.empty_like(dwq)
    dwq[perm] = dw[:q_cols].view(n_heads, head_dim).sum(0)
    dwk[perm] = dw[q_cols:q_cols + n_kv_heads * head_dim].view(n_kv_heads, head_dim).sum(0)
    return dwq, dwk
