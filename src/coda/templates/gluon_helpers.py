"""The Triton helpers of `jit_helpers`, re-wrapped for Gluon kernels: one source for both.

They are elementwise or scalar code with no layouts, which Gluon compiles as it is (Gluon's
own standard library imports Triton's the same way).
"""

from triton.experimental import gluon

from . import jit_helpers


def _as_gluon(fn):
    return gluon.jit(fn.fn)


_sigmoid = _as_gluon(jit_helpers._sigmoid)
_tanh = _as_gluon(jit_helpers._tanh)
_tile_coords = _as_gluon(jit_helpers._tile_coords)
_trig = _as_gluon(jit_helpers._trig)


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
