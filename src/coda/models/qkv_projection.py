"""The QKV projection's epilogue and its backward for each attention variant a config describes,
decided here once for both segments that end in it (`first_segment`, `block_segment`):

* RoPE alone (Llama): `rms_rope` / `rope`; backward: the RoPE-backward row pass, whose `<z, dz>`
  is the input norm's row term (docs/ALGEBRA.md 3).
* q/k/v biases (Qwen2): `rms_rope_bias` / `rope_bias`; backward as RoPE's, plus the bias gradient
  and the row term's `<b, dz>` correction (docs/MODEL.md, "Q/K/V biases").
* QK-norm (Qwen3): a per-head RMSNorm of q and k before RoPE, `rms_qknorm_rope(hd)`; backward:
  `qknorm_rope_backward(hd)` on the recomputed QKV GEMM, which needs that GEMM's input `h`, not
  `qkv` (docs/ALGEBRA.md 3a).

* whole-width q/k norms (OLMo 2): `whole_qk_norm_qkv`, row passes after a plain GEMM (below).
* per-head q/k norms without an input norm (EXAONE 4): `qk_norm_qkv`, Qwen3's epilogue with a unit
  row scale, as an op of its own (below).

`rstd` is the input norm's row scale the GEMM applies (block segments), or None where the GEMM's
input is normalized already (the first segment's row pass applied it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import epilogues as E
from ..ops.layout import permute_rope_rows
from ..ops.qknorm import qknorm_columns, qknorm_weight_grads
from ..ops.custom import fused_op
from ..ops.rowwise import rms_backward, rms_prep, rope_backward
from ..ops.rowwise import rope_pairs as rope_pairs_rows
from ..runtime import gemm


def _check(b_qkv: list[torch.Tensor], qk_norm: list[torch.Tensor]) -> None:
    if b_qkv and qk_norm:  # no supported family has both (families.py refuses Qwen3's attention_bias)
        raise ValueError("QKV projection: q/k/v biases together with QK-norm are not computed")


def _qknorm_operands(h: torch.Tensor, rstd: torch.Tensor | None, qk_norm: list[torch.Tensor], n_heads: int,
                     n_kv_heads: int, eps: float, pos: torch.Tensor, freq: torch.Tensor) -> dict:
    qk_weight, qk_mask = qknorm_columns(qk_norm[0], qk_norm[1], n_heads, n_kv_heads)
    if rstd is None:  # the input is normalized already: a unit row scale
        rstd = torch.ones(h.shape[0], dtype=torch.float32, device=h.device)
    return dict(rstd=rstd, qk_weight=qk_weight, qk_mask=qk_mask, eps=eps, pos=pos, freq=freq)


def qkv_forward(h: torch.Tensor, rstd: torch.Tensor | None, pos: torch.Tensor, freq: torch.Tensor,
                w_qkv: torch.Tensor, b_qkv: list[torch.Tensor], qk_norm: list[torch.Tensor], n_heads: int,
                n_kv_heads: int, eps: float) -> torch.Tensor:
    """qkv = the projection of h by the fused, pair-permuted w_qkv, with the variant's epilogue.
    b_qkv: [] or [bias]; qk_norm: [] or [q_norm weight, k_norm weight] ([head_dim] each, HF order)."""
    _check(b_qkv, qk_norm)
    if qk_norm:
        head_dim = w_qkv.shape[0] // (n_heads + 2 * n_kv_heads)
        ops = _qknorm_operands(h, rstd, qk_norm, n_heads, n_kv_heads, eps, pos, freq)
        return gemm(h, w_qkv.T, E.rms_qknorm_rope(head_dim), **ops)
    scale = {} if rstd is None else {"rstd": rstd}
    if b_qkv:
        epi = E.rope_bias if rstd is None else E.rms_rope_bias
        return gemm(h, w_qkv.T, epi, **scale, bias=b_qkv[0], pos=pos, freq=freq)
    return gemm(h, w_qkv.T, E.rope if rstd is None else E.rms_rope, **scale, pos=pos, freq=freq)


def saved_for_backward(h: torch.Tensor, qkv: torch.Tensor, qk_norm: list[torch.Tensor]) -> torch.Tensor:
    """What `qkv_backward` reads: the GEMM's input h with QK-norm (its backward recomputes the
    GEMM), else the output qkv (RoPE backward's row term)."""
    return h if qk_norm else qkv


def qkv_backward(d_qkv: torch.Tensor, saved: torch.Tensor, rstd: torch.Tensor | None, pos: torch.Tensor,
                 freq: torch.Tensor, w_qkv: torch.Tensor, b_qkv: list[torch.Tensor], qk_norm: list[torch.Tensor],
                 n_heads: int, n_kv_heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(dz, zdz, grads): dz the gradient of z = h @ w_qkv.T * rstd (the input norm's output times
    w_qkv: the A operand of the RMSNorm-backward GEMM and of dW_qkv = dz.T @ normed), zdz = <z, dz>
    per row in fp32 (that GEMM's row term), and the gradients of b_qkv or of the two QK-norm
    weights (in their dtypes; [] for neither)."""
    _check(b_qkv, qk_norm)
    d_qkv = d_qkv.contiguous()
    if qk_norm:
        head_dim = w_qkv.shape[0] // (n_heads + 2 * n_kv_heads)
        ops = _qknorm_operands(saved, rstd, qk_norm, n_heads, n_kv_heads, eps, pos, freq)
        back = gemm(saved, w_qkv.T, E.qknorm_rope_backward(head_dim), grad=d_qkv, **ops)
        dwq, dwk = qknorm_weight_grads(back["dw"], n_heads, n_kv_heads, head_dim)
        return back["du"], back["zdz"], [dwq.to(qk_norm[0].dtype), dwk.to(qk_norm[1].dtype)]
    # With biases z = n W^T + b: the norm's row term <n, dn> = <z - b, dz> (the row pass subtracts
    # <b, dz>), and db = the column sums of dz, accumulated in fp32 from dz as it is.
    dz, zdz = rope_backward(d_qkv, saved, pos, freq, b_qkv[0] if b_qkv else None)
    grads = [dz.sum(0, dtype=torch.float32).to(b_qkv[0].dtype)] if b_qkv else []
    return dz, zdz, grads


def _qk_columns(g_q: torch.Tensor, g_k: torch.Tensor) -> tuple[slice, slice, slice]:
    """The q, k and v columns of the QKV output (q and k as wide as their norm weights)."""
    nq, nk = g_q.shape[0], g_k.shape[0]
    return slice(0, nq), slice(nq, nq + nk), slice(nq + nk, None)


def _whole_fwd(z: torch.Tensor, g_q: torch.Tensor, g_k: torch.Tensor, pos: torch.Tensor, freq_q: torch.Tensor,
               freq_k: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = _qk_columns(g_q, g_k)
    out, rstds = torch.empty_like(z), []
    for cols, g, freq in ((q, g_q, freq_q), (k, g_k, freq_k)):
        h, rstd = rms_prep(z[:, cols], g, eps)
        rope_pairs_rows(h, pos, freq, out=out[:, cols])
        rstds.append(rstd)
    out[:, v] = z[:, v]
    return out, rstds[0], rstds[1]


def _whole_fake(z, g_q, g_k, pos, freq_q, freq_k, eps):
    rows = z.new_empty(z.shape[0], dtype=torch.float32)
    return torch.empty_like(z), rows, torch.empty_like(rows)


def _whole_save(z, g_q, g_k, pos, freq_q, freq_k, eps, *, out):
    return z, g_q, g_k, pos, freq_q, freq_k, out[1], out[2]


def _whole_bwd(d_out: torch.Tensor, z: torch.Tensor, g_q: torch.Tensor, g_k: torch.Tensor, pos: torch.Tensor,
               freq_q: torch.Tensor, freq_k: torch.Tensor, rstd_q: torch.Tensor,
               rstd_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = _qk_columns(g_q, g_k)
    dz, dgs = torch.empty_like(z), []
    for cols, g, freq, rstd in ((q, g_q, freq_q, rstd_q), (k, g_k, freq_k, rstd_k)):
        dh = rope_pairs_rows(d_out[:, cols], pos, freq, inverse=True)
        dgs.append(rms_backward(dh, z[:, cols], g, rstd, out=dz[:, cols])[1].to(g.dtype))
    dz[:, v] = d_out[:, v]
    return dz, dgs[0], dgs[1]


def _whole_bwd_fake(d_out, z, g_q, g_k, pos, freq_q, freq_k, rstd_q, rstd_k):
    return torch.empty_like(z), torch.empty_like(g_q), torch.empty_like(g_k)


_whole_qk_norm_rope = fused_op("coda::whole_qk_norm_rope", forward=_whole_fwd, fake=_whole_fake, save=_whole_save,
                               backward=_whole_bwd, backward_fake=_whole_bwd_fake, grads=("z", "g_q", "g_k"))


def whole_qk_norm_qkv(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, w_qkv: torch.Tensor,
                      q_norm: torch.Tensor, k_norm: torch.Tensor, n_heads: int, n_kv_heads: int,
                      eps: float) -> torch.Tensor:
    """OLMo 2's qkv: q and k each RMS-normalized over its whole width (every head; [n_heads*hd] and
    [n_kv_heads*hd] weights in HF order), then RoPE. A norm over all heads needs whole rows of the
    GEMM output, which a tile does not hold, so this is the plain QKV GEMM (pair-permuted rows, as
    every variant's), then row passes in place of an epilogue, the honest cost of that norm: for q
    and for k an RMSNorm pass and a rotation pass (inv_freq [hd/2] repeated per head) written into
    its columns of the output, v copied (backward: the inverse rotation and the RMSNorm backward
    written into the GEMM output's gradient, dv copied). Writing each pass's columns in place spares
    the concatenations that slices of q, k and v need both ways (two non-vectorized [M, qkv] copies
    a layer: 32 launches, 4.4 ms of OLMo-2-1B's step on the H200 at 5f0d0df)."""
    hd = w_qkv.shape[0] // (n_heads + 2 * n_kv_heads)
    g_q = permute_rope_rows(q_norm[:, None], n_heads, hd)[:, 0]
    g_k = permute_rope_rows(k_norm[:, None], n_kv_heads, hd)[:, 0]
    freq = inv_freq.float()
    return _whole_qk_norm_rope(F.linear(x, w_qkv), g_q, g_k, pos, freq.repeat(n_heads), freq.repeat(n_kv_heads),
                               float(eps))


# -- per-head q/k norms without an input norm (EXAONE 4): x -> qkv, the QK-norm epilogue on x @ w_qkv.T --

def _qkn_fwd(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor, w_qkv: torch.Tensor, g_q: torch.Tensor,
             g_k: torch.Tensor, n_heads: int, n_kv_heads: int, eps: float) -> torch.Tensor:
    return qkv_forward(x, None, pos, freq, w_qkv, [], [g_q, g_k], n_heads, n_kv_heads, eps)


def _qkn_fake(x, pos, freq, w_qkv, g_q, g_k, n_heads, n_kv_heads, eps):
    return x.new_empty(x.shape[0], w_qkv.shape[0])


def _qkn_save(x, pos, freq, w_qkv, g_q, g_k, n_heads, n_kv_heads, eps, *, out):
    return x, pos, freq, w_qkv, g_q, g_k, n_heads, n_kv_heads, eps


def _qkn_bwd(d_qkv: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor, w_qkv: torch.Tensor,
             g_q: torch.Tensor, g_k: torch.Tensor, n_heads: int, n_kv_heads: int,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dz, _, (dg_q, dg_k) = qkv_backward(d_qkv, x, None, pos, freq, w_qkv, [], [g_q, g_k], n_heads, n_kv_heads, eps)
    return gemm(dz, w_qkv), gemm(dz.T, x), dg_q, dg_k


def _qkn_bwd_fake(d_qkv, x, pos, freq, w_qkv, g_q, g_k, n_heads, n_kv_heads, eps):
    return torch.empty_like(x), torch.empty_like(w_qkv), torch.empty_like(g_q), torch.empty_like(g_k)


_qk_norm_qkv = fused_op("coda::qk_norm_qkv", forward=_qkn_fwd, fake=_qkn_fake, save=_qkn_save, backward=_qkn_bwd,
                        backward_fake=_qkn_bwd_fake, grads=("x", "w_qkv", "g_q", "g_k"))


def qk_norm_qkv(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor, w_qkv: torch.Tensor, q_norm: torch.Tensor,
                k_norm: torch.Tensor, n_heads: int, n_kv_heads: int, eps: float) -> torch.Tensor:
    """EXAONE 4's qkv: x (no input norm) times the fused, pair-permuted w_qkv, each q and k head
    RMS-normalized (q_norm, k_norm: [head_dim] weights in HF order) and rotated in the GEMM's
    epilogue, Qwen3's `rms_qknorm_rope` with a unit row scale; `freq` the fused columns' RoPE table
    (llama_block.rope_freq_table). Backward: the QK-norm-backward epilogue on the recomputed GEMM,
    then dx and dW_qkv as two GEMMs. Differentiable in x, w_qkv, q_norm, k_norm."""
    return _qk_norm_qkv(x, pos, freq, w_qkv, q_norm, k_norm, n_heads, n_kv_heads, float(eps))
