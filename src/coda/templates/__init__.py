"""coda.templates: kernel template text (plain strings with named hooks), one module a backend.

CONTRACT below is the emitter-template contract both templates keep; codegen fills the hooks.
"""

from .gluon_hopper import EPILOGUE_LOADER, GLUON_HOPPER_GEMM
from .gluon_hopper import TEMPLATE_VERSION as GLUON_TEMPLATE_VERSION
from .persistent_gemm import PERSISTENT_GEMM, TEMPLATE_VERSION, fill, hooks

CONTRACT = """\
Names the generated epilogue may use, in both templates (per tile unless said otherwise):
  pid_m, pid_n, off_m     the tile's coordinates and first row
  offs_m, mask_m, rows    its row indices, row mask, row offsets (int64 when the spec is wide)
  num_pid_n               tiles along N (per-tile partial columns: num_pid_n * subtiles)
per epilogue subtile (codegen repeats the epilogue block once per subtile, or on gluon-hopper with
epilogue_loop runs it in a loop over `h`):
  epi_acc                 the fp32 accumulator of this subtile, [BLOCK_M, EPI_N]
  off_n, offs_n, mask_n   its first column, column indices, column mask
  part_n                  its partial column (reductions over N without group=)
  EPI_N, BLOCK_M          constexprs
Argument names: coda.codegen.spec.operand_args / output_args (in_<operand>..., out_<output>...).
Hooks every template declares: kernel_name, epilogue_name, graph_hash, args, rows, row_loads, epilogue.
gluon-hopper adds, inside a consumer partition: CID (0 or 1), local (the tile's position in the
program's tile order), own (this consumer's tiles before this one), SPLIT_M and HALF (consumers per tile
and this one's row block of it: 1 and 0 in ping-pong, 2 and CID in the cooperative schedule;
BLOCK_M, pid_m, off_m are then the consumer's rows, row block and first row), acc (the
[BLOCK_M, BLOCK_N] wgmma accumulator, layout MMA) and acc_<h>
(its subtiles, register slices made by the `subtiles` hook), EPI / ROWS / COLS (the layout of
width-1 values, the accumulator's own at EPI_N columns, and its row/column slices) and, where
the epilogue has values of half or double width, EPI_H / ROWS_H / COLS_H and EPI_2 / ROWS_2 /
COLS_2 (declared by the `layouts` hook; they split into and join from EPI with no data
movement, which the generated code asserts); e_slot (the Tile-operand ring slot of this
subtile), ering_<operand> (that ring, [SPLIT_M * E_STAGES, BLOCK_M, cols]), stage_<output>
(TMA staging buffers, [2 * STAGE_BUFS, BLOCK_M, cols]; s_buf, this subtile's buffer of its
consumer), and PINGPONG, eturn and HANDOFF (in ping-pong the emitter hands the epilogue turn on:
`mbarrier.arrive(eturn.index(1 - CID))` once a tile, after the ring wait of subtile HANDOFF,
see gluon_helpers._eturn_handoff); its extra hooks are consumer_params,
consumer_args, alloc, layouts, subtiles, epilogue_loader, epilogue_loader_partition,
epilogue_loader_warps, epilogue_loader_regs (and loader_params, loader_bytes, loader_copies in
EPILOGUE_LOADER).
"""

__all__ = ["CONTRACT", "EPILOGUE_LOADER", "GLUON_HOPPER_GEMM", "GLUON_TEMPLATE_VERSION", "PERSISTENT_GEMM",
           "TEMPLATE_VERSION", "fill", "hooks"]
