"""coda.gemm under torch.compile: one generic `coda::gemm` custom op.

While Dynamo traces, coda.gemm does not run the kernel (Triton launches, data pointers and the
plan cache cannot be traced); it records one call of `torch.ops.coda.gemm`, which names the
epilogue by its graph hash, takes the tensor operands, the Scalars and the out= tensors (which
it mutates) in the graph's operand and output order, and returns the outputs gemm() allocates.
Its fake kernel derives their shapes and dtypes from the graph, so any @coda.epilogue works
under `torch.compile(fullgraph=True)`. At run time the op calls coda.gemm eagerly, with every
check of an eager call. Outside tracing coda.gemm does not go through the op (its dispatch
would cost host time on every call).

The op has no autograd formula (coda.gemm is not differentiable); with grad mode on, inputs
that require grad raise while tracing, as they do eagerly.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import torch

from ..ir.graph import Graph
from ..ir.nodes import StoreOutput

# graph hash -> graph, for every traced epilogue (and the plain GEMM): what the op's key names
_graphs: dict[str, Graph] = {}

Signature = tuple[str, tuple[str, ...], tuple[str, ...], bool]  # hash, operands, outputs, single


def register(graph: Graph) -> Signature:
    """Make `graph` callable through coda::gemm; returns what dispatch() needs, as constants."""
    _graphs[graph.hash] = graph
    return (graph.hash, tuple(s.name for s in graph.operands), tuple(o.name for o in graph.outputs),
            len(graph.outputs) == 1)


def _graph(key: str) -> Graph:
    graph = _graphs.get(key)
    if graph is None:
        raise RuntimeError(f"coda::gemm: no epilogue with graph hash {key} in this process; define (import) the "
                           f"@coda.epilogue before running a compiled program that calls it")
    return graph


def _cols(n, width) -> object:
    return n * width.numerator // width.denominator


def _new_outputs(graph: Graph, a: torch.Tensor, b: torch.Tensor, out_idx: Sequence[int]) -> list[tuple]:
    m, n = a.shape[0], b.shape[1]
    shapes = []
    for i, o in enumerate(graph.outputs):
        if i in out_idx:
            continue
        cols = _cols(n, graph.node(o.x).frac_width)
        if isinstance(o, StoreOutput):
            shapes.append(((m, cols), a.dtype))
        elif o.axis == "m":
            shapes.append(((cols,), torch.float32))
        else:
            shapes.append(((m,) if o.group is None else (m, cols // o.group), torch.float32))
    return shapes


def _unpack(graph: Graph, tensor_idx, tensors, scalar_idx, scalars, out_idx, outs) -> tuple[dict, dict]:
    names = [s.name for s in graph.operands]
    operands: dict[str, object] = {names[i]: t for i, t in zip(tensor_idx, tensors)}
    operands.update({names[i]: v for i, v in zip(scalar_idx, scalars)})
    out = {graph.outputs[i].name: t for i, t in zip(out_idx, outs)}
    return operands, out


@torch.library.custom_op("coda::gemm", mutates_args=("outs",))
def _gemm_op(key: str, a: torch.Tensor, b: torch.Tensor, tensor_idx: list[int], tensors: list[torch.Tensor],
             scalar_idx: list[int], scalars: list[float], out_idx: list[int],
             outs: list[torch.Tensor]) -> list[torch.Tensor]:
    from .guard import run_checked

    graph = _graph(key)
    operands, out = _unpack(graph, tensor_idx, tensors, scalar_idx, scalars, out_idx, outs)
    result = run_checked(graph, a, b, operands, out or None)
    if isinstance(result, torch.Tensor):
        result = {graph.outputs[0].name: result}
    return [result[o.name] for i, o in enumerate(graph.outputs) if i not in out_idx]


@_gemm_op.register_fake
def _gemm_fake(key, a, b, tensor_idx, tensors, scalar_idx, scalars, out_idx, outs):
    graph = _graph(key)
    operands, out = _unpack(graph, tensor_idx, tensors, scalar_idx, scalars, out_idx, outs)
    sizes = [a, b, *tensors, *outs]
    if all(isinstance(d, int) for t in sizes for d in t.shape):  # static shapes: the eager call's errors now
        from .device import interpreting
        from .validate import validate

        validate(graph, a, b, operands, out or None, interpreting())
    return [a.new_empty(shape, dtype=dtype) for shape, dtype in _new_outputs(graph, a, b, out_idx)]


def dispatch(a: object, b: object, epilogue: object, out: object, operands: dict[str, object]):
    """coda.gemm while Dynamo traces: one coda::gemm call, its results as gemm() returns them."""
    sig = _PLAIN if epilogue is None else getattr(epilogue, "_coda_signature", None)
    if sig is None:
        raise TypeError(f"coda.gemm: epilogue must be a @coda.epilogue function or None, got {type(epilogue).__name__}")
    key, op_names, out_names, single = sig
    if torch.is_grad_enabled():
        for name, t in (("a", a), ("b", b), *operands.items()):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                from .guard import NOT_DIFFERENTIABLE

                raise RuntimeError(f"coda.gemm: {name} requires grad, but {NOT_DIFFERENTIABLE}")
    tensor_idx, tensors, scalar_idx, scalars = [], [], [], []
    for name, v in operands.items():
        if name not in op_names:
            raise TypeError(f"coda.gemm: unknown operand {name!r}; the epilogue takes: {', '.join(op_names) or 'none'}")
        if isinstance(v, torch.Tensor):
            tensor_idx.append(op_names.index(name))
            tensors.append(v)
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
            scalar_idx.append(op_names.index(name))
            scalars.append(float(v))
        else:
            raise TypeError(f"coda.gemm: operand {name!r} must be a tensor or a Python number, got {type(v).__name__}")
    out_idx, outs = [], []
    if isinstance(out, torch.Tensor):
        if not single:
            raise TypeError(f"coda.gemm: out= is a tensor but the epilogue has several outputs ({', '.join(out_names)}); "
                            f"pass a dict")
        out_idx, outs = [0], [out]
    elif isinstance(out, dict):
        for name, t in out.items():
            if name not in out_names:
                raise ValueError(f"coda.gemm: out= names {name!r}, which is not an output ({', '.join(out_names)})")
            out_idx.append(out_names.index(name))
            outs.append(t)
    elif out is not None:
        raise TypeError(f"coda.gemm: out= must be a tensor or a dict of tensors, got {type(out).__name__}")
    new = torch.ops.coda.gemm(key, a, b, tensor_idx, tensors, scalar_idx, scalars, out_idx, outs)
    results, j = {}, 0
    for i, name in enumerate(out_names):
        if i in out_idx:
            results[name] = outs[out_idx.index(i)]
        else:
            results[name] = new[j]
            j += 1
    return results[out_names[0]] if single else results


def _plain() -> Signature:
    from ..ir.trace import trace

    def _identity(acc):
        return acc

    return register(trace(_identity))


_PLAIN = _plain()
