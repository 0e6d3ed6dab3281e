"""What coda.gemm checks and records around each launch, whatever the plan cache holds.

* Autograd: coda.gemm has no backward (an epilogue is an arbitrary program), so with grad
  mode on, inputs that require grad raise instead of yielding a result without gradient;
  `out=` tensors that require grad raise as PyTorch's `out=` arguments do. Every `out=`
  tensor's version counter is bumped, so a tensor saved for backward and then overwritten
  makes backward raise, as after any in-place op.
* Aliasing: `out=` may not overlap what the call reads (coda.runtime.alias).
* torch.compile: while Dynamo traces, the call becomes one `coda::gemm` custom op
  (coda.runtime.custom_op).

These depend on data pointers and grad mode, so they run on every call (a few attribute
reads; the overlap test only for tensors passed as `out=`).
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..ir.graph import Graph
from ..ir.types import Kind
from . import alias, custom_op, threads

threads.install()

# graph hash -> (Tile operand names, the single output's name or None)
_info: dict[str, tuple[frozenset[str], str | None]] = {}


def _graph_info(graph: Graph) -> tuple[frozenset[str], str | None]:
    hit = _info.get(graph.hash)
    if hit is None:
        tiles = frozenset(s.name for s in graph.operands if s.kind == Kind.TILE)
        hit = _info[graph.hash] = (tiles, graph.outputs[0].name if len(graph.outputs) == 1 else None)
    return hit


NOT_DIFFERENTIABLE = (
    "coda.gemm is not differentiable (an epilogue has no backward), so its result would carry no "
    "gradient. For gradients use coda.ops (rmsnorm_linear, swiglu_mlp, linear_cross_entropy) or write the "
    "backward GEMMs yourself in a torch.autograd.Function; if no gradient should flow, pass .detach()ed "
    "tensors or call it under torch.no_grad()"
)


def check(graph: Graph, a: object, b: object, operands: Mapping[str, object], out: object) -> list[torch.Tensor]:
    """Raise for autograd misuse and aliasing of out=; returns the out= tensors."""
    tiles, single = _graph_info(graph)
    if isinstance(out, torch.Tensor):
        outs = {single: out} if single is not None else {}  # several outputs: validation raises
    elif isinstance(out, dict):
        outs = out
    else:
        outs = {}
    if torch.is_grad_enabled():
        grads = [name for name, t in (("a", a), ("b", b), *operands.items())
                 if isinstance(t, torch.Tensor) and t.requires_grad]
        if grads:
            raise RuntimeError(f"coda.gemm: {', '.join(grads)} require(s) grad, but {NOT_DIFFERENTIABLE}")
        for name, t in outs.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                leaf = "a leaf tensor that requires grad" if t.is_leaf else "a tensor that requires grad"
                raise RuntimeError(
                    f"coda.gemm: out[{name!r}] is {leaf}; out= arguments do not support automatic "
                    f"differentiation (as in PyTorch). Write into a tensor that does not require grad, or "
                    f"under torch.no_grad() (e.g. to update a parameter in place)"
                )
    if outs:
        alias.check_out(a, b, operands, outs, tiles)
    return [t for t in outs.values() if isinstance(t, torch.Tensor)]


def gemm(a: object, b: object, epilogue: object, out: object, operands: dict[str, object]):
    """coda.gemm: the checks above, the launch (coda.runtime.launch.run), the version bump."""
    if torch.compiler.is_compiling():
        return custom_op.dispatch(a, b, epilogue, out, operands)
    from . import launch

    return run_checked(launch.graph_of(epilogue), a, b, operands, out)


def run_checked(graph: Graph, a: object, b: object, operands: Mapping[str, object], out: object):
    from . import launch

    written = check(graph, a, b, operands, out)
    result = launch.run(graph, a, b, operands, out=out)
    if written:
        torch.autograd.graph.increment_version(written)
    return result
