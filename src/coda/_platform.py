"""Choose Triton's interpreter before Triton is imported when there is no CUDA device.

Triton decides at import time whether its language functions run interpreted, so
this module runs first, from `coda/__init__.py`. Under the interpreter it also refuses a
numpy that Triton 3.6's interpreter cannot run with, saying what to install, instead of
letting the first kernel fail deep inside Triton.
"""

from __future__ import annotations

import os
import re
import sys

import torch

_FLAG = "TRITON_INTERPRET"


def _decide() -> bool:
    flag = os.environ.get(_FLAG)
    if flag is not None:
        # An explicit setting wins: TRITON_INTERPRET=0 on a CPU-only machine is for
        # ahead-of-time compilation (coda.runtime.aot), where nothing is launched.
        return flag not in ("", "0")
    if torch.cuda.is_available():
        return False
    if "triton.language" in sys.modules:
        raise RuntimeError(
            "coda: no CUDA device, so kernels must run in Triton's interpreter, but Triton was imported "
            "before coda without TRITON_INTERPRET=1; import coda first or set TRITON_INTERPRET=1"
        )
    os.environ[_FLAG] = "1"
    return True


# Triton 3.6's interpreter fails under numpy 2.4 ("InterpreterError: only 0-dimensional arrays
# can be converted to Python scalars"); pyproject.toml caps numpy below it.
NUMPY_LIMIT = (2, 4)


def check_numpy(version: str) -> None:
    """Raise ImportError, saying what to install, if numpy `version` breaks the interpreter."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and (int(found[1]), int(found[2])) >= NUMPY_LIMIT:
        limit = ".".join(map(str, NUMPY_LIMIT))
        raise ImportError(
            f"coda: numpy {version} breaks Triton 3.6's interpreter, which runs coda's kernels when there is no "
            f"CUDA device; install numpy<{limit} (pip install 'numpy<{limit}')"
        )


INTERPRET = _decide()
if INTERPRET:
    import numpy

    check_numpy(numpy.__version__)
