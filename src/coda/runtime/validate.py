"""Input validation for gemm(): every mistake raises a message naming the operand.

The result, a `Call`, holds what the launch needs: sizes, the specialization inputs
and the output shapes.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Mapping

import torch

from ..codegen.spec import OperandForm
from ..ir.graph import Graph
from ..ir.nodes import ReduceOutput, StoreOutput
from ..ir.types import Kind

IN_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
OPERAND_DTYPES = {
    **IN_DTYPES, torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.uint8: "uint8", torch.bool: "bool",
}


@dataclass
class Call:
    graph: Graph
    a: torch.Tensor
    b: torch.Tensor
    m: int
    n: int
    k: int
    operands: dict[str, object]
    forms: tuple[OperandForm, ...]
    out: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def in_dtype(self) -> str:
        return IN_DTYPES[self.a.dtype]

    def out_dtype(self, out: StoreOutput) -> torch.dtype:
        """A tile output's dtype: its out= tensor's, else a's."""
        t = self.out.get(out.name)
        return t.dtype if t is not None else self.a.dtype

    def output_shape(self, out: StoreOutput | ReduceOutput) -> tuple[int, ...]:
        cols = int(self.n * self.graph.node(out.x).frac_width)
        if isinstance(out, StoreOutput):
            return (self.m, cols)
        if out.axis == "m":
            return (cols,)
        return (self.m,) if out.group is None else (self.m, cols // out.group)


def _describe(spec_kind: Kind, width: Fraction) -> str:
    names = {Kind.SCALAR: "Scalar", Kind.VEC_M: "VecM", Kind.VEC_N: "VecN", Kind.TILE: "Tile"}
    return names[spec_kind] + (f"(width={width})" if width != 1 else "")


def _check_matrix(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"coda.gemm: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"coda.gemm: {name} must be 2-D, got shape {tuple(t.shape)}")
    if t.dtype not in IN_DTYPES:
        raise TypeError(f"coda.gemm: {name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    return t


def check_kernel_device(what: str, t: torch.Tensor, interpret: bool) -> None:
    """Kernels read CPU tensors under the interpreter and CUDA tensors otherwise; say which, not
    Triton's launch error (a CPU tensor on a machine with a GPU is the usual case)."""
    if interpret and t.device.type != "cpu":
        raise ValueError(f"{what} is on {t.device}, but kernels run in Triton's interpreter (CPU tensors)")
    if not interpret and t.device.type != "cuda":
        raise ValueError(f"{what} is on {t.device}; coda's kernels run on the GPU, move it to cuda "
                         "(or set TRITON_INTERPRET=1 before importing coda to run them on the CPU)")


def check_device(what: str, t: torch.Tensor, device: torch.device, interpret: bool) -> None:
    if t.device != device:
        raise ValueError(f"coda.gemm: {what} is on {t.device}, but a is on {device}; put all tensors on one device")
    check_kernel_device(f"coda.gemm: {what}", t, interpret)


def validate(
    graph: Graph, a: object, b: object, operands: Mapping[str, object],
    out: object, interpret: bool,
) -> Call:
    a = _check_matrix("a", a)
    b = _check_matrix("b", b)
    if a.dtype != b.dtype:
        hint = (" (torch.autocast is on, and coda's ops do not autocast: cast the operands to its dtype; "
                "coda.models and coda.patch do)" if torch.is_autocast_enabled(a.device.type) else "")
        raise ValueError(f"coda.gemm: a is {a.dtype} but b is {b.dtype}; both must have one dtype{hint}")
    check_device("a", a, a.device, interpret)
    check_device("b", b, a.device, interpret)
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"coda.gemm: a is [M, K] = {list(a.shape)} but b is [K, N] = {list(b.shape)}; K differs")

    name = graph.name
    if graph.uses_width(Fraction(1, 2)) and n % 2:
        raise ValueError(
            f"epilogue {name!r} uses pairs or width-1/2 values, so N must be even; got N={n}"
        )
    for what, group, width in graph.column_groups():
        cols = n * width
        if cols.denominator != 1 or int(cols) % group:
            raise ValueError(
                f"epilogue {name!r}: {what} reduces groups of {group} columns, "
                f"but its input has {cols} columns (not a multiple of {group})"
            )

    specs = {s.name: s for s in graph.operands}
    missing = [s for s in specs if s not in operands]
    unknown = [s for s in operands if s not in specs]
    if missing:
        needs = ", ".join(f"{s} ({_describe(specs[s].kind, specs[s].frac_width)})" for s in missing)
        raise TypeError(f"epilogue {name!r} is missing operand(s): {needs}")
    if unknown:
        takes = ", ".join(specs) or "no operands"
        raise TypeError(f"epilogue {name!r} got unknown operand(s) {', '.join(map(repr, unknown))}; it takes: {takes}")

    forms = []
    values: dict[str, object] = {}
    for s in graph.operands:
        value = operands[s.name]
        what = f"operand {s.name!r} ({_describe(s.kind, s.frac_width)})"
        if s.kind == Kind.SCALAR and not isinstance(value, torch.Tensor):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"coda.gemm: {what} must be a Python number or a 0-d tensor, got {type(value).__name__}")
            forms.append(OperandForm(name=s.name))
            try:
                values[s.name] = float(value)
            except OverflowError:
                raise ValueError(f"coda.gemm: {what} is {value}, too large for a float") from None
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"coda.gemm: {what} must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in OPERAND_DTYPES:
            raise TypeError(
                f"coda.gemm: {what} has dtype {value.dtype}; supported: float16, bfloat16, float32 and integer/bool"
            )
        cols = n * s.frac_width
        expected = {
            Kind.SCALAR: (),
            Kind.VEC_M: (m,),
            Kind.VEC_N: (int(cols),),
            Kind.TILE: (m, int(cols)),
        }[s.kind]
        if cols.denominator != 1:
            raise ValueError(f"coda.gemm: {what} has width {s.width}, so N must be even; got N={n}")
        if tuple(value.shape) != expected:
            raise ValueError(f"coda.gemm: {what} must have shape {list(expected)}, got {list(value.shape)}")
        check_device(what, value, a.device, interpret)
        forms.append(OperandForm(name=s.name, dtype=OPERAND_DTYPES[value.dtype]))
        values[s.name] = value

    call = Call(graph=graph, a=a, b=b, m=m, n=n, k=k, operands=values, forms=tuple(forms))
    call.out = _check_out(call, out, interpret)
    return call


def _check_out(call: Call, out: object, interpret: bool) -> dict[str, torch.Tensor]:
    graph = call.graph
    if out is None:
        return {}
    if isinstance(out, torch.Tensor):
        if len(graph.outputs) != 1:
            names = ", ".join(o.name for o in graph.outputs)
            raise TypeError(f"coda.gemm: out= is a tensor but epilogue {graph.name!r} has several outputs ({names}); pass a dict")
        out = {graph.outputs[0].name: out}
    if not isinstance(out, dict):
        raise TypeError(f"coda.gemm: out= must be a tensor or a dict of tensors, got {type(out).__name__}")
    by_name = {o.name: o for o in graph.outputs}
    for key, t in out.items():
        if key not in by_name:
            raise ValueError(f"coda.gemm: out= names {key!r}, which is not an output of {graph.name!r} ({', '.join(by_name)})")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"coda.gemm: out[{key!r}] must be a tensor, got {type(t).__name__}")
        spec = by_name[key]
        shape = call.output_shape(spec)
        if tuple(t.shape) != shape:
            raise ValueError(f"coda.gemm: out[{key!r}] must have shape {list(shape)}, got {list(t.shape)}")
        allowed = (torch.float32,) if isinstance(spec, ReduceOutput) else tuple(IN_DTYPES)
        if t.dtype not in allowed:
            raise TypeError(
                f"coda.gemm: out[{key!r}] has dtype {t.dtype}; expected one of {', '.join(map(str, allowed))}"
            )
        check_device(f"out[{key!r}]", t, call.a.device, interpret)
    return dict(out)
