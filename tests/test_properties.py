"""Property tests (hypothesis): kernels agree with the fp32 oracle `ep.reference`.

* Shapes: ragged M, N, K (M == N included), both memory orders of a and b, fp32, bf16
  and fp16, for a row-scale + pairs + SwiGLU epilogue and for the plain GEMM, with a
  small config so that every output spans several tiles.
* Random epilogue programs over every primitive: operands of each kind and width
  (float, integer and bool), row/column indices, unary functions, arithmetic,
  comparisons and where, maximum/minimum, pairs/interleave, group_sum/group_max values
  (groups of 2-8 columns at any width), and 1-3 outputs including
  reduce_n sum/max/logsumexp, reduce_n group=2 and reduce_m sum.
* IR properties: tracing is deterministic, the hash tells programs apart, the graph
  survives its canonical JSON, printing names every output.

Random programs keep the comparison meaningful without loosening anything: a and b
hold small integers (max |a| = max |b| = 3), so the fp32 accumulator is exact in any
summation order, and float operands are multiples of 1/4. The generator tracks, for
every value, a bound on its magnitude and on |kernel - oracle| and builds only ops
whose outputs stay within the tolerance that `conftest.assert_close` derives from
dtype and K (transcendentals appear in bounded forms such as log(|x| + 1), products
need one bounded factor, comparisons and sums see only exactly computed values).
"""

import math
import operator
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import coda
from coda.ir import Graph, Kind
from coda.ir.nodes import BINARY_FNS, UNARY_FNS, StoreOutput
from coda.ir.types import combine
from coda.runtime import graph_of
from conftest import DEVICE, assert_close, matrix, scale

BLOCKS = dict(block_m=scale(16, 64), block_n=scale(16, 64), block_k=scale(16, 32))  # several tiles per output
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

Outputs = torch.Tensor | dict[str, torch.Tensor]

def _config(tma: bool, flat: bool, subtile: int) -> coda.Config:
    """BLOCKS, or with the epilogue in `subtile` column subtiles of BLOCKS' width (same epilogue tile)."""
    blocks = {**BLOCKS, "block_n": BLOCKS["block_n"] * subtile}
    return coda.Config(**blocks, tma_store=tma, flatten=flat, subtile=subtile)


configs = st.builds(_config, st.booleans(), st.booleans(), st.sampled_from([1, 2]))


def as_dict(x: Outputs) -> dict[str, torch.Tensor]:
    """A single output as {"out": x}; dicts unchanged."""
    return x if isinstance(x, dict) else {"out": x}


def compare(graph: Graph, out: Outputs, ref: Outputs, a: torch.Tensor, b: torch.Tensor) -> None:
    """Kernel outputs vs the oracle: same structure, tiles in a.dtype, reductions fp32, values close."""
    assert isinstance(out, dict) == isinstance(ref, dict) == (not graph.single)
    outs, refs = as_dict(out), as_dict(ref)
    assert outs.keys() == refs.keys()
    for o in graph.outputs:
        want = a.dtype if isinstance(o, StoreOutput) else torch.float32
        assert outs[o.name].dtype == want, f"{o.name}: dtype {outs[o.name].dtype}, expected {want}"
        assert outs[o.name].shape == refs[o.name].shape, f"{o.name}: shape {tuple(outs[o.name].shape)}"
        assert_close(outs[o.name], refs[o.name], a, b, f"output {o.name!r}")


# -- a. shapes, memory orders and dtypes -----------------------------------------------

SIZE = scale(48, 640)


@coda.epilogue
def swiglu_rows(acc, rstd: coda.VecM):
    z = acc * rstd
    gate, up = coda.pairs(z)
    return {"z": z, "y": coda.silu(gate) * up}


@st.composite
def gemm_shapes(draw: st.DrawFn, even_n: bool) -> tuple[int, int, int]:
    """(M, N, K), ragged, sometimes square in M and N; N even when `even_n`."""
    n = draw(st.integers(1, SIZE // 2)) * 2 if even_n else draw(st.integers(1, SIZE))
    m = n if draw(st.booleans()) else draw(st.integers(1, SIZE))
    return m, n, draw(st.integers(1, SIZE))


layouts = st.tuples(st.sampled_from(FLOAT_DTYPES), st.booleans(), st.booleans(), st.integers(0, 2**31 - 1))


@pytest.mark.slow
@settings(max_examples=scale(60, 25), **SETTINGS)
@given(shape=gemm_shapes(even_n=False), layout=layouts, config=configs)
def test_plain_gemm_shapes(shape: tuple[int, int, int], layout: tuple[torch.dtype, bool, bool, int],
                           config: coda.Config) -> None:
    (m, n, k), (dtype, a_col, b_col, seed) = shape, layout
    torch.manual_seed(seed)
    a, b = matrix(m, k, dtype, a_col), matrix(k, n, dtype, b_col)
    graph = graph_of(None)
    out = coda.runtime.run(graph, a, b, {}, config=config)
    compare(graph, out, a.float() @ b.float(), a, b)


@pytest.mark.slow
@settings(max_examples=scale(60, 25), **SETTINGS)
@given(shape=gemm_shapes(even_n=True), layout=layouts, config=configs)
def test_swiglu_shapes(shape: tuple[int, int, int], layout: tuple[torch.dtype, bool, bool, int],
                       config: coda.Config) -> None:
    (m, n, k), (dtype, a_col, b_col, seed) = shape, layout
    torch.manual_seed(seed)
    a, b = matrix(m, k, dtype, a_col), matrix(k, n, dtype, b_col)
    rstd = (torch.rand(m, device=DEVICE) + 0.5) / math.sqrt(k)  # an RMSNorm-like scale: z is O(1)
    out = coda.runtime.run(swiglu_rows.graph, a, b, {"rstd": rstd}, config=config)
    compare(swiglu_rows.graph, out, swiglu_rows.reference(a, b, rstd=rstd), a, b)


# -- b. random epilogue programs -------------------------------------------------------

M_MAX, N_MAX, K_MAX = scale(24, 160), scale(36, 160), scale(20, 96)
AMAX = 3  # max |a| = max |b|: entries are integers in [-3, 3] with a[0, 0] = b[0, 0] = 3
EXACT = 2.0**24  # fp32 holds every multiple of 2**-frac up to EXACT * 2**-frac
MAG_CAP = 2.0**14  # every value stays finite in fp16
C_FN = 3.0  # |kernel - torch| of a transcendental: C_FN eps32 absolute + C_FN eps32 relative (measured <= 2.5)
C_LSE = 8.0  # absolute error of a logsumexp's log-sum part, in eps32
CONSTS = (0.5, 2.0, -1.0, 0.25, 1.5, -3.0)
WIDTHS = (Fraction(1, 2), Fraction(1), Fraction(2))


@dataclass(frozen=True)
class Val:
    """A value of a generated program, with the bounds that keep its comparison meaningful.

    `err` bounds |kernel - oracle| in units of eps32 (0: computed exactly on both sides);
    `rnd` is the part of `err` that is relative to the value itself (a rounding, or a
    transcendental's relative error), which the relative tolerance covers when the value
    is an output. Exact values are multiples of 2**-frac.
    """

    expr: str
    kind: Kind
    width: Fraction
    dtype: str  # "float" | "int" | "bool"
    mag: float
    err: float = 0.0
    frac: int = 0
    rnd: float = 0.0
    const: bool = False

    @property
    def exact(self) -> bool:
        return self.err == 0


@dataclass(frozen=True)
class Param:
    """A declared operand: its annotation and how to make its value."""

    name: str
    kind: Kind
    width: Fraction
    dtype: Optional[torch.dtype]  # None: a Python number (Scalar only)

    @property
    def annotation(self) -> str:
        cls = {Kind.SCALAR: "Scalar", Kind.VEC_M: "VecM", Kind.VEC_N: "VecN", Kind.TILE: "Tile"}[self.kind]
        return f"coda.{cls}" if self.width == 1 else f"coda.{cls}(width={float(self.width)})"

    def value(self) -> Val:
        if self.dtype is None or self.dtype.is_floating_point:
            return Val(self.name, self.kind, self.width, "float", 1.0, frac=2)
        if self.dtype == torch.bool:
            return Val(self.name, self.kind, self.width, "bool", 1.0)
        return Val(self.name, self.kind, self.width, "int", 31.0)

    def make(self, m: int, n: int, gen: torch.Generator) -> object:
        """Multiples of 1/4 in [-1, 1] (float), integers in [0, 32) (int), or bools."""
        cols = int(n * self.width)
        shape = {Kind.SCALAR: (), Kind.VEC_M: (m,), Kind.VEC_N: (cols,), Kind.TILE: (m, cols)}[self.kind]
        if self.dtype is None:
            return torch.randint(-4, 5, (), generator=gen).item() / 4
        if self.dtype == torch.bool:
            return (torch.randint(0, 2, shape, generator=gen) == 1).to(DEVICE)
        if self.dtype.is_floating_point:
            return (torch.randint(-4, 5, shape, generator=gen) / 4).to(self.dtype).to(DEVICE)
        return torch.randint(0, 32, shape, generator=gen).to(self.dtype).to(DEVICE)


@dataclass
class Program:
    """A random epilogue as Python source: operands, statements and outputs."""

    params: list[Param]
    lines: list[str] = field(default_factory=list)
    outputs: list[tuple[str, str]] = field(default_factory=list)  # (name, expression)
    single: bool = False

    def source(self, name: str = "random_epilogue") -> str:
        args = ", ".join(["acc"] + [f"{p.name}: {p.annotation}" for p in self.params])
        if self.single:
            ret = self.outputs[0][1]
        else:
            ret = "{" + ", ".join(f"{k!r}: {v}" for k, v in self.outputs) + "}"
        body = "".join(f"    {line}\n" for line in self.lines)
        return f"def {name}({args}):\n{body}    return {ret}\n"

    def epilogue(self, name: str = "random_epilogue") -> coda.Epilogue:
        namespace: dict[str, object] = {"coda": coda}
        exec(self.source(name), namespace)  # noqa: S102 - our own generated source
        return coda.epilogue(namespace[name])


def _cols_compatible(x: Val, y: Val) -> bool:
    """Whether x and y broadcast together (column widths agree when both have columns)."""
    return not (x.kind.has_cols and y.kind.has_cols and x.width != y.width)


def _combined_kind(*vals: Val) -> tuple[Kind, Fraction]:
    """(kind, width) of an elementwise op over broadcast-compatible values."""
    kind, width = vals[0].kind, vals[0].width
    for v in vals[1:]:
        kind, width = combine((kind, width), (v.kind, v.width), "generated op")
    return kind, width


def _exactly(mag: float, frac: int) -> bool:
    """Whether every multiple of 2**-frac up to mag is an fp32 number."""
    return mag * 2.0**frac <= EXACT


def _rounded(kind: Kind, width: Fraction, mag: float, err: float, frac: int, exact_inputs: bool) -> dict:
    """Fields of an add/sub/mul/square result: exact when its inputs are and it fits fp32."""
    if exact_inputs and _exactly(mag, frac):
        return dict(kind=kind, width=width, dtype="float", mag=mag, frac=frac)
    return dict(kind=kind, width=width, dtype="float", mag=mag, err=err + mag, rnd=mag)


def _selected(kind: Kind, width: Fraction, *vals: Val) -> dict:
    """Fields of a result that is one of its inputs elementwise (where, maximum, interleave, ...)."""
    return dict(kind=kind, width=width, dtype="float", mag=max(v.mag for v in vals), err=max(v.err for v in vals),
                frac=max(v.frac for v in vals), rnd=max(v.rnd for v in vals))


def _plus_one_error(x: Val) -> float:
    """Error bound of |x| + 1 (exact when x is and the sum fits fp32)."""
    return x.err + (0.0 if x.exact and _exactly(x.mag + 1.0, x.frac) else x.mag + 1.0)


class Builder:
    """Draws a random program step by step, keeping a pool of values and their bounds.

    A value enters the pool only if it could be an output: its error, less its own
    relative rounding, is within the absolute tolerance for this K.
    """

    def __init__(self, draw: st.DrawFn, m: int, n: int, k: int, params: list[Param]) -> None:
        self.draw, self.m, self.n = draw, m, n
        self.budget = 2.0 * k * AMAX * AMAX  # assert_close's atol, in eps32
        self.program = Program(params)
        acc = Val("acc", Kind.TILE, Fraction(1), "float", float(k * AMAX * AMAX))
        self.pool: list[Val] = [acc] + [p.value() for p in params]
        self.consts = [Val(f"({c!r})", Kind.SCALAR, Fraction(1), "float", abs(c), frac=2, const=True) for c in CONSTS]

    def pick(self, vals: list[Val]) -> Optional[Val]:
        """One of `vals`, often one of the newest (so that steps build on each other)."""
        if not vals:
            return None
        if len(vals) > 2 and self.draw(st.integers(0, 3)):
            vals = vals[-2:]
        return self.draw(st.sampled_from(vals))

    def values(self, pred: Callable[[Val], bool] = lambda v: True, consts: bool = False) -> list[Val]:
        return [v for v in self.pool + (self.consts if consts else []) if pred(v)]

    def emit(self, expr: str, **fields: object) -> None:
        val = Val(f"v{len(self.program.lines)}", **fields)  # type: ignore[arg-type]
        if val.mag <= MAG_CAP and val.err - val.rnd <= self.budget:
            self.program.lines.append(f"{val.expr} = {expr}")
            self.pool.append(val)

    # -- steps: each draws its inputs and adds at most a few values ----------------------
    def unary_exact(self) -> None:
        x = self.pick(self.values())
        fns = ["neg", "abs", "relu", "square"] + (["round_bf16", "round_fp16"] if x.exact else [])
        fn = self.draw(st.sampled_from(fns))
        if fn.startswith("round_"):
            # Both sides round the same exact value: exact again, on a coarser grid (so still a
            # multiple of 2**-frac), and at most one bf16/fp16 ulp larger in magnitude.
            self.emit(f"coda.{fn}({x.expr})", kind=x.kind, width=x.width, dtype="float", mag=x.mag * (1 + 2.0**-7),
                      frac=x.frac)
            return
        if fn == "square":
            err = 2 * x.mag * x.err + x.err**2
            self.emit(f"coda.square({x.expr})", **_rounded(x.kind, x.width, x.mag**2, err, 2 * x.frac, x.exact))
            return
        expr = {"neg": f"-{x.expr}", "abs": f"coda.abs({x.expr})", "relu": f"coda.relu({x.expr})"}[fn]
        self.emit(expr, **_selected(x.kind, x.width, x))

    def squash(self) -> None:
        """A transcendental in a bounded form. Each form is (source, slope bound, input error,
        |result| bound); its own error is C_FN eps32 absolute plus C_FN eps32 relative."""
        x = self.pick(self.values())
        d = f"(coda.abs({x.expr}) + 1.0)"
        forms = {
            "tanh": (f"coda.tanh({x.expr})", 1.0, x.err, 1.0),
            "sigmoid": (f"coda.sigmoid({x.expr})", 0.25, x.err, 1.0),
            "exp_neg": (f"coda.exp(-coda.abs({x.expr}))", 1.0, x.err, 1.0),
            "rsqrt": (f"coda.rsqrt({d})", 0.5, _plus_one_error(x), 1.0),
            "log": (f"coda.log({d})", 1.0, _plus_one_error(x), math.log(x.mag + 1.0)),
            "silu": (f"coda.silu({x.expr})", 1.1, x.err, max(x.mag, 0.3)),
            "gelu": (f"coda.gelu({x.expr})", 1.13, x.err, max(x.mag, 0.2)),
        }
        if x.exact:  # sqrt has an unbounded slope at 0: only of exactly computed values
            forms["sqrt"] = (f"coda.sqrt(coda.abs({x.expr}))", 0.0, 0.0, math.sqrt(x.mag))
        if x.mag <= 8:
            forms["sin"] = (f"coda.sin({x.expr})", 1.0, x.err, 1.0)
            forms["cos"] = (f"coda.cos({x.expr})", 1.0, x.err, 1.0)
        if x.mag <= 2:
            forms["exp"] = (f"coda.exp({x.expr})", math.exp(x.mag), x.err, math.exp(x.mag))
        expr, slope, err_in, mag = forms[self.draw(st.sampled_from(sorted(forms)))]
        rnd = C_FN * mag
        self.emit(expr, kind=x.kind, width=x.width, dtype="float", mag=mag, err=slope * err_in + C_FN + rnd, rnd=rnd)

    def binary(self) -> None:
        x = self.pick(self.values())
        y = self.pick(self.values(lambda v: _cols_compatible(x, v), consts=True))
        if self.draw(st.booleans()):
            x, y = y, x
        kind, width = _combined_kind(x, y)
        fn = self.draw(st.sampled_from(["add", "sub", "mul", "div", "maximum", "minimum"]))
        exact = x.exact and y.exact
        if fn in ("add", "sub"):
            fields = _rounded(kind, width, x.mag + y.mag, x.err + y.err, max(x.frac, y.frac), exact)
            self.emit(f"{x.expr} {'+' if fn == 'add' else '-'} {y.expr}", **fields)
        elif fn == "mul" and min(x.mag, y.mag) <= 4:  # one factor must be bounded
            err = x.mag * y.err + y.mag * x.err + x.err * y.err
            self.emit(f"{x.expr} * {y.expr}", **_rounded(kind, width, x.mag * y.mag, err, x.frac + y.frac, exact))
        elif fn == "div":  # x / (|y| + 1): the slope in y is at most |x|
            err = x.err + x.mag * _plus_one_error(y) + x.mag
            expr = f"{x.expr} / ({y.mag + 1.0!r})" if y.const else f"{x.expr} / (coda.abs({y.expr}) + 1.0)"
            self.emit(expr, kind=kind, width=width, dtype="float", mag=x.mag, err=err, rnd=x.mag)
        elif fn in ("maximum", "minimum"):
            self.emit(f"coda.{fn}({x.expr}, {y.expr})", **_selected(kind, width, x, y))

    def compare_where(self) -> None:
        """A comparison of exactly computed values (so both sides agree on it), then where."""
        x = self.pick(self.values(lambda v: v.exact))
        y = self.pick(self.values(lambda v: v.exact and _cols_compatible(x, v), consts=True))
        op = self.draw(st.sampled_from(["<", "<=", ">", ">=", "==", "!="]))
        kind, width = _combined_kind(x, y)
        self.emit(f"{x.expr} {op} {y.expr}", kind=kind, width=width, dtype="bool", mag=1.0)
        cond = self.pick(self.values(lambda v: v.exact))  # a bool, or any exact value (!= 0)
        p = self.pick(self.values(lambda v: _cols_compatible(cond, v), consts=True))
        q = self.pick(self.values(lambda v: _cols_compatible(cond, v) and _cols_compatible(p, v), consts=True))
        kind, width = _combined_kind(cond, p, q)
        self.emit(f"coda.where({cond.expr}, {p.expr}, {q.expr})", **_selected(kind, width, p, q))

    def pairs(self) -> None:
        x = self.pick(self.values(lambda v: v.kind.has_cols and v.width >= 1))
        if x is None:
            return
        even, odd = f"v{len(self.program.lines)}_even", f"v{len(self.program.lines)}_odd"
        self.program.lines.append(f"{even}, {odd} = coda.pairs({x.expr})")
        for name in (even, odd):
            self.pool.append(Val(name, x.kind, x.width / 2, x.dtype, x.mag, x.err, x.frac, x.rnd))

    def interleave(self) -> None:
        x = self.pick(self.values(lambda v: v.kind.has_cols and v.width <= 1))
        if x is None:
            return
        y = self.pick(self.values(lambda v: v.kind == x.kind and v.width == x.width))
        self.emit(f"coda.interleave({x.expr}, {y.expr})", **_selected(x.kind, x.width * 2, x, y))

    def index(self) -> None:
        if self.draw(st.booleans()):
            self.emit("coda.row_index()", kind=Kind.VEC_M, width=Fraction(1), dtype="int", mag=float(self.m))
            return
        w = self.draw(st.sampled_from(WIDTHS))
        arg = "" if w == 1 else repr(float(w))
        self.emit(f"coda.col_index({arg})", kind=Kind.VEC_N, width=w, dtype="int", mag=float(self.n * w))

    def group(self) -> None:
        """group_sum / group_max of a tile, in groups whole in N and in every epilogue subtile
        (EPI_N columns at the value's width). A sum is exact when its inputs and partial sums
        are; otherwise its summation order differs from torch's by at most g^2 * mag eps32."""
        x = self.pick(self.values(lambda v: v.kind == Kind.TILE))
        sizes = [g for g in (2, 4, 8) if (self.n * x.width) % g == 0 and (BLOCKS["block_n"] * x.width) % g == 0]
        if not sizes:
            return
        g = self.draw(st.sampled_from(sizes))
        if self.draw(st.booleans()):
            self.emit(f"coda.group_max({x.expr}, {g})", **_selected(x.kind, x.width, x))
            return
        mag = g * x.mag
        if x.exact and _exactly(mag, x.frac):
            self.emit(f"coda.group_sum({x.expr}, {g})", kind=x.kind, width=x.width, dtype="float", mag=mag, frac=x.frac)
        else:
            self.emit(f"coda.group_sum({x.expr}, {g})", kind=x.kind, width=x.width, dtype="float", mag=mag,
                      err=g * x.err + g * g * x.mag)

    STEPS = ("unary_exact", "squash", "squash", "binary", "binary", "compare_where", "pairs", "interleave", "index",
             "group")

    def unused(self) -> list[Val]:
        """Pool values that no statement reads yet (newest last)."""
        read = set(re.findall(r"\w+", " ".join(line.split(" = ", 1)[1] for line in self.program.lines)))
        return [v for v in self.pool if v.expr not in read]

    def to_tile(self) -> None:
        """Broadcast the newest unread non-tile value against a tile, so that it reaches an output."""
        loose = [v for v in self.unused() if v.kind != Kind.TILE]
        t = self.pick(self.values(lambda v: v.kind == Kind.TILE and _cols_compatible(loose[-1], v))) if loose else None
        if t is not None:
            x = loose[-1]
            fields = _rounded(Kind.TILE, t.width, x.mag + t.mag, x.err + t.err, max(x.frac, t.frac), x.exact and t.exact)
            self.emit(f"{x.expr} + {t.expr}", **fields)

    # -- outputs -----------------------------------------------------------------------
    def output(self, first: bool) -> str:
        """A tile store or a reduction, preferring tiles no statement reads (the first output
        takes the newest such tile). Sums see only exactly computed values."""

        def exact_sum(v: Val, count: float) -> bool:
            return v.exact and _exactly(count * v.mag, v.frac)

        forms: dict[str, tuple[Callable[[Val], bool], str]] = {
            "store": (lambda v: True, "{}"),
            "max": (lambda v: True, 'coda.reduce_n({}, "max")'),
            "logsumexp": (lambda v: v.err + C_LSE <= self.budget, 'coda.reduce_n({}, "logsumexp")'),
            "sum": (lambda v: exact_sum(v, self.n * v.width), 'coda.reduce_n({}, "sum")'),
            "group": (lambda v: exact_sum(v, 2) or 2 * v.err <= self.budget, 'coda.reduce_n({}, "sum", group=2)'),
            "reduce_m": (lambda v: exact_sum(v, self.m), 'coda.reduce_m({}, "sum")'),
        }
        tiles = self.values(lambda v: v.kind == Kind.TILE)
        loose = [v for v in self.unused() if v.kind == Kind.TILE]
        if first:
            x = (loose or tiles)[-1]
            kind = self.draw(st.sampled_from([k for k, (ok, _) in forms.items() if ok(x)]))
        else:
            kind = self.draw(st.sampled_from([k for k, (ok, _) in forms.items() if any(map(ok, tiles))]))
            ok = forms[kind][0]
            x = self.pick([v for v in loose if ok(v)] or [v for v in tiles if ok(v)])
        return forms[kind][1].format(x.expr)


@st.composite
def param_lists(draw: st.DrawFn) -> list[Param]:
    """0-4 operands of random kinds, widths and dtypes (floats, integers, bools, Python numbers)."""
    params = []
    for i in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(list(Kind)))
        width = draw(st.sampled_from(WIDTHS)) if kind.has_cols else Fraction(1)
        dtypes: list[Optional[torch.dtype]] = [*FLOAT_DTYPES, torch.int32, torch.int64, torch.bool]
        if kind == Kind.SCALAR:
            dtypes.append(None)
        params.append(Param(f"p{i}", kind, width, draw(st.sampled_from(dtypes))))
    return params


@st.composite
def programs(draw: st.DrawFn, m: int, n: int, k: int) -> Program:
    """A random program whose outputs stay within tolerance for an [m, n] output and depth k."""
    builder = Builder(draw, m, n, k, draw(param_lists()))
    for _ in range(draw(st.integers(1, 12))):
        getattr(builder, draw(st.sampled_from(Builder.STEPS)))()
    builder.to_tile()
    count = draw(st.integers(1, 3))
    names = [f"o{i}" for i in range(count)]
    builder.program.outputs = [(name, builder.output(first=name == names[0])) for name in names]
    builder.program.single = count == 1 and draw(st.booleans())
    return builder.program


@dataclass(frozen=True)
class Case:
    """A random program with the shapes, dtype, memory orders, seed and config of one run."""

    program: Program
    m: int
    n: int
    k: int
    dtype: torch.dtype
    a_col: bool
    b_col: bool
    seed: int
    config: coda.Config


@st.composite
def cases(draw: st.DrawFn) -> Case:
    m, n, k = draw(st.integers(1, M_MAX)), 4 * draw(st.integers(1, N_MAX // 4)), draw(st.integers(1, K_MAX))
    return Case(draw(programs(m, n, k)), m, n, k, draw(st.sampled_from(FLOAT_DTYPES)),
                draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**31 - 1)), draw(configs))


def int_matrix(rows: int, cols: int, dtype: torch.dtype, col_major: bool, gen: torch.Generator) -> torch.Tensor:
    """Integers in [-3, 3] with [0, 0] = 3 (so max |x| = 3), in either memory order."""
    t = torch.randint(-AMAX, AMAX + 1, (cols, rows) if col_major else (rows, cols), generator=gen)
    t = t.to(dtype).to(DEVICE)
    t = t.T if col_major else t
    t[0, 0] = AMAX
    return t


@pytest.mark.slow
@settings(max_examples=scale(300, 40), **SETTINGS)
@given(case=cases())
def test_random_epilogue_matches_reference(case: Case) -> None:
    """Two calls with fresh values; the second has the same metadata, so it takes the cached launch plan."""
    note(case.program.source())
    ep = case.program.epilogue()
    gen = torch.Generator().manual_seed(case.seed)
    for _ in range(2):
        a = int_matrix(case.m, case.k, case.dtype, case.a_col, gen)
        b = int_matrix(case.k, case.n, case.dtype, case.b_col, gen)
        operands = {p.name: p.make(case.m, case.n, gen) for p in case.program.params}
        out = coda.runtime.run(ep.graph, a, b, operands, config=case.config)
        compare(ep.graph, out, ep.reference(a, b, **operands), a, b)


@st.composite
def qknorm_cases(draw: st.DrawFn) -> tuple:
    """(head_dim, heads, kv_heads, M, K): N = (heads + 2 kv_heads) head_dim, a multiple of the group."""
    return (draw(st.sampled_from([4, 8, 16])), draw(st.integers(1, 3)), draw(st.integers(1, 2)),
            draw(st.integers(1, M_MAX)), draw(st.integers(1, K_MAX)))


@settings(max_examples=scale(40, 25), **SETTINGS)
@given(case=qknorm_cases(), layout=layouts, config=configs)
def test_qknorm_rope_shapes(case: tuple, layout: tuple[torch.dtype, bool, bool, int], config: coda.Config) -> None:
    """The QK-norm epilogue (group_sum values over each head, then pairs) on ragged M and K, both
    memory orders, every dtype and config: integer a and b and quarter-step operands keep the
    accumulator, row scale and sums of squares exact, so only rsqrt, sin and cos round."""
    (hd, heads, kv, m, k), (dtype, a_col, b_col, seed) = case, layout
    gen = torch.Generator().manual_seed(seed)
    n = (heads + 2 * kv) * hd
    a, b = int_matrix(m, k, dtype, a_col, gen), int_matrix(k, n, dtype, b_col, gen)
    quarter = lambda *shape: (torch.randint(1, 5, shape, generator=gen) / 4).to(DEVICE)  # noqa: E731
    weight, mask = coda.ops.qknorm_columns(quarter(hd) - 0.5, quarter(hd), heads, kv)
    freq = torch.cat([torch.randint(0, 64, ((heads + kv) * hd // 2,), generator=gen) / 64,
                      torch.zeros(kv * hd // 2)]).to(DEVICE)
    operands = dict(rstd=quarter(m), qk_weight=weight, qk_mask=mask, eps=2.0**-10,
                    pos=torch.randint(0, 32, (m,), generator=gen).to(DEVICE), freq=freq)
    ep = coda.ops.epilogues.rms_qknorm_rope(hd)
    out = coda.runtime.run(ep.graph, a, b, operands, config=config)
    compare(ep.graph, out, ep.reference(a, b, **operands), a, b)


# -- c. IR properties --------------------------------------------------------------------

small_programs = programs(8, 8, 4)


@settings(max_examples=200, **SETTINGS)
@given(program=small_programs)
def test_tracing_is_deterministic_and_printable(program: Program) -> None:
    first, second = program.epilogue().graph, program.epilogue().graph
    assert first == second and first.hash == second.hash
    renamed = program.epilogue("another_name").graph
    assert renamed.name == "another_name" and renamed.hash == first.hash  # the name is not hashed
    again = Graph.model_validate_json(first.model_dump_json())
    assert again == first and again.hash == first.hash
    text = str(first)
    assert text.startswith(f"epilogue {first.name}(")
    for o in first.outputs:
        assert f"out {o.name} = " in text
    for p in program.params:
        assert f"{p.name}: " in text.splitlines()[0]


BINOPS: dict[str, Callable] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
    "maximum": coda.maximum, "minimum": coda.minimum,
}
VARIANTS: dict[str, tuple] = {
    "const": (0.5, 1.0, 2.0, -1.5),
    "width": (0.5, 1, 2),
    "unary": ("exp", "tanh", "sigmoid", "silu", "square", "abs"),
    "binop": tuple(BINOPS),
    "out_name": ("y", "z", "h"),
    "reduce_op": ("sum", "max", "logsumexp"),
    "group": (None, 2, 4),
    "value_group": (None, ("sum", 2), ("sum", 4), ("max", 2)),
}


def family(const: float, width: float, unary: str, binop: str, out_name: str, reduce_op: str,
           group: Optional[int], value_group: Optional[tuple[str, int]]) -> Graph:
    """One epilogue shape, with each constant, operand width, op and name a parameter."""

    def member(acc, t: coda.Tile(width=width)):
        y = BINOPS[binop](getattr(coda, unary)(acc), const)
        if value_group is not None:
            y = getattr(coda, f"group_{value_group[0]}")(y, value_group[1])
        return {out_name: y, "t": t + 1.0, "r": coda.reduce_n(acc, reduce_op, group=group)}

    return coda.epilogue(member).graph


variant_params = st.fixed_dictionaries({name: st.sampled_from(values) for name, values in VARIANTS.items()})


@settings(max_examples=200, **SETTINGS)
@given(params=variant_params, changed=st.sampled_from(sorted(VARIANTS)), data=st.data())
def test_hash_tells_programs_apart(params: dict, changed: str, data: st.DataObject) -> None:
    base = family(**params)
    assert family(**params).hash == base.hash
    other = data.draw(st.sampled_from([v for v in VARIANTS[changed] if v != params[changed]]), label=changed)
    variant = family(**{**params, changed: other})
    assert variant.hash != base.hash and variant != base


def test_random_programs_cover_every_primitive() -> None:
    """The program generator reaches every node family, function, output kind, operand kind, width and dtype."""
    seen: set[str] = set()

    @settings(max_examples=400, database=None, derandomize=True, **SETTINGS)
    @given(program=small_programs)
    def collect(program: Program) -> None:
        graph = program.epilogue().graph
        for node in graph.nodes:
            seen.add(node.family)
            seen.add(getattr(node, "fn", node.family))
            if node.family == "group":
                seen.add(f"group_{node.op}")
        for o in graph.outputs:
            seen.add(o.family if isinstance(o, StoreOutput) else f"reduce_{o.axis}_{o.op}_{o.group}")
        seen.update(f"{p.kind.value}_{p.width}" for p in program.params)
        seen.update(str(p.dtype) for p in program.params)

    collect()
    expected = {"input", "const", "index", "unary", "binary", "where", "pair", "interleave", "group", "group_sum",
                "group_max", "store",
                *UNARY_FNS, *BINARY_FNS, "reduce_n_sum_None", "reduce_n_max_None", "reduce_n_logsumexp_None",
                "reduce_n_sum_2", "reduce_m_sum_None",
                *(f"{k}_{w}" for k in ("vec_n", "tile") for w in WIDTHS), "scalar_1", "vec_m_1",
                *(str(d) for d in (*FLOAT_DTYPES, torch.int32, torch.int64, torch.bool, None))}
    assert expected <= seen, f"never generated: {sorted(expected - seen)}"
