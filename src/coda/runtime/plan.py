"""A launch plan: everything about a validated call that does not change between calls
with the same tensor metadata, so that a repeated call only binds tensors and launches."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..codegen import Specialization, operand_args, output_args
from ..ir.nodes import ReduceOutput, StoreOutput
from ..ir.primitives import REDUCTIONS
from ..ir.types import Kind
from . import compile_log
from .backends import backend_of
from .config import Config
from .validate import OPERAND_DTYPES, Call


@dataclass(frozen=True)
class _Layout:
    """A TMA descriptor's fixed part (shape, strides, box; for Gluon also its shared layout).
    The plan key fixes every tensor's shape, strides, dtype and alignment, so a call only binds
    its tensor: the descriptor classes' checks would re-verify per call what planning verified."""

    shape: list[int]
    strides: list[int]
    block: list[int]
    shared: object = None  # gluon-hopper: the NVMMA shared layout the kernel allocates with

    def bind(self, t: torch.Tensor) -> object:
        if self.shared is None:
            d = object.__new__(TensorDescriptor)
        else:
            d = object.__new__(GluonTensorDescriptor)
            d.layout = self.shared
        d.base, d.shape, d.strides, d.block_shape, d.padding = t, self.shape, self.strides, self.block, "zero"
        return d


def _layout(shape: list[int], strides: list[int], block: list[int], dtype: torch.dtype, backend: str) -> _Layout:
    shared = backend_of(backend).shared_layout(block, OPERAND_DTYPES[dtype])
    return _Layout(shape, strides, block, shared)


def _operand_layout(t: torch.Tensor, mode: str, block_rows: int, block_cols: int, backend: str) -> _Layout | None:
    """How the template reads a GEMM operand: row-major TMA, TMA of its transpose (base is the
    same memory), or pointers (None)."""
    if mode == "tma_row":
        return _layout([t.shape[0], t.shape[1]], [t.stride(0), 1], [block_rows, block_cols], t.dtype, backend)
    if mode == "tma_col":
        return _layout([t.shape[1], t.shape[0]], [t.stride(1), 1], [block_cols, block_rows], t.dtype, backend)
    return None


def _out_strides(call: Call, name: str, shape: tuple[int, ...]) -> list[int]:
    """A 2-D output's strides: its out= tensor's, else those of the contiguous one gemm() allocates."""
    given = call.out.get(name)
    return [given.stride(0), given.stride(1)] if given is not None else [shape[1], 1]


@dataclass
class _Out:
    out: StoreOutput | ReduceOutput
    names: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: _Layout | None = None  # TMA-stored tile outputs
    partial: tuple[int, int] | None = None  # reductions finalized from per-tile partials


@dataclass(frozen=True)
class _Direct:
    """A compiled kernel to call without `JITFunction.run`, which re-derives per call, from every
    argument, the specialization (integer divisibility, pointer alignment) that selects the
    compiled binary. The plan key fixes all of it, so the binary of the plan's first launch
    serves every later call on that device."""

    device: int
    run: object  # Triton's launcher for the binary
    function: object
    packed_metadata: object
    compiled: object
    order: tuple[str, ...]  # the kernel's parameters, as the launcher takes them

    def launch(self, grid: tuple[int], args: dict) -> object:
        stream = driver.active.get_current_stream(self.device)
        positional = [args[name] for name in self.order]
        meta = self.compiled.launch_metadata(grid, stream, *positional)  # for launch hooks, as Triton does
        self.run(grid[0], 1, 1, stream, self.function, self.packed_metadata, meta, knobs.runtime.launch_enter_hook,
                 knobs.runtime.launch_exit_hook, *positional)
        return self.compiled


def _direct(kernel: object, compiled: object) -> _Direct | None:
    """The direct call for a JIT kernel's compiled binary, or None (the interpreter, stubs)."""
    names = getattr(kernel, "arg_names", None)
    if names is None or getattr(compiled, "packed_metadata", None) is None:
        return None
    run = compiled.run  # loads the binary onto the current device
    return _Direct(device=driver.active.get_current_device(), run=run, function=compiled.function,
                   packed_metadata=compiled.packed_metadata, compiled=compiled, order=tuple(names))


@dataclass
class Plan:
    kernel: object
    spec: Specialization
    single: str | None  # the output name when gemm returns a tensor
    static: dict[str, object]  # sizes, strides and constexprs
    layout_a: _Layout | None
    layout_b: _Layout | None
    operands: list[tuple[str, str, bool, _Layout | None]]  # name, pointer argument, number?, TMA layout
    outs: list[_Out]
    grid: tuple[int]
    config: Config
    direct: _Direct | None = None
    launched: bool = False  # whether the first launch (compile or binary load: compile_log) happened

    @classmethod
    def build(cls, call: Call, spec: Specialization, kernel: object, cfg: Config, programs: int) -> "Plan":
        graph, m, n, k = call.graph, call.m, call.n, call.k
        tiles_m, tiles_n = -(-m // cfg.block_m), -(-n // cfg.block_n)
        grid = (min(programs, tiles_m * tiles_n),)
        backend = backend_of(spec.backend)
        static: dict[str, object] = {
            "M": m, "N": n, "K": k,
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "GROUP_M": cfg.group_m, "NUM_SMS": grid[0], "EPI_N": cfg.epi_n, "num_warps": cfg.num_warps,
        }
        strides = (call.a.stride(0), call.a.stride(1), call.b.stride(0), call.b.stride(1))
        static.update(zip(backend.STRIDE_ARGS, strides))
        static.update(backend.constexprs(cfg, spec.a_load == "tma_col", spec.b_load == "tma_col"))
        static.update(backend.launch_options(cfg))
        layout_a = _operand_layout(call.a, spec.a_load, cfg.block_m, cfg.block_k, spec.backend)
        layout_b = _operand_layout(call.b, spec.b_load, cfg.block_k, cfg.block_n, spec.backend)
        forms = {f.name: f for f in spec.operands}
        operands = []
        for s in graph.operands:
            names = operand_args(s, forms[s.name])
            v = call.operands[s.name]
            layout = None
            if s.kind == Kind.TILE:
                static[names[1]], static[names[2]] = v.stride(0), v.stride(1)
                if s.name in spec.tma_tiles:
                    layout = _operand_layout(v, "tma_row", cfg.epi_m, int(cfg.epi_n * s.frac_width), spec.backend)
            elif s.kind != Kind.SCALAR:
                static[names[1]] = v.stride(0)
            operands.append((s.name, names[0], forms[s.name].dtype is None and s.kind == Kind.SCALAR, layout))
        outs = []
        for o in graph.outputs:
            shape = call.output_shape(o)
            names = output_args(o)
            if isinstance(o, StoreOutput):
                strides = _out_strides(call, o.name, shape)
                static[names[1]], static[names[2]] = strides
                width = graph.node(o.x).frac_width
                layout = (_layout(list(shape), strides, [cfg.epi_m, int(cfg.epi_n * width)], call.out_dtype(o),
                                  spec.backend)
                          if o.name in spec.tma_stores else None)
                outs.append(_Out(o, names, shape, call.out_dtype(o), layout=layout))
            elif o.group is not None:
                static[names[1]], static[names[2]] = _out_strides(call, o.name, shape)
                outs.append(_Out(o, names, shape, torch.float32))
            else:
                part = (m, tiles_n * cfg.subtile) if o.axis == "n" else (-(-m // cfg.epi_m), shape[0])
                outs.append(_Out(o, names, shape, torch.float32, partial=part))
        return cls(kernel=kernel, spec=spec, single=graph.outputs[0].name if graph.single else None, static=static,
                   layout_a=layout_a, layout_b=layout_b,
                   operands=operands, outs=outs, grid=grid, config=cfg)

    def execute(self, a: torch.Tensor, b: torch.Tensor, operands: dict, out: dict) -> tuple[object, object]:
        """Bind this call's tensors, launch, finalize reductions; (results, compiled kernel)."""
        args = dict(self.static)
        args["a_src"] = self.layout_a.bind(a) if self.layout_a else a
        args["b_src"] = self.layout_b.bind(b) if self.layout_b else b
        for name, arg, number, layout in self.operands:
            v = operands[name]
            args[arg] = float(v) if number else layout.bind(v) if layout else v
        results: dict[str, torch.Tensor] = {}
        finalize = []
        device = a.device
        for o in self.outs:
            target = out.get(o.out.name)
            t = target if target is not None else torch.empty(o.shape, dtype=o.dtype, device=device)
            results[o.out.name] = t
            if o.partial is not None:
                partial = torch.empty(o.partial, dtype=torch.float32, device=device)
                args[o.names[0]] = partial
                finalize.append((o.out, partial))
            else:
                args[o.names[0]] = o.layout.bind(t) if o.layout else t
        compiled = self._launch(args)
        for r, partial in finalize:  # per-tile partials: [M, tiles] over N, [tiles, N] over M
            REDUCTIONS[r.op].finalize(partial, 0 if r.axis == "m" else 1, results[r.name])
        if self.single is not None:
            return results[self.single], compiled
        return results, compiled

    def _launch(self, args: dict) -> object:
        """Launch through the first launch's binary when on its device, else through Triton."""
        direct = self.direct
        if direct is not None and driver.active.get_current_device() == direct.device:
            return direct.launch(self.grid, args)
        start = time.perf_counter()
        compiled = self.kernel[self.grid](**args)
        if not self.launched:
            self.launched = True
            compile_log.record(self.kernel, self.spec.backend, self.config, time.perf_counter() - start)
        if direct is None:
            self.direct = _direct(self.kernel, compiled)
        return compiled


def launch_values(call: Call, spec: Specialization, cfg: Config) -> dict[str, int]:
    """The integer arguments (sizes, strides) a launch of this call passes: what Triton's JIT
    specializes the compiled kernel on (an AOT compile needs them to compile the same one)."""
    plan = Plan.build(call, spec, None, cfg, programs=1)
    return {name: v for name, v in plan.static.items() if type(v) is int}


__all__ = ["Plan", "launch_values"]
