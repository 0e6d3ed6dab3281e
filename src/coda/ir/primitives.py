"""Every elementwise primitive, reduction and group reduction of the IR, each defined once.

An entry holds what the rest of coda needs to know about one primitive: its typing (how
many arguments, and whether its result is a float or a boolean), its text in each backend's
dialect (a format string over `{x}`, `{y}` taking fp32 arguments, or the comparison's raw
operands), and its fp32 torch reference. A reduction also holds its identity (what masked
columns contribute) and the torch finalize that combines per-tile partials.

Adding a primitive means adding its entry here (and its tests); a backend that lacks a
text for it must refuse the program (`unsupported`), never compute another op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch
import torch.nn.functional as F

Backend = Literal["triton", "gluon-hopper"]
BACKENDS: tuple[Backend, ...] = ("triton", "gluon-hopper")


@dataclass(frozen=True)
class Primitive:
    name: str
    arity: int
    result: Literal["f32", "bool"]  # comparisons keep integer operands exact and give booleans
    text: dict[str, str]  # backend -> format string over {x} (and {y})
    reference: Callable[..., torch.Tensor]

    def emit(self, backend: str, x: str, y: Optional[str] = None) -> str:
        template = self.text.get(backend)
        if template is None:
            raise NotImplementedError(f"primitive {self.name!r} has no {backend} text")
        return template.format(x=x, y=y)


@dataclass(frozen=True)
class Reduction:
    op: str
    axes: tuple[str, ...]  # "n" (over columns) and/or "m" (over rows)
    identity: str  # a Python float literal, valid in every dialect
    finalize: Callable[[torch.Tensor, int, torch.Tensor], None]  # (partials, dim, out) -> out filled


def _same(text: str) -> dict[str, str]:
    """The text in both dialects: Triton's `tl.` and Gluon's `gl.` share these functions."""
    return {"triton": text.replace("NS.", "tl."), "gluon-hopper": text.replace("NS.", "gl.")}


def _unary(name: str, text: dict[str, str], ref: Callable[[torch.Tensor], torch.Tensor]) -> Primitive:
    return Primitive(name, 1, "f32", text, ref)


def _binary(name: str, text: dict[str, str], ref: Callable[..., torch.Tensor], result: str = "f32") -> Primitive:
    return Primitive(name, 2, result, text, ref)  # type: ignore[arg-type]


def _gelu(x: torch.Tensor) -> torch.Tensor:
    """The erf GELU as its formula, which the kernels compute: F.gelu's CPU kernel answers inf
    with NaN and 3e38 with inf on its vectorized path (AVX512) but not on its scalar one."""
    return 0.5 * x * (1.0 + torch.erf(x * 0.7071067811865476))


# Helpers named `_x` are Triton functions in coda.templates.jit_helpers (Gluon imports the same
# functions, re-wrapped, from coda.templates.gluon_helpers).
_UNARIES = [
    _unary("neg", _same("-({x})"), torch.neg),
    _unary("exp", _same("NS.exp({x})"), torch.exp),
    _unary("log", _same("NS.log({x})"), torch.log),
    _unary("sqrt", _same("NS.sqrt_rn({x})"), torch.sqrt),
    _unary("rsqrt", _same("NS.rsqrt({x})"), torch.rsqrt),
    _unary("sigmoid", _same("_sigmoid({x})"), torch.sigmoid),
    _unary("silu", _same("{x} * _sigmoid({x})"), F.silu),
    _unary("gelu", _same("0.5 * {x} * (1.0 + NS.erf({x} * 0.7071067811865476))"), _gelu),
    _unary("tanh", _same("_tanh({x})"), torch.tanh),
    _unary("relu", _same("NS.maximum({x}, 0.0, propagate_nan=tl.PropagateNan.ALL)"), torch.relu),
    _unary("sin", _same("_trig({x}, 0)"), torch.sin),
    _unary("cos", _same("_trig({x}, 1)"), torch.cos),
    _unary("abs", _same("NS.abs({x})"), torch.abs),
    _unary("square", _same("{x} * {x}"), lambda x: x * x),
    _unary("round_bf16", _same("({x}).to(NS.bfloat16).to(NS.float32)"), lambda x: x.to(torch.bfloat16).float()),
    _unary("round_fp16", _same("({x}).to(NS.float16).to(NS.float32)"), lambda x: x.to(torch.float16).float()),
]
_BINARIES = [
    _binary("add", _same("{x} + {y}"), torch.add),
    _binary("sub", _same("{x} - {y}"), torch.sub),
    _binary("mul", _same("{x} * {y}"), torch.mul),
    _binary("div", _same("NS.div_rn({x}, {y})"), torch.div),
    _binary("maximum", _same("NS.maximum({x}, {y}, propagate_nan=tl.PropagateNan.ALL)"), torch.maximum),
    _binary("minimum", _same("NS.minimum({x}, {y}, propagate_nan=tl.PropagateNan.ALL)"), torch.minimum),
] + [
    _binary(name, _same(f"{{x}} {op} {{y}}"), ref, "bool")
    for name, op, ref in (("lt", "<", torch.lt), ("le", "<=", torch.le), ("gt", ">", torch.gt),
                          ("ge", ">=", torch.ge), ("eq", "==", torch.eq), ("ne", "!=", torch.ne))
]

PRIMITIVES: dict[str, Primitive] = {p.name: p for p in _UNARIES + _BINARIES}
UNARY_FNS = tuple(p.name for p in _UNARIES)
BINARY_FNS = tuple(p.name for p in _BINARIES)
ARITH_FNS = tuple(p.name for p in _BINARIES if p.result == "f32")
COMPARE_FNS = tuple(p.name for p in _BINARIES if p.result == "bool")


def _sum(p: torch.Tensor, dim: int, out: torch.Tensor) -> None:
    torch.sum(p, dim=dim, out=out)


def _max(p: torch.Tensor, dim: int, out: torch.Tensor) -> None:
    torch.amax(p, dim=dim, out=out)


def _logsumexp(p: torch.Tensor, dim: int, out: torch.Tensor) -> None:
    torch.logsumexp(p, dim=dim, out=out)


REDUCTIONS: dict[str, Reduction] = {
    "sum": Reduction("sum", ("n", "m"), "0.0", _sum),
    "max": Reduction("max", ("n",), 'float("-inf")', _max),
    "logsumexp": Reduction("logsumexp", ("n",), 'float("-inf")', _logsumexp),
}
REDUCE_N_OPS = tuple(r.op for r in REDUCTIONS.values() if "n" in r.axes)
REDUCE_M_OPS = tuple(r.op for r in REDUCTIONS.values() if "m" in r.axes)


@dataclass(frozen=True)
class GroupReduction:
    """A reduction over each group of `g` consecutive columns of a row, used as a value: every
    column of a group holds the group's result (per-head statistics applied in the same
    epilogue). Typing (coda.ir.graph.infer): a tile in, a tile of its kind and width out, `g` a
    power of two >= 2 counted in the value's own columns. Its text is a helper of
    coda.templates.jit_helpers / gluon_helpers; its reference reduces [.., C // g, g]."""

    op: str
    text: dict[str, str]  # backend -> format string over {x} and {g}
    reference: Callable[[torch.Tensor, int], torch.Tensor]

    def emit(self, backend: str, x: str, g: int) -> str:
        template = self.text.get(backend)
        if template is None:
            raise NotImplementedError(f"group_{self.op} has no {backend} text")
        return template.format(x=x, g=g)


def _grouped(reduce: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor, int], torch.Tensor]:
    def ref(x: torch.Tensor, g: int) -> torch.Tensor:
        groups = x.reshape(*x.shape[:-1], x.shape[-1] // g, g)
        return reduce(groups).expand(groups.shape).reshape(x.shape)
    return ref


GROUP_REDUCTIONS: dict[str, GroupReduction] = {
    "sum": GroupReduction("sum", _same("_group_sum({x}, {g})"), _grouped(lambda t: t.sum(-1, keepdim=True))),
    # torch.amax propagates NaN, as the helper does (tl.max alone would drop it)
    "max": GroupReduction("max", _same("_group_max({x}, {g})"), _grouped(lambda t: t.amax(-1, keepdim=True))),
}
GROUP_OPS = tuple(GROUP_REDUCTIONS)


def reference(fn: str, *args: torch.Tensor) -> torch.Tensor:
    return PRIMITIVES[fn].reference(*args)


def reduce_reference(op: str, x: torch.Tensor, dim: int) -> torch.Tensor:
    out = torch.empty(x.shape[:dim] + x.shape[dim + 1:], dtype=torch.float32, device=x.device)
    REDUCTIONS[op].finalize(x, dim, out)
    return out


__all__ = ["ARITH_FNS", "BACKENDS", "BINARY_FNS", "COMPARE_FNS", "GROUP_OPS", "GROUP_REDUCTIONS", "GroupReduction",
           "PRIMITIVES", "Primitive", "REDUCE_M_OPS",
           "REDUCE_N_OPS", "REDUCTIONS", "Reduction", "UNARY_FNS", "reduce_reference", "reference"]
