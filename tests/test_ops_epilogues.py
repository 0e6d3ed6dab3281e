"""Each docs/ALGEBRA.md epilogue of coda.ops.epilogues against standard-layout PyTorch
(autograd where it is a gradient), in fp32 with accumulation-derived tolerances."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import coda
from coda.ops import epilogues as E
from conftest import DEVICE, EPS, scale

M, D, N = scale(19, 300), scale(24, 256), scale(40, 520)


def close(out: torch.Tensor, ref: torch.Tensor, k: int, what: str) -> None:
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    bound = 16 * math.sqrt(k) * EPS[torch.float32]
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound:.3g}"


def rn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE)


def test_residual_norm_stats() -> None:
    a, w, res, g = rn(M, D), rn(N, D), rn(M, N), rn(N)
    out = coda.gemm(a, w.T, E.residual_norm_stats, residual=res, norm_weight=g)
    x = a @ w.T + res
    close(out["x"], x, D, "x")
    close(out["h"], x * g, D, "h")
    close(out["sumsq"], (x * x).sum(-1), D, "sumsq")
    rstd = torch.rsqrt(out["sumsq"] / N + 1e-6)  # the finalize: rms_norm(x) = rstd * h
    close(rstd[:, None] * out["h"], F.rms_norm(x, (N,), g, 1e-6), D, "rms_norm")


def test_row_scale_and_rms_swiglu() -> None:
    h, wg, wu = rn(M, D), rn(N, D), rn(N, D)
    rstd = torch.rand(M, device=DEVICE) + 0.5
    close(coda.gemm(h, wg.T, E.row_scale, rstd=rstd), rstd[:, None] * (h @ wg.T), D, "row_scale")
    out = coda.gemm(h, coda.ops.interleave_gate_up(wg, wu).T, E.rms_swiglu, rstd=rstd)
    gate, up = rstd[:, None] * (h @ wg.T), rstd[:, None] * (h @ wu.T)
    close(out["y"], F.silu(gate) * up, D, "y")
    close(out["z"][:, 0::2], gate, D, "z gate")
    close(out["z"][:, 1::2], up, D, "z up")


def test_rms_geglu_scales_the_rows_before_the_gelu() -> None:
    """The block's GeGLU (Gemma 1): z = rstd * (h @ Wgu.T), y = gelu_tanh(gate) * up."""
    h, wg, wu = rn(M, D), rn(N, D), rn(N, D)
    rstd = torch.rand(M, device=DEVICE) + 0.5
    out = coda.gemm(h, coda.ops.interleave_gate_up(wg, wu).T, E.rms_geglu, rstd=rstd)
    gate, up = rstd[:, None] * (h @ wg.T), rstd[:, None] * (h @ wu.T)
    close(out["y"], F.gelu(gate, approximate="tanh") * up, D, "y")
    close(out["z"][:, 0::2], gate, D, "z gate")
    close(out["z"][:, 1::2], up, D, "z up")


def test_rms_rope_matches_half_split_rope() -> None:
    heads, hd = 3, 8
    h, wq = rn(M, D), rn(heads * hd, D)
    rstd, pos = torch.rand(M, device=DEVICE) + 0.5, torch.arange(M, device=DEVICE) * 5
    inv = 10000.0 ** (-torch.arange(0, hd, 2, device=DEVICE).float() / hd)
    out = coda.gemm(h, coda.ops.permute_rope_rows(wq, heads, hd).T, E.rms_rope, rstd=rstd, pos=pos,
                    freq=inv.repeat(heads))
    q = (rstd[:, None] * (h @ wq.T)).reshape(M, heads, hd)
    theta = pos[:, None].float() * inv[None, :]
    cos, sin = torch.cat([theta.cos()] * 2, -1)[:, None], torch.cat([theta.sin()] * 2, -1)[:, None]
    ref = q * cos + torch.cat([-q[..., hd // 2:], q[..., : hd // 2]], -1) * sin
    close(coda.ops.unpermute_rope_rows(out.T, heads, hd).T, ref.reshape(M, heads * hd), D, "rope")


def test_rope_bias_epilogues_add_the_bias_before_the_rotation() -> None:
    """rms_rope_bias / rope_bias: each adjacent column pair of acc * rstd + bias (Qwen2's q/k/v
    biases, in the projection's column order) rotated by pos * freq; freq 0 (v) leaves it as is."""
    h, w = rn(M, D), rn(N, D)
    rstd, pos = torch.rand(M, device=DEVICE) + 0.5, torch.arange(M, device=DEVICE) * 5
    bias, freq = rn(N), torch.rand(N // 2, device=DEVICE)
    freq[-3:] = 0.0

    def rotated(z: torch.Tensor) -> torch.Tensor:
        theta = pos[:, None].float() * freq[None, :]
        a, b = z[:, 0::2], z[:, 1::2]
        return torch.stack([a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()], -1).reshape(M, N)

    out = coda.gemm(h, w.T, E.rms_rope_bias, rstd=rstd, bias=bias, pos=pos, freq=freq)
    close(out, rotated(rstd[:, None] * (h @ w.T) + bias), D, "rms_rope_bias")
    out = coda.gemm(h, w.T, E.rope_bias, bias=bias, pos=pos, freq=freq)
    close(out, rotated(h @ w.T + bias), D, "rope_bias")


def test_lm_head_stats_and_cross_entropy_grad() -> None:
    x, w = rn(M, D), rn(N, D)
    target = torch.randint(0, N, (M,), device=DEVICE)
    stats = coda.gemm(x, w.T, E.lm_head_stats, target=target)
    logits = x @ w.T
    close(stats["lse"], torch.logsumexp(logits, -1), D, "lse")
    close(stats["target_logit"], logits.gather(1, target[:, None])[:, 0], D, "target logit")
    row_scale = torch.rand(M, device=DEVICE)
    dl = coda.gemm(x, w.T, E.cross_entropy_grad, lse=stats["lse"], target=target, scale=row_scale)
    lg = logits.clone().requires_grad_()
    (ref,) = torch.autograd.grad((F.cross_entropy(lg, target, reduction="none") * row_scale).sum(), lg)
    close(dl, ref, D, "dl")
    both = coda.gemm(x, w.T, E.cross_entropy_grad_zdz, lse=stats["lse"], target=target, scale=row_scale)
    close(both["dl"], ref, D, "dl (with zdz)")
    close(both["zdz"], (logits * ref).sum(-1), D, "zdz")


def test_rmsnorm_backward_epilogues() -> None:
    """dx, dg and the normalized input from gq = dz @ W, against autograd of F.rms_norm -> linear;
    the residual variant adds the incoming gradient in place."""
    x, g, w = rn(M, D).requires_grad_(), rn(D).requires_grad_(), rn(N, D)
    eps = 1e-6
    y = F.rms_norm(x, (D,), g, eps)
    z = y @ w.T
    dz = rn(M, N)
    dx_ref, dg_ref = torch.autograd.grad(z, (x, g), dz)
    rstd = torch.rsqrt(x.detach().pow(2).mean(-1) + eps)
    zdz = (z.detach() * dz).sum(-1)
    ops = dict(x=x.detach(), norm_weight=g.detach(), rstd=rstd, zdz_over_d=zdz / D)
    out = coda.gemm(dz, w, E.rmsnorm_backward, **ops)
    close(out["dx"], dx_ref, N, "dx")
    close(out["dg"], dg_ref, N * M, "dg")
    close(out["normed"], y.detach(), N, "normed")
    grad = rn(M, D)
    expected = grad + dx_ref
    res = coda.gemm(dz, w, E.rmsnorm_backward_residual, out={"dx": grad}, grad=grad, **ops)
    assert res["dx"] is grad
    close(grad, expected, N, "dx accumulated in place")


def _qknorm_block_torch(x, g, wq, wk, wv, qw, kw, pos, inv, heads, kv, hd, eps):
    """Standard layout: input RMSNorm, separate q/k/v, per-head RMSNorm of q and k, half-split RoPE."""
    m = x.shape[0]
    h = F.rms_norm(x, (x.shape[1],), g, eps)
    theta = pos[:, None].float() * inv[None, :]
    cos, sin = torch.cat([theta.cos()] * 2, -1)[:, None], torch.cat([theta.sin()] * 2, -1)[:, None]

    def norm_rope(t, n, w):
        t = F.rms_norm(t.reshape(m, n, hd), (hd,), w, eps)
        return (t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin).reshape(m, n * hd)

    return norm_rope(h @ wq.T, heads, qw), norm_rope(h @ wk.T, kv, kw), h @ wv.T


@pytest.mark.parametrize("hd", [16, 32])
def test_qknorm_rope_forward_and_backward_match_autograd(hd: int) -> None:
    """rms_qknorm_rope and qknorm_rope_backward (+ rmsnorm_backward for dx) against autograd of
    the standard-layout block front: q/k/v, every gradient (x, g, Wq, Wk, Wv, q/k norm weights)."""
    from coda.ops import permute_rope_rows, qknorm_columns, qknorm_weight_grads, unpermute_rope_rows

    heads, kv, eps, d = 2, 1, 1e-6, D
    leaves = [rn(M, d), 1 + 0.1 * rn(d), rn(heads * hd, d), rn(kv * hd, d), rn(kv * hd, d), 1 + 0.3 * rn(hd),
              1 + 0.3 * rn(hd)]
    x, g, wq, wk, wv, qw, kw = (t.requires_grad_() for t in leaves)
    pos = torch.arange(M, device=DEVICE) * 3
    inv = 10000.0 ** (-torch.arange(0, hd, 2, device=DEVICE).float() / hd)
    q, k, v = _qknorm_block_torch(x, g, wq, wk, wv, qw, kw, pos, inv, heads, kv, hd, eps)
    gq, gk, gv = rn(*q.shape), rn(*k.shape), rn(*v.shape)
    ((q * gq).sum() + (k * gk).sum() + (v * gv).sum()).backward()

    with torch.no_grad():
        rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
        hg = x * g  # what the producer stores (section 1); the QKV GEMM applies rstd
        w_qkv = torch.cat([permute_rope_rows(wq, heads, hd), permute_rope_rows(wk, kv, hd), wv])
        qk_weight, qk_mask = qknorm_columns(qw, kw, heads, kv)
        freq = torch.cat([inv.repeat(heads + kv), torch.zeros(kv * hd // 2, device=DEVICE)])
        ops = dict(rstd=rstd, qk_weight=qk_weight, qk_mask=qk_mask, eps=eps, pos=pos, freq=freq)
        qkv = coda.gemm(hg, w_qkv.T, E.rms_qknorm_rope(hd), **ops)
        nq = heads * hd
        close(unpermute_rope_rows(qkv[:, :nq].T, heads, hd).T, q, d, "q")
        close(unpermute_rope_rows(qkv[:, nq:nq + kv * hd].T, kv, hd).T, k, d, "k")
        close(qkv[:, nq + kv * hd:], v, d, "v")

        grad = torch.cat([permute_rope_rows(gq.T, heads, hd).T, permute_rope_rows(gk.T, kv, hd).T, gv], 1)
        back = coda.gemm(hg, w_qkv.T, E.qknorm_rope_backward(hd), grad=grad, **ops)
        dqw, dkw = qknorm_weight_grads(back["dw"], heads, kv, hd)
        close(dqw, qw.grad, d, "q norm weight grad")
        close(dkw, kw.grad, d, "k norm weight grad")
        n = w_qkv.shape[0]
        dx = coda.gemm(back["du"], w_qkv, E.rmsnorm_backward, x=x, norm_weight=g, rstd=rstd,
                       zdz_over_d=back["zdz"] / d)
        close(dx["dx"], x.grad, n, "dx")
        close(dx["dg"], g.grad, n, "input norm weight grad")
        dw_qkv = back["du"].T @ dx["normed"]
        close(unpermute_rope_rows(dw_qkv[:nq], heads, hd), wq.grad, M, "dWq")
        close(unpermute_rope_rows(dw_qkv[nq:nq + kv * hd], kv, hd), wk.grad, M, "dWk")
        close(dw_qkv[nq + kv * hd:], wv.grad, M, "dWv")
