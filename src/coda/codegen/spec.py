"""What a generated kernel is specialized on, and the kernel argument names.

The runtime builds a `Specialization` from the call's tensors; codegen turns
(graph, specialization) into source. Argument names are defined here once so the
runtime can call the kernel by keyword.
"""

from __future__ import annotations

import hashlib
import json
from fractions import Fraction
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict

from ..ir.nodes import OperandSpec, ReduceOutput, StoreOutput
from ..ir.primitives import Backend
from ..ir.types import Kind

DType = Literal["float16", "bfloat16", "float32", "int8", "int16", "int32", "int64", "uint8", "bool"]
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
OperandLoad = Literal["tma_row", "tma_col", "ptr"]


class OperandForm(BaseModel):
    """How one epilogue operand arrives: a Python number (`dtype` None) or a tensor of `dtype`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    dtype: Optional[DType] = None


class Specialization(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    backend: Backend = "triton"  # which template and dialect the kernel is generated for
    in_dtype: Literal["float16", "bfloat16", "float32"]
    a_load: OperandLoad
    b_load: OperandLoad
    operands: tuple[OperandForm, ...]
    store_dtypes: tuple[tuple[str, Literal["float16", "bfloat16", "float32"]], ...]
    interpret: bool
    tma_stores: tuple[str, ...] = ()  # tile outputs written through TMA descriptors
    tma_tiles: tuple[str, ...] = ()  # Tile operands read through TMA descriptors
    wide: bool = True  # int64 row offsets: some tensor spans 2**31 elements or more
    subtile: int = 1  # epilogue column subtiles per output tile (Config.subtile)
    epilogue_loop: bool = False  # gluon-hopper: one loop over the subtiles (Config.epilogue_loop)

    def key(self) -> str:
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def width_suffix(width: Fraction) -> str:
    return {Fraction(1, 2): "nh", Fraction(1): "n1", Fraction(2): "n2"}[width]


# Every generated name is a fixed prefix, the user's name, then one suffix without an
# underscore ("in_x_ptr", "in_x_s0", "in_x_val", "red_x_max"): since the suffix is what follows
# the last underscore, two different user names never give the same generated name.


def operand_args(spec: OperandSpec, form: OperandForm) -> list[str]:
    """Kernel argument names for one operand, in order."""
    base = f"in_{spec.name}"
    if spec.kind == Kind.SCALAR:
        return [f"{base}_val"] if form.dtype is None else [f"{base}_ptr"]
    if spec.kind == Kind.TILE:
        return [f"{base}_ptr", f"{base}_s0", f"{base}_s1"]
    return [f"{base}_ptr", f"{base}_s0"]


def output_args(out: StoreOutput | ReduceOutput) -> list[str]:
    """Kernel argument names for one output (a reduction's are its partials or, with group=, its result)."""
    base = f"out_{out.name}"
    if isinstance(out, StoreOutput) or out.group is not None:
        return [f"{base}_ptr", f"{base}_s0", f"{base}_s1"]
    return [f"{base}_ptr"]
