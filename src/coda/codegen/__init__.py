"""coda.codegen: IR -> Triton source, by filling the persistent GEMM template."""

from .kernel import generate
from .spec import OperandForm, Specialization, operand_args, output_args

__all__ = ["generate", "OperandForm", "Specialization", "operand_args", "output_args"]
