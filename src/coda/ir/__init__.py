"""coda.ir: typed epilogue graphs, the tracing front end and the fp32 torch reference."""

from .graph import Graph
from .nodes import OperandSpec, ReduceOutput, StoreOutput
from .reference import evaluate
from .trace import trace
from .types import Kind, OperandType, Scalar, Tile, VecM, VecN

__all__ = [
    "Graph", "OperandSpec", "ReduceOutput", "StoreOutput", "evaluate", "trace",
    "Kind", "OperandType", "Scalar", "Tile", "VecM", "VecN",
]
