"""The helpers Gluon kernels import: most are `jit_helpers`' Triton functions re-wrapped (one
source for both dialects: elementwise or scalar code with no layouts, which Gluon compiles as it
is, as Gluon's own standard library imports Triton's). `_sigmoid` is Gluon's own, in PTX
approximations that Triton's interpreter (which runs the Triton template) could not execute.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from . import jit_helpers


def _as_gluon(fn):
    return gluon.jit(fn.fn)


_group_max = _as_gluon(jit_helpers._group_max)
_group_sum = _as_gluon(jit_helpers._group_sum)
_tanh = _as_gluon(jit_helpers._tanh)
_tile_coords = _as_gluon(jit_helpers._tile_coords)
_trig = _as_gluon(jit_helpers._trig)


@gluon.jit
def _sigmoid(x):
    # 1 / (1 + 2**(-x log2(e))) with the approximate flush-to-zero ex2: Triton's exp (as in
    # jit_helpers._sigmoid) adds a range check and two multiplies for subnormal results, which
    # here are only ever added to 1. The division stays Triton's (div.full: within 2 ulp, scaled
    # for a huge 1 + e). The SwiGLU backward's sm_90 kernel: 3848 instructions -> 3560; with
    # rcp.approx for the division as well, 3360 but 24 bytes of spills.
    e = gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * -1.4426950408889634],
                                  dtype=gl.float32, is_pure=True, pack=1)
    return 1.0 / (1.0 + e)


@gluon.constexpr_function
def _eturn_handoff(subtile, e_stages):
    """The subtile after whose epilogue-ring wait a ping-pong consumer lets the other consumer
    start its epilogue. The other's first ring slot is `subtile` indices past this tile's first,
    and an mbarrier tells phases apart by parity alone, so that slot's previous use (`e_stages`
    indices back) must have been filled, which this consumer's wait on it proves. Handing over
    earlier than the tile's end lets the two epilogues overlap where an epilogue outlasts a K loop."""
    return max(0, int(subtile) - int(e_stages))


@gluon.constexpr_function
def _acc_layout(block_m, cols, shift):
    """The register layout of a [block_m, cols] slice of a wgmma accumulator (4 warps), its
    columns scaled by 2**shift: shift 0 is the accumulator's own layout (as an NVMMA layout of
    instruction width `cols` would give), -1 the layout of either half that a column-pair split
    of a [block_m, 2 * cols] value gives, +1 the layout that splits into two shift-0 halves.
    Every thread keeps whole column pairs of its rows, so pairs, interleave and subtiles move no
    data (`convert_layout(..., assert_trivial=True)` checks it at compile time)."""
    from triton.experimental.gluon import language as gl

    block_m, cols, shift = int(block_m), int(cols), int(shift)
    rows = [[8, 0]], [[1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]], [[64, 0]] if block_m == 128 else []
    # column bits: 2**low..2**(k-1) in registers (low bits first), two bits in lanes
    if shift == 0:
        regs, lanes, first_high = [[0, 1]], [[0, 2], [0, 4]], 8
    elif shift < 0:
        regs, lanes, first_high = [], [[0, 1], [0, 2]], 4
    else:
        regs, lanes, first_high = [[0, 1], [0, 2]], [[0, 4], [0, 8]], 16
    high = []
    c = first_high
    while c < cols:
        high.append([0, c])
        c *= 2
    return gl.DistributedLinearLayout(regs + rows[0] + high + rows[3], lanes + rows[1], rows[2], [], [block_m, cols])
