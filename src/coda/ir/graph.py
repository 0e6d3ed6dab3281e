"""The epilogue graph: validation on construction, printing, canonical hashing.

`infer` holds the typing rules in one place: the tracer uses it to type new nodes,
and the graph validator uses it to re-check every node it is given.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import unicodedata
from fractions import Fraction
from functools import cached_property

from pydantic import model_validator

from .nodes import (
    ARITH_FNS, BinaryNode, ConstNode, GroupNode, IndexNode, InputNode, InterleaveNode, Node, OperandSpec,
    Output, PairNode, ReduceOutput, StoreOutput, UnaryNode, WhereNode, _Model,
)
from .types import Kind, combine

RESERVED_NAMES = frozenset({"a", "b", "acc", "out", "epilogue"})


def check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
        raise ValueError(f"{what} {name!r} is not a valid name (a Python identifier not starting with '_')")
    normal = unicodedata.normalize("NFKC", name)
    if normal != name:
        # Python reads identifiers in NFKC form: the generated kernel would name it otherwise.
        raise ValueError(f"{what} {name!r} is not in NFKC normal form (Python reads it as {normal!r}); use {normal!r}")


def check_group(group: object, what: str) -> None:
    """A column group size: a power of two >= 2 (a group of one column is the value itself)."""
    if isinstance(group, bool) or not isinstance(group, int):
        raise TypeError(f"{what}: the group size must be an int, got {type(group).__name__}")
    if group < 2 or group & (group - 1):
        raise ValueError(f"{what}: the group size must be a power of two >= 2 (e.g. head_dim), got {group}")


def infer(node: object, types: dict[int, tuple[Kind, Fraction]]) -> tuple[Kind, Fraction]:
    """(kind, width) of a value node from the types of its arguments; raises on misuse."""
    if isinstance(node, (UnaryNode,)):
        return types[node.x]
    if isinstance(node, BinaryNode):
        return combine(types[node.x], types[node.y], node.fn)
    if isinstance(node, WhereNode):
        return combine(combine(types[node.cond], types[node.x], "where"), types[node.y], "where")
    if isinstance(node, PairNode):
        kind, width = types[node.x]
        if not kind.has_cols:
            raise TypeError(f"coda.pairs needs a value with columns (tile or vec_n), got a {kind.value}")
        if width == Fraction(1, 2):
            raise ValueError("coda.pairs of a width-1/2 value would have width 1/4; widths are 1/2, 1 or 2")
        return kind, width / 2
    if isinstance(node, InterleaveNode):
        (kx, wx), (ky, wy) = types[node.x], types[node.y]
        if not (kx.has_cols and ky.has_cols) or kx != ky or wx != wy:
            raise ValueError(
                "coda.interleave needs two values of the same kind and width with columns, "
                f"got a {kx.value} of width {wx} and a {ky.value} of width {wy}"
            )
        if wx == 2:
            raise ValueError("coda.interleave of width-2 values would have width 4; widths are 1/2, 1 or 2")
        return kx, wx * 2
    if isinstance(node, GroupNode):
        kind, width = types[node.x]
        what = f"coda.group_{node.op}"
        if kind != Kind.TILE:
            raise TypeError(
                f"{what} needs a tile (groups of columns within each row), got a {kind.value}; "
                "a vec_n's groups can be reduced in torch before the call"
            )
        check_group(node.group, what)
        return kind, width
    raise TypeError(f"infer: not a computed node: {node!r}")


def _leaf_type(node: object, operands: dict[str, OperandSpec]) -> tuple[Kind, Fraction]:
    if isinstance(node, InputNode):
        if node.name == "acc":
            return Kind.TILE, Fraction(1)
        if node.name not in operands:
            raise ValueError(f"input node refers to undeclared operand {node.name!r}")
        spec = operands[node.name]
        return spec.kind, spec.frac_width
    if isinstance(node, ConstNode):
        return Kind.SCALAR, Fraction(1)
    if isinstance(node, IndexNode):
        return (Kind.VEC_M, Fraction(1)) if node.axis == "m" else (Kind.VEC_N, node.frac_width)
    raise TypeError(f"not a leaf node: {node!r}")


def check_output(out: object, kind: Kind, width: Fraction) -> None:
    """The rules for what may be an output (shared by the tracer and the validator)."""
    if isinstance(out, StoreOutput):
        if kind != Kind.TILE:
            raise TypeError(
                f"output {out.name!r} is a {kind.value}; only tiles and reductions can be outputs "
                "(reduce it, or combine it with the accumulator)"
            )
        return
    assert isinstance(out, ReduceOutput)
    if kind != Kind.TILE:
        raise TypeError(f"reduction {out.name!r} needs a tile, got a {kind.value}")
    if out.axis == "m" and out.op != "sum":
        raise ValueError(f"reduce_m supports only 'sum', got {out.op!r}")
    if out.group is not None:
        if out.axis != "n":
            raise ValueError("group= is only for reduce_n")
        g = out.group
        if g < 1 or g & (g - 1):
            raise ValueError(f"reduce_n group must be a positive power of two, got {g}")


class Graph(_Model):
    """A validated epilogue program. `name` is for printing; it is not part of the hash."""

    name: str
    operands: tuple[OperandSpec, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[Output, ...]
    single: bool = False

    @model_validator(mode="after")
    def _validate(self) -> "Graph":
        # The typing rules raise TypeError for kind misuse (what a tracing user sees); on a
        # constructed graph every rule violation is a validation error like the others.
        try:
            return self._check()
        except TypeError as exc:
            raise ValueError(str(exc)) from exc

    def _check(self) -> "Graph":
        operands = {}
        for spec in self.operands:
            check_name(spec.name, "operand")
            if spec.name in RESERVED_NAMES:
                raise ValueError(f"operand name {spec.name!r} is reserved ({', '.join(sorted(RESERVED_NAMES))})")
            if spec.name in operands:
                raise ValueError(f"operand {spec.name!r} is declared twice")
            if spec.kind in (Kind.SCALAR, Kind.VEC_M) and spec.width != "1":
                raise ValueError(f"operand {spec.name!r}: a {spec.kind.value} has no width")
            operands[spec.name] = spec
        types: dict[int, tuple[Kind, Fraction]] = {}
        used: set[int] = set()
        for position, node in enumerate(self.nodes):
            if node.id != position:
                raise ValueError(f"node ids must be 0..n-1 in order, found id {node.id} at position {position}")
            for arg in node.args:
                if arg not in types:
                    raise ValueError(f"node %{node.id} uses %{arg}, which is not an earlier node")
                used.add(arg)
            kind, width = (
                _leaf_type(node, operands)
                if isinstance(node, (InputNode, ConstNode, IndexNode))
                else infer(node, types)
            )
            if (kind, width) != (node.kind, node.frac_width):
                raise ValueError(
                    f"node %{node.id} is declared {node.kind.value}[{node.width}] "
                    f"but its arguments make it {kind.value}[{width}]"
                )
            types[node.id] = (kind, width)
        if not self.outputs:
            raise ValueError("an epilogue must have at least one output")
        names = set()
        for out in self.outputs:
            check_name(out.name, "output")
            if out.name in names:
                raise ValueError(f"output {out.name!r} appears twice")
            names.add(out.name)
            if out.x not in types:
                raise ValueError(f"output {out.name!r} refers to missing node %{out.x}")
            used.add(out.x)
            check_output(out, *types[out.x])
        if self.single and len(self.outputs) != 1:
            raise ValueError("a single-output graph must have exactly one output")
        dead = [n.id for n in self.nodes if n.id not in used]
        if dead:
            raise ValueError(f"nodes {dead} are not used by any output (graphs hold no dead code)")
        return self

    @cached_property
    def hash(self) -> str:
        """sha256 of the canonical serialization (everything but the name)."""
        data = self.model_dump(mode="json", exclude={"name"})
        text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def node(self, node_id: int) -> Node:
        return self.nodes[node_id]

    def column_groups(self) -> list[tuple[str, int, Fraction]]:
        """(what, group, width) of every grouped reduction: outputs (reduce_n group=) and values
        (group_sum / group_max). Each needs whole groups in every epilogue (sub)tile and in N."""
        groups = [(f"reduction {o.name!r}", o.group, self.node(o.x).frac_width)
                  for o in self.outputs if isinstance(o, ReduceOutput) and o.group is not None]
        groups += [(f"group_{n.op} (node %{n.id})", n.group, n.frac_width) for n in self.nodes if isinstance(n, GroupNode)]
        return groups

    def uses_width(self, width: Fraction) -> bool:
        return any(n.kind.has_cols and n.frac_width == width for n in self.nodes) or any(
            s.kind.has_cols and s.frac_width == width for s in self.operands
        )

    def __str__(self) -> str:
        params = ", ".join(["acc: tile"] + [f"{s.name}: {_type_str(s.kind, s.width)}" for s in self.operands])
        lines = [f"epilogue {self.name}({params})"]
        for node in self.nodes:
            lines.append(f"  %{node.id} = {_node_str(node):<34} : {_type_str(node.kind, node.width)}")
        for out in self.outputs:
            if isinstance(out, StoreOutput):
                lines.append(f"  out {out.name} = store %{out.x}")
            else:
                group = f", group={out.group}" if out.group else ""
                lines.append(f"  out {out.name} = reduce_{out.axis}(%{out.x}, {out.op!r}{group}) : fp32")
        return "\n".join(lines)


def _type_str(kind: Kind, width: str) -> str:
    return kind.value if width == "1" else f"{kind.value}[{width}]"


def _node_str(node: object) -> str:
    if isinstance(node, InputNode):
        return node.name
    if isinstance(node, ConstNode):
        return repr(node.value)
    if isinstance(node, IndexNode):
        return f"{'row' if node.axis == 'm' else 'col'}_index()"
    if isinstance(node, UnaryNode):
        return f"{node.fn} %{node.x}"
    if isinstance(node, BinaryNode):
        return f"{node.fn} %{node.x}, %{node.y}"
    if isinstance(node, WhereNode):
        return f"where %{node.cond}, %{node.x}, %{node.y}"
    if isinstance(node, PairNode):
        return f"pair_{'even' if node.half == 0 else 'odd'} %{node.x}"
    if isinstance(node, InterleaveNode):
        return f"interleave %{node.x}, %{node.y}"
    if isinstance(node, GroupNode):
        return f"group_{node.op} %{node.x}, group={node.group}"
    raise TypeError(node)


__all__ = ["Graph", "infer", "check_group", "check_output", "check_name", "RESERVED_NAMES", "ARITH_FNS"]
