"""Triton functions that generated kernels import (and coda.ops' row-wise kernels call).

They live in a module, not in the template text, so that every kernel shares one copy.
"""

import triton
import triton.language as tl


@triton.jit
def _bf16_rne(x):
    # fp32 -> bf16 with round-to-nearest-even by bit arithmetic: Triton's interpreter
    # truncates in its own conversion, so interpreter builds store through this.
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _tanh(x):
    # Triton has no portable tanh (libdevice's does not run in the interpreter): odd Taylor
    # series near 0, where (1 - e) / (1 + e) would cancel, that form elsewhere.
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    t = tl.where(ax < 0.25, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def _trig(x, shift: tl.constexpr):
    # sin(x) (shift 0) or cos(x) = sin(x + pi/2) (shift 1) in a third of libdevice's
    # instructions and without its local-memory slow path (seen in sm_90 SASS): reduce by
    # q = round(x / (pi/2)) with pi/2 in five 8-bit pieces, r = x - q * pi/2 by fused
    # multiply-adds (exact while q is: |x| < 2.6e7 on the GPU; the interpreter's unfused
    # fma keeps it exact for |x| < 1e5), then odd/even polynomials on [-pi/4, pi/4]: ~2 ulp.
    # Beyond that r is clamped to [-0.8, 0.8] (inside it the polynomials stay in [-1, 1]), so the
    # result is bounded, not accurate; past 2**31 the quadrant q.to(int32) is out of range (the
    # GPU saturates) but still one of the four. NaN and inf give NaN (the clamp uses where, which
    # keeps NaN). The quadrant stays an integer conversion: taking q mod 4 in fp32 instead made the
    # sm_90 compile of RoPE stage its whole 128x256 tile in shared memory (278 KB, over the limit).
    q = tl.floor(x * 0.6366197723675814 + 0.5)
    r = tl.fma(q, -1.5703125, x)
    r = tl.fma(q, -0.000484466552734375, r)
    r = tl.fma(q, 6.407499313354492e-07, r)
    r = tl.fma(q, -9.89530235528946e-10, r)
    r = tl.fma(q, -2.5579538487363607e-12, r)
    r = tl.where(r > 0.8, 0.8, tl.where(r < -0.8, -0.8, r))
    z = r * r
    s = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4))
    c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5))
    k = (q.to(tl.int32) + shift) & 3
    return tl.where(k == 0, s, tl.where(k == 1, c, tl.where(k == 2, -s, -c)))


@triton.jit
def _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row-tiles share each column of B while it is in L2.
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _sigmoid(x):
    # As triton.language.sigmoid, as a function both dialects can import (Gluon has none).
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _group_sum(x, G: tl.constexpr):
    # coda.group_sum: per row, each group of G consecutive columns of the [rows, cols] x summed,
    # the sum in every column of its group (the reshapes keep row-major order).
    groups = tl.reshape(x, (x.shape[0], x.shape[1] // G, G))
    s = tl.expand_dims(tl.sum(groups, axis=2), 2)
    return tl.reshape(tl.broadcast(s, groups)[0], (x.shape[0], x.shape[1]))


@triton.jit
def _group_max(x, G: tl.constexpr):
    # coda.group_max, as _group_sum; NaN where a group holds one (tl.max alone would drop it).
    groups = tl.reshape(x, (x.shape[0], x.shape[1] // G, G))
    nan = tl.sum((groups != groups).to(tl.int32), axis=2) > 0
    m = tl.expand_dims(tl.where(nan, float("nan"), tl.max(groups, axis=2)), 2)
    return tl.reshape(tl.broadcast(m, groups)[0], (x.shape[0], x.shape[1]))
