"""Choose Triton's interpreter before Triton is imported when there is no CUDA device.

Triton decides at import time whether its language functions run interpreted, so
this module runs first, from `coda/__init__.py`.
"""

from __future__ import annotations

import os
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


INTERPRET = _decide()
