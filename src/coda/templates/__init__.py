"""coda.templates: kernel template text (plain strings with named hooks)."""

from .persistent_gemm import PERSISTENT_GEMM, TEMPLATE_VERSION, fill, hooks

__all__ = ["PERSISTENT_GEMM", "TEMPLATE_VERSION", "fill", "hooks"]
