"""coda.ops against plain PyTorch in the standard layout: forward, every gradient,
leading batch dims, ragged shapes, fp32 (tight) and bf16 (dtype-derived), torch.compile.

Composite ops are compared by relative Frobenius error: in fp32 a few ulps of
accumulation (K * eps32); in bf16 one rounding (at most 2^-9 relative) per stored
intermediate on each side, since coda and PyTorch round at different points: up to three
per side here (e.g. SwiGLU: coda stores z, y, out; PyTorch gate/up, the product, out),
so 6 * 2^-9 = ROUNDINGS * EPS[bf16].
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch
import torch.nn.functional as F

import coda
from coda.ops import epilogues as E
from coda.ops.layout import interleave_gate_up
from coda.ops.swiglu_mlp import swiglu_mlp_interleaved
from conftest import DEVICE, EPS, GPU, scale

ROUNDINGS = 3


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def limit(dtype: torch.dtype, k: int) -> float:
    """Relative-error bound: fp32 accumulation over K (with headroom) or bf16/fp16 roundings."""
    if dtype == torch.float32:
        return 16 * math.sqrt(k) * EPS[torch.float32]
    return ROUNDINGS * EPS[dtype]


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, k: int, what: str) -> None:
    err = rel(out, ref)
    assert err <= limit(dtype, k), f"{what}: relative error {err:.3g} > {limit(dtype, k):.3g}"


def leaf(*shape: int, dtype: torch.dtype, s: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * s).to(dtype).requires_grad_()


def grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], dout: torch.Tensor | None = None,
          retain_graph: bool | None = None) -> tuple:
    return torch.autograd.grad(out, inputs, dout, retain_graph=retain_graph)


DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [((2, 9), 24, 40), ((19,), 32, 22)]  # (leading dims, D, N): ragged M and N


# -- layout helpers --------------------------------------------------------------------------

def test_gate_up_interleave_round_trip() -> None:
    g, u = torch.randn(6, 5), torch.randn(6, 5)
    w = coda.ops.interleave_gate_up(g, u)
    assert torch.equal(w[0::2], g) and torch.equal(w[1::2], u)
    g2, u2 = coda.ops.split_gate_up(w)
    assert torch.equal(g2, g) and torch.equal(u2, u)


def test_rope_permutation_is_a_pair_adjacent_inverse() -> None:
    w = torch.randn(3 * 8, 4)
    p = coda.ops.permute_rope_rows(w, 3, 8)
    assert torch.equal(p[0], w[0]) and torch.equal(p[1], w[4]) and torch.equal(p[9], w[8 + 4])
    assert torch.equal(coda.ops.unpermute_rope_rows(p, 3, 8), w)
    perm = coda.ops.rope_pair_permutation(3, 8)
    assert sorted(perm.tolist()) == list(range(24))
    assert torch.equal(p, w[perm])  # the transposing copy is the documented permutation


@pytest.mark.parametrize("head_dim,rotary_dim,interleaved", [(8, None, False), (8, 6, False), (16, 12, True),
                                                         (8, 4, True), (8, 8, True)])
def test_rope_row_order_rotates_pairs_as_transformers_does(head_dim: int, rotary_dim: int | None,
                                                           interleaved: bool) -> None:
    """coda's RoPE rotates adjacent rows (2i, 2i + 1) with inv_freq's frequencies (0 past rotary_dim):
    on rows in rope_row_order's order it gives transformers' rotation of the first rotary_dim dims,
    pairs (i, i + r/2) (Llama's, Phi-3's partial) or (2i, 2i + 1) (GLM's), the other dims passing."""
    from coda.models.llama_block import inv_freq
    from coda.ops.layout import reorder_head_rows, rope_row_order

    x, r = torch.randn(3 * head_dim, dtype=torch.float64), rotary_dim or head_dim
    angle = 7 * (100.0 ** (-torch.arange(0, r, 2, dtype=torch.float64) / r))  # position 7, base 100
    heads = x.view(3, head_dim)
    rot, rest = heads[:, :r], heads[:, r:]
    if interleaved:
        a, b = rot[:, 0::2], rot[:, 1::2]
        turned = torch.stack([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1).flatten(1)
    else:
        a, b = rot[:, :r // 2], rot[:, r // 2:]
        turned = torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)
    expected = torch.cat([turned, rest], -1).reshape(-1)

    order = rope_row_order(head_dim, rotary_dim, interleaved)
    assert sorted(order.tolist()) == list(range(head_dim))
    pairs = reorder_head_rows(x, order).view(3, head_dim // 2, 2)
    theta = 7 * inv_freq(head_dim, 100.0, None, rotary_dim=rotary_dim).double()
    assert torch.equal(theta[r // 2:], torch.zeros(head_dim // 2 - r // 2, dtype=torch.float64))
    c, s = theta.cos(), theta.sin()
    ours = torch.stack([pairs[..., 0] * c - pairs[..., 1] * s, pairs[..., 1] * c + pairs[..., 0] * s], -1)
    back = reorder_head_rows(ours.reshape(-1), torch.argsort(order))
    assert (back - expected).abs().max() < 1e-6  # inv_freq's fp32 frequencies
    if rotary_dim is None and not interleaved:
        assert torch.equal(order, coda.ops.rope_pair_permutation(1, head_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qknorm_columns_and_weight_grads_follow_the_pair_permutation(dtype: torch.dtype) -> None:
    """The QK-norm epilogue's column operands (views and one concatenation) and the weight
    gradients back from its columns, exactly as the documented permutation gives them."""
    heads, kv, hd = 3, 2, 8
    q, k = torch.randn(hd, dtype=dtype), torch.randn(hd, dtype=dtype)
    perm = coda.ops.rope_pair_permutation(1, hd)
    weight, mask = coda.ops.qknorm_columns(q, k, heads, kv)
    assert weight.dtype == torch.float32 and weight.is_contiguous()
    assert torch.equal(weight, torch.cat([q.float()[perm].repeat(heads), k.float()[perm].repeat(kv), torch.ones(kv * hd)]))
    assert torch.equal(mask, torch.arange((heads + 2 * kv) * hd) < (heads + kv) * hd)
    dw = torch.randn((heads + 2 * kv) * hd)
    dq, dk = coda.ops.qknorm_weight_grads(dw, heads, kv, hd)
    assert torch.equal(dq[perm], dw[:heads * hd].view(heads, hd).sum(0))
    assert torch.equal(dk[perm], dw[heads * hd:(heads + kv) * hd].view(kv, hd).sum(0))


@pytest.mark.parametrize("call,match", [
    (lambda: coda.ops.interleave_gate_up(torch.zeros(2, 3), torch.zeros(3, 3)), "must be equal 2-D shapes"),
    (lambda: coda.ops.split_gate_up(torch.zeros(3, 3)), r"expected \[2F, D\]"),
    (lambda: coda.ops.rope_pair_permutation(2, 7), "head_dim must be even"),
    (lambda: coda.ops.permute_rope_rows(torch.zeros(14, 3), 2, 7), r"even head_dim, got \[14, 3\]"),
    (lambda: coda.ops.unpermute_rope_rows(torch.zeros(12, 3), 2, 8), r"\[2\*8, D\] with an even head_dim"),
])
def test_layout_errors(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# -- rmsnorm -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,d", [((2, 9), 24), ((37,), 32), ((1,), 8)])  # runs of rows per program, ragged
def test_rmsnorm(dtype: torch.dtype, lead: tuple[int, ...], d: int) -> None:
    d = scale(d, 64 * d)
    x, g = leaf(*lead, d, dtype=dtype, s=3.0), leaf(d, dtype=dtype)
    y = coda.ops.rmsnorm(x, g, eps=1e-5)
    ref = F.rms_norm(x, (d,), g, 1e-5)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    close(y, ref, dtype, d, "y")
    dy = torch.randn_like(ref)
    for name, a, b in zip("xg", grads(y, (x, g), dy), grads(ref, (x, g), dy)):
        assert a.shape == b.shape and a.dtype == b.dtype
        close(a, b, dtype, max(d, math.prod(lead)), f"d{name}")


@pytest.mark.parametrize("tiling", [(1, 4, 4, 1), (2, 1, 4, 2), (4, 2, 8, 1), (8, 1, 2, 3), (4, 64, 4, 2)])
def test_rms_backward_tilings(tiling: tuple[int, int, int, int]) -> None:
    """Every tiling (rows per step, programs per SM, warps, stages) gives F.rms_norm's gradients on
    ragged rows (37 rows: runs that end inside a step of rows, programs with no rows at all)."""
    from coda.ops.rowwise import RmsBackwardTiling, rms_backward

    m, d = 37, scale(24, 1536)
    x = torch.randn(m, d, device=DEVICE) * 3
    g, dy = torch.rand(d, device=DEVICE) + 0.5, torch.randn(m, d, device=DEVICE)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-5)
    dx, dg = rms_backward(dy, x, g, rstd, RmsBackwardTiling(*tiling))
    xr, gr = x.clone().requires_grad_(), g.clone().requires_grad_()
    F.rms_norm(xr, (d,), gr, 1e-5).backward(dy)
    close(dx, xr.grad, torch.float32, d, "dx")
    close(dg, gr.grad, torch.float32, m, "dg")


@pytest.mark.parametrize("tiling", [(3, 4, 4, 1), (1, 0, 4, 1), (1, 4, 6, 1), (1, 4, 4, 0)])
def test_rms_backward_rejects_bad_tilings(tiling: tuple[int, int, int, int]) -> None:
    from coda.ops.rowwise import RmsBackwardTiling, rms_backward

    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="rows and num_warps powers of two"):
        rms_backward(x, x, torch.ones(8, device=DEVICE), torch.ones(4, device=DEVICE), RmsBackwardTiling(*tiling))


def test_rmsnorm_checks_shapes() -> None:
    with pytest.raises(ValueError, match=r"must be \[..., D\] and \[D\]"):
        coda.ops.rmsnorm(torch.zeros(4, 8), torch.zeros(7))


# -- rmsnorm_linear ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,d,n", SHAPES)
def test_rmsnorm_linear(dtype: torch.dtype, lead: tuple[int, ...], d: int, n: int) -> None:
    d, n = scale(d, 8 * d), scale(n, 8 * n)
    x, g, w = leaf(*lead, d, dtype=dtype), leaf(d, dtype=dtype), leaf(n, d, dtype=dtype, s=d**-0.5)
    y = coda.ops.rmsnorm_linear(x, g, w, eps=1e-5)
    ref = F.linear(F.rms_norm(x, (d,), g, 1e-5), w)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    close(y, ref, dtype, d, "y")
    dy = torch.randn_like(ref)
    for name, a, b in zip("xgw", grads(y, (x, g, w), dy), grads(ref, (x, g, w), dy)):
        assert a.shape == b.shape and a.dtype == b.dtype
        close(a, b, dtype, max(n, math.prod(lead)), f"d{name}")


def test_rmsnorm_linear_checks_shapes() -> None:
    with pytest.raises(ValueError, match=r"must be \[..., D\], \[D\] and \[N, D\]"):
        coda.ops.rmsnorm_linear(torch.zeros(4, 8), torch.zeros(7), torch.zeros(3, 8))


# -- swiglu_mlp ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,d,f", [((2, 7), 16, 24), ((13,), 24, 20)])
def test_swiglu_mlp(dtype: torch.dtype, lead: tuple[int, ...], d: int, f: int) -> None:
    d, f = scale(d, 8 * d), scale(f, 8 * f)
    x = leaf(*lead, d, dtype=dtype)
    wg, wu, wd = (leaf(f, d, dtype=dtype, s=d**-0.5), leaf(f, d, dtype=dtype, s=d**-0.5),
                  leaf(d, f, dtype=dtype, s=f**-0.5))
    out = coda.ops.swiglu_mlp(x, wg, wu, wd)
    ref = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    close(out, ref, dtype, max(d, f), "out")
    dout = torch.randn_like(ref)
    names = ("x", "w_gate", "w_up", "w_down")
    for name, a, b in zip(names, grads(out, (x, wg, wu, wd), dout), grads(ref, (x, wg, wu, wd), dout)):
        assert a.shape == b.shape
        close(a, b, dtype, max(d, f, math.prod(lead)), f"d{name}")


def test_swiglu_mlp_checks_shapes() -> None:
    with pytest.raises(ValueError, match=r"must be \[..., D\], \[\[F, D\], \[F, D\]\] \(or \[\[2F, D\]\] interleaved\), \[D, F\]"):
        coda.ops.swiglu_mlp(torch.zeros(4, 8), torch.zeros(6, 8), torch.zeros(6, 8), torch.zeros(6, 8))
    with pytest.raises(ValueError, match=r"gate/up \[\[6, 8\]\]"):
        swiglu_mlp_interleaved(torch.zeros(4, 8), torch.zeros(6, 8), torch.zeros(8, 6))


def test_swiglu_mlp_on_interleaved_weights_is_the_same_op() -> None:
    """The models' form (gate/up interleaved, as they hold it): the separate-weight op's output, and
    its weight gradient is theirs interleaved, with no per-call copy of the weights."""
    d, f = 16, 24
    x = leaf(5, d, dtype=torch.float32)
    wg, wu, wd = leaf(f, d, dtype=torch.float32, s=d**-0.5), leaf(f, d, dtype=torch.float32, s=d**-0.5), \
        leaf(d, f, dtype=torch.float32, s=f**-0.5)
    wgu = interleave_gate_up(wg, wu).detach().requires_grad_()
    out, fused = coda.ops.swiglu_mlp(x, wg, wu, wd), swiglu_mlp_interleaved(x, wgu, wd)
    assert torch.equal(out, fused)
    dout = torch.randn_like(out)
    dwg, dwu = torch.autograd.grad(out, (wg, wu), dout)
    (dwgu,) = torch.autograd.grad(fused, (wgu,), dout)
    assert torch.equal(dwgu, interleave_gate_up(dwg, dwu))


# -- linear_cross_entropy ----------------------------------------------------------------------

def reference_ce(x, w, t, ignore_index=-100, reduction="mean", *, label_smoothing=0.0, lse_square_scale=0.0,
                 softcap=None):
    """fp32 torch: F.cross_entropy (its own smoothing and averaging) of the (softcapped) logits,
    plus the z-loss lse_square_scale * logsumexp^2 of the non-ignored rows, averaged with them."""
    z, t = F.linear(x, w).float().reshape(-1, w.shape[0]), t.reshape(-1)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, t, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    if lse_square_scale:
        valid = t != ignore_index
        zloss = torch.where(valid, lse_square_scale * torch.logsumexp(z, -1) ** 2, 0.0)
        loss = loss + {"none": zloss, "sum": zloss.sum(), "mean": zloss.sum() / valid.sum()}[reduction]
    return loss.reshape(x.shape[:-1]) if reduction == "none" else loss


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("lead,d,v", [((3, 6), 16, 50), ((21,), 24, 37)])
def test_linear_cross_entropy(dtype: torch.dtype, reduction: str, lead: tuple[int, ...], d: int, v: int) -> None:
    d, v = scale(d, 8 * d), scale(v, 64 * v)
    x, w = leaf(*lead, d, dtype=dtype), leaf(v, d, dtype=dtype, s=0.5)
    t = torch.randint(0, v, lead, device=DEVICE)
    t.view(-1)[1] = -100
    t.view(-1)[-1] = v - 1  # the last (ragged-tile) column is a target
    loss, ref = coda.ops.linear_cross_entropy(x, w, t, reduction=reduction), reference_ce(x, w, t, reduction=reduction)
    assert loss.shape == () and loss.dtype == torch.float32
    close(loss, ref, dtype, d, "loss")
    for name, a, b in zip("xw", grads(loss, (x, w)), grads(ref, (x, w))):
        close(a, b, dtype, max(d, v), f"d{name}")


def test_linear_cross_entropy_custom_ignore_index() -> None:
    x, w = leaf(10, 16, dtype=torch.float32), leaf(30, 16, dtype=torch.float32)
    t = torch.randint(0, 30, (10,), device=DEVICE)
    t[::3] = 7  # class 7 is ignored, also where it would be the target
    loss, ref = coda.ops.linear_cross_entropy(x, w, t, ignore_index=7), reference_ce(x, w, t, ignore_index=7)
    close(loss, ref, torch.float32, 16, "loss")
    close(grads(loss, (w,))[0], grads(ref, (w,))[0], torch.float32, 30, "dw")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_all_ignored(reduction: str) -> None:
    """Like PyTorch: mean over no valid target is nan, sum is 0; gradients match PyTorch's."""
    x, w = leaf(6, 16, dtype=torch.float32), leaf(30, 16, dtype=torch.float32)
    t = torch.full((6,), -100, device=DEVICE)
    loss, ref = coda.ops.linear_cross_entropy(x, w, t, reduction=reduction), reference_ce(x, w, t, reduction=reduction)
    torch.testing.assert_close(loss, ref, equal_nan=True)
    for a, b in zip(grads(loss, (x, w)), grads(ref, (x, w))):
        torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy_without_gradients(dtype: torch.dtype) -> None:
    """Evaluation (no_grad, or inputs without requires_grad) takes the statistics-only path: the
    same loss, and no [tokens, V] tensor comes back from the op."""
    x, w = leaf(13, 24, dtype=dtype).detach(), leaf(40, 24, dtype=dtype, s=0.5).detach()
    t = torch.randint(0, 40, (13,), device=DEVICE)
    ref = reference_ce(x, w, t)
    close(coda.ops.linear_cross_entropy(x, w, t), ref, dtype, 24, "loss")
    with torch.no_grad():
        loss, *kept = torch.ops.coda.linear_cross_entropy_fwd(x, w, t, -100, "mean", 0.0, 0.0, None, False)
    close(loss, ref, dtype, 24, "loss under no_grad")
    assert [k.numel() for k in kept] == [0, 0, 0]


OPTIONS = {
    "smoothing": {"label_smoothing": 0.1},
    "z-loss": {"lse_square_scale": 0.05},
    "softcap": {"softcap": 2.5},
    "all": {"label_smoothing": 0.2, "lse_square_scale": 0.02, "softcap": 2.0},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", OPTIONS)
def test_linear_cross_entropy_options(dtype: torch.dtype, reduction: str, option: str) -> None:
    """Label smoothing, z-loss and softcapping, alone and together, under each reduction, with
    ignored rows and a ragged last tile: the loss with and without gradients, dx and dW (for
    "none" under a random per-row upstream gradient) against fp32 torch."""
    lead, d, v = (3, 5), scale(24, 256), scale(41, 4000)
    kw = OPTIONS[option]
    x, w = leaf(*lead, d, dtype=dtype), leaf(v, d, dtype=dtype, s=0.5)
    # Mostly the most likely class, as in a trained model: smoothing then moves the loss far
    # (with random targets it moves it about as little as bf16's tolerance).
    t = F.linear(x, w).argmax(-1)
    t.view(-1)[[1, 7]] = -100
    t.view(-1)[[0, -1]] = v - 1  # the last (ragged-tile) column is a target
    loss = coda.ops.linear_cross_entropy(x, w, t, reduction=reduction, **kw)
    ref = reference_ce(x, w, t, reduction=reduction, **kw)
    up = torch.randn(lead, device=DEVICE) if reduction == "none" else None
    ref_grads = grads(ref, (x, w), up, retain_graph=True)
    plain = reference_ce(x, w, t, reduction=reduction)
    for what, a, b in (("loss", ref, plain), ("dx", ref_grads[0], grads(plain, (x,), up)[0])):
        assert rel(a, b) > 4 * limit(dtype, max(d, v)), f"the option must change the {what} beyond the tolerance"
    assert loss.shape == ref.shape and loss.dtype == torch.float32
    close(loss, ref, dtype, d, "loss")
    if reduction == "none":
        assert (loss.view(-1)[[1, 7]] == 0).all()
    with torch.no_grad():
        close(coda.ops.linear_cross_entropy(x, w, t, reduction=reduction, **kw), ref, dtype, d, "loss without gradients")
    for name, a, b in zip("xw", grads(loss, (x, w), up), ref_grads):
        close(a, b, dtype, max(d, v), f"d{name}")


def test_lm_head_chunks_where_its_gradient_outweighs_an_fp32_weight() -> None:
    """G ([tokens, V]) is kept unless it is more than twice an fp32 [V, D]; then as few chunks
    of equal rows as hold at most about one fp32 [V, D] of logits each, in whole 128-row tiles."""
    from coda.ops.cross_entropy import chunk_rows
    assert chunk_rows(8192, 262144, 1152, 2) == 2048  # Gemma 3 1B at 2 x 4096: 4 chunks of at most 2304
    assert chunk_rows(8192, 128256, 2048, 2) is None  # Llama 3.2 1B at 2 x 4096: G kept
    assert chunk_rows(8193, 128256, 2048, 2) == 2816  # 3 chunks of at most 4096, equal, in 128-row tiles
    assert chunk_rows(300, 40, 16, 4) == 128 and chunk_rows(32, 40, 16, 4) is None
    assert chunk_rows(300, 40, 0, 4) == 128  # no features: still whole tiles of rows


# the quick subset keeps plain mean in the first dtype; the full suite runs all
@pytest.mark.parametrize("dtype, reduction, option", [
    pytest.param(d, r, o, marks=() if d == DTYPES[0] and (r, o) == ("mean", "plain") else pytest.mark.slow)
    for d in DTYPES for r in ("mean", "sum") for o in ("plain", "all")])
def test_linear_cross_entropy_gradients_in_chunks(dtype: torch.dtype, reduction: str, option: str) -> None:
    """Tokens enough for several chunks (dW accumulated in place across them): the op keeps dx and
    dW in fp32, no [tokens, V] tensor, and under an upstream scale they match fp32 torch."""
    from coda.ops.cross_entropy import chunk_rows
    tokens, d, v = scale(300, 1000), scale(16, 64), scale(40, 4000)
    kw = OPTIONS["all"] if option == "all" else {}
    x, w = leaf(tokens, d, dtype=dtype), leaf(v, d, dtype=dtype, s=0.5)
    assert tokens > 2 * chunk_rows(tokens, v, d, x.element_size())
    t = torch.randint(0, v, (tokens,), device=DEVICE)
    t[::7] = -100
    t[-1] = v - 1
    loss = coda.ops.linear_cross_entropy(x, w, t, reduction=reduction, **kw)
    ref = reference_ce(x, w, t, reduction=reduction, **kw)
    close(loss, ref, dtype, d, "loss")
    up = torch.tensor(0.37, device=DEVICE)
    for name, a, b in zip("xw", grads(loss, (x, w), up), grads(ref, (x, w), up)):
        close(a, b, dtype, max(d, v), f"d{name}")
    _, grad, dx, dw = torch.ops.coda.linear_cross_entropy_fwd(x.detach(), w.detach(), t, -100, reduction,
                                                             0.0, 0.0, None, True)
    assert grad.numel() == 0 and dx.shape == x.shape and dw.shape == w.shape
    assert dx.dtype == dw.dtype == torch.float32


@pytest.mark.slow
def test_linear_cross_entropy_gradients_in_chunks_compiled() -> None:
    """torch.compile(fullgraph=True) traces the chunked op (its fake outputs are dx and dW) and
    gives the eager results."""
    x, w = leaf(300, 16, dtype=torch.float32), leaf(40, 16, dtype=torch.float32)
    t = torch.randint(0, 40, (300,), device=DEVICE)
    compiled = torch.compile(lambda x, w, t: coda.ops.linear_cross_entropy(x, w, t), fullgraph=True, backend="aot_eager")
    loss = compiled(x, w, t)
    eager = coda.ops.linear_cross_entropy(x, w, t)
    torch.testing.assert_close(loss, eager)
    for a, b in zip(grads(loss, (x, w)), grads(eager, (x, w))):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 400), d=st.sampled_from([8, 16, 24]), v=st.integers(2, 70),
       dtype=st.sampled_from(DTYPES), reduction=st.sampled_from(["mean", "sum", "none"]),
       option=st.sampled_from(["plain", *OPTIONS]), ignored=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_linear_cross_entropy_matches_torch_either_side_of_the_chunk_rule(tokens: int, d: int, v: int,
                                                                         dtype: torch.dtype, reduction: str,
                                                                         option: str, ignored: float, seed: int) -> None:
    """Random sizes about the chunk rule (G kept or gradients in forward, one chunk or several),
    reductions, options, ignored rows and an upstream gradient: loss, dx and dW against fp32 torch."""
    torch.manual_seed(seed)
    kw = OPTIONS.get(option, {})
    x, w = leaf(tokens, d, dtype=dtype), leaf(v, d, dtype=dtype, s=0.5)
    t = torch.randint(0, v, (tokens,), device=DEVICE)
    t[torch.rand(tokens, device=DEVICE) < ignored] = -100
    loss = coda.ops.linear_cross_entropy(x, w, t, reduction=reduction, **kw)
    ref = reference_ce(x, w, t, reduction=reduction, **kw)
    torch.testing.assert_close(loss.isnan(), ref.isnan())
    if ref.isnan().any():  # "mean" with every row ignored
        return
    close(loss, ref, dtype, d, "loss")
    up = torch.randn(ref.shape, device=DEVICE)
    for name, a, b in zip("xw", grads(loss, (x, w), up), grads(ref, (x, w), up)):
        close(a, b, dtype, max(d, v), f"d{name}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_options_all_ignored(reduction: str) -> None:
    """Every row ignored: "mean" is nan, the others 0, and every gradient 0, as in PyTorch."""
    x, w = leaf(6, 16, dtype=torch.float32), leaf(30, 16, dtype=torch.float32)
    t = torch.full((6,), -100, device=DEVICE)
    kw = OPTIONS["all"]
    loss = coda.ops.linear_cross_entropy(x, w, t, reduction=reduction, **kw)
    ref = reference_ce(x, w, t, reduction=reduction, **kw)
    torch.testing.assert_close(loss, ref, equal_nan=True)
    for a, b in zip(grads(loss.sum(), (x, w)), grads(ref.sum(), (x, w))):
        torch.testing.assert_close(a, b)
        assert not a.any()


@pytest.mark.parametrize("kw,exc,match", [
    ({"label_smoothing": -0.1}, ValueError, r"label_smoothing must be in \[0, 1\], got -0.1"),
    ({"label_smoothing": 1.5}, ValueError, r"label_smoothing must be in \[0, 1\]"),
    ({"label_smoothing": float("nan")}, ValueError, r"label_smoothing must be in \[0, 1\]"),
    ({"label_smoothing": torch.tensor(0.1)}, TypeError, "label_smoothing must be a Python number, got Tensor"),
    ({"lse_square_scale": -1e-4}, ValueError, "lse_square_scale must be finite and >= 0"),
    ({"lse_square_scale": float("inf")}, ValueError, "lse_square_scale must be finite and >= 0"),
    ({"softcap": 0.0}, ValueError, r"softcap must be None or finite and > 0, got 0.0"),
    ({"softcap": -30.0}, ValueError, "softcap must be None or finite and > 0"),
    ({"softcap": float("inf")}, ValueError, "softcap must be None or finite and > 0"),
    ({"softcap": True}, TypeError, "softcap must be a Python number, got bool"),
    ({"reduction": "batchmean"}, ValueError, "reduction must be one of"),
])
def test_linear_cross_entropy_option_errors(kw: dict, exc: type, match: str) -> None:
    x, w, t = torch.zeros(4, 8), torch.zeros(9, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(exc, match=match):
        coda.ops.linear_cross_entropy(x, w, t, **kw)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: coda.ops.linear_cross_entropy(torch.zeros(4, 8), torch.zeros(9, 8), torch.zeros(4, dtype=torch.long),
                                           reduction="avg"), ValueError, "reduction must be one of"),
    (lambda: coda.ops.linear_cross_entropy(torch.zeros(4, 8), torch.zeros(9, 7), torch.zeros(4, dtype=torch.long)),
     ValueError, r"must be \[..., D\], \[V, D\]"),
    (lambda: coda.ops.linear_cross_entropy(torch.zeros(4, 8), torch.zeros(9, 8), torch.zeros(5, dtype=torch.long)),
     ValueError, "must have x's leading shape"),
    (lambda: coda.ops.linear_cross_entropy(torch.zeros(4, 8), torch.zeros(9, 8), torch.zeros(4)),
     TypeError, "integer class ids"),
])
def test_linear_cross_entropy_errors(call, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


# -- the backward epilogues' algebra ------------------------------------------------------------

def test_zdz_identity_and_swiglu_backward_epilogue() -> None:
    """sum_j y_j gq_j == sum_k z_k dz_k (docs/ALGEBRA.md 5), and the SwiGLU-backward epilogues
    give autograd's dz, the recomputed y and (the _zdz one) zdz = sum(z * dz)."""
    m, f, d = 11, 12, 16
    z = torch.randn(m, 2 * f, device=DEVICE)
    dy, w_down = torch.randn(m, d, device=DEVICE), torch.randn(d, f, device=DEVICE)
    out = coda.gemm(dy, w_down, E.swiglu_backward_zdz, z=z)
    plain = coda.gemm(dy, w_down, E.swiglu_backward, z=z)
    assert plain.keys() == {"dz", "y"}
    zz = z.clone().requires_grad_()
    gate, up = zz[:, 0::2], zz[:, 1::2]
    y = F.silu(gate) * up
    (dz,) = torch.autograd.grad(y, zz, dy @ w_down)
    for o in (out, plain):
        close(o["dz"], dz, torch.float32, d, "dz")
        close(o["y"], y, torch.float32, d, "y")
    close(out["zdz"], (z * dz).sum(-1), torch.float32, d, "zdz")
    h, w = torch.randn(m, d, device=DEVICE), torch.randn(2 * f, d, device=DEVICE)
    zf = h @ w.T
    dzf = torch.randn_like(zf)
    close((h * (dzf @ w)).sum(-1), (zf * dzf).sum(-1), torch.float32, d, "identity")


# -- torch.compile ------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")
def test_fullgraph_compile_parity() -> None:
    """The ops trace into one graph (custom ops with fake kernels) and give the same results."""
    torch._dynamo.reset()
    x = leaf(2, 5, 16, dtype=torch.float32)
    g, w = leaf(16, dtype=torch.float32), leaf(24, 16, dtype=torch.float32)
    wg, wu, wd = leaf(12, 24, dtype=torch.float32), leaf(12, 24, dtype=torch.float32), leaf(24, 12, dtype=torch.float32)
    wv, g2 = leaf(30, 24, dtype=torch.float32), leaf(24, dtype=torch.float32)
    t = torch.randint(0, 30, (2, 5), device=DEVICE)

    def block(x):
        h = coda.ops.rmsnorm_linear(x, g, w)
        h = h + coda.ops.swiglu_mlp(coda.ops.rmsnorm(h, g2), wg, wu, wd)
        return coda.ops.linear_cross_entropy(h, wv, t)

    eager = block(x)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager" if not GPU else "inductor")(x)
    torch.testing.assert_close(compiled, eager)
    params = (x, g, w, g2, wg, wu, wd, wv)
    for a, b in zip(grads(compiled, params), grads(eager, params)):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")
def test_fullgraph_compile_cross_entropy_options() -> None:
    """reduction="none" with every option traces into one graph (the fake kernel gives the
    per-row loss its shape) and gives eager's loss and gradients."""
    torch._dynamo.reset()
    x, wv = leaf(2, 5, 16, dtype=torch.float32), leaf(30, 16, dtype=torch.float32)
    t = torch.randint(0, 30, (2, 5), device=DEVICE)
    t[0, 1] = -100
    up = torch.randn(2, 5, device=DEVICE)

    def loss(x):
        return (coda.ops.linear_cross_entropy(x, wv, t, reduction="none", **OPTIONS["all"]) * up).sum()

    eager = loss(x)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager" if not GPU else "inductor")(x)
    torch.testing.assert_close(compiled, eager)
    close(eager, (reference_ce(x, wv, t, reduction="none", **OPTIONS["all"]) * up).sum(), torch.float32, 16, "loss")
    for a, b in zip(grads(compiled, (x, wv)), grads(eager, (x, wv))):
        torch.testing.assert_close(a, b)
