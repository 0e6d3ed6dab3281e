"""Where kernels run: the GPU, or Triton's interpreter when no CUDA device is present."""

from __future__ import annotations

import functools

import torch

from .._platform import INTERPRET
from .env import env_int


def interpreting() -> bool:
    """True when kernels go through Triton's interpreter (no CUDA device, or TRITON_INTERPRET=1)."""
    return INTERPRET


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device) -> int:
    """Persistent-grid width: the SM count, or a few programs under the interpreter
    (enough to exercise the persistent tile loop; set CODA_INTERPRET_PROGRAMS to change)."""
    if interpreting():
        return env_int("CODA_INTERPRET_PROGRAMS", 3)
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def device_name(device: torch.device) -> str:
    if interpreting():
        return "triton-interpreter"
    return torch.cuda.get_device_name(device)
