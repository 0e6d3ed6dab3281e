"""coda.nn: nn.Module wrappers around coda.ops, with standard parameter layouts."""

from .modules import LinearCrossEntropy, RMSNormLinear, SwiGLUMLP

__all__ = ["LinearCrossEntropy", "RMSNormLinear", "SwiGLUMLP"]
