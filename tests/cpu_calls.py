"""Validated calls on CPU tensors, for the tests that plan or compile kernels without a GPU
(test_aot_gluon, test_compile_time, test_older_gpus, test_resources) and their worker processes:
a plan or a compile reads only the tensors' metadata, so every operand is zeros. The one place for
the operands' shapes and dtypes (those a Llama block passes) and for the registry of the epilogues
coda.ops builds."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from coda.epilogue import Epilogue
from coda.ir.graph import Graph
from coda.ir.nodes import OperandSpec
from coda.ir.types import Kind
from coda.ops import epilogues as E
from coda.runtime.validate import validate

_BY_NAME = {"target": "int64", "pos": "int64", "qk_mask": "bool"}


def block_dtype(s: OperandSpec, pos_dtype: str = "int64") -> str | None:
    """The dtype a Llama block passes for an operand: Tiles bf16, vectors fp32, the targets and
    positions int64 (`pos_dtype`), the QK-norm column mask bool; None for a scalar (a number)."""
    if s.kind == Kind.SCALAR:
        return None
    if s.name == "pos":
        return pos_dtype
    return _BY_NAME.get(s.name, "bfloat16" if s.kind == Kind.TILE else "float32")


def matrix(rows: int, cols: int, dtype: str | torch.dtype, col_major: bool = False, pad: int = 0) -> torch.Tensor:
    """Zeros [rows, cols], column-major (a transposed view) or with `pad` elements between rows."""
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if col_major:
        return torch.zeros(cols, rows + pad, dtype=dt)[:, :rows].T
    return torch.zeros(rows, cols + pad, dtype=dt)[:, :cols]


def operands(graph: Graph, m: int, n: int, dtypes: Mapping[str, str | None] | None = None,
             col_major: Collection[str] = (), pad: int = 0) -> dict[str, torch.Tensor | float]:
    """Each operand of `graph` at an [m, n] output: a number where its dtype is None (a scalar's
    default), else zeros of its shape (a scalar's: 0-d) in `dtypes`' dtype (default `block_dtype`); Tiles named in `col_major` column-major,
    Tiles `pad` elements apart by row (read through pointers, not TMA)."""
    found: dict[str, torch.Tensor | float] = {}
    for s in graph.operands:
        dtype = dtypes[s.name] if dtypes is not None else block_dtype(s)
        cols = int(n * s.frac_width)
        if dtype is None:
            found[s.name] = 0.5
        elif s.kind == Kind.TILE:
            found[s.name] = matrix(m, cols, dtype, s.name in col_major, pad)
        else:
            shape = {Kind.SCALAR: (), Kind.VEC_M: (m,), Kind.VEC_N: (cols,)}[s.kind]
            found[s.name] = torch.zeros(shape, dtype=getattr(torch, dtype))
    return found


def call(graph: Graph, m: int, n: int, k: int, dtypes: Mapping[str, str | None] | None = None, *,
         in_dtype: str = "bfloat16", a_col: bool = False, b_col: bool = True, col_major: Collection[str] = (),
         pad: int = 0, out: Mapping[str, torch.Tensor] | None = None):
    """`validate`'s call of `graph` (as for the interpreter: CPU tensors) with a [m, k] and b [k, n]
    (by default b = W.T of an nn.Linear weight W) and `operands`."""
    a, b = matrix(m, k, in_dtype, a_col), matrix(k, n, in_dtype, b_col)
    return validate(graph, a, b, operands(graph, m, n, dtypes, col_major, pad), out, True)


def ops_epilogues() -> dict[str, Epilogue]:
    """Every epilogue coda.ops builds, by its graph's name: the module-level ones of
    coda.ops.epilogues, the LM head's per dtype and with bf16's options, QK-norm's per head_dim."""
    eps = [ep for ep in vars(E).values() if isinstance(ep, Epilogue)]
    eps += [E.lm_head(d) for d in (torch.bfloat16, torch.float16, torch.float32)]
    eps += [E.lm_head(torch.bfloat16, softcap=c, smoothing=s) for c, s in ((True, False), (False, True), (True, True))]
    eps += [f(hd) for f in (E.rms_qknorm_rope, E.qknorm_rope_backward) for hd in (64, 128)]
    return {ep.graph.name: ep for ep in eps}
