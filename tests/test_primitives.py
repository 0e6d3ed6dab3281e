"""One focused test per epilogue primitive, operand kind and gemm() feature.

Each test runs the kernel (Triton's interpreter on CPU, the GPU where there is one),
compares it with the epilogue's fp32 torch oracle (`ep.reference`), and, where the
expression is simple, checks the oracle itself against hand-written torch.
Shapes are small and ragged (M=19, N=22, K=27) so that masking matters; a 16x16x16
config forces several tiles (and more tiles than the interpreter's 3 programs).
"""

import operator
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import coda
from coda.ir.nodes import StoreOutput
from coda.runtime.device import num_programs
from conftest import DEVICE, GPU, assert_close, matrix, randn

M, N, K = 19, 22, 27
CFG = coda.Config(block_m=16, block_n=16, block_k=16)

Outputs = torch.Tensor | dict[str, torch.Tensor]


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Deterministic inputs for every test."""
    torch.manual_seed(0)


def inputs(m: int = M, n: int = N, k: int = K, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A row-major [m, k] `a` and a column-major [k, n] `b` (a transposed weight, as in x @ w.T)."""
    return randn(m, k, dtype=dtype), matrix(k, n, dtype, col_major=True)


def acc_of(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The fp32 accumulator a @ b, for hand-written expected values."""
    return a.float() @ b.float()


def as_dict(x: Outputs) -> dict[str, torch.Tensor]:
    """A single output as {"out": x}; dicts unchanged."""
    return x if isinstance(x, dict) else {"out": x}


def check(
    ep: coda.Epilogue, a: torch.Tensor, b: torch.Tensor, expected: Outputs | None = None, *,
    config: coda.Config | None = None, **operands: object,
) -> Outputs:
    """Run `ep` as a kernel and compare every output with `ep.reference` (and the oracle with
    `expected`, hand-written torch, when given). Also checks output dtypes: tiles a.dtype,
    reductions fp32. Returns the kernel's outputs."""
    if config is None:
        out = coda.gemm(a, b, ep, **operands)
    else:
        out = coda.runtime.run(ep.graph, a, b, operands, config=config)
    ref = ep.reference(a, b, **operands)
    assert isinstance(out, dict) == isinstance(ref, dict) == (not ep.graph.single)
    outs, refs = as_dict(out), as_dict(ref)
    assert outs.keys() == refs.keys()
    for o in ep.graph.outputs:
        want = a.dtype if isinstance(o, StoreOutput) else torch.float32
        assert outs[o.name].dtype == want, f"{o.name}: dtype {outs[o.name].dtype}, expected {want}"
        assert_close(outs[o.name], refs[o.name], a, b, f"kernel vs reference, output {o.name!r}")
    if expected is not None:
        exp = as_dict(expected)
        assert exp.keys() == refs.keys()
        for name, value in exp.items():
            assert_close(refs[name], value, a, b, f"reference vs torch, output {name!r}")
    return out


# -- unary functions ------------------------------------------------------------------

UNARY: dict[str, tuple[Callable, Callable[[torch.Tensor], torch.Tensor]]] = {
    "exp": (coda.exp, torch.exp),
    "log": (lambda x: coda.log(coda.abs(x) + 1.0), lambda t: torch.log(t.abs() + 1.0)),
    "sqrt": (lambda x: coda.sqrt(coda.abs(x)), lambda t: t.abs().sqrt()),
    "rsqrt": (lambda x: coda.rsqrt(coda.abs(x) + 1.0), lambda t: 1.0 / (t.abs() + 1.0).sqrt()),
    "sigmoid": (coda.sigmoid, lambda t: 1.0 / (1.0 + torch.exp(-t))),
    "silu": (coda.silu, lambda t: t / (1.0 + torch.exp(-t))),
    "gelu": (coda.gelu, lambda t: 0.5 * t * (1.0 + torch.erf(t / 2.0**0.5))),
    "tanh": (coda.tanh, torch.tanh),
    "relu": (coda.relu, lambda t: t.clamp_min(0.0)),
    "sin": (coda.sin, torch.sin),
    "cos": (coda.cos, torch.cos),
    "abs": (coda.abs, torch.abs),
    "builtin_abs": (abs, torch.abs),
    "square": (coda.square, lambda t: t * t),
    "neg": (lambda x: -x, lambda t: -t),
}


@pytest.mark.parametrize("name", list(UNARY))
def test_unary(name: str) -> None:
    fn, torch_fn = UNARY[name]
    ep = coda.epilogue(lambda acc: fn(acc))
    a, b = inputs()
    check(ep, a, b, torch_fn(acc_of(a, b)), config=CFG)


@pytest.mark.parametrize("name,dtype", [("round_bf16", torch.bfloat16), ("round_fp16", torch.float16)])
def test_round_to_a_storage_dtype(name: str, dtype: torch.dtype) -> None:
    """x as stored in bf16/fp16 and read back, round-to-nearest-even. Integer operands make the
    accumulator exact (so kernel and oracle round the same value); |acc| reaches past 2048, where
    bf16 and fp16 no longer hold every integer, so rounding and its ties happen."""
    fn = getattr(coda, name)
    ep = coda.epilogue(lambda acc: {"r": fn(acc), "r_scaled": fn(acc * 1.001)})
    a = torch.randint(-100, 101, (M, K), device=DEVICE).float()
    b = torch.randint(-12, 13, (N, K), device=DEVICE).float().T
    acc = acc_of(a, b)
    assert acc.abs().max() > 2048
    out = check(ep, a, b, {"r": acc.to(dtype).float(), "r_scaled": (acc * 1.001).to(dtype).float()}, config=CFG)
    assert not torch.equal(out["r"], acc)  # some values did round
    torch.testing.assert_close(out["r"], acc.to(dtype).float(), rtol=0, atol=0)


def test_unary_on_small_values() -> None:
    """tanh/gelu of small arguments and a saturated sigmoid (|4 acc| up to ~80)."""
    @coda.epilogue
    def small(acc):
        x = acc * 1e-3
        return {"tanh": coda.tanh(x), "gelu": coda.gelu(x), "sig": coda.sigmoid(acc * 4.0)}

    a, b = inputs()
    acc = acc_of(a, b)
    check(small, a, b, {
        "tanh": torch.tanh(acc * 1e-3), "gelu": F.gelu(acc * 1e-3), "sig": torch.sigmoid(acc * 4.0),
    })


# -- arithmetic -----------------------------------------------------------------------

# Expressions written once with operators (and builtin abs), evaluated both as an
# epilogue and as torch; Python numbers appear on either side.
ACC_ARITH: dict[str, Callable] = {
    "add_number": lambda x: x + 1.5,
    "number_add": lambda x: 1.5 + x,
    "sub_number": lambda x: x - 2.0,
    "number_sub": lambda x: 2.0 - x,
    "mul_number": lambda x: x * 3,
    "number_mul": lambda x: 3 * x,
    "div_number": lambda x: x / 4.0,
    "number_div": lambda x: 1 / (abs(x) + 1),
    "chain": lambda x: (x * x - 3.0 * x + 2.0) / (x * x + 1.0),
}


@pytest.mark.parametrize("name", list(ACC_ARITH))
def test_arithmetic_with_numbers(name: str) -> None:
    expr = ACC_ARITH[name]
    ep = coda.epilogue(lambda acc: expr(acc))
    a, b = inputs()
    check(ep, a, b, expr(acc_of(a, b)), config=CFG)


TILE_ARITH: dict[str, Callable] = {
    "add": operator.add,
    "sub": operator.sub,
    "rsub": lambda x, t: t - x,
    "mul": operator.mul,
    "div": lambda x, t: x / (abs(t) + 0.5),
    "rdiv": lambda x, t: t / (abs(x) + 1.0),
}


@pytest.mark.parametrize("name", list(TILE_ARITH))
def test_arithmetic_between_values(name: str) -> None:
    expr = TILE_ARITH[name]

    @coda.epilogue
    def ep(acc, t: coda.Tile):
        return expr(acc, t)

    a, b = inputs()
    t = randn(M, N)
    check(ep, a, b, expr(acc_of(a, b), t), config=CFG, t=t)


def test_signed_zero_constants_are_distinct() -> None:
    """0.0 and -0.0 are different constants: 1 / (|acc| * -0.0) is -inf."""
    @coda.epilogue
    def ep(acc):
        return {"pos": 1.0 / (abs(acc) * 0.0), "neg": 1.0 / (abs(acc) * -0.0)}

    a, b = inputs()
    acc = acc_of(a, b)
    out = check(ep, a, b, {"pos": 1.0 / (acc.abs() * 0.0), "neg": 1.0 / (acc.abs() * -0.0)})
    assert (out["neg"] == float("-inf")).all()


def test_single_entry_dict_is_a_dict() -> None:
    out = check(coda.epilogue(lambda acc: {"y": acc * 2.0}), *inputs())
    assert list(out) == ["y"]


# -- comparisons, where, maximum/minimum ----------------------------------------------

COMPARE = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne}


@pytest.mark.parametrize("name", list(COMPARE))
def test_comparison_and_where(name: str) -> None:
    """Compare exactly-loaded operands (so no element sits on a rounding boundary), with a
    value on each side and with a Python number on the left; use the result in where and
    as a 0/1 factor."""
    op = COMPARE[name]

    @coda.epilogue
    def ep(acc, t: coda.Tile, c: coda.VecN):
        return {
            "where": coda.where(op(t, c), acc, -acc),
            "factor": acc * op(t, c),
            "number": coda.where(op(0.0, t), acc, 1.0),
        }

    a, b = inputs()
    c = randn(N)
    t = c.expand(M, N).clone()  # equal to c where not overwritten, so eq/le/ge are exercised
    replace = torch.rand(M, N, device=DEVICE) < 0.5
    t[replace] = randn(int(replace.sum()))
    t[::3, ::4] = 0.0
    acc = acc_of(a, b)
    check(ep, a, b, {
        "where": torch.where(op(t, c), acc, -acc),
        "factor": acc * op(t, c).float(),
        "number": torch.where(op(0.0, t), acc, 1.0),
    }, config=CFG, t=t, c=c)


def test_where_with_numbers_and_float_condition() -> None:
    """where() takes Python numbers as branches and treats a float condition as `!= 0`."""
    @coda.epilogue
    def ep(acc, mask: coda.VecN):
        return {"relu": coda.where(acc > 0.0, acc, 0.0), "masked": coda.where(mask, 2.0, acc)}

    a, b = inputs()
    mask = (torch.arange(N, device=DEVICE) % 3 == 0).float()
    acc = acc_of(a, b)
    check(ep, a, b, {"relu": acc.clamp_min(0.0), "masked": torch.where(mask != 0, 2.0, acc)}, mask=mask)


def test_maximum_minimum() -> None:
    @coda.epilogue
    def ep(acc, t: coda.Tile):
        return {
            "max": coda.maximum(acc, t), "min": coda.minimum(acc, t),
            "max_number": coda.maximum(acc, 0.5), "number_min": coda.minimum(1.0, acc),
        }

    a, b = inputs()
    t = randn(M, N)
    acc = acc_of(a, b)
    check(ep, a, b, {
        "max": torch.maximum(acc, t), "min": torch.minimum(acc, t),
        "max_number": acc.clamp_min(0.5), "number_min": acc.clamp_max(1.0),
    }, config=CFG, t=t)


# -- operand kinds --------------------------------------------------------------------

@pytest.mark.parametrize("value", [1.5, -3, torch.tensor(1.5), torch.tensor(-2)], ids=["float", "int", "tensor0d", "int_tensor0d"])
def test_scalar_operand(value: object) -> None:
    @coda.epilogue
    def ep(acc, s: coda.Scalar):
        return acc * s + s

    a, b = inputs()
    s = value.to(DEVICE) if isinstance(value, torch.Tensor) else value
    sv = float(value)
    check(ep, a, b, acc_of(a, b) * sv + sv, config=CFG, s=s)


def test_vec_m_operand() -> None:
    @coda.epilogue
    def ep(acc, r: coda.VecM):
        return acc * r + r

    a, b = inputs()
    r = randn(2 * M)[::2]  # a strided view: the kernel must use its stride
    check(ep, a, b, acc_of(a, b) * r[:, None] + r[:, None], config=CFG, r=r)


def test_vec_n_operand() -> None:
    @coda.epilogue
    def ep(acc, c: coda.VecN):
        return acc * c - c

    a, b = inputs()
    c = randn(3 * N)[1::3]
    check(ep, a, b, acc_of(a, b) * c[None, :] - c[None, :], config=CFG, c=c)


def test_tile_operand() -> None:
    @coda.epilogue
    def ep(acc, t: coda.Tile):
        return acc + 2.0 * t

    a, b = inputs()
    t = randn(N, M).T  # column-major view
    check(ep, a, b, acc_of(a, b) + 2.0 * t, config=CFG, t=t)


def test_vec_n_half_width_with_pairs() -> None:
    @coda.epilogue
    def ep(acc, w: coda.VecN(width=0.5)):
        even, odd = coda.pairs(acc)
        return {
            "even": even * w, "odd": odd - w,
            "mixed": coda.interleave(even * w, odd),
            "col": even + coda.col_index(0.5),
        }

    a, b = inputs()
    w = randn(N // 2)
    acc = acc_of(a, b)
    mixed = acc.clone()
    mixed[:, 0::2] *= w
    check(ep, a, b, {
        "even": acc[:, 0::2] * w, "odd": acc[:, 1::2] - w, "mixed": mixed,
        "col": acc[:, 0::2] + torch.arange(N // 2, device=DEVICE),
    }, config=CFG, w=w)


def test_tile_double_width() -> None:
    """A saved [M, 2N] pre-activation: pairs() of it gives width-1 gate/up values."""
    @coda.epilogue
    def ep(acc, h: coda.Tile(width=2)):
        gate, up = coda.pairs(h)
        return {"y": acc * coda.silu(gate) * up, "h2": h * 2.0, "col": h + coda.col_index(2)}

    a, b = inputs()
    h = randn(M, 2 * N)
    acc = acc_of(a, b)
    gate, up = h[:, 0::2], h[:, 1::2]
    check(ep, a, b, {
        "y": acc * F.silu(gate) * up, "h2": h * 2.0,
        "col": h + torch.arange(2 * N, device=DEVICE),
    }, config=CFG, h=h)


def test_pairs_of_vec_n_operand() -> None:
    @coda.epilogue
    def ep(acc, c: coda.VecN):
        even, odd = coda.pairs(c)
        return acc + coda.interleave(odd, even)

    a, b = inputs()
    c = randn(N)
    check(ep, a, b, acc_of(a, b) + c.reshape(N // 2, 2).flip(-1).reshape(N), config=CFG, c=c)


def test_bool_and_small_integer_operands() -> None:
    @coda.epilogue
    def ep(acc, keep: coda.Tile, flag: coda.VecN, shift: coda.VecM):
        return {"keep": coda.where(keep, acc, 0.0), "flag": acc * flag, "shift": acc + shift}

    a, b = inputs()
    keep = torch.rand(M, N, device=DEVICE) < 0.5
    flag = torch.randint(0, 3, (N,), device=DEVICE, dtype=torch.uint8)
    shift = torch.randint(-5, 5, (M,), device=DEVICE, dtype=torch.int8)
    acc = acc_of(a, b)
    check(ep, a, b, {
        "keep": torch.where(keep, acc, 0.0), "flag": acc * flag.float(), "shift": acc + shift[:, None].float(),
    }, config=CFG, keep=keep, flag=flag, shift=shift)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_targets_pick_logit(dtype: torch.dtype) -> None:
    """reduce_n(where(col_index() == target, acc, 0), "sum") picks acc[i, target[i]] exactly."""
    @coda.epilogue
    def ep(acc, target: coda.VecM):
        return coda.reduce_n(coda.where(coda.col_index() == target, acc, 0.0), "sum")

    a, b = inputs()
    target = torch.randint(0, N, (M,), device=DEVICE, dtype=dtype)
    target[0], target[1] = 0, N - 1  # both ends, including the ragged last tile
    picked = check(ep, a, b, acc_of(a, b).gather(1, target[:, None].long())[:, 0], config=CFG, target=target)
    plain = coda.runtime.run(coda.runtime.graph_of(None), a, b, {}, config=CFG)
    assert torch.equal(picked, plain.gather(1, target[:, None].long())[:, 0])


def test_integer_vec_m_in_arithmetic() -> None:
    """An integer operand used arithmetically is converted to fp32."""
    @coda.epilogue
    def ep(acc, pos: coda.VecM):
        return acc * pos + 0.5

    a, b = inputs()
    pos = torch.arange(M, device=DEVICE, dtype=torch.int32) * 3 - 20
    check(ep, a, b, acc_of(a, b) * pos[:, None].float() + 0.5, pos=pos)


def test_row_and_col_index() -> None:
    @coda.epilogue
    def ep(acc, pos: coda.VecM):
        return {
            "rows": acc + 100.0 * coda.row_index(),
            "cols": acc - coda.col_index(),
            "upper": coda.where(coda.col_index() >= coda.row_index(), acc, 0.0),
            "mine": coda.where(coda.row_index() == pos, acc, -1.0),
        }

    a, b = inputs()
    pos = torch.arange(M, device=DEVICE)
    pos[::2] = -1
    acc = acc_of(a, b)
    rows, cols = torch.arange(M, device=DEVICE)[:, None], torch.arange(N, device=DEVICE)[None, :]
    check(ep, a, b, {
        "rows": acc + 100.0 * rows, "cols": acc - cols,
        "upper": torch.where(cols >= rows, acc, 0.0),
        "mine": torch.where(rows == pos[:, None], acc, -1.0),
    }, config=CFG, pos=pos)


# -- pairs / interleave ---------------------------------------------------------------

def test_pairs_interleave_round_trip_is_exact() -> None:
    @coda.epilogue
    def ep(acc):
        even, odd = coda.pairs(acc)
        return {"same": coda.interleave(even, odd), "swapped": coda.interleave(odd, even)}

    a, b = inputs()
    out = check(ep, a, b, config=CFG)
    plain = coda.runtime.run(coda.runtime.graph_of(None), a, b, {}, config=CFG)
    assert torch.equal(out["same"], plain)
    swapped = plain.reshape(M, N // 2, 2).flip(-1).reshape(M, N)
    assert torch.equal(out["swapped"], swapped)


# -- reductions -----------------------------------------------------------------------

# Inputs chosen so that a masked-out column (acc == 0 there) would change the result
# if the kernel did not replace it with the reduction's identity.
REDUCE_N: dict[str, tuple[Callable, Callable[[torch.Tensor], torch.Tensor]]] = {
    "sum": (lambda x: x + 1.0, lambda t: (t + 1.0).sum(dim=1)),
    "max": (lambda x: -abs(x) - 1.0, lambda t: (-t.abs() - 1.0).amax(dim=1)),
    "logsumexp": (lambda x: -abs(x), lambda t: torch.logsumexp(-t.abs(), dim=1)),
}


@pytest.mark.parametrize("op", list(REDUCE_N))
def test_reduce_n_ragged(op: str) -> None:
    pre, torch_fn = REDUCE_N[op]
    ep = coda.epilogue(lambda acc: coda.reduce_n(pre(acc), op))
    a, b = inputs()
    check(ep, a, b, torch_fn(acc_of(a, b)), config=CFG)


def test_reduce_n_logsumexp_large_values() -> None:
    """logsumexp must be computed stably (exp(acc * 20) overflows fp32)."""
    ep = coda.epilogue(lambda acc: coda.reduce_n(acc * 20.0, "logsumexp"))
    a, b = inputs()
    out = check(ep, a, b, torch.logsumexp(acc_of(a, b) * 20.0, dim=1), config=CFG)
    assert torch.isfinite(out).all()


def test_reduce_n_masked_with_minus_inf() -> None:
    """Columns set to -inf (as cross-entropy masking does): tiles and groups that are all
    -inf give -inf for max/logsumexp, not NaN."""
    @coda.epilogue
    def ep(acc):
        x = coda.where(coda.col_index() < 5, acc, float("-inf"))
        return {"max": coda.reduce_n(x, "max"), "lse": coda.reduce_n(x, "logsumexp"), "group": coda.reduce_n(x, "logsumexp", group=4)}

    n = 24
    a, b = inputs(n=n)
    acc = acc_of(a, b)
    group = torch.full((M, n // 4), float("-inf"), device=DEVICE)
    group[:, 0] = torch.logsumexp(acc[:, :4], dim=1)
    group[:, 1] = acc[:, 4]
    check(ep, a, b, {"max": acc[:, :5].amax(1), "lse": torch.logsumexp(acc[:, :5], dim=1), "group": group}, config=CFG)


def nan_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, t, maximum(a @ b, t)) with two NaN elements in t, one of them in the ragged last tile."""
    a, b = inputs()
    t = randn(M, N)
    t[3, 4] = t[5, 17] = float("nan")
    return a, b, t, torch.maximum(acc_of(a, b), t)


def test_nan_propagates_through_elementwise_and_sums() -> None:
    """NaN in, NaN out where torch gives NaN (the oracle's semantics)."""
    @coda.epilogue
    def ep(acc, t: coda.Tile):
        x = coda.maximum(acc, t)
        return {
            "max": x, "min": coda.minimum(t, acc), "sum": coda.reduce_n(x, "sum"),
            "lse": coda.reduce_n(x, "logsumexp"), "cols": coda.reduce_m(x),
        }

    a, b, t, x = nan_inputs()
    check(ep, a, b, {
        "max": x, "min": torch.minimum(t, acc_of(a, b)), "sum": x.sum(1), "lse": torch.logsumexp(x, 1), "cols": x.sum(0),
    }, config=CFG, t=t)


def test_nan_propagates_through_reduce_max() -> None:
    """reduce_n(x, "max") of a row holding a NaN is NaN, as torch.amax (and the oracle) give."""
    @coda.epilogue
    def ep(acc, t: coda.Tile):
        x = coda.maximum(acc, t)
        return {"rmax": coda.reduce_n(x, "max"), "gmax": coda.reduce_n(x, "max", group=2)}

    a, b, t, x = nan_inputs()
    check(ep, a, b, {"rmax": x.amax(1), "gmax": x.reshape(M, N // 2, 2).amax(-1)}, config=CFG, t=t)


def test_reduce_n_of_half_width_value() -> None:
    @coda.epilogue
    def ep(acc):
        gate, up = coda.pairs(acc)
        return coda.reduce_n(gate * up + 1.0, "sum")

    a, b = inputs()
    acc = acc_of(a, b)
    check(ep, a, b, (acc[:, 0::2] * acc[:, 1::2] + 1.0).sum(dim=1), config=CFG)


@pytest.mark.parametrize("op", list(REDUCE_N))
def test_reduce_n_group(op: str) -> None:
    """group=4 gives one value per 4 columns: [M, N // 4]; N=20 leaves a ragged last tile."""
    pre, _ = REDUCE_N[op]
    ep = coda.epilogue(lambda acc: coda.reduce_n(pre(acc), op, group=4))
    n = 20
    a, b = inputs(n=n)
    grouped = pre(acc_of(a, b)).reshape(M, n // 4, 4)
    expected = {"sum": grouped.sum(-1), "max": grouped.amax(-1), "logsumexp": torch.logsumexp(grouped, -1)}[op]
    out = check(ep, a, b, expected, config=CFG)
    assert out.shape == (M, n // 4)


def _groups(x: torch.Tensor, g: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Hand-written group value: each row's groups of g columns reduced, repeated over the group."""
    return reduce(x.reshape(x.shape[0], -1, g)).expand(-1, -1, g).reshape(x.shape)


def test_group_values_at_every_width() -> None:
    """group_sum / group_max as values, of a full-width tile (an RMSNorm per 4 columns), of a
    pair half (groups of 2 pair-halves = 4 columns of N) and of a double-width Tile operand;
    N = 20 leaves a ragged last tile of whole groups."""
    @coda.epilogue
    def ep(acc, h: coda.Tile(width=2)):
        gate, up = coda.pairs(acc)
        return {"norm": acc * coda.rsqrt(coda.group_sum(acc * acc, 4) * 0.25 + 1e-6),
                "half": coda.group_max(gate, 2) - up,
                "wide": coda.interleave(gate, up) + coda.pairs(coda.group_sum(h, 8))[0]}

    n = 20
    a, b = inputs(n=n)
    h = randn(M, 2 * n)
    acc = acc_of(a, b)
    total = lambda t: t.sum(-1, keepdim=True)  # noqa: E731
    check(ep, a, b, {
        "norm": acc * torch.rsqrt(_groups(acc * acc, 4, total) * 0.25 + 1e-6),
        "half": _groups(acc[:, 0::2], 2, lambda t: t.amax(-1, keepdim=True)) - acc[:, 1::2],
        "wide": acc + _groups(h, 8, total)[:, 0::2],
    }, config=CFG, h=h)


def test_nan_propagates_through_group_max() -> None:
    """group_max of a group holding a NaN is NaN in the whole group (as torch.amax), others exact."""
    @coda.epilogue
    def ep(acc, t: coda.Tile):
        return coda.group_max(coda.maximum(acc, t), 2)

    a, b, t, x = nan_inputs()
    check(ep, a, b, _groups(x, 2, lambda v: v.amax(-1, keepdim=True)), config=CFG, t=t)


def test_reduce_m_sum_ragged() -> None:
    @coda.epilogue
    def ep(acc, c: coda.VecN):
        return {"cols": coda.reduce_m(acc * c + 1.0, "sum"), "half": coda.reduce_m(coda.pairs(acc)[1] + 1.0)}

    a, b = inputs()
    c = randn(N)
    acc = acc_of(a, b)
    check(ep, a, b, {"cols": (acc * c + 1.0).sum(dim=0), "half": (acc[:, 1::2] + 1.0).sum(dim=0)}, config=CFG, c=c)


def test_reductions_of_double_width_value() -> None:
    @coda.epilogue
    def ep(acc, h: coda.Tile(width=2)):
        return {"cols": coda.reduce_m(h * 2.0), "groups": coda.reduce_n(h + 1.0, "sum", group=4), "max": coda.reduce_n(h, "max")}

    a, b = inputs()
    h = randn(M, 2 * N)
    check(ep, a, b, {"cols": (h * 2.0).sum(0), "groups": (h + 1.0).reshape(M, 2 * N // 4, 4).sum(-1), "max": h.amax(1)}, config=CFG, h=h)


def test_multiple_outputs() -> None:
    @coda.epilogue
    def ep(acc, r: coda.VecM, c: coda.VecN):
        z = acc * r
        return {"z": z, "y": coda.silu(z) + c, "rows": coda.reduce_n(z, "max"), "cols": coda.reduce_m(z, "sum")}

    a, b = inputs()
    r, c = randn(M), randn(N)
    z = acc_of(a, b) * r[:, None]
    out = check(ep, a, b, {"z": z, "y": F.silu(z) + c, "rows": z.amax(1), "cols": z.sum(0)}, r=r, c=c)
    assert {k: tuple(v.shape) for k, v in out.items()} == {"z": (M, N), "y": (M, N), "rows": (M,), "cols": (N,)}


# -- the persistent tile loop ---------------------------------------------------------

@pytest.mark.parametrize("group_m", [1, 2, 8])
def test_more_tiles_than_programs(group_m: int) -> None:
    """Every tile lands in its place when each program walks several tiles."""
    m, n, k = 50, 40, 20
    tiles = 4 * 3
    if not GPU:
        assert num_programs(DEVICE) < tiles
    config = coda.Config(block_m=16, block_n=16, block_k=16, group_m=group_m)

    @coda.epilogue
    def ep(acc):
        placed = acc + 1000.0 * coda.row_index() + coda.col_index()
        return {"placed": placed, "rows": coda.reduce_n(acc + 1.0, "sum"), "cols": coda.reduce_m(acc + 1.0, "sum")}

    a, b = inputs(m, n, k)
    acc = acc_of(a, b)
    idx = 1000.0 * torch.arange(m, device=DEVICE)[:, None] + torch.arange(n, device=DEVICE)[None, :]
    check(ep, a, b, {"placed": acc + idx, "rows": (acc + 1.0).sum(1), "cols": (acc + 1.0).sum(0)}, config=config)


# -- plain gemm, memory orders, dtypes ------------------------------------------------

@pytest.mark.parametrize("a_col_major", [False, True], ids=["a_row", "a_col"])
@pytest.mark.parametrize("b_col_major", [False, True], ids=["b_row", "b_col"])
@pytest.mark.parametrize("shape", [(M, N, K), (24, 40, 32)], ids=["ragged", "aligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_plain_gemm_memory_orders(dtype: torch.dtype, shape: tuple[int, int, int], a_col_major: bool, b_col_major: bool) -> None:
    """Row- and column-major a and b; "aligned" shapes are eligible for TMA descriptors."""
    m, n, k = shape
    a = matrix(m, k, dtype, a_col_major)
    b = matrix(k, n, dtype, b_col_major)
    out = coda.gemm(a, b)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close(out, acc_of(a, b), a, b, "plain gemm")


def test_plain_gemm_of_transposed_weight() -> None:
    """coda.gemm(x, w.T) is x @ w.T, with w.T read in place (no copy)."""
    x, w = randn(M, K), randn(N, K)
    assert not w.T.is_contiguous()
    assert_close(coda.gemm(x, w.T), x @ w.T, x, w.T, "x @ w.T")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype: torch.dtype) -> None:
    """bf16/fp16 inputs: math in fp32, tiles stored in a.dtype, reductions in fp32."""
    @coda.epilogue
    def ep(acc, c: coda.VecN, r: coda.VecM):
        return {"y": coda.silu(acc) * c + r, "s": coda.reduce_n(acc, "sum")}

    a, b = inputs(dtype=dtype)
    c, r = randn(N, dtype=dtype), randn(M)  # operands may have their own float dtype
    acc = acc_of(a, b)
    check(ep, a, b, {"y": F.silu(acc) * c.float() + r[:, None], "s": acc.sum(1)}, config=CFG, c=c, r=r)
    plain = coda.gemm(a, b)
    assert plain.dtype == dtype
    assert_close(plain, acc, a, b, "plain low-precision gemm")


# -- out= ----------------------------------------------------------------------------

@pytest.mark.parametrize("col_major", [False, True], ids=["row_major", "col_major"])
def test_out_tensor(col_major: bool) -> None:
    @coda.epilogue
    def ep(acc, r: coda.VecM):
        return acc * r

    a, b = inputs()
    r = randn(M)
    buf = torch.full((N, M), float("nan"), device=DEVICE).T if col_major else torch.full((M, N), float("nan"), device=DEVICE)
    res = coda.gemm(a, b, ep, out=buf, r=r)
    assert res is buf
    assert_close(buf, ep.reference(a, b, r=r), a, b, "out= tensor")


def test_out_tensor_plain_gemm_and_wider_dtype() -> None:
    """out= may choose a wider dtype than a: a bf16 GEMM stored to fp32 keeps fp32 accuracy."""
    a, b = inputs(dtype=torch.bfloat16)
    buf = torch.zeros(M, N, device=DEVICE)
    res = coda.gemm(a, b, out=buf)
    assert res is buf
    assert_close(buf, acc_of(a, b), a, b, "bf16 gemm into fp32 out=")


def test_out_dict() -> None:
    @coda.epilogue
    def ep(acc):
        return {"z": acc + 1.0, "y": acc * 2.0, "rows": coda.reduce_n(acc, "sum")}

    a, b = inputs()
    z, rows = torch.zeros(M, N, device=DEVICE), torch.zeros(M, device=DEVICE)
    res = coda.gemm(a, b, ep, out={"z": z, "rows": rows})
    assert res["z"] is z and res["rows"] is rows
    ref = ep.reference(a, b)
    for name in ("z", "y", "rows"):
        assert_close(res[name], ref[name], a, b, f"out= dict, {name}")


@pytest.mark.parametrize("dtype, config", [
    (torch.float32, None), (torch.float32, CFG), (torch.bfloat16, CFG),
], ids=["fp32-default", "fp32-16x16x16", "bf16-16x16x16"])
def test_in_place_accumulation(dtype: torch.dtype, config: coda.Config | None) -> None:
    """out=g with g also a Tile operand accumulates a @ b into g itself."""
    @coda.epilogue
    def add_into(acc, g: coda.Tile):
        return acc + g

    a, b = inputs(dtype=dtype)
    g = randn(M, N, dtype=dtype)
    old = g.to(torch.float32, copy=True)
    ptr = g.data_ptr()
    if config is None:
        res = coda.gemm(a, b, add_into, out=g, g=g)
    else:
        res = coda.runtime.run(add_into.graph, a, b, {"g": g}, out=g, config=config)
    assert res is g and g.data_ptr() == ptr
    assert_close(g, old + acc_of(a, b), a, b, "in-place accumulation")
