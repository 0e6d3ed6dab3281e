"""The attention between a layer's GEMM segments: transformers' causal-LM attention under one
layer's mask (masks.py), computed by the fastest torch kernel that computes exactly it.

* No mask (causal, one document a row, no window reaching): SDPA's `is_causal` path.
* Packed documents and sliding windows, bf16/fp16 on a GPU: flash attention over variable-length
  sequences (`torch.nn.attention.varlen`), each document (or each row) its own sequence and the
  window as flash's left window. No [S, S] mask is built, and the kernel skips the blocks that
  lie outside a document or a window, so the work is the documents' and the windows' own; SDPA
  with a boolean mask computes every block (bench/tools/attention.py measures both).
  Left or right padding too (each row's unpadded tokens one run): the padded queries after the run
  attend all of its keys in a second, smaller call (masks.py).
* Padding of any other shape or under compilation, fp32, the CPU, or a torch whose varlen
  attention has no window: SDPA with the materialized boolean mask.
* Capped scores (Gemma 2): eager attention on materialized scores, as transformers computes them
  (no SDPA kernel applies a function to the scores).

A query that sees no key (left padding) outputs zeros, as under transformers' SDPA, flash and flex
attention; for a model that transformers runs with eager attention (`LlamaConfig.keyless_queries`
"mean") it outputs the mean of every value in its row, as there: eager adds the dtype's lowest value
to every score of such a row, so its softmax is uniform over all S keys, and its backward is that
softmax's (`_KeylessMean`, exact and without the [S, S] scores).

q: [T, H, hd] and k, v: [T, KV, hd], T = B * S tokens in row order; the output is [T, H * hd].
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
import torch.nn.functional as F

from .masks import AttentionMask


@functools.cache
def _varlen() -> Callable | None:
    """torch's variable-length flash attention where it takes a window (torch >= 2.11), else None.
    Flash serves grouped kv heads natively; torch >= 2.12 asks for `enable_gqa` to allow them."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params:
        return None
    return functools.partial(varlen_attn, enable_gqa=True) if "enable_gqa" in params else varlen_attn


def varlen_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether masks for these activations should be sequence starts for flash's variable-length
    kernel (bf16/fp16 on a CUDA GPU, head_dim at most 256 and a multiple of 8) rather than [S, S]
    boolean masks (masks.build decides which masks can take that form)."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_dim <= 256
            and head_dim % 8 == 0 and _varlen() is not None)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, seq: int,
           mask: AttentionMask | None, scale: float, softcap: float | None = None,
           keyless: str = "zeros") -> torch.Tensor:
    """The attention output [T, H * hd] of one layer (the module docstring says which kernel, and
    what `keyless`, "zeros" or "mean", makes of a query that sees no key)."""
    tokens, h, hd = q.shape
    kv = k.shape[1]
    if mask is not None and mask.starts is not None:
        out = _sequences(q, k, v, mask, scale)
    else:
        bq, bk, bv = (t.view(batch, seq, -1, hd).transpose(1, 2) for t in (q, k, v))
        if softcap is not None:
            out = softcapped_attention(bq, bk, bv, mask, scale, softcap)
        elif mask is None:
            out = F.scaled_dot_product_attention(bq, bk, bv, is_causal=True, scale=scale, enable_gqa=h != kv)
        else:
            out = F.scaled_dot_product_attention(bq, bk, bv, attn_mask=mask.allowed, scale=scale,
                                                 enable_gqa=h != kv)
        out = out.transpose(1, 2)
    out = out.reshape(tokens, h * hd)
    if mask is not None and mask.live is not None and softcap is None:
        # Zeroed token-major: the kernel's backward then receives the output gradient in its output's
        # layout. Zeroing the [B, H, S, hd] view hands SDPA a contiguous one instead, on which torch
        # 2.11's cuDNN backward returned wrong q/k/v gradients (after a same-shaped call; H200).
        keyless_rows = ~mask.live.reshape(tokens)
        out = out.masked_fill(keyless_rows[:, None], 0.0)
        if keyless == "mean":
            out = out + _KeylessMean.apply(q, k, v, keyless_rows, batch, seq, scale).reshape(tokens, h * hd)
    return out


def _wide(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


class _KeylessMean(torch.autograd.Function):
    """What transformers' eager attention gives a query that sees no key: every score of its row
    plus the dtype's lowest value rounds to that value, so the softmax is uniform, p = 1/S over the
    row's S keys, and the output is the row's mean value v̄ (per kv head). Its backward is the
    softmax's at that point, dS_j = (1/S) dO . (v_j - v̄) (module docstring), which reaches q and k
    through S = scale q k^T; per row and kv head, with C = (1/S) sum_j (v_j - v̄) k_j^T:
    dq = scale dO C, dk_j = (scale / S) (v_j - v̄) sum_i dO_i q_i^T, dv_j = (1/S) sum_i dO_i.
    q [T, H, hd], k and v [T, KV, hd], `rows` [T] the keyless queries; the output [T, H, hd] is
    zero elsewhere. fp32 inside (or the inputs' wider dtype), as eager's softmax."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, batch: int,
                seq: int, scale: float) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, rows)
        ctx.batch, ctx.seq, ctx.scale = batch, seq, scale
        h, kv, hd = q.shape[1], k.shape[1], v.shape[2]
        mean = v.view(batch, seq, kv, 1, hd).to(_wide(v)).mean(1, keepdim=True)  # [B, 1, KV, 1, hd]
        out = mean.expand(batch, seq, kv, h // kv, hd).reshape(batch * seq, h, hd)
        return out.masked_fill(~rows[:, None, None], 0.0).to(q.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, rows = ctx.saved_tensors
        batch, seq, scale = ctx.batch, ctx.seq, ctx.scale
        h, kv, hd = q.shape[1], k.shape[1], v.shape[2]
        shape = (batch, seq, kv, h // kv, hd)
        wide = _wide(q)
        g = grad.to(wide).masked_fill(~rows[:, None, None], 0.0).view(shape)
        vb, kb = v.to(wide).view(batch, seq, kv, hd), k.to(wide).view(batch, seq, kv, hd)
        centred = vb - vb.mean(1, keepdim=True)
        c = torch.einsum("bsgv,bsgk->bgvk", centred, kb) / seq
        dq = scale * torch.einsum("bsgrv,bgvk->bsgrk", g, c)
        e = torch.einsum("bsgrv,bsgrk->bgvk", g, q.to(wide).view(shape))
        dk = (scale / seq) * torch.einsum("bsgv,bgvk->bsgk", centred, e)
        dv = (g.sum((1, 3), keepdim=True) / seq).expand(batch, seq, kv, 1, hd)
        return (dq.reshape(q.shape).to(q.dtype), dk.reshape(k.shape).to(k.dtype),
                dv.reshape(v.shape).to(v.dtype), None, None, None, None)


def _sequences(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
               scale: float) -> torch.Tensor:
    """Flash over the mask's sequences (causal, within the window), then the right-padded queries'
    full attention over their rows' unpadded keys written over their rows (masks.py). [T, H, hd]."""
    window = (-1, 0) if mask.window is None else (mask.window - 1, 0)  # HF's window counts the query
    out = _varlen()(q, k, v, mask.starts, mask.starts, mask.longest, mask.longest, scale=scale,
                    window_size=window)
    tail = mask.tail
    if tail is not None:
        keys, values = k.index_select(0, tail.keys), v.index_select(0, tail.keys)
        rest = _varlen()(q.index_select(0, tail.queries), keys, values, tail.cu_q, tail.cu_k, tail.max_q,
                         tail.max_k, scale=scale, window_size=(-1, -1))
        out = out.index_copy(0, tail.queries, rest)
    return out


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None,
                         scale: float, cap: float) -> torch.Tensor:
    """Attention whose scores are capped, c * tanh(s / c), before the mask and the softmax (Gemma 2).
    This materializes the scores ([B, H, S, S]) as transformers' eager attention does (Gemma 2's
    only one): the mask added as 0 or the dtype's lowest value, the softmax in fp32. So a query
    with no key (left padding) averages every value, and gradients flow as there.
    q: [B, H, S, hd]; k, v: [B, KV, S, hd]."""
    seq = q.shape[2]
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves H / KV q heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * scale / cap) * cap
    idx = torch.arange(seq, device=q.device)
    allowed = (idx[None, :] <= idx[:, None]) if mask is None else mask.allowed
    if mask is not None and mask.live is not None:  # masks.py lets a query with no key see itself: undo
        allowed = allowed & mask.live
    scores = scores + torch.zeros((), dtype=scores.dtype, device=q.device).masked_fill(
        ~allowed, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
