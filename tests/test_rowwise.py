"""The row-wise kernels of coda.ops against plain PyTorch: fp32 within a few fp32 ulps of
the reduction length, bf16/fp16 outputs within one rounding of the fp32 result."""

from __future__ import annotations

import math

import pytest
import torch

from coda.ops import rowwise
from conftest import DEVICE, EPS, scale

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def tol(dtype: torch.dtype, n: int) -> dict:
    """One rounding of the output dtype, plus fp32 accumulation over n terms."""
    rel = EPS[dtype] + 4 * math.sqrt(n) * EPS[torch.float32]
    return {"rtol": rel, "atol": rel * 1e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d", [(7, 48), (3, 200)])
def test_rms_prep(dtype: torch.dtype, m: int, d: int) -> None:
    d = scale(d, 16 * d)
    x, g = torch.randn(m, d, device=DEVICE).to(dtype), torch.randn(d, device=DEVICE).to(dtype)
    h, rstd = rowwise.rms_prep(x, g, 1e-6)
    xf = x.float()
    assert h.dtype == dtype and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd, torch.rsqrt(xf.pow(2).mean(-1) + 1e-6), **tol(torch.float32, d))
    # h = F.rms_norm(x): (x * rstd) * g rounded once (with the kernel's rstd, so only that rounding differs)
    torch.testing.assert_close(h.float(), (xf * rstd[:, None] * g.float()).to(dtype).float(), **tol(dtype, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_input_grad(dtype: torch.dtype) -> None:
    m, d = 5, scale(72, 1024)
    u, x, c = torch.randn(m, d, device=DEVICE), torch.randn(m, d, device=DEVICE).to(dtype), torch.rand(m, device=DEVICE)
    dx = rowwise.rms_input_grad(u, x, c)
    assert dx.dtype == dtype
    # The GPU fuses u - c*x into one fma: against the exact value, one rounding of dtype plus
    # one fp32 rounding of each term (the difference may cancel).
    want = u.double() - c[:, None].double() * x.double()
    err = (dx.double() - want).abs()
    bound = EPS[dtype] * want.abs() + 2 * EPS[torch.float32] * (u.double().abs() + (c[:, None] * x.float()).double().abs())
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_statistics_and_gradient_in_place(dtype: torch.dtype) -> None:
    m, v = 6, scale(300, 10000)  # several column blocks on the GPU
    logits = (3 * torch.randn(m, v, device=DEVICE)).to(dtype)
    logits[4, 7] = 40.0  # a late running-max jump rescales the sum
    target = torch.randint(0, v, (m,), device=DEVICE)
    target[2] = -100
    target[5] = v  # out of range: no target logit, like ignore_index
    scale_rows = torch.rand(m, device=DEVICE)
    lf = logits.float()
    want_lse = torch.logsumexp(lf.double(), -1)
    hit = (target >= 0) & (target < v)
    want_t = torch.where(hit, lf.gather(1, target.clamp(0, v - 1)[:, None])[:, 0], 0.0)
    onehot = torch.nn.functional.one_hot(target.clamp(0, v - 1), v) * hit[:, None]
    want = (torch.softmax(lf.double(), -1) - onehot) * scale_rows[:, None]
    before = logits.data_ptr()
    lse, t = rowwise.cross_entropy_(logits, target, scale_rows)
    assert logits.data_ptr() == before
    # lse: fp32 sums over a tree of log2(block) levels plus one rescale per block, exp's and
    # log's few ulp, and the rounding of max + log(sum).
    blocks = -(-v // min(4096, 1 << (v - 1).bit_length()))
    lse_err = ((v.bit_length() + 3 * blocks + 8) + want_lse.abs()) * EPS[torch.float32]
    assert ((lse.double() - want_lse).abs() <= lse_err).all()
    assert torch.equal(t, want_t)
    spread = (lf - want_lse[:, None].float()).abs().max().item()  # exp's relative error grows with |l - lse|
    rel = EPS[dtype] + 4 * (1 + spread) * EPS[torch.float32] + lse_err.max().item()
    torch.testing.assert_close(logits.double(), want, rtol=rel, atol=rel * 1e-3)


def rotated_pairs(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor, sign: int) -> torch.Tensor:
    """x's adjacent column pairs rotated by sign * theta, theta = pos * freq in fp32 (as the kernels
    and the GEMM epilogues compute the angle), the rotation in fp64."""
    theta = (pos[:, None].float() * freq[None, :]).double()
    c, s = theta.cos(), sign * theta.sin()
    a, b = x.double()[:, 0::2], x.double()[:, 1::2]
    return torch.stack([a * c - b * s, a * s + b * c], -1).reshape(x.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [scale(40, 3072), 600], ids=["one_chunk", "chunks_and_tail"])
def test_rope_backward_is_the_inverse_rotation(dtype: torch.dtype, n: int) -> None:
    """dz rotated by -theta per adjacent pair (the transpose of the forward rotation), and
    zdz = sum(z * dz) per row; 600 columns take two 256-pair chunks and a ragged third."""
    m = 9
    pos = torch.arange(m, device=DEVICE) * 37
    freq = torch.rand(n // 2, device=DEVICE)
    dz, z = torch.randn(m, n, device=DEVICE).to(dtype), torch.randn(m, n, device=DEVICE).to(dtype)
    out, zdz = rowwise.rope_backward(dz, z, pos, freq)
    want = rotated_pairs(dz, pos, freq, -1)
    assert out.dtype == dtype and zdz.dtype == torch.float32
    # one rounding to dtype of each value, plus a few fp32 ulps of sin/cos and the two products
    atol = 8 * EPS[torch.float32] * dz.abs().max().item()
    torch.testing.assert_close(out.double(), want, rtol=EPS[dtype], atol=atol)
    # fp32 summation: error bounded by n * eps32 * sum|z * dz| (the sum itself may cancel)
    bound = n * EPS[torch.float32] * (z.double() * dz.double()).abs().sum(-1).max().item()
    torch.testing.assert_close(zdz.double(), (z.double() * dz.double()).sum(-1), rtol=0, atol=bound)
    # with a bias added before the rotation: the row term of z - bias, sum(z * dz) - sum(bias * rotated dz)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    out_b, zdz_b = rowwise.rope_backward(dz, z, pos, freq, bias)
    torch.testing.assert_close(out_b.double(), want, rtol=EPS[dtype], atol=atol)
    term = bias.double() * rotated_pairs(dz, pos, freq, -1)
    bound += n * EPS[torch.float32] * term.abs().sum(-1).max().item()
    torch.testing.assert_close(zdz_b.double(), (z.double() * dz.double()).sum(-1) - term.sum(-1), rtol=0, atol=bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [scale(40, 2048), 600], ids=["one_chunk", "chunks_and_tail"])
def test_rope_pairs_rotates_and_its_op_backward_is_the_transpose(dtype: torch.dtype, n: int) -> None:
    """x's adjacent pairs rotated by +theta (rounded once), and the op's gradient dy rotated by
    -theta: the transpose, so <rope(x), dy> = <x, grad> up to the roundings."""
    from coda.ops.rope import rope_pairs

    m = 9
    pos = torch.arange(m, device=DEVICE) * 37
    freq = torch.rand(n // 2, device=DEVICE)
    x = torch.randn(m, n, device=DEVICE).to(dtype).requires_grad_()
    out = rope_pairs(x, pos, freq)
    want = rotated_pairs(x.detach(), pos, freq, 1)
    assert out.dtype == dtype and out.shape == (m, n)
    atol = 8 * EPS[torch.float32] * x.detach().abs().max().item()
    torch.testing.assert_close(out.double(), want, rtol=EPS[dtype], atol=atol)
    dy = torch.randn(m, n, device=DEVICE).to(dtype)
    out.backward(dy)
    torch.testing.assert_close(x.grad.double(), rotated_pairs(dy, pos, freq, -1), rtol=EPS[dtype],
                               atol=8 * EPS[torch.float32] * dy.abs().max().item())
    with pytest.raises(ValueError, match="even number of columns"):
        rowwise.rope_pairs(torch.zeros(2, 3, device=DEVICE), pos[:2], freq[:1])
    # rows of no pairs: nothing to rotate, and the backward's row term is 0
    empty = torch.zeros(m, 0, device=DEVICE, dtype=dtype)
    out, zdz = rowwise.rope_backward(empty, empty, pos, freq[:0])
    assert out.shape == (m, 0) and torch.equal(zdz, torch.zeros(m, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [0, 7, 4096 + 5])
def test_scale_cast_rounds_once(dtype: torch.dtype, n: int) -> None:
    """s * x of fp32 x in a narrower dtype is torch's (x * s).to(dtype): one rounding, s read on
    the device; ragged last block."""
    x, s = torch.randn(n, 3, device=DEVICE), torch.tensor(0.37, device=DEVICE)
    assert torch.equal(rowwise.scale_cast(x, s, dtype), (x * s).to(dtype))
    with pytest.raises(ValueError, match="contiguous fp32"):
        rowwise.scale_cast(torch.randn(4, 3, device=DEVICE).T, s, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (5, 7), (4, 300)])
def test_scale_rows_rounds_once(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """x * s[:, None] in x's dtype is torch's fp32 product cast once, for strided rows too (a
    column slice); s must be one fp32 value per row."""
    m, d = shape
    x = torch.randn(m, d + 3, device=DEVICE).to(dtype)[:, 1:d + 1]
    s = torch.rand(m, device=DEVICE) * 4
    assert torch.equal(rowwise.scale_rows(x, s), (x.float() * s[:, None]).to(dtype))
    with pytest.raises(ValueError, match="fp32"):
        rowwise.scale_rows(x, s.double())
    with pytest.raises(ValueError, match="shape"):
        rowwise.scale_rows(x, torch.rand(m + 1, device=DEVICE))


def test_row_passes_write_into_column_slices() -> None:
    """rope_pairs and rms_backward given `out` (columns of a wider tensor, as OLMo 2's q/k passes
    write the QKV output): the same values as into a new tensor, the other columns untouched; an
    `out` of another shape or dtype, or whose rows are not contiguous, is refused."""
    m, n = 5, 8
    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(m, n, generator=g).to(DEVICE) for _ in range(2))
    pos, freq = torch.arange(m, device=DEVICE), torch.rand(n // 2, generator=g).to(DEVICE)
    wide = torch.full((m, 3 * n), 7.0, device=DEVICE)
    got = rowwise.rope_pairs(x, pos, freq, out=wide[:, n:2 * n])
    assert got.data_ptr() == wide[:, n:].data_ptr() and torch.equal(got, rowwise.rope_pairs(x, pos, freq))
    rstd = torch.rand(m, generator=g).to(DEVICE)
    weight = torch.rand(n, generator=g).to(DEVICE)
    dx, dg = rowwise.rms_backward(dy, x, weight, rstd, out=wide[:, 2 * n:])
    want_dx, want_dg = rowwise.rms_backward(dy, x, weight, rstd)
    assert torch.equal(wide[:, 2 * n:], want_dx) and torch.equal(dg, want_dg)
    assert bool((wide[:, :n] == 7.0).all())
    for bad in (wide[:, :n - 2], wide[:, :n].double(), torch.zeros(n, m, device=DEVICE).T):
        with pytest.raises(ValueError, match="out must be"):
            rowwise.rope_pairs(x, pos, freq, out=bad)


def test_rowwise_rejects_non_matrices() -> None:
    with pytest.raises(ValueError, match="rms_prep: x must be 2-D"):
        rowwise.rms_prep(torch.randn(4, device=DEVICE), torch.randn(4, device=DEVICE), 1e-6)


def test_rowwise_names_a_tensor_on_the_wrong_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor the kernels cannot read is an error that names it and says what to do, not
    Triton's launch error: CPU tensors when kernels run on the GPU, others under the interpreter."""
    x, g = torch.randn(4, 8), torch.ones(8)
    monkeypatch.setattr(rowwise, "interpreting", lambda: False)
    with pytest.raises(ValueError, match=r"rms_prep: x is on cpu; coda's kernels run on the GPU, move it to cuda"):
        rowwise.rms_prep(x, g, 1e-6)
    monkeypatch.setattr(rowwise, "interpreting", lambda: True)
    with pytest.raises(ValueError, match=r"rms_prep: norm_weight is on meta, but kernels run in Triton's interpreter"):
        rowwise.rms_prep(x, g.to("meta"), 1e-6)
    with pytest.raises(ValueError, match=r"rms_input_grad: c is on meta"):
        rowwise.rms_input_grad(x, x, torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match=r"cross_entropy_: logits is on meta"):
        rowwise.cross_entropy_(torch.empty(4, 8, device="meta"), torch.zeros(4, dtype=torch.long), torch.ones(4))
