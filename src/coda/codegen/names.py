"""Names both backends give a kernel and its arguments (the runtime calls kernels by keyword)."""

from __future__ import annotations

import re

from ..ir.graph import Graph
from ..ir.nodes import ReduceOutput
from .spec import Specialization, operand_args, output_args


def kernel_name(graph: Graph) -> str:
    """`coda_<epilogue>`: the name profilers and Triton's errors show for this kernel (other
    characters than ASCII letters, digits and _ become _: the name is code, and PTX's)."""
    return "coda_" + re.sub(r"[^0-9A-Za-z_]", "_", graph.name)


def comment_name(graph: Graph) -> str:
    """The epilogue's name as the generated source's header comment shows it (no line breaks)."""
    return graph.name.encode("unicode_escape").decode("ascii")


def kernel_args(graph: Graph, spec: Specialization) -> list[str]:
    """The epilogue's kernel arguments after the GEMM's own, in order: operands, then outputs."""
    forms = {f.name: f for f in spec.operands}
    args = [name for s in graph.operands for name in operand_args(s, forms[s.name])]
    return args + [name for out in graph.outputs for name in output_args(out)]


def partials_n(graph: Graph) -> bool:
    """Whether the epilogue writes per-tile partials of a reduction over N."""
    return any(isinstance(o, ReduceOutput) and o.axis == "n" and o.group is None for o in graph.outputs)
