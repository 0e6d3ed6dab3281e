"""JIT cache: generated kernel source on disk, loaded modules in memory.

A kernel is keyed by (graph hash, specialization, code-generator fingerprint, coda version).
Its source is written atomically under `$CODA_CACHE_DIR/kernels` (default
`~/.cache/coda`); a later process imports the file instead of regenerating it.
Triton keeps its compiled binaries in its own on-disk cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from types import ModuleType

from .. import __version__
from ..codegen import Specialization, generate
from ..ir.graph import Graph
from .env import cache_root
from .fingerprint import GENERATOR

stats: Counter = Counter()  # "generated", "disk_hits", "memory_hits"
_modules: dict[str, ModuleType] = {}
_lock = threading.Lock()


def cache_dir() -> Path:
    return cache_root()  # CODA_CACHE_DIR expanded, or a temporary directory when unwritable: runtime/env.py


def kernel_key(graph: Graph, spec: Specialization) -> str:
    text = f"{graph.hash}|{spec.key()}|g{GENERATOR}|coda{__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _import(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    if not hasattr(module, "coda_kernel"):
        sys.modules.pop(name, None)
        raise ImportError(f"{path} defines no coda_kernel")
    return module


def load_kernel(graph: Graph, spec: Specialization):
    """The compiled-on-first-launch Triton kernel for (graph, spec)."""
    key = kernel_key(graph, spec)
    with _lock:
        module = _modules.get(key)
        if module is None:
            module = _load_or_generate(graph, spec, key)
            _modules[key] = module
    return module.coda_kernel


_SEAL = "# coda-sha256: "


def seal(text: str) -> str:
    """Append a checksum line, so a truncated or edited cache file is detected on load."""
    return f"{text}{_SEAL}{hashlib.sha256(text.encode()).hexdigest()}\n"


def is_sealed(text: str) -> bool:
    body, sep, digest = text.rstrip("\n").rpartition("\n" + _SEAL)
    return bool(sep) and hashlib.sha256((body + "\n").encode()).hexdigest() == digest


def _load_or_generate(graph: Graph, spec: Specialization, key: str) -> ModuleType:
    path = cache_dir() / "kernels" / f"coda_{key}.py"
    name = f"coda_generated_{key}"
    if path.exists():
        try:
            text = path.read_text()
            if is_sealed(text) and graph.hash in text:
                module = _import(path, name)
                stats["disk_hits"] += 1
                return module
        except Exception:  # unreadable or not importable: regenerate it below
            pass
    atomic_write(path, seal(generate(graph, spec)))
    stats["generated"] += 1
    return _import(path, name)
