"""Where kernels run: the GPU, or Triton's interpreter when no CUDA device is present."""

from __future__ import annotations

import functools

import torch

from .._platform import INTERPRET
from .env import env_int
from .resources import HOPPER_SMEM_BYTES


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
    return _sm_count(_index(device))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def has_tma(device: torch.device) -> bool:
    """Whether tensors on `device` should move through TMA: on sm_90 and later. Before Hopper,
    Triton 3.6 emulates tensor descriptors with plain loads that its pipeliner leaves unstaged (an
    sm_80 compile of rms_swiglu: no cp.async), where pointer loads get cp.async stages. Off the GPU
    (the interpreter, AOT compiles from CPU tensors) kernels are those for sm_90: yes."""
    return device.type != "cuda" or _capability(_index(device))[0] >= 9


@functools.lru_cache(maxsize=None)
def _smem_limit(index: int) -> int:
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def smem_limit(device: torch.device) -> int:
    """Shared memory one block may use on `device`, as Triton checks it before a launch (sm_90:
    227 KiB, sm_80: 163 KiB, sm_86/89: 99 KiB); off the GPU sm_90's (kernels are those for sm_90)."""
    return HOPPER_SMEM_BYTES if device.type != "cuda" else _smem_limit(_index(device))


def device_name(device: torch.device) -> str:
    if interpreting():
        return "triton-interpreter"
    return torch.cuda.get_device_name(device)
