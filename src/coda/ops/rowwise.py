"""Row-wise Triton kernels that the ops need beside their GEMMs: each is one pass over a
tensor the GEMMs cannot produce in their epilogues (their inputs come from the user or
need a statistic of a whole row first). One program per row and the row in one block, except
`rms_backward`, whose programs each take a share of the rows (its dg sums over rows).

* `rms_prep`: rstd and h = x * rstd * g (the norm's output) for a standalone RMSNorm in
  front of a GEMM;
* `rms_input_grad`: dx = u - rstd^2 * zdz / D * x, the RMSNorm backward's row correction;
* `rms_backward`: a standalone RMSNorm's whole backward, dx per row and dg partials per program
  (its dy comes from a GEMM coda does not run, so no epilogue can reduce for it);
* `cross_entropy_`: per-row logsumexp and target logit of stored logits, which it turns into
  (softmax - onehot) * scale in place (with softcap, label smoothing and z-loss as options);
* `rope_backward`: rotate pairs by -theta and zdz = sum(z * dz) per row;
* `rope_halves`: transformers' RoPE (rotate_half: the head's first and second halves are the
  pairs) from its cos/sin rows, and its backward, for every head of a token at once;
* `scale_cast`: s * x of an fp32 tensor in a narrower dtype, rounded once (a gradient computed
  ahead of its upstream scale).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..runtime import interpreting
from ..runtime.device import num_programs
from ..runtime.validate import check_kernel_device
from ..templates.jit_helpers import _bf16_rne, _sigmoid, _trig


@triton.jit
def _cast(x, OUT: tl.constexpr, RNE: tl.constexpr):
    # Under the interpreter fp32 -> bf16 truncates; RNE rounds by bits as the GEMM kernels do.
    if RNE:
        return _bf16_rne(x)
    return x.to(OUT)


@triton.jit
def _rms_prep_kernel(x_ptr, g_ptr, h_ptr, rstd_ptr, D, stride_x, stride_g, stride_h, eps,
                     BLOCK: tl.constexpr, OUT: tl.constexpr, RNE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + cols * stride_g, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(rstd_ptr + row, rstd)
    # (x * rstd) * g, rounded once, as F.rms_norm computes and stores it: x * g alone can
    # exceed the fp16 range where the normalized value does not.
    tl.store(h_ptr + row * stride_h + cols, _cast((x * rstd) * g, OUT, RNE), mask=mask)


@triton.jit
def _rms_input_grad_kernel(u_ptr, x_ptr, c_ptr, dx_ptr, D, stride_u, stride_x, stride_dx,
                           BLOCK: tl.constexpr, OUT: tl.constexpr, RNE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + row)
    tl.store(dx_ptr + row * stride_dx + cols, _cast(u - c * x, OUT, RNE), mask=mask)


@triton.jit
def _rms_backward_kernel(dy_ptr, x_ptr, g_ptr, rstd_ptr, dx_ptr, dg_ptr, M, D, STEPS, stride_dy, stride_x, stride_g,
                         stride_dx, BLOCK: tl.constexpr, R: tl.constexpr, STAGES: tl.constexpr,
                         OUT: tl.constexpr, RNE: tl.constexpr):
    # Step s of program pid takes rows [(s * programs + pid) * R, ... + R): the programs walk the
    # rows side by side, so at any time they read one contiguous band of memory. dx = r * (g dy -
    # xhat * sum(g dy xhat) / D) with xhat = r x, and this program's share of dg = sum over its rows
    # of dy * xhat, in fp32. STAGES > 1 lets the compiler prefetch the next rows while these compute.
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < D
    g = tl.load(g_ptr + cols * stride_g, mask=cmask, other=0.0).to(tl.float32)
    dg = tl.zeros((BLOCK,), tl.float32)
    for s in tl.range(0, STEPS, num_stages=STAGES):
        rows = (pid + programs * s).to(tl.int64) * R + tl.arange(0, R)  # step index < M: int32 is enough
        live = (rows < M)[:, None] & cmask[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=live, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=live, other=0.0).to(tl.float32)
        r = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
        xhat = x * r[:, None]
        gdy = g[None, :] * dy
        c = tl.sum(gdy * xhat, axis=1) / D
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :],
                 _cast(r[:, None] * (gdy - xhat * c[:, None]), OUT, RNE), mask=live)
        dg += tl.sum(dy * xhat, axis=0)
    tl.store(dg_ptr + pid * D + cols, dg, mask=cmask)


@triton.jit
def _capped(x, softcap):
    # (z, s) with z = c * tanh(x / c) = 2c * s - c for s = sigmoid(2x / c), as the LM-head epilogue
    # computes it (fewer instructions than tanh); dz/dx = 1 - tanh^2 = 4 s (1 - s).
    s = _sigmoid(x * (2.0 / softcap))
    return (2.0 * softcap) * s - softcap, s


@triton.jit
def _cross_entropy_kernel(l_ptr, target_ptr, scale_ptr, lse_ptr, tlogit_ptr, V, stride_l, softcap, on_target,
                          off_target, z_factor, BLOCK: tl.constexpr, OUT: tl.constexpr, RNE: tl.constexpr,
                          CAP: tl.constexpr, SMOOTH: tl.constexpr, ZLOSS: tl.constexpr):
    # Pass 1: logsumexp by the online rule (running max m, sum s of exp(x - m)); pass 2 reads
    # the row again (from L2 when it is still there) and writes the gradient over it. The
    # options are constexpr: a call without them compiles to the plain kernel. CAP: the
    # logits are z = softcap * tanh(l / softcap); SMOOTH: the target is q = on_target at the
    # target class and off_target elsewhere; ZLOSS: the loss adds c * lse^2 (z_factor = 2c).
    row = tl.program_id(0).to(tl.int64)
    base = l_ptr + row * stride_l
    target = tl.load(target_ptr + row)
    # The sum is kept relative to a shift: the running max, or 0 while that is +-inf (as
    # torch.logsumexp does), since inf - inf would make a row holding +-inf NaN.
    m = tl.full((), float("-inf"), tl.float32)
    shift = tl.zeros((), tl.float32)
    s = tl.zeros((), tl.float32)
    qz = tl.zeros((), tl.float32)  # SMOOTH: sum_j q_j z_j
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        if CAP:
            x = tl.where(cols < V, _capped(x, softcap)[0], float("-inf"))
        if SMOOTH:
            qz += tl.sum(tl.where(cols < V, tl.where(cols == target, on_target, off_target) * x, 0.0), axis=0)
        m = tl.maximum(m, tl.max(x, axis=0))
        shift_new = tl.where(tl.abs(m) == float("inf"), 0.0, m)
        # The shift falls only from -inf (s is 0) or to +inf (s becomes inf): no rescale then.
        s = s * tl.exp(tl.minimum(shift - shift_new, 0.0)) + tl.sum(tl.exp(x - shift_new), axis=0)
        shift = shift_new
    lse = shift + tl.log(s)
    if SMOOTH:
        tlogit = qz
    else:
        hit = (target >= 0) & (target < V)
        tlogit = tl.load(base + tl.where(hit, target, 0), mask=hit, other=0.0).to(tl.float32)
        if CAP:
            tlogit = _capped(tlogit, softcap)[0]
    tl.store(lse_ptr + row, lse)
    tl.store(tlogit_ptr + row, tlogit)
    scale = tl.load(scale_ptr + row)
    if ZLOSS:
        p_scale = 1.0 + z_factor * lse  # d(c lse^2)/dz = 2c lse softmax
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        if CAP:
            x, sig = _capped(x, softcap)
        if SMOOTH:
            q = tl.where(cols == target, on_target, off_target)
        else:
            q = tl.where(cols == target, 1.0, 0.0)
        if ZLOSS:
            grad = tl.exp(x - lse) * p_scale - q
        else:
            grad = tl.exp(x - lse) - q
        if CAP:
            grad = grad * (4.0 * sig * (1.0 - sig))  # dz/dl
        tl.store(base + cols, _cast(grad * scale, OUT, RNE), mask=mask)


@triton.jit
def _rope_pairs_kernel(x_ptr, z_ptr, bias_ptr, pos_ptr, freq_ptr, out_ptr, zdz_ptr, P, stride_x, stride_z, stride_out,
                       INVERSE: tl.constexpr, DOT: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr,
                       OUT: tl.constexpr, RNE: tl.constexpr):
    # A row in chunks of BLOCK pairs. Each chunk is read and written as 2 * BLOCK contiguous
    # columns and split into the pairs' halves in registers: wide vector loads and stores, where
    # loading the even and the odd columns separately issues two strided accesses per row.
    # INVERSE rotates by -theta (the backward); DOT also sums z * x over the row into zdz, and
    # BIAS subtracts the bias's dot with the rotated row from it (<z - bias, dz> before rotation).
    row = tl.program_id(0).to(tl.int64)
    angle = tl.load(pos_ptr + row).to(tl.float32)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, P, BLOCK):
        pairs = start + tl.arange(0, BLOCK)
        cols = 2 * start + tl.arange(0, 2 * BLOCK)
        live = cols < 2 * P
        theta = angle * tl.load(freq_ptr + pairs, mask=pairs < P, other=0.0)
        c, s = _trig(theta, 1), _trig(theta, 0)
        if INVERSE:
            s = -s
        a, b = tl.split(tl.reshape(tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
                                   .to(tl.float32), (BLOCK, 2)))
        ra, rb = a * c - b * s, a * s + b * c
        tl.store(out_ptr + row * stride_out + cols, _cast(tl.interleave(ra, rb), OUT, RNE), mask=live)
        if DOT:
            za, zb = tl.split(tl.reshape(tl.load(z_ptr + row * stride_z + cols, mask=live, other=0.0)
                                         .to(tl.float32), (BLOCK, 2)))
            dot += za * a + zb * b
        if BIAS:
            ba, bb = tl.split(tl.reshape(tl.load(bias_ptr + cols, mask=live, other=0.0).to(tl.float32), (BLOCK, 2)))
            dot -= ba * ra + bb * rb
    if DOT:
        tl.store(zdz_ptr + row, tl.sum(dot, axis=0))


@triton.jit
def _rope_halves_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, HALF, D, stride_xt, stride_xh, stride_c,
                        stride_ot, stride_oh, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, OUT: tl.constexpr, RNE: tl.constexpr):
    # One token a program, all its heads as one [BLOCK_H, BLOCK_HALF] tile: the token's cos and
    # sin rows are read once. Columns [2 HALF, D) (a partial rotary, Phi-3's) pass through.
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    on = cols < HALF
    mask = (heads < H) & on
    c1 = tl.load(cos_ptr + t * stride_c + cols, mask=on, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_c + HALF + cols, mask=on, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_c + cols, mask=on, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_c + HALF + cols, mask=on, other=0.0).to(tl.float32)
    src = x_ptr + t * stride_xt + heads * stride_xh
    dst = out_ptr + t * stride_ot + heads * stride_oh
    x1 = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose: dx1 = d1 c1 + d2 s2, dx2 = d2 c2 - d1 s1
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(dst + cols, _cast(y1, OUT, RNE), mask=mask)
    tl.store(dst + HALF + cols, _cast(y2, OUT, RNE), mask=mask)
    if BLOCK_PASS > 0:
        rest = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
        keep = (heads < H) & (rest < D)
        tl.store(dst + rest, tl.load(src + rest, mask=keep, other=0.0), mask=keep)


@triton.jit
def _scale_rows_kernel(x_ptr, s_ptr, out_ptr, D, stride_x, stride_out, BLOCK: tl.constexpr, OUT: tl.constexpr,
                       RNE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, _cast(x * tl.load(s_ptr + row), OUT, RNE), mask=mask)


@triton.jit
def _scale_cast_kernel(x_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr, OUT: tl.constexpr, RNE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(x_ptr + offs, mask=keep, other=0.0)
    tl.store(out_ptr + offs, _cast(x * tl.load(s_ptr), OUT, RNE), mask=keep)


_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _out_args(dtype: torch.dtype) -> dict:
    return {"OUT": _TL[dtype], "RNE": dtype == torch.bfloat16 and interpreting()}


def _rows(t: torch.Tensor, what: str) -> torch.Tensor:
    """A 2-D tensor whose rows are contiguous (the kernels walk columns with unit stride)."""
    if t.dim() != 2:
        raise ValueError(f"{what} must be 2-D, got shape {tuple(t.shape)}")
    check_kernel_device(what, t, interpreting())
    return t if t.stride(1) == 1 else t.contiguous()


def _vector(t: torch.Tensor, length: int, what: str) -> torch.Tensor:
    """A contiguous [length] tensor (the kernels index vectors with unit stride)."""
    if tuple(t.shape) != (length,):
        raise ValueError(f"{what} must have shape [{length}], got {list(t.shape)}")
    check_kernel_device(what, t, interpreting())
    return t.contiguous()


def _weight(g: torch.Tensor, d: int, what: str) -> torch.Tensor:
    """A [d] norm weight, read as it is (it may be strided or expanded)."""
    if g.shape != (d,):
        raise ValueError(f"{what} must have shape [{d}], got {list(g.shape)}")
    check_kernel_device(what, g, interpreting())
    return g


def _output(out: torch.Tensor | None, like: torch.Tensor, what: str) -> torch.Tensor:
    """`out` where given (x's shape and dtype, contiguous rows: e.g. a column slice of a wider
    tensor, which the row pass writes in place), else a new contiguous tensor like x."""
    if out is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    if out.shape != like.shape or out.dtype != like.dtype or (out.numel() and out.stride(1) != 1):
        raise ValueError(f"{what}: out must be {list(like.shape)} {like.dtype} with contiguous rows, got "
                         f"{list(out.shape)} {out.dtype} strides {out.stride()}")
    check_kernel_device(what, out, interpreting())
    return out


def rms_prep(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rstd): rstd = rsqrt(mean(x^2) + eps) fp32 per row and h = x * rstd * g in x.dtype
    (F.rms_norm's output), in one pass. norm_weight may be strided or expanded."""
    x = _rows(x, "rms_prep: x")
    m, d = x.shape
    norm_weight = _weight(norm_weight, d, "rms_prep: norm_weight")
    h = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    if m:
        _rms_prep_kernel[(m,)](x, norm_weight, h, rstd, d, x.stride(0), norm_weight.stride(0), h.stride(0), eps,
                               BLOCK=triton.next_power_of_2(d), **_out_args(x.dtype))
    return h, rstd


def rms_input_grad(u: torch.Tensor, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """dx = u - c[:, None] * x in x.dtype (u fp32, c fp32 per row)."""
    u, x = _rows(u, "rms_input_grad: u"), _rows(x, "rms_input_grad: x")
    m, d = x.shape
    if u.shape != x.shape:
        raise ValueError(f"rms_input_grad: u {list(u.shape)} and x {list(x.shape)} must have one shape")
    c = _vector(c, m, "rms_input_grad: c")
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if m:
        _rms_input_grad_kernel[(m,)](u, x, c, dx, d, u.stride(0), x.stride(0), dx.stride(0),
                                     BLOCK=triton.next_power_of_2(d), **_out_args(x.dtype))
    return dx


def scale_rows(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x * s[:, None] in x.dtype, computed in fp32 and rounded once (s fp32, one value per row): one
    pass where torch takes three (the fp32 copy, the product, the cast)."""
    x = _rows(x, "scale_rows: x")
    m, d = x.shape
    s = _vector(s, m, "scale_rows: s")
    if s.dtype != torch.float32:
        raise ValueError(f"scale_rows: s must be fp32, got {s.dtype}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if m and d:
        _scale_rows_kernel[(m,)](x, s, out, d, x.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(d),
                                 **_out_args(x.dtype))
    return out


class RmsBackwardTiling(NamedTuple):
    """How `rms_backward` splits its rows: `rows` at a time per program (a [rows, D] tile: more
    loads in flight), `programs_per_sm` programs per SM (each one row of dg partials),
    `num_warps`, and `stages` (> 1: the next rows prefetched while these compute)."""

    rows: int
    programs_per_sm: int
    num_warps: int
    stages: int


def rms_backward_tiling(d: int) -> RmsBackwardTiling:
    """The default tiling for rows of d columns, one program per SM: up to D=4096 steps of 16384
    elements (up to 8 rows) over 8 warps, 64 fp32 values of a tensor per thread; wider rows one
    at a time over 8 warps, and 16 past 8192 columns (sm_90 compiles: no spills through 8192, a
    few hundred bytes at 16384). From the H200 sweep (bench/results/rowwise/, replayed as CUDA
    graphs): at D=2048 this (8 rows) was the fastest of 64 tilings, 0.041 ms against 0.047 for
    the earlier one row at a time over 4 programs per SM; at D=4096 (4 rows) 0.072 against
    0.086, the fastest being 0.069. Wider rows are not measured."""
    block = triton.next_power_of_2(max(d, 1))
    rows = max(1, min(8, 16384 // block)) if block <= 4096 else 1
    return RmsBackwardTiling(rows=rows, programs_per_sm=1, num_warps=8 if block <= 8192 else 16, stages=1)


def rms_backward(dy: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, rstd: torch.Tensor,
                 tiling: RmsBackwardTiling | None = None,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x.dtype, dg fp32) of h = F.rms_norm(x, g) given dy = dL/dh and rstd per row; dx
    written into `out` where given (`_output`). dg is summed from per-program partials (each
    program takes every P-th step of rows), in a fixed order: deterministic for a given tiling
    (default: `rms_backward_tiling(D)`)."""
    dy, x = _rows(dy, "rms_backward: dy"), _rows(x, "rms_backward: x")
    m, d = x.shape
    if dy.shape != x.shape:
        raise ValueError(f"rms_backward: dy {list(dy.shape)} and x {list(x.shape)} must have one shape")
    norm_weight = _weight(norm_weight, d, "rms_backward: norm_weight")
    rstd = _vector(rstd, m, "rms_backward: rstd")
    tiling = tiling or rms_backward_tiling(d)
    if min(tiling) < 1 or tiling.rows & (tiling.rows - 1) or tiling.num_warps & (tiling.num_warps - 1):
        raise ValueError(f"rms_backward: {tiling} needs positive fields, rows and num_warps powers of two")
    programs = max(1, min(triton.cdiv(m, tiling.rows), tiling.programs_per_sm * num_programs(x.device)))
    steps = triton.cdiv(triton.cdiv(m, tiling.rows), programs)
    dx = _output(out, x, "rms_backward")
    partial = torch.empty(programs, d, device=x.device, dtype=torch.float32)
    if m:
        _rms_backward_kernel[(programs,)](dy, x, norm_weight, rstd, dx, partial, m, d, steps, dy.stride(0), x.stride(0),
                                          norm_weight.stride(0), dx.stride(0), BLOCK=triton.next_power_of_2(d),
                                          R=tiling.rows, STAGES=tiling.stages, num_warps=tiling.num_warps,
                                          **_out_args(x.dtype))
    else:
        partial.zero_()
    return dx, partial.sum(0)


def cross_entropy_(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, *, softcap: float | None = None,
                   smoothing: tuple[float, float] | None = None,
                   lse_square_scale: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of stored logits l: (lse, target logit) in fp32 (without smoothing, target logit 0
    where the target is out of range, e.g. ignore_index), and l <- (softmax(l) - onehot(target))
    * scale in place, the cross-entropy gradient per unit loss. Two reads and one write of the logits.

    The options (docs/ALGEBRA.md 4), each compiled in only when given: `softcap` c makes the
    logits z = c * tanh(l / c), with the gradient times dz/dl = 1 - tanh^2; `smoothing`
    (on_target, off_target) replaces onehot by the smoothed target q and the target logit by
    sum_j q_j z_j; `lse_square_scale` c' (z-loss c' * lse^2) multiplies softmax by 1 + 2 c' lse."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("cross_entropy_: logits must be 2-D with contiguous rows")
    check_kernel_device("cross_entropy_: logits", logits, interpreting())
    m, v = logits.shape
    if m > 1 and logits.stride(0) < v:
        raise ValueError("cross_entropy_: logits rows overlap (an expanded view?); they are written in place")
    target, scale = _vector(target, m, "cross_entropy_: target"), _vector(scale, m, "cross_entropy_: scale")
    lse = torch.empty(m, device=logits.device, dtype=torch.float32)
    tlogit = torch.empty_like(lse)
    on_target, off_target = smoothing or (1.0, 0.0)
    if m:
        _cross_entropy_kernel[(m,)](logits, target, scale, lse, tlogit, v, logits.stride(0), softcap or 1.0, on_target,
                                    off_target, 2.0 * lse_square_scale, BLOCK=min(4096, triton.next_power_of_2(v)),
                                    num_warps=8, CAP=softcap is not None, SMOOTH=smoothing is not None,
                                    ZLOSS=lse_square_scale != 0.0, **_out_args(logits.dtype))
    return lse, tlogit


def _rope_pairs(x: torch.Tensor, z: torch.Tensor | None, pos: torch.Tensor, freq: torch.Tensor, inverse: bool,
                what: str, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = _rows(x, f"{what}: {'dz' if z is not None else 'x'}")
    m, n = x.shape
    if z is not None:
        z = _rows(z, f"{what}: z")
        if z.shape != x.shape:
            raise ValueError(f"{what}: dz {list(x.shape)} and z {list(z.shape)} must have one shape")
    if bias is not None:
        bias = _vector(bias, n, f"{what}: bias")
    if n % 2:
        raise ValueError(f"{what}: {list(x.shape)} needs an even number of columns (adjacent pairs)")
    pos, freq = _vector(pos, m, f"{what}: pos"), _vector(freq.float(), n // 2, f"{what}: freq")
    out = _output(out, x, what)
    zdz = None if z is None else torch.empty(m, device=x.device, dtype=torch.float32)
    if m:  # (a row of no pairs still writes its zdz: 0)
        # 256 pairs a chunk: 512 columns, 8 per thread of 2 warps (16-byte bf16 vectors), and no
        # power-of-two padding of the row (the block passes all of qkv: 3072 or 6144 columns, 512 a chunk)
        _rope_pairs_kernel[(m,)](x, x if z is None else z, x if bias is None else bias, pos, freq, out,
                                 out if zdz is None else zdz, n // 2, x.stride(0),
                                 x.stride(0) if z is None else z.stride(0), out.stride(0),
                                 INVERSE=inverse, DOT=z is not None, BIAS=bias is not None,
                                 BLOCK=min(256, triton.next_power_of_2(max(n // 2, 1))), num_warps=2,
                                 **_out_args(x.dtype))
    return out, zdz


def rope_pairs(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor, inverse: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, 2P] with each adjacent column pair (2i, 2i+1) rotated by theta = pos[row] * freq[i]
    (fp32, rounded once); `inverse` rotates by -theta (the transpose: the backward). Written into
    `out` where given (`_output`)."""
    return _rope_pairs(x, None, pos, freq, inverse, "rope_pairs", out=out)[0]


def rope_backward(dz: torch.Tensor, z: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dz rotated by -theta per adjacent column pair, zdz = sum(z * dz) per row in fp32).

    z is the forward's rotated output: the rotation keeps dot products, so sum(z * dz)
    equals the pre-rotation input's dot with its gradient (the RMSNorm backward's row term).
    With `bias` ([2P], added before the rotation: z = n W^T + bias) zdz is the norm output's
    term, sum((z - bias) * dz) before the rotation."""
    return _rope_pairs(dz, z, pos, freq, True, "rope_backward", bias)


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one of q, k, in fp32 and rounded once: x [T, H, D],
    cos and sin [T, R] (R even, R <= D; columns from R on pass through); `inverse` applies the
    transpose (x is then the output's gradient). Returns a contiguous [T, H, D]."""
    if x.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[0] \
            or cos.shape[1] % 2 or cos.shape[1] > x.shape[2]:
        raise ValueError(f"rope_halves: x {list(x.shape)}, cos {list(cos.shape)} and sin {list(sin.shape)} must be "
                         "[T, H, D], [T, R] and [T, R] with R even and at most D")
    check_kernel_device("rope_halves: x", x, interpreting())
    x = x if x.stride(2) == 1 else x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()  # (one row stride for both)
    tokens, h, d = x.shape
    half = cos.shape[1] // 2
    out = torch.empty((tokens, h, d), device=x.device, dtype=x.dtype)
    if tokens and h and d:
        _rope_halves_kernel[(tokens,)](x, cos, sin, out, h, half, d, x.stride(0), x.stride(1), cos.stride(0),
                                       out.stride(0), out.stride(1), BACKWARD=inverse,
                                       BLOCK_H=triton.next_power_of_2(h), BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
                                       BLOCK_PASS=0 if 2 * half == d else triton.next_power_of_2(d - 2 * half),
                                       num_warps=4, **_out_args(x.dtype))
    return out


def scale_cast(x: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """s * x in `dtype`, rounded once: x fp32 and contiguous, s a 0-d fp32 tensor (read on the
    device: no synchronization). One read of x and one write, no fp32 temporary."""
    if x.dtype != torch.float32 or not x.is_contiguous() or s.shape != () or s.dtype != torch.float32:
        raise ValueError("scale_cast: x must be contiguous fp32 and s a 0-d fp32 tensor")
    check_kernel_device("scale_cast: x", x, interpreting())
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel():
        block = 4096
        _scale_cast_kernel[(triton.cdiv(x.numel(), block),)](x, s, out, x.numel(), BLOCK=block, num_warps=8,
                                                              **_out_args(dtype))
    return out


__all__ = ["rms_prep", "rms_input_grad", "scale_rows", "rms_backward", "RmsBackwardTiling", "rms_backward_tiling", "cross_entropy_",
           "rope_backward", "rope_pairs", "rope_halves", "scale_cast"]

