"""A launch plan: everything about a validated call that does not change between calls
with the same tensor metadata, so that a repeated call only binds tensors and launches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..codegen import Specialization, operand_args, output_args
from ..ir.nodes import ReduceOutput, StoreOutput
from ..ir.types import Kind
from .config import Config
from .validate import Call


def _descriptor(t: torch.Tensor, mode: str, rows: int, cols: int) -> object:
    if mode == "tma_row":
        return TensorDescriptor.from_tensor(t, [rows, cols])
    if mode == "tma_col":
        return TensorDescriptor.from_tensor(t.T, [cols, rows])
    return t


@dataclass
class _Out:
    out: StoreOutput | ReduceOutput
    names: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    tma_block: list[int] | None = None  # TMA-stored tile outputs
    partial: tuple[int, int] | None = None  # reductions finalized from per-tile partials


@dataclass
class Plan:
    kernel: object
    spec: Specialization
    single: str | None  # the output name when gemm returns a tensor
    static: dict[str, object]  # sizes, strides and constexprs
    block_a: tuple[int, int]
    block_b: tuple[int, int]
    operands: list[tuple[str, Kind, list[str], bool, list[int] | None]]  # name, kind, args, number?, TMA box
    outs: list[_Out]
    grid: tuple[int]

    @classmethod
    def build(cls, call: Call, spec: Specialization, kernel: object, cfg: Config, programs: int) -> "Plan":
        graph, m, n, k = call.graph, call.m, call.n, call.k
        tiles_m, tiles_n = -(-m // cfg.block_m), -(-n // cfg.block_n)
        grid = (min(programs, tiles_m * tiles_n),)
        static = {
            "M": m, "N": n, "K": k,
            "stride_am": call.a.stride(0), "stride_ak": call.a.stride(1),
            "stride_bk": call.b.stride(0), "stride_bn": call.b.stride(1),
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "GROUP_M": cfg.group_m, "NUM_SMS": grid[0], "FLATTEN": cfg.flatten, "EPI_N": cfg.epi_n,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
        }
        forms = {f.name: f for f in spec.operands}
        operands = [(s.name, s.kind, operand_args(s, forms[s.name]), forms[s.name].dtype is None and s.kind == Kind.SCALAR,
                     [cfg.block_m, int(cfg.epi_n * s.frac_width)] if s.name in spec.tma_tiles else None)
                    for s in graph.operands]
        outs = []
        for o in graph.outputs:
            shape = call.output_shape(o)
            if isinstance(o, StoreOutput):
                width = graph.node(o.x).frac_width
                block = [cfg.block_m, int(cfg.epi_n * width)] if o.name in spec.tma_stores else None
                outs.append(_Out(o, output_args(o), shape, call.out_dtype(o), tma_block=block))
            elif o.group is not None:
                outs.append(_Out(o, output_args(o), shape, torch.float32))
            else:
                part = (m, tiles_n * cfg.subtile) if o.axis == "n" else (tiles_m, shape[0])
                outs.append(_Out(o, output_args(o), shape, torch.float32, partial=part))
        return cls(kernel=kernel, spec=spec, single=graph.outputs[0].name if graph.single else None, static=static,
                   block_a=(cfg.block_m, cfg.block_k), block_b=(cfg.block_k, cfg.block_n), operands=operands,
                   outs=outs, grid=grid)

    def execute(self, a: torch.Tensor, b: torch.Tensor, operands: dict, out: dict) -> tuple[object, object]:
        """Bind this call's tensors, launch, finalize reductions; (results, compiled kernel)."""
        args = dict(self.static)
        args["a_src"] = _descriptor(a, self.spec.a_load, *self.block_a)
        args["b_src"] = _descriptor(b, self.spec.b_load, *self.block_b)
        for name, kind, names, number, box in self.operands:
            v = operands[name]
            if number:
                args[names[0]] = float(v)
            elif kind == Kind.SCALAR:
                args[names[0]] = v
            elif kind == Kind.TILE:
                args[names[0]] = TensorDescriptor.from_tensor(v, box) if box else v
                args[names[1]], args[names[2]] = v.stride(0), v.stride(1)
            else:
                args[names[0]], args[names[1]] = v, v.stride(0)
        results: dict[str, torch.Tensor] = {}
        finalize = []
        device = a.device
        for o in self.outs:
            target = out.get(o.out.name)
            if o.partial is not None:
                partial = torch.empty(o.partial, dtype=torch.float32, device=device)
                args[o.names[0]] = partial
                finalize.append((o.out, partial))
                results[o.out.name] = target if target is not None else torch.empty(o.shape, dtype=o.dtype, device=device)
                continue
            t = target if target is not None else torch.empty(o.shape, dtype=o.dtype, device=device)
            dst = TensorDescriptor.from_tensor(t, o.tma_block) if o.tma_block else t
            args[o.names[0]], args[o.names[1]], args[o.names[2]] = dst, t.stride(0), t.stride(1)
            results[o.out.name] = t
        compiled = self.kernel[self.grid](**args)
        for r, partial in finalize:
            dst = results[r.name]
            if r.axis == "m":
                torch.sum(partial, dim=0, out=dst)
            elif r.op == "sum":
                torch.sum(partial, dim=1, out=dst)
            elif r.op == "max":
                torch.amax(partial, dim=1, out=dst)
            else:
                torch.logsumexp(partial, dim=1, out=dst)
        if self.single is not None:
            return results[self.single], compiled
        return results, compiled


__all__ = ["Plan"]
