"""coda.gemm under torch.compile: one generic `coda::gemm` custom op.

While Dynamo traces, coda.gemm does not run the kernel (Triton launches, data pointers and the
plan cache cannot be traced); it records `torch.empty` for each output gemm() would allocate
(shapes and dtypes from the graph's output rules) and one call of `torch.ops.coda.gemm`, which
names the epilogue by its graph hash and takes the tensor operands, the Scalars and every output
(those and the out= tensors), which it writes: functionalization handles mutated arguments, not
returned outputs beside aliased ones. So any @coda.epilogue works under
`torch.compile(fullgraph=True)`. At run time the op calls coda.gemm eagerly, with every check of
an eager call. Outside tracing coda.gemm does not go through the op (its dispatch would cost
host time on every call).

The op has no autograd formula (coda.gemm is not differentiable); with grad mode on, inputs
that require grad raise while tracing, as they do eagerly.
"""

from __future__ import annotations

import numbers
import torch

from ..ir.graph import Graph
from ..ir.nodes import StoreOutput
from .inductor import before_tracing, explicit_fallback

# graph hash -> graph, for every traced epilogue (and the plain GEMM): what the op's key names
_graphs: dict[str, Graph] = {}

# hash, operand names, output names, single output?, and per output how gemm() allocates it:
# (tile store?, width numerator, width denominator, reduction over M?, group or 0)
Signature = tuple[str, tuple[str, ...], tuple[str, ...], bool, tuple[tuple[bool, int, int, bool, int], ...]]


def register(graph: Graph) -> Signature:
    """Make `graph` callable through coda::gemm; returns what dispatch() needs, as constants."""
    _graphs[graph.hash] = graph
    rules = []
    for o in graph.outputs:
        w = graph.node(o.x).frac_width
        store = isinstance(o, StoreOutput)
        rules.append((store, w.numerator, w.denominator, not store and o.axis == "m",
                      0 if store or o.group is None else o.group))
    return (graph.hash, tuple(s.name for s in graph.operands), tuple(o.name for o in graph.outputs),
            len(graph.outputs) == 1, tuple(rules))


def _graph(key: str) -> Graph:
    graph = _graphs.get(key)
    if graph is None:
        raise RuntimeError(f"coda::gemm: no epilogue with graph hash {key} in this process; define (import) the "
                           f"@coda.epilogue before running a compiled program that calls it")
    return graph


def _unpack(graph: Graph, tensor_idx, tensors, scalar_idx, scalars, outs) -> tuple[dict, dict]:
    names = [s.name for s in graph.operands]
    operands: dict[str, object] = {names[i]: t for i, t in zip(tensor_idx, tensors)}
    operands.update({names[i]: v for i, v in zip(scalar_idx, scalars)})
    return operands, {o.name: t for o, t in zip(graph.outputs, outs)}


# Every output is passed in (mutated): functionalization handles mutated inputs, not outputs
# that gemm() allocates next to out= tensors it returns as given.
@torch.library.custom_op("coda::gemm", mutates_args=("outs",))
def _gemm_op(key: str, a: torch.Tensor, b: torch.Tensor, tensor_idx: list[int], tensors: list[torch.Tensor],
             scalar_idx: list[int], scalars: list[float], outs: list[torch.Tensor]) -> None:
    from .guard import run_checked

    graph = _graph(key)
    operands, out = _unpack(graph, tensor_idx, tensors, scalar_idx, scalars, outs)
    run_checked(graph, a, b, operands, out)


@_gemm_op.register_fake
@before_tracing
def _gemm_fake(key, a, b, tensor_idx, tensors, scalar_idx, scalars, outs) -> None:
    graph = _graph(key)
    operands, out = _unpack(graph, tensor_idx, tensors, scalar_idx, scalars, outs)
    if all(isinstance(d, int) for t in (a, b, *tensors, *outs) for d in t.shape):  # the eager call's errors
        from .device import interpreting
        from .validate import validate

        validate(graph, a, b, operands, out, interpreting())


explicit_fallback(torch.ops.coda.gemm.default)


def dispatch(a: object, b: object, epilogue: object, out: object, operands: dict[str, object]):
    """coda.gemm while Dynamo traces: one coda::gemm call, its results as gemm() returns them."""
    sig = _PLAIN if epilogue is None else getattr(epilogue, "_coda_signature", None)
    if sig is None:
        raise TypeError(f"coda.gemm: epilogue must be a @coda.epilogue function or None, got {type(epilogue).__name__}")
    key, op_names, out_names, single, rules = sig
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
    given: dict[str, torch.Tensor] = {}
    if isinstance(out, torch.Tensor):
        if not single:
            raise TypeError(f"coda.gemm: out= is a tensor but the epilogue has several outputs ({', '.join(out_names)}); "
                            f"pass a dict")
        given = {out_names[0]: out}
    elif isinstance(out, dict):
        for name in out:
            if name not in out_names:
                raise ValueError(f"coda.gemm: out= names {name!r}, which is not an output ({', '.join(out_names)})")
        given = out
    elif out is not None:
        raise TypeError(f"coda.gemm: out= must be a tensor or a dict of tensors, got {type(out).__name__}")
    m, n = a.shape[0], b.shape[1]
    outs = []
    for name, (store, num, den, axis_m, group) in zip(out_names, rules):
        if name in given:
            outs.append(given[name])
            continue
        cols = n * num // den
        shape = (m, cols) if store else (cols,) if axis_m else (m, cols // group) if group else (m,)
        outs.append(torch.empty(shape, dtype=a.dtype if store else torch.float32, device=a.device))
    torch.ops.coda.gemm(key, a, b, tensor_idx, tensors, scalar_idx, scalars, outs)
    return outs[0] if single else dict(zip(out_names, outs))


def _plain() -> Signature:
    from ..ir.trace import trace

    def _identity(acc):
        return acc

    return register(trace(_identity))


_PLAIN = _plain()
