"""@coda.epilogue: trace a user function once, at decoration, into an Epilogue."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .ir import Graph, evaluate, trace
from .runtime import interpreting, source as _source
from .runtime.custom_op import register
from .runtime.validate import validate


class Epilogue:
    """A traced epilogue: `.graph` (the IR), `.reference(...)` (fp32 torch oracle), `.source(...)`."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.graph: Graph = trace(fn)
        self._coda_signature = register(self.graph)  # names it to torch.compile (coda.runtime.custom_op)
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"<coda.epilogue {self.graph.name} {self.graph.hash[:12]}>"

    def reference(self, a: torch.Tensor, b: torch.Tensor, **operands: object):
        """The same graph evaluated with torch in fp32 on a.float() @ b.float()."""
        call = validate(self.graph, a, b, operands, None, interpreting())
        acc = call.a.to(torch.float32) @ call.b.to(torch.float32)
        results = evaluate(self.graph, acc, call.operands)
        return results[self.graph.outputs[0].name] if self.graph.single else results

    def source(self, a: torch.Tensor, b: torch.Tensor, **operands: object) -> str:
        """The generated source (Triton or Gluon, its first line says which and why) of the kernel
        coda.gemm(a, b, self, **operands) runs, at the default config (tuning may pick another)."""
        return _source(self.graph, a, b, operands)


def epilogue(fn: Callable) -> Epilogue:
    """Decorator: trace `fn(acc, *operands)` into an Epilogue usable with coda.gemm."""
    return Epilogue(fn)
