"""out= aliasing and in-place writes: refused with ValueError, or the reference answer.

The one pattern that may share memory is the documented in-place accumulation: a Tile
operand that is exactly the output (`gemm(a, b, add, out=g, g=g)`). Everything else that
overlaps what a call reads, another output, or itself is refused before anything is written.
"""

import torch
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import coda
from coda.runtime.alias import overlaps, self_overlapping
from conftest import DEVICE, assert_close, randn

M = N = K = 16


@coda.epilogue
def add(acc, g: coda.Tile):
    return acc + g


@coda.epilogue
def scale_add(acc, r: coda.VecM, c: coda.VecN, g: coda.Tile):
    return acc * r + c + g


@coda.epilogue
def two(acc, g: coda.Tile):
    return {"y": acc + g, "z": acc * 2.0}


@coda.epilogue
def stats(acc):
    return {"y": acc, "s": coda.reduce_n(acc, "sum")}


def _refused(f, match: str = "") -> None:
    with pytest.raises(ValueError, match=match):
        f()


def test_out_is_a():
    a = randn(M, K)
    b = randn(K, N)
    keep = a.clone()
    _refused(lambda: coda.gemm(a, b, out=a), "overlaps a")
    assert torch.equal(a, keep)  # refused before anything was written


def test_out_is_b_or_part_of_a():
    a, b = randn(M, K), randn(K, N)
    _refused(lambda: coda.gemm(a, b, out=b), "overlaps b")
    big = randn(2 * M, K)
    _refused(lambda: coda.gemm(big[:M], b, out=big[M // 2:M // 2 + M]), "overlaps a")


def test_out_is_transposed_tile_operand():
    a, b, g = randn(M, K), randn(K, N), randn(M, N)
    _refused(lambda: coda.gemm(a, b, add, out=g.T, g=g), "operand 'g'")


def test_out_is_shifted_view_of_tile_operand():
    a, b, buf = randn(M, K), randn(K, N), randn(M + 1, N)
    _refused(lambda: coda.gemm(a, b, add, out=buf[1:], g=buf[:-1]), "operand 'g'")


def test_out_same_memory_other_dtype_refused():
    a, b = randn(M, K), randn(K, N)
    g = randn(M, N, dtype=torch.float16)
    _refused(lambda: coda.gemm(a, b, add, out=g.view(torch.bfloat16), g=g), "operand 'g'")


def test_vector_operand_is_row_of_out():
    a, b, g = randn(M, K), randn(K, N), randn(M, N)
    out = randn(M, N)
    r = torch.ones(M, device=DEVICE)
    _refused(lambda: coda.gemm(a, b, scale_add, out=out, r=r, c=out[3], g=g), "operand 'c'")
    _refused(lambda: coda.gemm(a, b, scale_add, out=out, r=out[:, 2], c=out[0].clone(), g=g), "operand 'r'")


def test_one_tensor_for_two_outputs():
    a, b, g = randn(M, K), randn(K, N), randn(M, N)
    t = randn(M, N)
    _refused(lambda: coda.gemm(a, b, two, out={"y": t, "z": t}, g=g), "share memory")
    buf = randn(M, N + 4)
    _refused(lambda: coda.gemm(a, b, two, out={"y": buf[:, :N], "z": buf[:, 4:]}, g=g), "share memory")
    s = randn(M)
    _refused(lambda: coda.gemm(a, b, stats, out={"y": t, "s": t[0]}), "share memory")


def test_expanded_out():
    a, b = randn(M, K), randn(K, N)
    _refused(lambda: coda.gemm(a, b, out=torch.zeros(1, N, device=DEVICE).expand(M, N)), "share memory")
    _refused(lambda: coda.gemm(a, b, out=torch.zeros(M, 1, device=DEVICE).expand(M, N)), "share memory")
    flat = torch.zeros(M * N, device=DEVICE)
    _refused(lambda: coda.gemm(a, b, out=flat.as_strided((M, N), (4, 1))), "share memory")


def test_documented_inplace_accumulation():
    a, b, g = randn(M, K), randn(K, N), randn(M, N)
    ref = add.reference(a, b, g=g)
    out = coda.gemm(a, b, add, out=g, g=g)
    assert out is g
    assert_close(g, ref, a, b, "in place")
    # the very same view, as another tensor object, is the same pattern
    buf = randn(M + 2, N)
    view = buf[1:M + 1]
    ref = add.reference(a, b, g=view)
    coda.gemm(a, b, add, out=buf[1:M + 1], g=view)
    assert_close(buf[1:M + 1], ref, a, b, "same view")


def test_disjoint_views_of_one_buffer_pass():
    """Interleaved, non-overlapping views of one buffer are not overlap (decided exactly)."""
    a, b = randn(M, K), randn(K, N)
    buf = randn(M, 2 * N)
    g = buf[:, N:]
    ref = add.reference(a, b, g=g)
    coda.gemm(a, b, add, out=buf[:, :N], g=g)
    assert_close(buf[:, :N], ref, a, b, "left half")
    rows = randn(2 * M, N)  # every other row: out and g interleave
    ref = add.reference(a, b, g=rows[1::2])
    coda.gemm(a, b, add, out=rows[0::2], g=rows[1::2])
    assert_close(rows[0::2], ref, a, b, "even rows")


def test_inputs_may_alias_each_other():
    a = randn(M, M)
    ref = add.reference(a, a, g=a)
    assert_close(coda.gemm(a, a, add, g=a), ref, a, a, "a == b == g")


def test_overlap_helper_exact():
    buf = torch.zeros(8, 8)
    assert not overlaps(buf[:, :4], buf[:, 4:])
    assert overlaps(buf[:, :5], buf[:, 4:])
    assert not overlaps(buf[0::2], buf[1::2])
    assert overlaps(buf[0::2], buf[2::2])
    assert overlaps(buf.T[:, :4], buf[3:4])  # different pitches
    assert not overlaps(buf[:4, :4].T, buf[4:, 4:])
    assert not overlaps(buf[:, 0], buf[:, 1])  # strided columns
    assert overlaps(buf[:, 0], buf[5:6, :1])
    flat = torch.zeros(64)
    assert overlaps(flat.as_strided((4, 4), (5, 3)), flat[6:7])  # element 5 + 3 * 0 + ... : offset 6 = 3*2
    assert not overlaps(flat.as_strided((2, 2), (10, 3)), flat[4:10])  # offsets 0, 3, 10, 13
    assert self_overlapping(flat.as_strided((4, 4), (2, 1)))
    assert not self_overlapping(flat.as_strided((4, 4), (8, 2)))
    assert self_overlapping(torch.zeros(1, 4).expand(3, 4))


# -- property: random aliasing patterns are refused or right --------------------------------

BUF = (3 * M, 3 * N)


@st.composite
def placements(draw, shape: tuple[int, ...]):
    """How a tensor of `shape` lives: its own memory, or a view of the shared buffer."""
    if len(shape) == 1:
        (n,) = shape
        kind = draw(st.sampled_from(["fresh", "row", "col", "flat", "expand"]))
        r0 = draw(st.integers(0, BUF[0] - 1))
        c0 = draw(st.integers(0, BUF[1] - n))
        if kind == "col":
            r0 = draw(st.integers(0, BUF[0] - n))
        return (kind, r0, c0, draw(st.integers(0, BUF[0] * BUF[1] - n)))
    rows, cols = shape
    kind = draw(st.sampled_from(["fresh", "slice", "transpose", "flat", "expand_row", "expand_col", "step"]))
    r0 = draw(st.integers(0, BUF[0] - max(rows, cols)))
    c0 = draw(st.integers(0, BUF[1] - max(rows, cols)))
    return (kind, r0, c0, draw(st.integers(0, BUF[0] * BUF[1] - rows * cols)))


def place(buf: torch.Tensor, shape: tuple[int, ...], how: tuple) -> torch.Tensor:
    kind, r0, c0, off = how
    if kind == "fresh":
        return randn(*shape)
    if len(shape) == 1:
        (n,) = shape
        return {
            "row": lambda: buf[r0, c0:c0 + n],
            "col": lambda: buf[r0:r0 + n, c0],
            "flat": lambda: buf.view(-1)[off:off + n],
            "expand": lambda: buf[r0, c0:c0 + 1].expand(n),
        }[kind]()
    rows, cols = shape
    return {
        "slice": lambda: buf[r0:r0 + rows, c0:c0 + cols],
        "transpose": lambda: buf[r0:r0 + cols, c0:c0 + rows].T,
        "flat": lambda: buf.view(-1)[off:off + rows * cols].view(rows, cols),
        "expand_row": lambda: buf[r0, c0:c0 + cols].expand(rows, cols),
        "expand_col": lambda: buf[r0:r0 + rows, c0:c0 + 1].expand(rows, cols),
        "step": lambda: buf[r0:r0 + 2 * rows:2, c0:c0 + cols] if r0 + 2 * rows <= BUF[0] else buf[:rows, :cols],
    }[kind]()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    a_at=placements((M, K)), b_at=placements((K, N)), g_at=placements((M, N)), r_at=placements((M,)),
    c_at=placements((N,)), out_at=st.one_of(placements((M, N)), st.sampled_from(["g", "a", "b", "g.T", "view_of_g"])),
)
def test_aliasing_property(a_at, b_at, g_at, r_at, c_at, out_at):
    buf = randn(*BUF)
    a, b, g = place(buf, (M, K), a_at), place(buf, (K, N), b_at), place(buf, (M, N), g_at)
    r, c = place(buf, (M,), r_at), place(buf, (N,), c_at)
    out = {"g": lambda: g, "a": lambda: a, "b": lambda: b, "g.T": lambda: g.T,
           "view_of_g": lambda: g.as_strided(g.shape, g.stride(), g.storage_offset())}.get(
        out_at, lambda: None)() if isinstance(out_at, str) else place(buf, (M, N), out_at)
    note(f"out={out_at} a={a_at} b={b_at} g={g_at} r={r_at} c={c_at}")
    ref = scale_add.reference(a.clone(), b.clone(), r=r.clone(), c=c.clone(), g=g.clone())
    before = buf.clone()
    try:
        result = coda.gemm(a, b, scale_add, out=out, r=r, c=c, g=g)
    except ValueError as e:
        note(str(e))
        assert torch.equal(buf, before), "a refused call wrote"
        return
    assert result is out
    assert_close(out, ref, a, b, f"out={out_at}")


# -- autograd ----------------------------------------------------------------------------------

def test_requires_grad_inputs_raise():
    a, b, g = randn(M, K), randn(K, N), randn(M, N)
    for name in ("a", "b", "g"):
        args = {"a": a, "b": b, "g": g}
        args[name] = args[name].clone().requires_grad_()
        with pytest.raises(RuntimeError, match=f"{name} require.*not differentiable.*coda.ops"):
            coda.gemm(args["a"], args["b"], add, g=args["g"])
        with torch.no_grad():  # no gradient wanted: fine
            assert_close(coda.gemm(args["a"], args["b"], add, g=args["g"]), add.reference(a, b, g=g), a, b, "no_grad")
    assert_close(coda.gemm(a.requires_grad_().detach(), b, add, g=g), add.reference(a.detach(), b, g=g), a, b, "detach")


def test_out_requires_grad_raises():
    a, b = randn(M, K), randn(K, N)
    w = torch.zeros(M, N, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        coda.gemm(a, b, out=w)
    y = torch.randn(M, N, device=DEVICE, requires_grad=True).exp()
    with pytest.raises(RuntimeError, match="requires grad"):
        coda.gemm(a, b, out=y)
    with torch.no_grad():  # as PyTorch: an in-place update of a parameter under no_grad is allowed
        coda.gemm(a, b, out=w)
    assert_close(w.detach(), a @ b, a, b, "no_grad leaf")


def test_out_bumps_version_counter():
    a, b = randn(M, K), randn(K, N)
    x = torch.randn(M, N, device=DEVICE, requires_grad=True)
    y = x.exp()  # exp saves its result for backward
    v = y._version
    with torch.no_grad():
        coda.gemm(a, b, add, out=y, g=y)
    assert y._version > v
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    t = randn(M, N)
    v = t._version
    coda.gemm(a, b, out={"out": t})
    assert t._version > v
    with torch.inference_mode():  # inference tensors have no version counter: still fine
        u = randn(M, N)
        coda.gemm(a, b, out=u)
