"""The tracing front end: call the user's function with proxy values, record a Graph.

No source parsing: every operation on a `Value` appends a node. Identical nodes are
shared (so equal programs give equal graphs) and nodes no output uses are dropped.
"""

from __future__ import annotations

import contextvars
import inspect
import numbers
from fractions import Fraction
from typing import Callable

from .graph import RESERVED_NAMES, Graph, _leaf_type, check_group, check_name, check_output, infer
from .nodes import (
    REDUCE_M_OPS, REDUCE_N_OPS, BinaryNode, ConstNode, GroupNode, IndexNode, InputNode, InterleaveNode,
    OperandSpec, PairNode, ReduceOutput, StoreOutput, UnaryNode, WhereNode,
)
from .types import Kind, as_operand_type, parse_width, width_str

_current: contextvars.ContextVar["Tracer | None"] = contextvars.ContextVar("coda_tracer", default=None)


class Tracer:
    def __init__(self, operands: dict[str, OperandSpec]) -> None:
        self.operands = operands
        self.nodes: list = []
        self.types: dict[int, tuple[Kind, Fraction]] = {}
        self._seen: dict[tuple, int] = {}
        self.finished = False

    def add(self, cls: type, **fields: object) -> "Value":
        if self.finished:
            raise ValueError(
                "a value of an epilogue whose tracing has finished was used (a value leaked from another "
                "epilogue's trace?); build each epilogue from its own accumulator and operands"
            )
        # float.hex keeps 0.0 and -0.0 (equal as floats) apart; they are different programs.
        key = (cls.__name__, tuple(sorted((f, v.hex() if isinstance(v, float) else v) for f, v in fields.items())))
        if key in self._seen:
            return Value(self, self._seen[key])
        probe = cls.model_construct(id=len(self.nodes), kind=Kind.SCALAR, **{"width": "1", **fields})
        if cls in (InputNode, ConstNode, IndexNode):
            kind, width = _leaf_type(probe, self.operands)
        else:
            kind, width = infer(probe, self.types)
        node = cls(id=len(self.nodes), kind=kind, **{**fields, "width": width_str(width)})
        self.nodes.append(node)
        self.types[node.id] = (kind, width)
        self._seen[key] = node.id
        return Value(self, node.id)

    def lift(self, x: object, op: str) -> "Value":
        if isinstance(x, Value):
            if x.tracer is not self:
                raise ValueError(f"{op}: value from another epilogue's trace")
            return x
        if isinstance(x, Reduction):
            x.misuse()
        if isinstance(x, numbers.Real) and not hasattr(x, "shape"):
            return self.add(ConstNode, value=float(x))
        raise TypeError(
            f"{op}: epilogue values combine only with coda values and Python numbers, got {type(x).__name__} "
            "(pass tensors as annotated operands)"
        )


def _tracer_of(*xs: object, op: str) -> Tracer:
    for x in xs:
        if isinstance(x, Value):
            return x.tracer
        if isinstance(x, Reduction):
            x.misuse()
    tracer = _current.get()
    if tracer is None:
        raise TypeError(f"coda.{op} works on epilogue values inside a @coda.epilogue function")
    if not any(isinstance(x, Value) for x in xs):
        raise TypeError(f"coda.{op} needs at least one epilogue value, got {', '.join(type(x).__name__ for x in xs)}")
    return tracer


class Value:
    """A traced value: a node of the graph being built."""

    __slots__ = ("tracer", "id")

    def __init__(self, tracer: Tracer, node_id: int) -> None:
        self.tracer = tracer
        self.id = node_id

    @property
    def kind(self) -> Kind:
        return self.tracer.types[self.id][0]

    @property
    def width(self) -> Fraction:
        return self.tracer.types[self.id][1]

    def __repr__(self) -> str:
        return f"<coda value %{self.id}: {self.kind.value} width {self.width}>"

    def _bin(self, fn: str, other: object, swap: bool = False) -> "Value":
        o = self.tracer.lift(other, fn)
        x, y = (o, self) if swap else (self, o)
        return self.tracer.add(BinaryNode, fn=fn, x=x.id, y=y.id)

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("div", o)
    def __rtruediv__(self, o): return self._bin("div", o, True)
    def __lt__(self, o): return self._bin("lt", o)
    def __le__(self, o): return self._bin("le", o)
    def __gt__(self, o): return self._bin("gt", o)
    def __ge__(self, o): return self._bin("ge", o)
    def __eq__(self, o): return self._bin("eq", o)  # type: ignore[override]
    def __ne__(self, o): return self._bin("ne", o)  # type: ignore[override]
    def __neg__(self): return _unary("neg", self)
    def __abs__(self): return _unary("abs", self)

    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        raise TypeError(
            "an epilogue value has no truth value at trace time: data-dependent Python control flow "
            "(if/and/or/while) is not supported; use coda.where"
        )


class Reduction:
    """The result of reduce_n / reduce_m: it can only be returned as an output."""

    def __init__(self, x: Value, axis: str, op: str, group: int | None) -> None:
        self.x, self.axis, self.op, self.group = x, axis, op, group

    def misuse(self, *_: object) -> None:
        hint = " (for per-group statistics as values use coda.group_sum / coda.group_max)" if self.axis == "n" else ""
        raise TypeError(
            f"a reduction (reduce_{self.axis} {self.op!r}) is an output only: return it from the "
            f"epilogue; it cannot be used as a value inside it{hint}"
        )

    def __bool__(self) -> bool:
        self.misuse()
        return False

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = misuse
    __truediv__ = __rtruediv__ = __lt__ = __le__ = __gt__ = __ge__ = misuse
    __eq__ = __ne__ = __neg__ = __abs__ = misuse  # type: ignore[assignment]
    __hash__ = None  # type: ignore[assignment]


def _unary(fn: str, x: object) -> Value:
    if not isinstance(x, Value):
        if isinstance(x, Reduction):
            x.misuse()
        raise TypeError(f"coda.{fn} expects an epilogue value, got {type(x).__name__}")
    return x.tracer.add(UnaryNode, fn=fn, x=x.id)


def exp(x): return _unary("exp", x)
def log(x): return _unary("log", x)
def sqrt(x): return _unary("sqrt", x)
def rsqrt(x): return _unary("rsqrt", x)
def sigmoid(x): return _unary("sigmoid", x)
def silu(x): return _unary("silu", x)
def gelu(x): return _unary("gelu", x)
def tanh(x): return _unary("tanh", x)
def relu(x): return _unary("relu", x)
def sin(x): return _unary("sin", x)
def cos(x): return _unary("cos", x)
def abs(x): return _unary("abs", x)  # noqa: A001 - the public name is coda.abs
def square(x): return _unary("square", x)
def round_bf16(x): return _unary("round_bf16", x)  # x as stored in bfloat16 and read back
def round_fp16(x): return _unary("round_fp16", x)  # x as stored in float16 and read back


def _binary_fn(fn: str, x: object, y: object) -> Value:
    tracer = _tracer_of(x, y, op=fn)
    vx, vy = tracer.lift(x, fn), tracer.lift(y, fn)
    return tracer.add(BinaryNode, fn=fn, x=vx.id, y=vy.id)


def maximum(x, y): return _binary_fn("maximum", x, y)
def minimum(x, y): return _binary_fn("minimum", x, y)


def where(cond, x, y) -> Value:
    """`x` where cond is true (non-zero), else `y`; broadcasts like arithmetic."""
    tracer = _tracer_of(cond, x, y, op="where")
    c, vx, vy = (tracer.lift(v, "where") for v in (cond, x, y))
    return tracer.add(WhereNode, cond=c.id, x=vx.id, y=vy.id)


def pairs(x) -> tuple[Value, Value]:
    """Split columns (2i, 2i+1) into (even, odd), each of half the width."""
    if not isinstance(x, Value):
        if isinstance(x, Reduction):
            x.misuse()
        raise TypeError(f"coda.pairs expects an epilogue value, got {type(x).__name__}")
    return x.tracer.add(PairNode, x=x.id, half=0), x.tracer.add(PairNode, x=x.id, half=1)


def interleave(even, odd) -> Value:
    """Columns (even_0, odd_0, even_1, odd_1, ...), of twice the width: the inverse of pairs."""
    tracer = _tracer_of(even, odd, op="interleave")
    a, b = tracer.lift(even, "interleave"), tracer.lift(odd, "interleave")
    return tracer.add(InterleaveNode, x=a.id, y=b.id)


def _index_tracer(op: str) -> Tracer:
    tracer = _current.get()
    if tracer is None:
        raise TypeError(f"coda.{op}() is only available inside a @coda.epilogue function")
    return tracer


def row_index() -> Value:
    """Global output row of each element (int32, a VecM)."""
    return _index_tracer("row_index").add(IndexNode, axis="m")


def col_index(width: object = 1) -> Value:
    """Global output column of each element (int32, a VecN of the given width)."""
    w = parse_width(width, "coda.col_index")
    return _index_tracer("col_index").add(IndexNode, axis="n", width=width_str(w))


def _group(op: str, x: object, group: object) -> Value:
    what = f"coda.group_{op}"
    if not isinstance(x, Value):
        if isinstance(x, Reduction):
            x.misuse()
        raise TypeError(f"{what} expects an epilogue value, got {type(x).__name__}")
    check_group(group, what)
    return x.tracer.add(GroupNode, op=op, x=x.id, group=group)


def group_sum(x, group: int) -> Value:
    """Per row, the sum of each group of `group` consecutive columns of the tile x (e.g. a
    head's head_dim columns), in every column of that group: a value of x's width, usable in
    the same epilogue (QK-norm's per-head statistic). `group` counts x's own columns."""
    return _group("sum", x, group)


def group_max(x, group: int) -> Value:
    """As group_sum, with the maximum (NaN if the group holds one)."""
    return _group("max", x, group)


def reduce_n(x, op: str, *, group: int | None = None) -> Reduction:
    """Reduce over columns: [M] fp32, or [M, width*N // group] with group= (e.g. per head)."""
    if op not in REDUCE_N_OPS:
        raise ValueError(f"reduce_n op must be one of {REDUCE_N_OPS}, got {op!r}")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
        raise TypeError(f"reduce_n group must be an int, got {type(group).__name__}")
    return _reduction(x, "n", op, group)


def reduce_m(x, op: str = "sum") -> Reduction:
    """Reduce over rows: [width*N] fp32."""
    if op not in REDUCE_M_OPS:
        raise ValueError(f"reduce_m supports only {REDUCE_M_OPS}, got {op!r}")
    return _reduction(x, "m", op, None)


def _reduction(x: object, axis: str, op: str, group: int | None) -> Reduction:
    if not isinstance(x, Value):
        if isinstance(x, Reduction):
            x.misuse()
        raise TypeError(f"coda.reduce_{axis} expects an epilogue value, got {type(x).__name__}")
    label = f"reduce_{axis}({op!r})"
    check_output(ReduceOutput.model_construct(name=label, x=x.id, axis=axis, op=op, group=group), *x.tracer.types[x.id])
    return Reduction(x, axis, op, group)


def signature_operands(fn: Callable) -> dict[str, OperandSpec]:
    """The operand specs declared by fn's annotations (its first parameter is the accumulator)."""
    name = getattr(fn, "__name__", "epilogue")
    try:
        sig = inspect.signature(fn, eval_str=True)
    except NameError as exc:
        raise TypeError(f"epilogue {name!r}: cannot evaluate an annotation: {exc}") from exc
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise TypeError(f"epilogue {name!r} must take the accumulator as its first parameter (a positional one)")
    specs: dict[str, OperandSpec] = {}
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"epilogue {name!r}: *args/**kwargs are not supported; declare each operand")
        if p.default is not p.empty:
            raise TypeError(f"epilogue {name!r}: parameter {p.name!r} has a default; operands have none")
        if i == 0:
            continue
        check_name(p.name, f"epilogue {name!r}: parameter")
        if p.name in RESERVED_NAMES:
            raise ValueError(
                f"epilogue {name!r}: parameter name {p.name!r} is reserved ({', '.join(sorted(RESERVED_NAMES))})"
            )
        if p.annotation is p.empty:
            raise TypeError(
                f"epilogue {name!r}: parameter {p.name!r} has no annotation; annotate it with "
                "coda.Scalar, coda.VecM, coda.VecN or coda.Tile"
            )
        spec = as_operand_type(p.annotation)
        if spec is None:
            raise TypeError(
                f"epilogue {name!r}: parameter {p.name!r} is annotated {p.annotation!r}; operands are "
                "annotated coda.Scalar, coda.VecM, coda.VecN(width=...) or coda.Tile(width=...)"
            )
        specs[p.name] = OperandSpec(name=p.name, kind=spec.kind, width=width_str(spec.width))
    return specs


def trace(fn: Callable) -> Graph:
    """Trace fn into a validated Graph."""
    name = getattr(fn, "__name__", "epilogue")
    operands = signature_operands(fn)
    tracer = Tracer(operands)
    acc = tracer.add(InputNode, name="acc")
    values = {n: tracer.add(InputNode, name=n) for n in operands}
    keyword_only = {p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY}
    args = [v for n, v in values.items() if n not in keyword_only]
    kwargs = {n: v for n, v in values.items() if n in keyword_only}
    token = _current.set(tracer)
    try:
        result = fn(acc, *args, **kwargs)
    finally:
        _current.reset(token)
    try:
        outputs, single = _collect_outputs(name, result)
        for key, v in outputs:
            if (v.x if isinstance(v, Reduction) else v).tracer is not tracer:
                raise ValueError(
                    f"epilogue {name!r}: output {key!r} is a value from another epilogue's trace; "
                    "outputs must be computed from this epilogue's accumulator and operands"
                )
        return _finish(tracer, name, operands, outputs, single)
    finally:
        tracer.finished = True


def _collect_outputs(name: str, result: object) -> tuple[list, bool]:
    if isinstance(result, (Value, Reduction)):
        return [("out", result)], True
    if isinstance(result, dict):
        if not result:
            raise ValueError(f"epilogue {name!r} returned an empty dict; return at least one output")
        items = []
        for key, value in result.items():
            if not isinstance(key, str):
                raise TypeError(f"epilogue {name!r}: output names must be strings, got {key!r}")
            check_name(key, f"epilogue {name!r}: output")
            if not isinstance(value, (Value, Reduction)):
                raise TypeError(
                    f"epilogue {name!r}: output {key!r} is a {type(value).__name__}, not an epilogue value"
                )
            items.append((key, value))
        return items, False
    raise TypeError(
        f"epilogue {name!r} must return an epilogue value or a dict of them, got {type(result).__name__}"
    )


def _finish(tracer: Tracer, name: str, operands: dict[str, OperandSpec], outputs: list, single: bool) -> Graph:
    """Drop unused nodes, renumber the rest in order, and build the Graph."""
    roots = [(v.x if isinstance(v, Reduction) else v).id for _, v in outputs]
    live: set[int] = set()
    stack = list(roots)
    while stack:
        i = stack.pop()
        if i not in live:
            live.add(i)
            stack.extend(tracer.nodes[i].args)
    remap = {old: new for new, old in enumerate(sorted(live))}
    arg_fields = ("x", "y", "cond")
    nodes = []
    for old in sorted(live):
        node = tracer.nodes[old]
        update = {"id": remap[old]}
        update.update({f: remap[getattr(node, f)] for f in arg_fields if f in type(node).model_fields})
        nodes.append(node.model_copy(update=update))
    outs = []
    for key, v in outputs:
        if isinstance(v, Reduction):
            outs.append(ReduceOutput(name=key, x=remap[v.x.id], axis=v.axis, op=v.op, group=v.group))
        else:
            check_output(StoreOutput.model_construct(name=key, x=v.id), v.kind, v.width)
            outs.append(StoreOutput(name=key, x=remap[v.id]))
    return Graph(name=name, operands=tuple(operands.values()), nodes=tuple(nodes), outputs=tuple(outs), single=single)
