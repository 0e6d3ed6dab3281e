"""coda.runtime: gemm(), input validation, the JIT cache and kernel launch."""

from .cache import cache_dir, stats
from .config import Config, default_config
from .device import interpreting
from .launch import gemm, graph_of, run, source

__all__ = ["Config", "cache_dir", "default_config", "gemm", "graph_of", "interpreting", "run", "source", "stats"]
