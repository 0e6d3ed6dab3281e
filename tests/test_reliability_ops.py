"""Issue 11, "no silent wrong answers": a correct result or a clear error for adversarial
input to the ops, the numerics of the epilogue primitives, empty shapes, and the code
generator's handling of names. Tiny shapes: every test runs under the interpreter."""

from __future__ import annotations

import pytest
import torch

import coda
from conftest import DEVICE, GPU, randn


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _eye(n: int) -> torch.Tensor:
    return torch.eye(n, device=DEVICE)


# -- generated-code hygiene -----------------------------------------------------------------

def test_epilogue_name_with_newline_is_not_code() -> None:
    def fn(acc):
        return acc * 2

    fn.__name__ = "evil\nraise SystemExit('injected')\n#"
    ep = coda.epilogue(fn)
    a = randn(4, 4)
    src = ep.source(a, _eye(4))
    assert "\nraise SystemExit" not in src
    assert "def coda_evil_raise_SystemExit__injected____(" in src
    torch.testing.assert_close(coda.gemm(a, _eye(4), ep), 2 * a)


def test_non_ascii_epilogue_name_gives_an_ascii_kernel_name() -> None:
    def fn(acc):
        return acc + 1

    fn.__name__ = "größe"
    src = coda.epilogue(fn).source(randn(4, 4), _eye(4))
    assert "def coda_gr__e(" in src and "größe" not in src


def test_output_name_not_in_nfkc_form_is_rejected() -> None:
    def ligature(acc):
        return {"\ufb01": acc}  # "ﬁ", which Python reads as "fi"

    with pytest.raises(ValueError, match=r"output 'ﬁ' is not in NFKC normal form .*'fi'"):
        coda.epilogue(ligature)


def test_output_name_with_newline_is_rejected() -> None:
    def bad(acc):
        return {"y\nimport os": acc}

    with pytest.raises(ValueError, match=r"is not a valid name"):
        coda.epilogue(bad)


def test_colliding_argument_names_compile() -> None:
    """A Scalar `x_ptr` beside a vector `x` (and tile `x_s0` beside tile `x`) once both became
    the kernel argument `in_x_ptr` (`in_x_s0`): a SyntaxError."""

    @coda.epilogue
    def collide(acc, x: coda.VecM, x_ptr: coda.Scalar, t: coda.Tile, t_s0: coda.Scalar):
        return {"y": acc * x + x_ptr + t * t_s0, "y_r": coda.reduce_n(acc, "sum"), "y_r_max": coda.reduce_n(acc, "max")}

    a, b = randn(5, 6), randn(6, 8)
    ops = {"x": randn(5), "x_ptr": 1.5, "t": randn(5, 8), "t_s0": torch.tensor(-2.0, device=DEVICE)}
    out = coda.gemm(a, b, collide, **ops)
    ref = collide.reference(a, b, **ops)
    for name in ref:
        torch.testing.assert_close(out[name], ref[name], rtol=1e-5, atol=1e-5)


def test_keyword_only_operands() -> None:
    @coda.epilogue
    def kw(acc, rstd: coda.VecM, *, s: coda.Scalar, g: coda.Tile):
        return acc * rstd * s + g

    assert [o.name for o in kw.graph.operands] == ["rstd", "s", "g"]
    a, b = randn(5, 6), randn(6, 8)
    ops = {"rstd": randn(5), "s": 3.0, "g": randn(5, 8)}
    torch.testing.assert_close(coda.gemm(a, b, kw, **ops), kw.reference(a, b, **ops), rtol=1e-5, atol=1e-5)


def test_keyword_only_accumulator_is_rejected() -> None:
    def kw_acc(*, acc):
        return acc

    with pytest.raises(TypeError, match=r"accumulator as its first parameter \(a positional one\)"):
        coda.epilogue(kw_acc)


def test_value_from_another_trace_as_output() -> None:
    leaked = []

    @coda.epilogue
    def leak(acc):
        leaked.append(acc * 2)
        return acc

    def returns_it(acc):
        return {"y": acc, "z": leaked[0]}

    def reduces_it(acc):
        return {"y": acc, "s": coda.reduce_n(leaked[0], "sum")}

    def computes_with_it(acc):
        return coda.exp(leaked[0])

    for fn in (returns_it, reduces_it):
        with pytest.raises(ValueError, match=r"output '[zs]' is a value from another epilogue's trace"):
            coda.epilogue(fn)
    with pytest.raises(ValueError, match=r"tracing has finished"):
        coda.epilogue(computes_with_it)


# -- numerics -----------------------------------------------------------------------------------
INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("group", [None, 4])
def test_logsumexp_over_infinities(group: int | None) -> None:
    """A row holding +inf has logsumexp inf (the shift by an infinite max was inf - inf = NaN);
    an all -inf row has -inf; NaN stays NaN."""

    @coda.epilogue
    def lse(acc, g: coda.Tile):
        return coda.reduce_n(acc + g, "logsumexp", group=group)

    a, b = randn(5, 4), randn(4, 8)
    g = torch.zeros(5, 8, device=DEVICE)
    g[0, 1] = INF
    g[1] = -INF
    g[2, 3], g[2, 5] = INF, -INF
    g[3, 6] = NAN
    out = coda.gemm(a, b, lse, g=g)
    ref = lse.reference(a, b, g=g)
    assert out[0].isposinf().any() and out[1].isneginf().all() and out[3].isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_cross_entropy_row_pass_over_infinities() -> None:
    """The row pass's online logsumexp across column blocks: +inf in a later block, a first
    block of -inf followed by finite logits, and a first block that is all -inf."""
    from coda.ops import rowwise

    v = 4096 + 8  # two column blocks (BLOCK = 4096)
    logits = torch.randn(4, v, device=DEVICE)
    logits[0, v - 1] = INF
    logits[1, :4096] = -INF
    logits[1, 4096:] -= 1000.0
    logits[2, :] = -INF
    target = torch.tensor([3, 4100, 0, 5], device=DEVICE)
    ref = torch.logsumexp(logits, dim=1)
    lse, _ = rowwise.cross_entropy_(logits.clone(), target, torch.ones(4, device=DEVICE))
    assert lse[0].isposinf() and lse[2].isneginf()
    torch.testing.assert_close(lse, ref, rtol=1e-6, atol=1e-6)


def test_relu_propagates_nan() -> None:
    """tl.maximum drops NaN on the GPU by default (max.f32); relu must not."""
    from coda.ir.primitives import PRIMITIVES

    for fn, prim in PRIMITIVES.items():
        for backend, expr in prim.text.items():
            if ".maximum" in expr or ".minimum" in expr:
                assert "propagate_nan=tl.PropagateNan.ALL" in expr, (fn, backend)

    @coda.epilogue
    def relu(acc, g: coda.Tile):
        return coda.relu(acc + g)

    a, b = randn(3, 4), randn(4, 4)
    g = torch.zeros(3, 4, device=DEVICE)
    g[1, 2] = NAN
    out = coda.gemm(a, b, relu, g=g)
    assert out[1, 2].isnan() and (out.isnan().sum() == 1)
    torch.testing.assert_close(out, torch.relu(a @ b + g), equal_nan=True)


@pytest.mark.parametrize("s", [1e39, -1e39, 3.4028235e38, 1e-50])
def test_python_float_scalar_is_fp32(s: float) -> None:
    """A Python float reaches the kernel as fp32, as in the reference: 1e39 is inf (so 0 * s
    is NaN), 1e-50 is 0; the second call (a cached plan) too."""

    @coda.epilogue
    def scaled(acc, s: coda.Scalar):
        return acc * s

    a, b = _eye(2), _eye(2)
    ref = scaled.reference(a, b, s=s)
    for _ in range(2):
        torch.testing.assert_close(coda.gemm(a, b, scaled, s=s), ref, equal_nan=True)


def test_sin_cos_stay_bounded_for_huge_arguments() -> None:
    """Past the accurate range (docs/DESIGN.md, "The contract") the result is bounded, not accurate;
    inf/NaN give NaN."""

    @coda.epilogue
    def trig(acc, g: coda.Tile):
        return {"s": coda.sin(acc + g), "c": coda.cos(acc + g)}

    g = torch.tensor([[1e9, -3e9, 1e10, 2.0**40], [1e20, -1e30, 3.4e38, 12345678.0], [INF, -INF, NAN, 0.5]],
                     device=DEVICE)
    out = coda.gemm(torch.zeros(3, 2, device=DEVICE), torch.zeros(2, 4, device=DEVICE), trig, g=g)
    for name in ("s", "c"):
        assert (out[name][:2].abs() <= 1.0).all(), (name, out[name])
        assert out[name][2, :3].isnan().all()
    torch.testing.assert_close(out["s"][2, 3], torch.sin(g[2, 3]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out["c"][2, 3], torch.cos(g[2, 3]), rtol=1e-6, atol=1e-7)


def test_rmsnorm_linear_fp16_where_x_times_g_overflows() -> None:
    """|x * g| = 90000 exceeds fp16 (65504); the normalized value x * rstd * g does not."""
    d, n = 16, 8
    x = torch.full((3, d), 300.0, device=DEVICE).half()
    x[1] *= -1
    g = torch.full((d,), 300.0, device=DEVICE).half()
    w = (randn(n, d) * 0.01).half()
    y = coda.ops.rmsnorm_linear(x, g, w)
    ref = torch.nn.functional.linear(torch.nn.functional.rms_norm(x, (d,), g, 1e-6), w)
    assert y.isfinite().all()
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 * 2.0**-11, atol=1e-3)


# -- empty shapes -------------------------------------------------------------------------------

@coda.epilogue
def _stats(acc, rstd: coda.VecM, g: coda.Tile, bias: coda.VecN):
    y = acc * rstd + g + bias
    return {"y": y, "e": coda.exp(acc) + bias, "lse": coda.reduce_n(y, "logsumexp"), "s": coda.reduce_n(y, "sum"),
            "col": coda.reduce_m(y, "sum"), "heads": coda.reduce_n(y, "sum", group=2)}


def _stats_ops(m: int, n: int) -> dict:
    return {"rstd": randn(m), "g": randn(m, n), "bias": randn(n)}


@pytest.mark.parametrize("m,n,k", [(0, 6, 5), (4, 0, 5), (0, 0, 5), (4, 6, 0), (0, 6, 0)])
def test_gemm_empty_shapes_match_the_reference(m: int, n: int, k: int) -> None:
    """As torch.matmul: M = 0 or N = 0 gives empty tiles (reductions over an empty axis give
    their identity: sum 0, logsumexp -inf); K = 0 gives the epilogue of a zero accumulator."""
    a, b, ops = randn(m, k), randn(k, n), _stats_ops(m, n)
    ref = _stats.reference(a, b, **ops)
    for _ in range(2):  # the second call would use a cached plan
        out = coda.gemm(a, b, _stats, **ops)
        assert set(out) == set(ref)
        for name, r in ref.items():
            assert out[name].shape == r.shape and out[name].dtype == (a.dtype if name in "ye" else torch.float32)
            torch.testing.assert_close(out[name], r, rtol=1e-6, atol=1e-6)
    if k == 0 and m:
        assert torch.equal(coda.gemm(a, b), torch.zeros(m, n, device=DEVICE))


def test_gemm_empty_shapes_write_out() -> None:
    a, b = randn(4, 0), randn(0, 6)
    y = torch.full((4, 6), 7.0, device=DEVICE)
    assert coda.gemm(a, b, out=y) is y and torch.equal(y, torch.zeros(4, 6, device=DEVICE))
    col = torch.full((6,), 7.0, device=DEVICE)
    out = coda.gemm(randn(0, 3), randn(3, 6), _stats, out={"col": col}, **_stats_ops(0, 6))
    assert out["col"] is col and torch.equal(col, torch.zeros(6, device=DEVICE))


def test_gemm_max_over_no_columns_is_an_error() -> None:
    @coda.epilogue
    def row_max(acc):
        return coda.reduce_n(acc, "max")

    assert coda.gemm(randn(0, 3), randn(3, 4), row_max).shape == (0,)
    with pytest.raises(ValueError, match=r"max over N = 0 columns"):
        coda.gemm(randn(3, 3), randn(3, 0), row_max)


def _grads(loss: torch.Tensor, inputs: tuple) -> tuple:
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def test_ops_with_no_rows_forward_and_backward() -> None:
    """An empty batch (an MoE expert with no tokens) through all three ops, with gradients,
    as in PyTorch: empty outputs, zero weight gradients, NaN for a mean loss, 0 for a sum."""
    import torch.nn.functional as F

    d, n, f, v = 8, 6, 4, 10
    x = randn(0, d).requires_grad_()
    g, w = randn(d).requires_grad_(), randn(n, d).requires_grad_()
    y = coda.ops.rmsnorm_linear(x, g, w)
    ref = F.linear(F.rms_norm(x, (d,), g, 1e-6), w)
    assert y.shape == ref.shape == (0, n)
    for got, want in zip(_grads(y.sum(), (x, g, w)), _grads(ref.sum(), (x, g, w))):
        assert got.shape == want.shape and torch.equal(got, want)

    wg, wu, wd = randn(f, d).requires_grad_(), randn(f, d).requires_grad_(), randn(d, f).requires_grad_()
    y = coda.ops.swiglu_mlp(x, wg, wu, wd)
    ref = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    assert y.shape == ref.shape == (0, d)
    for got, want in zip(_grads(y.sum(), (x, wg, wu, wd)), _grads(ref.sum(), (x, wg, wu, wd))):
        assert got.shape == want.shape and torch.equal(got, want)

    wv, t = randn(v, d).requires_grad_(), torch.zeros(0, dtype=torch.long, device=DEVICE)
    for reduction in ("mean", "sum"):
        with torch.no_grad():
            nograd = coda.ops.linear_cross_entropy(x, wv, t, reduction=reduction)
        loss = coda.ops.linear_cross_entropy(x, wv, t, reduction=reduction)
        ref = F.cross_entropy(F.linear(x, wv).float(), t, reduction=reduction)
        torch.testing.assert_close(loss.detach(), ref.detach(), equal_nan=True)
        torch.testing.assert_close(nograd, ref.detach(), equal_nan=True)
        for got, want in zip(_grads(loss, (x, wv)), _grads(ref, (x, wv))):
            assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("tokens", [0, 300])
def test_linear_cross_entropy_with_no_features(tokens: int) -> None:
    """D = 0 (every logit 0: the loss is log V), with enough tokens for the chunked gradients: as
    in PyTorch, loss and gradients (empty dx, zero dW)."""
    import torch.nn.functional as F

    x, w = randn(tokens, 0).requires_grad_(), randn(40, 0).requires_grad_()
    t = torch.randint(0, 40, (tokens,), device=DEVICE)
    loss, ref = coda.ops.linear_cross_entropy(x, w, t), F.cross_entropy(F.linear(x, w).float(), t)
    torch.testing.assert_close(loss.detach(), ref.detach(), equal_nan=True)
    for got, want in zip(_grads(loss, (x, w)), _grads(ref, (x, w))):
        assert got.shape == want.shape and torch.equal(got, want)


# -- strided and expanded inputs of the row kernels ---------------------------------------------

def _norm_weights(d: int) -> dict:
    base = randn(d, 3).requires_grad_()
    one = randn(1).requires_grad_()
    return {"strided": (base, lambda: base[:, 1]), "expanded": (one, lambda: one.expand(d)),
            "flipped": (base, lambda: base[:, 0].flip(0))}


@pytest.mark.parametrize("kind", ["strided", "expanded", "flipped"])
def test_rmsnorm_linear_strided_norm_weight(kind: str) -> None:
    """g[:, 1] and t.expand(D) once read as if contiguous (the expanded one past its storage)."""
    import torch.nn.functional as F

    d, n = 12, 10
    leaf, make = _norm_weights(d)[kind]
    x, w = randn(2, 3, d).requires_grad_(), randn(n, d).requires_grad_()
    y = coda.ops.rmsnorm_linear(x, make(), w)
    ref = F.linear(F.rms_norm(x, (d,), make(), 1e-6), w)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    dy = randn(*y.shape)
    for got, want in zip(torch.autograd.grad(y, (x, leaf, w), dy), torch.autograd.grad(ref, (x, leaf, w), dy)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_row_kernels_honour_strides_or_refuse() -> None:
    """Every pointer-based row kernel: strided vectors are made contiguous, wrong lengths and
    overlapping in-place rows are refused (no out-of-bounds reads or racing writes)."""
    from coda.ops import rowwise

    m, d = 3, 8
    x = randn(m, d)
    g = randn(d, 2)[:, 0]
    h, rstd = rowwise.rms_prep(x, g, 1e-6)
    torch.testing.assert_close(h, torch.nn.functional.rms_norm(x, (d,), g, 1e-6), rtol=1e-6, atol=1e-6)
    c = randn(m, 2)[:, 1]
    u = randn(m, d)
    torch.testing.assert_close(rowwise.rms_input_grad(u, x, c), u - c[:, None] * x)
    with pytest.raises(ValueError, match=r"rms_prep: norm_weight must have shape \[8\]"):
        rowwise.rms_prep(x, randn(d + 1), 1e-6)
    with pytest.raises(ValueError, match=r"rms_input_grad: c must have shape \[3\]"):
        rowwise.rms_input_grad(u, x, randn(m + 4))
    logits = randn(m, d)
    target = torch.tensor([[1, 9], [2, 9], [7, 9]], device=DEVICE)[:, 0]
    lse, tl = rowwise.cross_entropy_(logits.clone(), target, torch.ones(m, device=DEVICE))
    torch.testing.assert_close(lse, torch.logsumexp(logits, 1))
    torch.testing.assert_close(tl, logits.gather(1, target[:, None])[:, 0])
    with pytest.raises(ValueError, match=r"cross_entropy_: target must have shape \[3\]"):
        rowwise.cross_entropy_(logits.clone(), target[:2], torch.ones(m, device=DEVICE))
    with pytest.raises(ValueError, match=r"rows overlap"):
        rowwise.cross_entropy_(randn(1, d).expand(m, d), target, torch.ones(m, device=DEVICE))
    with pytest.raises(ValueError, match=r"rope_backward: freq must have shape \[4\]"):
        rowwise.rope_backward(randn(m, d), randn(m, d), torch.arange(m, device=DEVICE), randn(3))


# -- out-of-range targets -------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [10, -5, 10**6, -101])
@pytest.mark.parametrize("with_grad", [False, True])
def test_cross_entropy_target_out_of_range_raises(bad: int, with_grad: bool) -> None:
    """Targets must be ignore_index or in [0, V): they once gave the loss of a 0 target logit."""
    import torch.nn.functional as F

    if GPU:
        pytest.skip("on the GPU the check is a device-side assert, which ends the CUDA context: "
                    "test_cross_entropy_target_out_of_range_asserts_on_the_gpu")
    x, w = randn(4, 8).requires_grad_(with_grad), randn(10, 8)
    target = torch.tensor([0, 9, bad, -100], device=DEVICE)
    with pytest.raises(IndexError, match="out of bounds"):
        F.cross_entropy(F.linear(x, w), target)  # what PyTorch does
    with pytest.raises(IndexError, match=rf"linear_cross_entropy: target {bad} is out of bounds for 10 classes"):
        coda.ops.linear_cross_entropy(x, w, target)


def test_cross_entropy_ignore_index_may_lie_outside_the_classes() -> None:
    import torch.nn.functional as F

    x, w = randn(4, 8), randn(10, 8)
    for ignore in (10, 10**6, -1, 3):
        target = torch.tensor([0, ignore, 9, ignore], device=DEVICE)
        want = F.cross_entropy(F.linear(x, w), target, ignore_index=ignore)
        torch.testing.assert_close(coda.ops.linear_cross_entropy(x, w, target, ignore_index=ignore), want,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not GPU, reason="the GPU's device-side assert")
def test_cross_entropy_target_out_of_range_asserts_on_the_gpu() -> None:
    """In a child process: the device-side assert fails the next synchronization loudly."""
    import subprocess
    import sys

    code = (
        "import torch, coda\n"
        "x, w = torch.randn(4, 64, device='cuda'), torch.randn(128, 64, device='cuda')\n"
        "t = torch.tensor([0, 1, 128, 2], device='cuda')\n"
        "print(coda.ops.linear_cross_entropy(x, w, t).item())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "device-side assert" in done.stderr, done.stderr[-2000:]


def test_python_int_scalar_too_large_for_a_float() -> None:
    @coda.epilogue
    def scaled(acc, s: coda.Scalar):
        return acc * s

    with pytest.raises(ValueError, match=r"operand 's' \(Scalar\) is 1000.*, too large for a float"):
        coda.gemm(_eye(2), _eye(2), scaled, s=10**400)
    torch.testing.assert_close(coda.gemm(_eye(2), _eye(2), scaled, s=10**40), scaled.reference(_eye(2), _eye(2), s=10**40),
                               equal_nan=True)


# No denormal results (the GPU may flush them): |x| <= 80 keeps exp(-x) normal.
_SPECIAL = [float("inf"), -float("inf"), float("nan"), -0.0, 0.0, 100.0, -100.0, 1e-30, 80.0, -80.0, 3e38, -3e38]


@pytest.mark.parametrize("fn", ["exp", "log", "sqrt", "rsqrt", "sigmoid", "silu", "gelu", "tanh", "relu", "abs",
                                "square", "neg"])
def test_unary_special_values_match_the_reference(fn: str) -> None:
    """inf, -inf, NaN, signed zeros, tiny and near-overflow values, as the fp32 torch oracle: the
    same NaN/inf pattern and signs; finite values within 128 fp32 ulps (the GPU's exp is ex2 of
    a rounded x * log2(e): exp(80) amplifies that rounding about 55-fold)."""
    op = (lambda v: -v) if fn == "neg" else getattr(coda, fn)

    def special(acc, g: coda.Tile):
        return op(acc + g)

    special.__name__ = f"special_{fn}"
    ep = coda.epilogue(special)
    a, b, g = torch.zeros(1, 2, device=DEVICE), torch.zeros(2, len(_SPECIAL), device=DEVICE), torch.tensor([_SPECIAL], device=DEVICE)
    out, ref = coda.gemm(a, b, ep, g=g), ep.reference(a, b, g=g)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    nonzero = ~ref.isnan() & (ref != 0)  # the sign of a zero result may differ (gelu(-100): -0.0 here, 0.0 in torch)
    assert torch.equal(torch.signbit(out[nonzero]), torch.signbit(ref[nonzero]))
    torch.testing.assert_close(out, ref, rtol=128 * 2.0**-23, atol=0.0, equal_nan=True)
