"""How much epilogue code a kernel holds: the measure that keeps a first compile in seconds.

Triton runs LLVM's O3 pipeline on every kernel, and on a long straight-line epilogue its time
grows faster than the code: an sm_90 compile of a random program (two width-2 Tile operands,
seven sin/cos, grouped values and reductions) spent 59 of its 86 s in `optimize_module` on the
CPU, 114 of 158 s in another run. The code is about (operations per element of the epilogue) x
(elements a thread holds per subtile) x (copies of the epilogue the kernel holds: unrolled
subtiles, a flattened tile loop's second copy, Gluon's two consumers). `epilogue_weight` is the
first factor; the runtime's default config keeps the product under `CODE_BUDGET`.
"""

from __future__ import annotations

from fractions import Fraction

from ..ir.graph import Graph
from ..ir.nodes import GroupNode, InputNode, ReduceOutput, StoreOutput, UnaryNode
from ..ir.primitives import Backend

# Operations per element beyond one, in sm_90 PTX: coda's sin/cos range reduction and
# polynomials, the tanh and erf forms, the exp-based ones; everything else counts 1.
_HEAVY = {"sin": 40, "cos": 40, "tanh": 20, "gelu": 25, "exp": 8, "log": 8, "sigmoid": 8, "silu": 9}

# Triton's width-2 values compile to about twice the code their ops suggest (Gluon keeps them in
# the accumulator's registers, asserted): an epilogue with two width-2 Tiles and sin of one took
# 15-25 s at 20096 by this measure without the factor, where qknorm_rope_backward (no width-2
# value) took 5 s at 28544 (sm_90 compiles on the CPU machine, same default config family).
_TRITON_WIDTH2 = 2.0


def epilogue_weight(graph: Graph, backend: Backend) -> float:
    """Operations of the epilogue per accumulator element: every column-carrying value's ops,
    scaled by its width (a width-2 value has two elements per accumulator element, and on Triton
    twice that again); loads, stores and reductions count too. Scalars and row values are computed
    once a row: not counted."""
    scale = {Fraction(1, 2): 0.5, Fraction(1): 1.0,
             Fraction(2): 2.0 * (_TRITON_WIDTH2 if backend == "triton" else 1.0)}
    weight = 0.0
    for node in graph.nodes:
        if node.kind.value != "tile" or (isinstance(node, InputNode) and node.name == "acc"):
            continue
        ops = _HEAVY.get(node.fn, 1) if isinstance(node, UnaryNode) else 1
        if isinstance(node, GroupNode):
            ops = 2 * node.group.bit_length()
        weight += ops * scale[node.frac_width]
    for out in graph.outputs:
        ops = 2 if isinstance(out, StoreOutput) else 6 if isinstance(out, ReduceOutput) else 1
        weight += ops * scale[graph.node(out.x).frac_width]
    return weight


def code_size(graph: Graph, backend: Backend, elements: int, copies: int) -> float:
    """The epilogue's operations in a `backend` kernel whose threads hold `elements` accumulator
    elements a subtile, with `copies` copies of the epilogue."""
    return epilogue_weight(graph, backend) * elements * copies


__all__ = ["code_size", "epilogue_weight"]
