"""coda.ops: Transformer operators as GEMM-epilogue programs, with autograd and torch.library ops."""

from . import epilogues
from .cross_entropy import linear_cross_entropy
from .custom import FusedOp, fused_op
from .layout import interleave_gate_up, permute_rope_rows, rope_pair_permutation, split_gate_up, unpermute_rope_rows
from .qknorm import qknorm_columns, qknorm_weight_grads
from .rmsnorm import rmsnorm
from .rmsnorm_linear import rmsnorm_linear
from .rmsnorm_gated_mlp import rmsnorm_geglu_mlp, rmsnorm_swiglu_mlp
from .rope import rope
from .swiglu_mlp import swiglu_mlp

__all__ = [
    "epilogues", "fused_op", "FusedOp", "linear_cross_entropy", "rmsnorm", "rmsnorm_linear", "rmsnorm_swiglu_mlp",
    "rmsnorm_geglu_mlp", "swiglu_mlp", "rope",
    "qknorm_columns", "qknorm_weight_grads",
    "interleave_gate_up", "split_gate_up", "rope_pair_permutation", "permute_rope_rows", "unpermute_rope_rows",
]
