"""The gluon-hopper backend: fill the warp-specialized template's hooks for (graph, specialization).

The epilogue body is the shared emitter's, in the Gluon dialect. What this module adds is the
backend's own plumbing: the accumulator's split into epilogue subtiles, the layouts of half- and
double-width values, the Tile-operand ring (slot waits and releases around the epilogue's
loads), staging buffers for TMA stores, and the partition list.
"""

from __future__ import annotations

from fractions import Fraction

from ..ir.graph import Graph
from ..ir.types import Kind
from ..templates import EPILOGUE_LOADER, GLUON_HOPPER_GEMM, fill
from .dialect import layout_suffix
from .epilogue import EpilogueEmitter, col_start
from .names import comment_name, kernel_args, kernel_name, partials_n
from .spec import Specialization


def unsupported(graph: Graph, spec: Specialization) -> str | None:
    """Why this backend cannot run (graph, spec), or None when it can."""
    if spec.interpret:
        return "Gluon kernels do not run under Triton's interpreter"
    if spec.in_dtype == "float32":
        return "fp32 operands take IEEE fp32 dot products, which wgmma does not do"
    for name, mode in (("a", spec.a_load), ("b", spec.b_load)):
        if mode == "ptr":
            return f"{name} cannot be read by TMA (it needs a unit stride, 16-byte aligned base and row pitch)"
    return None


def _subtiles(count: int) -> list[str]:
    """Split the [BLOCK_M, BLOCK_N] accumulator into `count` EPI_N-column subtiles acc_0.. by
    halving it: a reshape that puts the halves in a trailing dimension of 2, then a split. The
    halves' column bits are register bits of the wgmma layout, so no data moves."""
    if count == 1:
        return ["acc_0 = acc"]
    lines, pieces, cols = [], ["acc"], "BLOCK_N"
    while len(pieces) < count:
        halves = []
        for p in pieces:
            lo, hi = (f"{p}_0", f"{p}_1") if p != "acc" else ("acc_h0", "acc_h1")
            lines.append(f"{lo}, {hi} = gl.split(gl.permute(gl.reshape({p}, (BLOCK_M, 2, {cols} // 2)), (0, 2, 1)))")
            halves += [lo, hi]
        pieces, cols = halves, f"({cols} // 2)"
    lines += [f"acc_{h} = gl.convert_layout({p}, EPI, assert_trivial=True)" for h, p in enumerate(pieces)]
    return lines


def _layouts(graph: Graph) -> list[str]:
    """The layouts of half- and double-width values, where the epilogue has any."""
    widths = {n.frac_width for n in graph.nodes if n.kind.has_cols} | {
        s.frac_width for s in graph.operands if s.kind.has_cols}
    lines = []
    for width, cols, shift in ((Fraction(1, 2), "EPI_N // 2", -1), (Fraction(2), "EPI_N * 2", 1)):
        if width in widths:
            sfx = layout_suffix(width)
            lines += [f"EPI{sfx}: gl.constexpr = _acc_layout(BLOCK_M, {cols}, {shift})",
                      f"ROWS{sfx}: gl.constexpr = gl.SliceLayout(1, EPI{sfx})",
                      f"COLS{sfx}: gl.constexpr = gl.SliceLayout(0, EPI{sfx})"]
    return lines or ["# (every epilogue value is EPI_N columns wide)"]


def generate(graph: Graph, spec: Specialization) -> str:
    """Gluon source of a warp-specialized kernel computing graph(a @ b); binds `coda_kernel`."""
    reason = unsupported(graph, spec)
    if reason is not None:
        raise ValueError(f"gluon-hopper backend: {reason}")
    emitter = EpilogueEmitter(graph, spec)
    emitter.emit_values()
    stores = emitter.emit_stores()
    reductions = emitter.emit_reductions()
    columns = emitter.emit_columns()

    args = kernel_args(graph, spec)
    widths = {s.name: s.frac_width for s in graph.operands}
    tiles = [s.name for s in graph.operands if s.kind == Kind.TILE and s.name in spec.tma_tiles]
    stages = [name for name in spec.tma_stores]
    extra = [f"stage_{n}" for n in stages] + [f"ering_{n}" for n in tiles] + (["e_ready", "e_empty"] if tiles else [])
    consumer = args + extra

    alloc = [f"stage_{n} = gl.allocate_shared_memory(out_{n}_ptr.dtype, [2 * STAGE_BUFS] + out_{n}_ptr.block_type.shape, "
             f"out_{n}_ptr.layout)" for n in stages]
    alloc += [f"ering_{n} = gl.allocate_shared_memory(in_{n}_ptr.dtype, [SPLIT_M * E_STAGES] + in_{n}_ptr.block_type.shape, "
              f"in_{n}_ptr.layout)" for n in tiles]
    if tiles:
        alloc += ["e_ready = gl.allocate_shared_memory(gl.int64, [SPLIT_M * E_STAGES, 1], mbarrier.MBarrierLayout())",
                  "e_empty = gl.allocate_shared_memory(gl.int64, [SPLIT_M * E_STAGES, 1], mbarrier.MBarrierLayout())",
                  "for i in gl.static_range(SPLIT_M * E_STAGES):",
                  "    mbarrier.init(e_ready.index(i), count=1)",
                  "    mbarrier.init(e_empty.index(i), count=1)"]

    sub = spec.subtile

    handoff = ["if PINGPONG:", "    mbarrier.arrive(eturn.index(1 - CID), count=1)"]

    def subtile(h: str) -> list[str]:
        """The epilogue of subtile `h` (a literal index, or the loop's variable)."""
        lines = ["off_n = pid_n * BLOCK_N" + ("" if h == "0" else f" + {h} * EPI_N"),
                 "offs_n = off_n + gl.arange(0, EPI_N, layout=COLS)", "mask_n = offs_n < N"]
        if partials_n(graph):
            lines.append(f"part_n = pid_n * {sub} + {h}")
        if stages:  # this subtile's staging buffers: successive subtiles of a consumer alternate
            lines.append(f"s_buf = CID * STAGE_BUFS + (own * SUBTILE + {h}) % STAGE_BUFS")
        lines += columns
        if tiles:  # this subtile's slot of the Tile-operand ring
            lines += [f"e_count = local * SUBTILE + {h}", "e_slot = HALF * E_STAGES + e_count % E_STAGES",
                      "mbarrier.wait(e_ready.index(e_slot), (e_count // E_STAGES) & 1)"]
            if h != "h":  # unrolled: eturn's handoff, at subtile HANDOFF
                lines += ["if PINGPONG:", f"    mbarrier.arrive(eturn.index(1 - CID), count=1, pred={h} == HANDOFF)"]
        lines += emitter.loads
        if tiles:  # the values are in registers: the slot goes back to the epilogue loader
            lines += ["fence_async_shared()", "mbarrier.arrive(e_empty.index(e_slot), count=1)"]
        return lines + emitter.body + stores + reductions

    # Ping-pong: with no epilogue ring the other consumer's epilogue may start at once
    epilogue = [] if tiles else handoff
    if spec.epilogue_loop and sub > 1:
        # one copy of the code: the loop picks its subtile from the registers by selects. It hands
        # eturn on after the loop: inside it the predicated arrive cost registers (sm_90 spills of
        # the RMSNorm backward's loop 272 -> 280 B), for an early handoff that measures within the
        # run-to-run spread where it is kept (the unrolled form: bench/results/timeline_v4).
        pick = "acc_0"
        for h in range(1, sub):
            pick = f"gl.where(h == {h}, acc_{h}, {pick})"
        epilogue += ["for h in range(SUBTILE):", f"    epi_acc = {pick}"]
        epilogue += [f"    {line}" for line in subtile("h")]
        epilogue += handoff if tiles else []
    else:
        for h in range(sub):
            epilogue += [f"epi_acc = acc_{h}"] + subtile(str(h))

    loader, partition, warps, regs = "# (no Tile operand is read through TMA)", "# (no epilogue loader)", "", ""
    if tiles:
        params = [f"in_{n}_ptr" for n in tiles] + [f"ering_{n}" for n in tiles]
        copies = [f"tma.async_copy_global_to_shared(in_{n}_ptr, [off_m, {col_start(Fraction(widths[n]))}], bar, "
                  f"ering_{n}.index(e_slot))" for n in tiles]
        loader = fill({"loader_params": "".join(f"{p}, " for p in params),
                       "loader_bytes": " + ".join(f"in_{n}_ptr.block_type.nbytes" for n in tiles),
                       "loader_copies": "\n".join(copies)}, EPILOGUE_LOADER)
        partition = (f"(_epilogue_loader, ({''.join(f'{p}, ' for p in params)}e_ready, e_empty, M, N, EPI_M, "
                     "BLOCK_N, GROUP_M, NUM_SMS, EPI_N, E_STAGES, SPLIT_M)),")
        warps, regs = ", 1", ", 40"

    rows = ["rows = offs_m.to(gl.int64)" if spec.wide else "rows = offs_m"] + emitter.emit_rows()
    return fill({
        "kernel_name": kernel_name(graph),
        "epilogue_name": comment_name(graph),
        "graph_hash": graph.hash,
        "args": "\n".join(f"{a}," for a in args),
        "consumer_params": "\n".join(f"{a}," for a in consumer),
        "consumer_args": "".join(f"{a}, " for a in consumer),
        "alloc": "\n".join(alloc),
        "layouts": "\n".join(_layouts(graph)),
        "subtiles": "\n".join(_subtiles(sub)),
        "rows": "\n".join(rows),
        "row_loads": "\n".join(emitter.row_loads),
        "epilogue": "\n".join(epilogue),
        "epilogue_loader": loader,
        "epilogue_loader_partition": partition,
        "epilogue_loader_warps": warps,
        "epilogue_loader_regs": regs,
    }, GLUON_HOPPER_GEMM)
