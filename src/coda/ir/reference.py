"""The oracle: evaluate a Graph with torch in fp32 on a given accumulator.

Shapes during evaluation: scalar -> 0-d, vec_m -> [M, 1], vec_n -> [1, width*N],
tile -> [M, width*N]. Arithmetic happens in fp32; comparisons keep integer operands
exact, as the kernels do.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .graph import Graph
from .primitives import GROUP_REDUCTIONS, PRIMITIVES, reduce_reference
from .nodes import (
    BinaryNode, ConstNode, GroupNode, IndexNode, InputNode, InterleaveNode, PairNode, ReduceOutput,
    UnaryNode, WhereNode,
)
from .types import Kind

def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _operand_value(kind: Kind, value: object, device: torch.device) -> torch.Tensor:
    if kind == Kind.SCALAR:
        t = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        t = t.to(device)
        return _f32(t) if t.is_floating_point() else t
    t = value.to(device)  # type: ignore[union-attr]
    if t.is_floating_point():
        t = _f32(t)
    if kind == Kind.VEC_M:
        return t[:, None]
    if kind == Kind.VEC_N:
        return t[None, :]
    return t


def evaluate(graph: Graph, acc: torch.Tensor, operands: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """Outputs of `graph` (by name, fp32) for an [M, N] accumulator and validated operands."""
    m, n = acc.shape
    acc = _f32(acc)
    specs = {s.name: s for s in graph.operands}
    vals: list[torch.Tensor] = []
    for node in graph.nodes:
        if isinstance(node, InputNode):
            v = acc if node.name == "acc" else _operand_value(specs[node.name].kind, operands[node.name], acc.device)
        elif isinstance(node, ConstNode):
            v = torch.tensor(node.value, dtype=torch.float32, device=acc.device)
        elif isinstance(node, IndexNode):
            count = m if node.axis == "m" else int(n * node.frac_width)
            idx = torch.arange(count, dtype=torch.int32, device=acc.device)
            v = idx[:, None] if node.axis == "m" else idx[None, :]
        elif isinstance(node, UnaryNode):
            v = PRIMITIVES[node.fn].reference(_f32(vals[node.x]))
        elif isinstance(node, BinaryNode):
            x, y = vals[node.x], vals[node.y]
            prim = PRIMITIVES[node.fn]
            v = prim.reference(x, y) if prim.result == "bool" else prim.reference(_f32(x), _f32(y))
        elif isinstance(node, WhereNode):
            c = vals[node.cond]
            c = c if c.dtype == torch.bool else c != 0
            v = torch.where(c, _f32(vals[node.x]), _f32(vals[node.y]))
        elif isinstance(node, PairNode):
            v = vals[node.x][..., node.half::2]
        elif isinstance(node, InterleaveNode):
            x, y = vals[node.x], vals[node.y]
            v = torch.stack([x, y], dim=-1).reshape(*x.shape[:-1], 2 * x.shape[-1])
        elif isinstance(node, GroupNode):
            v = GROUP_REDUCTIONS[node.op].reference(_f32(vals[node.x]), node.group)
        else:  # pragma: no cover - Graph validation admits no other node
            raise TypeError(node)
        vals.append(v)
    results: dict[str, torch.Tensor] = {}
    for out in graph.outputs:
        x = _f32(vals[out.x])
        if not isinstance(out, ReduceOutput):
            results[out.name] = x
        elif out.axis == "m":
            results[out.name] = x.sum(dim=0)
        else:
            if out.group:
                x = x.reshape(x.shape[0], x.shape[1] // out.group, out.group)
            results[out.name] = reduce_reference(out.op, x, x.dim() - 1)
    return results
