"""gemm() on empty shapes, as torch.matmul defines them: nothing to launch for M = 0 or N = 0
(tile outputs are empty; reductions over an empty axis are their identities: sum 0,
logsumexp -inf), and for K = 0 the accumulator is zeros, so the epilogue runs on a K = 1
product of zeros (one tiny launch of the same epilogue; TMA descriptors need K > 0)."""

from __future__ import annotations

import torch

from ..ir.nodes import ReduceOutput
from ..ir.reference import evaluate
from .validate import Call


def is_degenerate(call: Call) -> bool:
    return call.m == 0 or call.n == 0 or call.k == 0


def zero_k_inputs(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) of shape [M, 1], [1, N] whose product is the K = 0 accumulator, zeros."""
    return call.a.new_zeros(call.m, 1), call.b.new_zeros(1, call.n)


def empty_outputs(call: Call) -> torch.Tensor | dict[str, torch.Tensor]:
    """The outputs of a call with M = 0 or N = 0 (into out= where given)."""
    graph = call.graph
    for o in graph.outputs:
        if isinstance(o, ReduceOutput) and o.op == "max" and o.axis == "n" and call.m and not call.n:
            raise ValueError(f"coda.gemm: reduction {o.name!r} takes the max over N = 0 columns, which has no value")
    acc = torch.zeros(call.m, call.n, device=call.a.device, dtype=torch.float32)
    values = evaluate(graph, acc, call.operands)
    results: dict[str, torch.Tensor] = {}
    for o in graph.outputs:
        dtype = torch.float32 if isinstance(o, ReduceOutput) else call.out_dtype(o)
        t = call.out.get(o.name)
        if t is None:
            t = torch.empty(call.output_shape(o), dtype=dtype, device=call.a.device)
        t.copy_(values[o.name].reshape(t.shape))
        results[o.name] = t
    return results[graph.outputs[0].name] if graph.single else results
