"""torch.autocast for coda's models: its dtype, and a module's call with its parameters in that dtype.

Under autocast, torch casts the operands of each matmul-like op to the autocast dtype (bf16 or fp16)
while the parameters stay fp32 (mixed precision with fp32 master weights, as transformers' Trainer
runs `bf16=True` on an fp32 model). coda's fused ops are not autocast ops, and one GEMM takes one
dtype, so the models cast instead: each module's floating parameters once per call, read in place in
its forward (autograd carries the gradients back to the fp32 parameters, as through autocast's
casts), the body run with autocast off so that every op sees that one dtype.
"""

from __future__ import annotations

import torch


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype torch.autocast casts to on this device, or None where it is off."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """t in `dtype` where both are floating (None: t as it is)."""
    return t if dtype is None or not t.is_floating_point() or t.dtype == dtype else t.to(dtype)
