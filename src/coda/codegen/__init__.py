"""coda.codegen: IR -> kernel source (Triton or Gluon) by filling a backend's template."""

from .kernel import generate, unsupported
from .names import kernel_name
from .spec import OperandForm, Specialization, operand_args, output_args

__all__ = ["generate", "kernel_name", "unsupported", "OperandForm", "Specialization", "operand_args", "output_args"]
