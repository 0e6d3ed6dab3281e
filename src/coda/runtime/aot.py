"""Ahead-of-time compilation for Hopper (sm_90) on any machine, GPU or not.

Used by tests to prove generated kernels compile with wgmma and fit in shared memory.
Run in a process started with TRITON_INTERPRET=0 (on a CPU-only machine coda would
otherwise choose the interpreter, whose kernels cannot be compiled).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from ..codegen import OperandForm, Specialization, generate, operand_args, output_args
from ..ir.graph import Graph
from ..ir.nodes import StoreOutput
from ..ir.types import Kind
from .backends import backend_of
from .cache import _import, atomic_write, cache_dir, kernel_key, seal
from .config import Config, check_config
from .resources import HOPPER_SMEM_BYTES
from .plan import launch_values
from .specialize import make_spec, spec_fields
from .validate import Call

_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int8": "i8", "int16": "i16",
          "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "i1"}


@dataclass
class AotResult:
    ptx: str
    shared: int
    num_warps: int
    registers: int | None
    spills: int | None

    @property
    def uses_wgmma(self) -> bool:
        return "wgmma.mma_async" in self.ptx


def _desc(dtype: str, block: list[int], backend: str) -> str:
    """A tensor-descriptor signature type; Gluon's also carries the box's shared layout."""
    text = f"tensordesc<{_SHORT[dtype]}[{block[0]}, {block[1]}]"
    layout = backend_of(backend).shared_layout(block, dtype)
    return text + (f",{layout!r}>" if layout is not None else ">")


def _signature(graph: Graph, spec: Specialization, cfg: Config) -> tuple[dict[str, str], dict[str, object]]:
    t = _SHORT[spec.in_dtype]
    backend = backend_of(spec.backend)
    sig: dict[str, str] = {}
    for name, mode, block in (("a_src", spec.a_load, [cfg.block_m, cfg.block_k]), ("b_src", spec.b_load, [cfg.block_k, cfg.block_n])):
        if mode == "ptr":
            sig[name] = f"*{t}"
        else:
            sig[name] = _desc(spec.in_dtype, block if mode == "tma_row" else block[::-1], spec.backend)
    for name in ("M", "N", "K") + backend.STRIDE_ARGS:
        sig[name] = "i32"
    forms = {f.name: f for f in spec.operands}
    for s in graph.operands:
        form = forms[s.name]
        names = operand_args(s, form)
        if s.kind == Kind.SCALAR and form.dtype is None:
            sig[names[0]] = "fp32"
            continue
        if s.name in spec.tma_tiles:
            sig[names[0]] = _desc(form.dtype, [cfg.epi_m, int(cfg.epi_n * s.frac_width)], spec.backend)
        else:
            sig[names[0]] = f"*{_SHORT[form.dtype]}"
        for n in names[1:]:
            sig[n] = "i32"
    stores = dict(spec.store_dtypes)
    for o in graph.outputs:
        names = output_args(o)
        if isinstance(o, StoreOutput) and o.name in spec.tma_stores:
            cols = int(cfg.epi_n * graph.node(o.x).frac_width)
            sig[names[0]] = _desc(stores[o.name], [cfg.epi_m, cols], spec.backend)
        else:
            sig[names[0]] = f"*{_SHORT[stores[o.name]]}" if isinstance(o, StoreOutput) else "*fp32"
        for n in names[1:]:
            sig[n] = "i32"
    constexprs: dict[str, object] = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                                     "GROUP_M": cfg.group_m, "NUM_SMS": 132, "EPI_N": cfg.epi_n}
    constexprs.update(backend.constexprs(cfg, spec.a_load == "tma_col", spec.b_load == "tma_col"))
    for name in constexprs:
        sig[name] = "constexpr"
    return sig, constexprs


def _jit_specialized(sig: dict[str, str], constexprs: dict[str, object],
                     values: Mapping[str, int]) -> dict[tuple[int], list]:
    """Specialize `sig` in place as Triton's JIT does for a launch with these integer arguments:
    one equal to 1 becomes a constant, a multiple of 16 is marked divisible by 16, and so is
    every pointer (torch allocates 16-byte aligned). The compiled code depends on it: unit
    strides make Tile loads vectorized, whose layout conversions take shared memory (32 KB
    more in the 128x512 kernel of a grouped max beside a Tile operand)."""
    attrs = {}
    for i, (name, kind) in enumerate(sig.items()):
        value = values.get(name)
        if kind == "i32" and value == 1:
            sig[name], constexprs[name] = "constexpr", 1
        elif kind.startswith("*") or kind == "i32" and value is not None and value % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_hopper(graph: Graph, spec: Specialization, cfg: Config,
                   values: Mapping[str, int] | None = None) -> AotResult:
    """Compile the kernel for (graph, spec, cfg) to sm_90 PTX/cubin without a GPU. `values`: the
    launch's integer arguments (sizes, strides; `compile_call` takes them from a call), to
    compile what the GPU would run for them; without, a kernel for any sizes."""
    import triton
    from triton.backends.compiler import GPUTarget

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_hopper needs a process started with TRITON_INTERPRET=0")
    if spec.interpret:
        raise ValueError("compile_hopper needs a specialization with interpret=False")
    fields = ("subtile", "backend", "epilogue_loop")
    if any(getattr(spec, f) != getattr(cfg, f) for f in fields):
        raise ValueError("compile_hopper: the specialization and the config differ in "
                         + ", ".join(f"{f} ({getattr(spec, f)} vs {getattr(cfg, f)})" for f in fields
                                     if getattr(spec, f) != getattr(cfg, f)))
    check_config(graph, cfg)
    key = kernel_key(graph, spec)
    path = cache_dir() / "kernels" / f"coda_{key}.py"
    atomic_write(path, seal(generate(graph, spec)))
    module = _import(path, f"coda_aot_{key}")
    sig, constexprs = _signature(graph, spec, cfg)
    attrs = _jit_specialized(sig, constexprs, values) if values is not None else None
    backend = backend_of(spec.backend)
    src = backend.ast_source(fn=module.coda_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": cfg.num_warps, **backend.launch_options(cfg)}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    meta = compiled.metadata
    return AotResult(ptx=compiled.asm["ptx"], shared=meta.shared, num_warps=meta.num_warps,
                     registers=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None))


def compile_call(call: Call, cfg: Config) -> AotResult:
    """Compile what a GPU launch of this validated call with `cfg` would run: the runtime's
    specialization, and Triton's for the call's sizes and strides (the tensors may be on the
    CPU: only their metadata is read)."""
    spec = make_spec(spec_fields(call, False, cfg))
    return compile_hopper(call.graph, spec, cfg, launch_values(call, spec, cfg))


def hopper_spec(graph: Graph, *, backend: str = "triton", in_dtype: str = "bfloat16", a_load: str = "tma_row", b_load: str = "tma_col",
                operand_dtypes: dict[str, str | None] | None = None, store_dtype: str | None = None,
                tma_stores: bool = True, tma_tiles: bool = True, wide: bool = False, subtile: int = 1,
                epilogue_loop: bool = False) -> Specialization:
    """A GPU specialization for AOT tests, as the runtime makes one for aligned inputs of moderate
    size (TMA Tile loads and stores, int32 row offsets); operands default to fp32 tensors, Scalars
    to numbers."""
    operand_dtypes = operand_dtypes or {}
    forms = tuple(
        OperandForm(name=s.name, dtype=operand_dtypes.get(s.name, None if s.kind == Kind.SCALAR else "float32"))
        for s in graph.operands
    )
    stores = tuple((o.name, store_dtype or in_dtype) for o in graph.outputs if isinstance(o, StoreOutput))
    return Specialization(backend=backend, in_dtype=in_dtype, a_load=a_load, b_load=b_load, operands=forms,
                          store_dtypes=stores, interpret=False,
                          tma_stores=tuple(name for name, _ in stores) if tma_stores else (),
                          tma_tiles=tuple(s.name for s in graph.operands if s.kind == Kind.TILE) if tma_tiles else (),
                          wide=wide, subtile=subtile, epilogue_loop=epilogue_loop)


__all__ = ["AotResult", "compile_call", "compile_hopper", "hopper_spec", "HOPPER_SMEM_BYTES"]
