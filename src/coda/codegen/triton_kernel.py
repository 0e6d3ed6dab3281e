"""The Triton backend: fill the persistent GEMM template's hooks for (graph, specialization)."""

from __future__ import annotations

from ..ir.graph import Graph
from ..templates import PERSISTENT_GEMM, fill
from .epilogue import EpilogueEmitter
from .names import comment_name, kernel_args, kernel_name, partials_n
from .spec import Specialization

_A_LOADS = {
    "tma_row": ["a = a_src.load([off_am, off_k])"],
    "tma_col": ["a = a_src.load([off_k, off_am]).T"],
    "ptr": [
        "offs_am = off_am + tl.arange(0, BLOCK_M)",
        "offs_k = off_k + tl.arange(0, BLOCK_K)",
        "a = tl.load(a_src + offs_am.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak,",
        "            mask=(offs_am[:, None] < M) & (offs_k[None, :] < K), other=0.0)",
    ],
}
_B_LOADS = {
    "tma_row": ["b = b_src.load([off_k, off_bn])"],
    "tma_col": ["b = b_src.load([off_bn, off_k]).T"],
    "ptr": [
        "offs_bn = off_bn + tl.arange(0, BLOCK_N)",
        "offs_kb = off_k + tl.arange(0, BLOCK_K)",
        "b = tl.load(b_src + offs_kb[:, None] * stride_bk + offs_bn.to(tl.int64)[None, :] * stride_bn,",
        "            mask=(offs_kb[:, None] < K) & (offs_bn[None, :] < N), other=0.0)",
    ],
}


def generate(graph: Graph, spec: Specialization) -> str:
    """Triton source of a kernel computing graph(a @ b) for this specialization; the module
    binds it to `coda_kernel` too."""
    emitter = EpilogueEmitter(graph, spec)
    emitter.emit_values()
    stores = emitter.emit_stores()
    reductions = emitter.emit_reductions()
    columns = emitter.emit_columns()  # last: loads, stores and reductions declare the widths they use

    args = kernel_args(graph, spec)

    load_a = list(_A_LOADS[spec.a_load])
    load_b = list(_B_LOADS[spec.b_load])
    if spec.interpret and spec.in_dtype != "float32":
        # The interpreter's tl.dot computes on bf16/fp16 bit patterns; fp32 is exact there.
        load_a.append("a = a.to(tl.float32)")
        load_b.append("b = b.to(tl.float32)")
    dot_options = ', input_precision="ieee"' if spec.in_dtype == "float32" else ""

    return fill({
        "kernel_name": kernel_name(graph),
        "epilogue_name": comment_name(graph),
        "graph_hash": graph.hash,
        "args": "\n".join(f"{a}," for a in args),
        "load_a": "\n".join(load_a),
        "load_b": "\n".join(load_b),
        "dot_options": dot_options,
        "rows": "rows = offs_m.to(tl.int64)" if spec.wide else "rows = offs_m",
        "row_loads": "\n".join(emitter.row_loads),
        "epilogue": "\n".join(_subtiles(spec.subtile, partials_n(graph),
                                        columns + emitter.loads + emitter.body + stores + reductions)),
    }, PERSISTENT_GEMM)


def _subtiles(count: int, partials: bool, block: list[str]) -> list[str]:
    """Split the accumulator into `count` column subtiles of EPI_N (halving, as Triton's
    persistent-matmul tutorial does) and run the epilogue block on each in turn."""
    lines, accs = [], ["acc"]
    while len(accs) < count:
        half = f"(BLOCK_N // {2 * len(accs)})"
        for name in accs:
            lines.append(f"{name}_0, {name}_1 = tl.split(tl.permute(tl.reshape({name}, (BLOCK_M, 2, {half})), (0, 2, 1)))")
        accs = [f"{name}_{i}" for name in accs for i in (0, 1)]
    for h, name in enumerate(accs):
        lines += [f"epi_acc = {name}", "off_n = pid_n * BLOCK_N" + (f" + {h} * EPI_N" if h else ""),
                  "offs_n = off_n + tl.arange(0, EPI_N)", "mask_n = offs_n < N"]
        if partials:  # one partial per subtile: [M, tiles_n * subtiles]
            lines.append(f"part_n = pid_n * {count} + {h}")
        lines += block
    return lines
