"""The docs/ALGEBRA.md section-7 segment (4 fused GEMMs forward, fused backward) against a
plain PyTorch block in the standard layout: outputs and every gradient."""

from __future__ import annotations

import math

import pytest
import torch

from coda.models import BlockWeights, NativeBlockWeights, block_segment, qkv_to_standard, reference_block_segment
from coda.ops.layout import permute_rope_rows
from conftest import DEVICE, EPS, rel, scale



def make(dtype: torch.dtype, m: int, d: int, heads: int, kv: int, hd: int, f: int, activation: str = "silu") -> tuple:
    def p(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=DEVICE) * s).to(dtype).requires_grad_()

    w = BlockWeights(
        wo=p(d, heads * hd, s=(heads * hd) ** -0.5), g_ffn=p(d, s=0.3), w_gate=p(f, d, s=d**-0.5),
        w_up=p(f, d, s=d**-0.5), w_down=p(d, f, s=f**-0.5), g_attn=p(d, s=0.3), wq=p(heads * hd, d, s=d**-0.5),
        wk=p(kv * hd, d, s=d**-0.5), wv=p(kv * hd, d, s=d**-0.5), n_heads=heads, n_kv_heads=kv,
        activation=activation,
    )
    attn, x0 = p(m, heads * hd), p(m, d)
    pos = (torch.arange(m, device=DEVICE) * 7) % 61
    return w, attn, x0, pos


def to_coda_layout(d_qkv: torch.Tensor, w: BlockWeights) -> torch.Tensor:
    hd, nq, nk = w.head_dim, w.wq.shape[0], w.wk.shape[0]
    q = permute_rope_rows(d_qkv[:, :nq].T, w.n_heads, hd).T
    k = permute_rope_rows(d_qkv[:, nq:nq + nk].T, w.n_kv_heads, hd).T
    return torch.cat([q, k, d_qkv[:, nq + nk:]], -1)


@pytest.mark.parametrize("m,d,heads,kv,hd,f,activation", [(20, 32, 4, 2, 8, 48, "silu"), (13, 48, 3, 1, 16, 40, "silu"),
                                                            (20, 32, 4, 2, 8, 48, "gelu_tanh")])
def test_block_matches_pytorch_in_fp32(m: int, d: int, heads: int, kv: int, hd: int, f: int, activation: str) -> None:
    """SwiGLU (Llama's) and GeGLU (Gemma 1's: the activation is the gate/up GEMM's epilogue)."""
    m, d, f, hd = scale(m, 64 * m), scale(d, 8 * d), scale(f, 8 * f), scale(hd, 64)
    w, attn, x0, pos = make(torch.float32, m, d, heads, kv, hd, f, activation)
    x2, qkv = block_segment(attn, x0, pos, w)
    rx2, rqkv = reference_block_segment(attn, x0, pos, w)
    bound = 64 * math.sqrt(max(m, d, f)) * EPS[torch.float32]  # fp32: accumulation order only
    assert rel(x2, rx2) < bound and rel(qkv_to_standard(qkv, w), rqkv) < bound
    dx2, dqkv = torch.randn_like(rx2), torch.randn_like(rqkv)
    params = (attn, x0) + w.tensors()
    ours = torch.autograd.grad((x2 * dx2).sum() + (qkv * to_coda_layout(dqkv, w)).sum(), params)
    theirs = torch.autograd.grad((rx2 * dx2).sum() + (rqkv * dqkv).sum(), params)
    names = ("attn_out", "x0", "wo", "g_ffn", "w_gate", "w_up", "w_down", "g_attn", "wq", "wk", "wv")
    for name, a, b in zip(names, ours, theirs):
        assert a.shape == b.shape, name
        assert rel(a, b) < bound, f"d{name}: relative error {rel(a, b):.3g} >= {bound:.3g}"


def native(w: BlockWeights) -> NativeBlockWeights:
    return NativeBlockWeights.from_standard(w).leaves()


def test_native_weights_give_the_standard_results_bit_for_bit() -> None:
    """The same kernels without the per-call layout copies: outputs equal, and the native
    gradients turned standard by to_standard equal the standard-weight path's exactly."""
    w, attn, x0, pos = make(torch.float32, 20, 32, 4, 2, 8, 48)
    nw = native(w)
    (x2, qkv), (nx2, nqkv) = block_segment(attn, x0, pos, w), block_segment(attn, x0, pos, nw)
    assert torch.equal(x2, nx2) and torch.equal(qkv, nqkv)
    dx2, dqkv = torch.randn_like(x2), torch.randn_like(qkv)
    std = torch.autograd.grad((x2 * dx2).sum() + (qkv * dqkv).sum(), (attn, x0) + w.tensors())
    nat = torch.autograd.grad((nx2 * dx2).sum() + (nqkv * dqkv).sum(), (attn, x0) + nw.tensors())
    converted = NativeBlockWeights(*nat[2:], n_heads=w.n_heads, n_kv_heads=w.n_kv_heads).to_standard().tensors()
    for a, b in zip(std, nat[:2] + converted):
        assert a.shape == b.shape and a.is_contiguous() and torch.equal(a, b)


def test_standard_weights_hold_no_converted_copy_until_backward() -> None:
    """Standard weights are converted again in backward rather than saved converted: what
    backward keeps of the weights is the caller's tensors (no [2F, D] or fused-qkv copy)."""
    w, attn, x0, pos = make(torch.float32, 20, 32, 4, 2, 8, 48)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        block_segment(attn, x0, pos, w)
    assert {t.data_ptr() for t in w.tensors()} <= {t.data_ptr() for t in saved}
    assert not [t.shape for t in saved if t.shape in ((96, 32), (64, 32))]


def test_native_weights_round_trip_and_reject_bad_shapes() -> None:
    w, *_ = make(torch.float32, 4, 32, 4, 2, 8, 48)
    back = NativeBlockWeights.from_standard(w).to_standard()
    assert all(torch.equal(a, b) for a, b in zip(back.tensors(), w.tensors()))
    nw = native(w)
    assert all(t.is_leaf and t.requires_grad for t in nw.tensors()) and (nw.eps, nw.rope_base) == (w.eps, w.rope_base)
    args = dict(n_heads=4, n_kv_heads=2)
    with pytest.raises(ValueError, match=r"w_qkv \[60, 32\] is not \[\(n_heads \+ 2 n_kv_heads\) \* head_dim, D\]"):
        NativeBlockWeights(nw.wo, nw.g_ffn, nw.w_gate_up, nw.w_down, nw.g_attn, nw.w_qkv[:60], **args)
    with pytest.raises(ValueError, match=r"w_gate_up \[48, 32\] must be \[2F, D\] for w_down \[32, 48\]"):
        NativeBlockWeights(nw.wo, nw.g_ffn, nw.w_gate_up[:48], nw.w_down, nw.g_attn, nw.w_qkv, **args)
    with pytest.raises(ValueError, match=r"activation must be one of \['gelu_tanh', 'silu'\], got 'gelu'"):
        NativeBlockWeights(nw.wo, nw.g_ffn, nw.w_gate_up, nw.w_down, nw.g_attn, nw.w_qkv, **args, activation="gelu")
    with pytest.raises(TypeError, match="weights must be BlockWeights or NativeBlockWeights, got tuple"):
        block_segment(torch.zeros(4, 32), torch.zeros(4, 32), torch.zeros(4, dtype=torch.long), w.tensors())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["standard", "native"])
def test_block_traces_into_one_graph(layout: str) -> None:
    """torch.compile(fullgraph=True) sees the segment as custom ops and gives the same results."""
    torch._dynamo.reset()
    w, attn, x0, pos = make(torch.float32, 12, 32, 4, 2, 8, 24)
    w = native(w) if layout == "native" else w

    def run(attn: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        x2, qkv = block_segment(attn, x0, pos, w)
        return (x2 * x2).sum() + qkv.sum()

    eager = run(attn, x0)
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")(attn, x0)
    torch.testing.assert_close(compiled, eager)
    params = (attn, x0) + w.tensors()
    for a, b in zip(torch.autograd.grad(compiled, params), torch.autograd.grad(eager, params)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("used", ["x2", "qkv"])
def test_block_gradients_when_the_loss_uses_one_output(used: str) -> None:
    """The unused output's gradient counts as zero (internal outputs get no materialized zeros,
    the two public ones do when unused). sum(qkv^2) does not see coda's head-dimension order."""
    w, attn, x0, pos = make(torch.float32, 20, 32, 4, 2, 8, 48)
    ours, theirs = block_segment(attn, x0, pos, w), reference_block_segment(attn, x0, pos, w)
    pick = 0 if used == "x2" else 1
    params = (attn, x0) + w.tensors()
    g_ours = torch.autograd.grad(ours[pick].square().sum(), params, allow_unused=True)
    g_theirs = torch.autograd.grad(theirs[pick].square().sum(), params, allow_unused=True)
    bound = 64 * math.sqrt(48) * EPS[torch.float32]
    for a, b in zip(g_ours, g_theirs):
        if b is None:  # a weight the used output does not depend on
            assert not a.any()
        else:
            assert rel(a, b) < bound
