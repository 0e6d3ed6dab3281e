"""Weight-layout helpers: the free permutations that turn SwiGLU and RoPE into pair
transforms (docs/ALGEBRA.md sections 2-3), each with its exact inverse."""

from __future__ import annotations

import torch


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """[F, D] gate and up weights -> [2F, D] with rows g0, u0, g1, u1, ... (for coda.pairs)."""
    if w_gate.shape != w_up.shape or w_gate.dim() != 2:
        raise ValueError(f"interleave_gate_up: gate {list(w_gate.shape)} and up {list(w_up.shape)} must be equal 2-D shapes")
    return torch.stack([w_gate, w_up], dim=1).reshape(2 * w_gate.shape[0], w_gate.shape[1])


def split_gate_up(w_gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of interleave_gate_up (also splits a gradient in that layout)."""
    if w_gu.dim() != 2 or w_gu.shape[0] % 2:
        raise ValueError(f"split_gate_up: expected [2F, D], got {list(w_gu.shape)}")
    pairs = w_gu.reshape(w_gu.shape[0] // 2, 2, w_gu.shape[1])
    return pairs[:, 0], pairs[:, 1]


def gate_up_rows(gate_up: list[torch.Tensor]) -> torch.Tensor:
    """A gated MLP op's gate/up argument as one interleaved [2F, D] weight: [w_gate_up] as it is, or
    [w_gate, w_up] interleaved (a copy, made again in backward rather than held per layer)."""
    return gate_up[0] if len(gate_up) == 1 else interleave_gate_up(*gate_up)


def gate_up_grads(dw_gate_up: torch.Tensor, gate_up: list[torch.Tensor]) -> list[torch.Tensor]:
    """The interleaved weight gradient in the form `gate_up` came in (gate_up_rows' inverse)."""
    return [dw_gate_up] if len(gate_up) == 1 else [w.contiguous() for w in split_gate_up(dw_gate_up)]


def rope_pair_permutation(n_heads: int, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Row order that puts each half-split RoPE pair (i, i + head_dim/2) of every head in
    adjacent rows: new row 2i (+ head offset) is old row i, new row 2i+1 is old row i + head_dim/2."""
    if head_dim % 2:
        raise ValueError(f"rope_pair_permutation: head_dim must be even, got {head_dim}")
    per_head = rope_row_order(head_dim, device=device)
    return (torch.arange(n_heads, device=device)[:, None] * head_dim + per_head).reshape(-1)


def rope_row_order(head_dim: int, rotary_dim: int | None = None, interleaved: bool = False,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """For each row of one head in coda's order, the row of the given order it holds. coda's RoPE
    rotates adjacent rows (2i, 2i + 1); the first `rotary_dim` rows (None: all) of the given order
    rotate as pairs (i, i + rotary_dim/2) (halves, Llama's), or (2i, 2i + 1) (`interleaved`, GLM's:
    already adjacent); the rows past rotary_dim (partial rotary) keep their places."""
    r = head_dim if rotary_dim is None else rotary_dim
    if r % 2 or not 0 < r <= head_dim:
        raise ValueError(f"rope_row_order: rotary_dim must be even, in (0, head_dim={head_dim}], got {r}")
    half = torch.arange(r // 2, device=device)
    pairs = torch.arange(r, device=device) if interleaved else torch.stack([half, half + r // 2], dim=1).reshape(r)
    return torch.cat([pairs, torch.arange(r, head_dim, device=device)])


def reorder_head_rows(w: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The rows (or entries of a bias) of every head of w [n_heads * head_dim, ...] in `order`
    (rope_row_order's, or its inverse: torch.argsort(order)), as a new tensor."""
    head_dim = order.numel()
    if w.shape[0] % head_dim:
        raise ValueError(f"reorder_head_rows: {w.shape[0]} rows are not whole heads of {head_dim}")
    heads = w.reshape(w.shape[0] // head_dim, head_dim, -1)
    return heads[:, order.to(w.device)].reshape(w.shape)


def permute_rope_rows(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """q or k projection weight [n_heads*head_dim, D] in the pair-adjacent row order
    (rope_pair_permutation, as one transposing copy: no index tensors to build per call)."""
    _check_rows(w, n_heads, head_dim)
    return w.reshape(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of permute_rope_rows (rows, or the columns of a [.., n_heads*head_dim] output via .T)."""
    _check_rows(w, n_heads, head_dim)
    return w.reshape(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _check_rows(w: torch.Tensor, n_heads: int, head_dim: int) -> None:
    if head_dim % 2 or w.dim() != 2 or w.shape[0] != n_heads * head_dim:
        raise ValueError(f"RoPE row permutation: expected [n_heads*head_dim, D] = [{n_heads}*{head_dim}, D] "
                         f"with an even head_dim, got {list(w.shape)}")
