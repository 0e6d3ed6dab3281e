"""A fingerprint of the code generator: every source file that decides what a kernel's text is.

Kernel and tuning cache keys include it, so they fail closed: a changed emitter, template,
primitive table or spec never serves a kernel (or a tuned config) made by the old one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_PACKAGES = ("ir", "codegen", "templates")


def _compute() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for path in sorted((root / pkg).glob("*.py")):
            h.update(f"{pkg}/{path.name}\0".encode())
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:16]


GENERATOR = _compute()

__all__ = ["GENERATOR"]
