"""When a tensor can move through TMA."""

from __future__ import annotations

import torch

from ..ir.nodes import StoreOutput
from .config import Config
from .device import has_tma
from .validate import Call


def tma_ok(t: torch.Tensor, major: int) -> bool:
    """TMA needs a GPU that has it (`device.has_tma`), a unit stride on the `major`-th dim, a
    16-byte aligned base and other stride."""
    if not has_tma(t.device):
        return False
    other = 1 - major
    size = t.element_size()
    return (
        t.stride(major) == 1
        and t.data_ptr() % 16 == 0
        and (t.stride(other) * size) % 16 == 0
        and t.shape[major] * size >= 16
    )


def operand_load(t: torch.Tensor) -> str:
    """How a template reads a [rows, cols] GEMM operand: TMA row/col-major or pointers."""
    if tma_ok(t, 1):
        return "tma_row"
    if tma_ok(t, 0):
        return "tma_col"
    return "ptr"


def box_ok(cfg: Config, cols: object, itemsize: int) -> bool:
    """An epilogue's [rows, cols] TMA box: at most 256 per dim and at least 16 bytes per row."""
    return cols <= 256 and cfg.epi_m <= 256 and cols * itemsize >= 16


def store_ok(call: Call, o: StoreOutput, cfg: Config) -> bool:
    """A TMA store needs an aligned row-major target and a legal box."""
    if not box_ok(cfg, cfg.epi_n * call.graph.node(o.x).frac_width, call.out_dtype(o).itemsize):
        return False
    t = call.out.get(o.name)
    if t is None:  # gemm() allocates it row-major on a's device; only the row pitch can break alignment
        row_bytes = call.output_shape(o)[1] * call.out_dtype(o).itemsize
        return has_tma(call.a.device) and row_bytes % 16 == 0
    return tma_ok(t, 1)


def tile_ok(call: Call, name: str, cfg: Config) -> bool:
    spec = next(s for s in call.graph.operands if s.name == name)
    t = call.operands[name]
    return t.dtype != torch.bool and box_ok(cfg, cfg.epi_n * spec.frac_width, t.element_size()) and tma_ok(t, 1)
