"""What `out=` may share with the tensors a call reads, and with itself.

A kernel program reads its rows of `a`, every column of `b`, whole vector operands and its
own tile of each Tile operand while other programs write other tiles of the outputs. So an
`out=` tensor may overlap nothing the call reads, nothing another output writes and not
itself, with one exception: a Tile operand that is *exactly* the output (same address, shape,
strides and dtype) is read element by element by the program that then overwrites that
element, which is the documented in-place accumulation (`gemm(a, b, add, out=g, g=g)`).

Overlap is decided on memory, not on storages: each tensor is a set of byte intervals (rows
of contiguous bytes at a fixed pitch, where its layout allows) and two tensors overlap when
some byte lies in both. Disjoint address ranges, the case of almost every call, cost a few
comparisons; interleaved views of one buffer (`buf[:, :n]` beside `buf[:, n:]`) are decided
exactly. Layouts for which the exact test would enumerate too much are refused as "may
overlap": a refusal is never a wrong answer.

This runs on every call that passes `out=` (it depends on data pointers, which the plan key
does not hold): a call without `out=` writes only tensors gemm() allocates.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

_ENUMERATE_MAX = 1 << 16  # rows (or elements) an exact test may walk before it refuses


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses of t's elements (t non-empty)."""
    start, last = t.data_ptr(), 1
    for n, s in zip(t.size(), t.stride()):
        last += (n - 1) * s
    return start, start + last * t.element_size()


def _rows(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """t as (base, count, pitch, width): `count` runs of `width` contiguous bytes, `pitch`
    bytes apart; None when no such description exists (both strides > 1)."""
    size, base = t.element_size(), t.data_ptr()
    shape, stride = list(t.shape), list(t.stride())
    dims = [(n, s) for n, s in zip(shape, stride) if n != 1]
    if not dims:
        return base, 1, size, size
    if len(dims) == 1:
        n, s = dims[0]
        if s == 1:
            return base, 1, n * size, n * size
        return (base, 1, size, size) if s == 0 else (base, n, s * size, size)
    (n0, s0), (n1, s1) = dims
    if s1 == 1 or (s0 != 1 and s1 == 0):
        rows, pitch, width = n0, s0 * size, n1 * size if s1 == 1 else size
    elif s0 == 1 or s0 == 0:
        rows, pitch, width = n1, s1 * size, n0 * size if s0 == 1 else size
    else:
        return None
    return (base, 1, width, width) if pitch == 0 else (base, rows, pitch, width)


def _row_hits(start: int, end: int, rows: tuple[int, int, int, int]) -> bool:
    """Whether the byte interval [start, end) meets one of the runs in `rows`."""
    base, count, pitch, width = rows
    # run j covers [base + j*pitch, base + j*pitch + width): need base + j*pitch < end and
    # base + j*pitch + width > start, i.e. (start - width - base) / pitch < j < (end - base) / pitch
    lo = max(0, (start - width - base) // pitch + 1)
    hi = min(count - 1, -((base - end) // pitch) - 1)
    return lo <= hi


def _rows_meet(r: tuple[int, int, int, int], u: tuple[int, int, int, int]) -> bool | None:
    """Exact overlap of two run sets; None when deciding it would walk too many runs."""
    if r[1] > u[1]:
        r, u = u, r
    if r[2] == u[2]:  # one pitch p: run i of r meets run j of u iff -wu < δ + (j - i) p < wr
        (br, cr, p, wr), (bu, cu, _, wu) = r, u
        d = bu - br
        lo = max(-(cr - 1), (-wu - d) // p + 1)
        hi = min(cu - 1, -((d - wr) // p) - 1)
        return lo <= hi
    if r[1] > _ENUMERATE_MAX:
        return None
    base, count, pitch, width = r
    return any(_row_hits(base + i * pitch, base + i * pitch + width, u) for i in range(count))


def overlaps(t: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether t and u share a byte of memory (conservatively True when undecidable)."""
    if t.numel() == 0 or u.numel() == 0:
        return False
    (t0, t1), (u0, u1) = _span(t), _span(u)
    return not (t1 <= u0 or u1 <= t0) and _meet(t, u)


def _meet(t: torch.Tensor, u: torch.Tensor) -> bool:
    """Exact test for two non-empty tensors whose address ranges intersect."""
    if t.device != u.device:
        return False
    rt, ru = _rows(t), _rows(u)
    if rt is not None and ru is not None:
        hit = _rows_meet(rt, ru)
        if hit is not None:
            return hit
    if t.numel() + u.numel() > 4 * _ENUMERATE_MAX:
        return True
    return bool(torch.isin(_bytes(t), _bytes(u)).any())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte address t's elements occupy, relative to no particular origin (CPU int64)."""
    idx = torch.zeros((), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        idx = idx.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
    start = idx.reshape(-1) * t.element_size() + t.data_ptr()
    return (start.unsqueeze(-1) + torch.arange(t.element_size(), dtype=torch.int64)).reshape(-1)


def self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of t share memory (an expanded or otherwise overlapping view);
    conservatively True for layouts torch cannot decide and that are not plainly disjoint."""
    verdict = torch._debug_has_internal_overlap(t)
    if verdict != 2:  # 0: no overlap, 1: overlap
        return verdict == 1
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    reach = 0  # elements covered by the smaller dims; a larger stride must step past them
    for s, n in dims:
        if s <= reach:
            return True
        reach += (n - 1) * s
    return False


def _same_view(t: torch.Tensor, u: torch.Tensor) -> bool:
    return (t.data_ptr() == u.data_ptr() and t.shape == u.shape and t.stride() == u.stride()
            and t.dtype == u.dtype)


def check_out(
    a: object, b: object, operands: Mapping[str, object], out: Mapping[str, object], tiles: Iterable[str],
) -> None:
    """Raise ValueError if an out= tensor overlaps itself, another output, or anything the call
    reads other than a Tile operand (named in `tiles`) that is exactly that output."""
    outs = [(k, t, _span(t)) for k, t in out.items() if isinstance(t, torch.Tensor) and t.numel()]
    if not outs:
        return
    reads = [("a", a, False), ("b", b, False)] + [(k, v, k in tiles) for k, v in operands.items()]
    reads = [(w, t, tile, _span(t)) for w, t, tile in reads if isinstance(t, torch.Tensor) and t.numel()]
    for i, (name, t, (t0, t1)) in enumerate(outs):
        if t.numel() > 1 and self_overlapping(t):
            raise ValueError(
                f"coda.gemm: out[{name!r}] has elements that share memory (an expanded or overlapping view, "
                f"strides {list(t.stride())}); pass a tensor whose elements are distinct, e.g. .contiguous()"
            )
        for other, u, (u0, u1) in outs[:i]:
            if t0 < u1 and u0 < t1 and _meet(t, u):
                raise ValueError(
                    f"coda.gemm: out[{name!r}] and out[{other!r}] share memory; each output needs its own tensor"
                )
        for what, u, tile, (u0, u1) in reads:
            if not (t0 < u1 and u0 < t1 and _meet(t, u)):
                continue
            if tile and _same_view(t, u):
                continue
            what = what if u is a or u is b else f"operand {what!r}"
            hint = (" (a Tile operand may be the output itself, for in-place accumulation, only as the very same "
                    "view: same storage offset, shape, strides and dtype)") if tile else ""
            raise ValueError(
                f"coda.gemm: out[{name!r}] overlaps {what}, which the kernel reads while it writes the output{hint}; "
                f"write into a separate tensor, or pass a copy (.clone()) of {what.split(' ')[-1]}"
            )
