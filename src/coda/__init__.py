"""coda: Transformer-block operators as GEMM-plus-epilogue programs (Triton + PyTorch)."""

__version__ = "0.1.0"

from . import _platform  # noqa: E402,F401  (must precede any Triton import)

from .ir.trace import (  # noqa: E402
    abs, col_index, cos, exp, gelu, group_max, group_sum, interleave, log, maximum, minimum, pairs, reduce_m, reduce_n,
    relu, round_bf16, round_fp16, row_index, rsqrt, sigmoid, silu, sin, sqrt, square, tanh, where,
)
from .ir.types import Scalar, Tile, VecM, VecN  # noqa: E402
from .epilogue import Epilogue, epilogue  # noqa: E402
from .runtime import Config, gemm  # noqa: E402
from . import ops  # noqa: E402  (built on the API above)
from . import nn  # noqa: E402
from . import models  # noqa: E402
from .models.hf_patch import patch  # noqa: E402

__all__ = [
    "__version__", "Epilogue", "epilogue", "gemm", "Config", "ops", "nn", "models", "patch",
    "Scalar", "VecM", "VecN", "Tile",
    "exp", "log", "sqrt", "rsqrt", "sigmoid", "silu", "gelu", "tanh", "relu", "sin", "cos", "abs",
    "square", "round_bf16", "round_fp16", "maximum", "minimum", "where", "pairs", "interleave", "row_index", "col_index",
    "reduce_n", "reduce_m", "group_sum", "group_max",
]
