"""coda's row-pass kernels (coda.ops.rowwise) against the memory bandwidth they could use (H200).

Each row pass is memory-bound: its time is set by the bytes it moves. For each kernel at the
Llama block's shapes (M=8192, D=2048 and 4096), check it against a PyTorch formula, time it (as
called, and replayed as a CUDA graph: the second leaves the host's launch work out), and
time in the same run a PyTorch elementwise op over tensors of the same sizes (`torch.add`: two
inputs, one output), whose achieved bandwidth is the yardstick:
x = (kernel's bytes / kernel's time) / (add's bytes / add's time); 1.0 is as fast per byte as add.

With --sweep, also `rms_backward` under every tiling of TILINGS (rows per step, programs per SM,
warps, pipeline stages) at each width, against the same yardstick: where its default comes from.

    python bench/tools/rowwise_bandwidth.py --out DIR [--sweep]
    python bench/tools/rowwise_bandwidth.py --merge DIR/rowwise.json --out bench/results/rowwise
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared harness

import torch
import torch.nn.functional as F

import harness
from coda.ops import rowwise
from harness import NOTES, log, rel_err

M = 8192
QKV = {2048: 3072, 4096: 6144}  # D: the block's qkv width (RoPE's rows)
V = 128256
# rms_backward tilings of --sweep: (rows per step, programs per SM, num_warps, stages)
TILINGS = [rowwise.RmsBackwardTiling(*t) for t in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (4, 8), (1, 2))]


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _yardstick(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """(ms, bytes) of torch.add over two distinct inputs shaped like the kernel's and one output."""
    out = torch.empty_like(a)
    return harness.timed(lambda: torch.add(a, b, out=out)), _bytes(a, b, out)


def _rms_backward_check(dy: torch.Tensor, x: torch.Tensor, g: torch.Tensor):
    """check(result) of rms_backward(dy, x, g, rstd): the larger relative error of (dx, dg) against
    F.rms_norm's fp32 backward (computed once)."""
    xf, gf = x.float().requires_grad_(), g.clone().requires_grad_()
    F.rms_norm(xf, (x.shape[1],), gf, 1e-6).backward(dy.float())
    return lambda result: max(rel_err(result[0], xf.grad), rel_err(result[1], gf.grad))


def _timed(run, check, moved: int, yardstick: tuple[float, int]) -> dict:
    """run checked (error < 2e-2 against `check`, else AssertionError), then timed as called and as a
    CUDA graph; x_add: its `moved` bytes per ms over the yardstick's (ms, bytes)."""
    err = check(run())
    if not err < 2e-2:
        raise AssertionError(f"error {err:.3g} against the PyTorch formula")
    ms = harness.timed(run)
    return {"ms": ms, "graph_ms": _graph_ms(run), "x_add": (moved / ms) / (yardstick[1] / yardstick[0]), "err": err}


def cases(d: int, qkv: int, m: int, vocab: int | None) -> list[tuple]:
    """(name, run, check, bytes moved, yardstick inputs) at width d, RoPE over qkv columns, and
    with `vocab` the cross-entropy pass over [m, vocab] logits."""
    dev, bf16 = harness.DEVICE, torch.bfloat16
    x, g = torch.randn(m, d, device=dev).to(bf16), torch.rand(d, device=dev) + 0.5
    dz, z = torch.randn(m, qkv, device=dev).to(bf16), torch.randn(m, qkv, device=dev).to(bf16)
    pos, freq = torch.arange(m, device=dev), torch.rand(qkv // 2, device=dev)
    u, c = torch.randn(m, d, device=dev), torch.rand(m, device=dev)

    def rope_check(result) -> float:
        out, zdz = result
        theta = pos[:, None].float() * freq[None, :]
        a, b = dz.float()[:, 0::2], dz.float()[:, 1::2]
        want = torch.stack([a * theta.cos() + b * theta.sin(), b * theta.cos() - a * theta.sin()], -1).reshape(m, qkv)
        return max(rel_err(out, want), rel_err(zdz, (z.float() * dz.float()).sum(-1)))

    def prep_check(result) -> float:
        h, rstd = result
        return max(rel_err(h, F.rms_norm(x.float(), (d,), g, 1e-6)),
                   rel_err(rstd, torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)))

    dy = torch.randn(m, d, device=dev).to(bf16)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    rows = [
        ("rope_backward", lambda: rowwise.rope_backward(dz, z, pos, freq), rope_check,
         _bytes(dz, z, dz) + 4 * m, (dz, z)),
        ("rms_prep", lambda: rowwise.rms_prep(x, g, 1e-6), prep_check, _bytes(x, x) + 4 * m, (x, x.clone())),
        ("rms_input_grad", lambda: rowwise.rms_input_grad(u, x, c),
         lambda dx: rel_err(dx, u - c[:, None] * x.float()), _bytes(u, x, x), (u, u.clone())),
        ("rms_backward", lambda: rowwise.rms_backward(dy, x, g, rstd), _rms_backward_check(dy, x, g),
         _bytes(dy, x, x) + 4 * m, (dy, x)),
    ]
    if vocab:
        logits = torch.randn(m, vocab, device=dev).to(bf16)
        target, scale = torch.randint(0, vocab, (m,), device=dev), torch.full((m,), 1.0 / m, device=dev)
        ref = logits.float()

        def ce_check(result) -> float:
            lse, tlogit = result
            return max(rel_err(lse, torch.logsumexp(ref, -1)), rel_err(tlogit, ref.gather(1, target[:, None])[:, 0]))

        # it overwrites the logits with their gradient, which later (timed) calls take as logits:
        # the same work; two reads of the logits and one write
        rows.append(("cross_entropy_", lambda: rowwise.cross_entropy_(logits, target, scale), ce_check,
                     3 * _bytes(logits) + 16 * m, (logits, logits.clone())))
    return rows


def measure(m: int = M, widths: dict[int, int] = QKV, vocab: int = V) -> list[dict]:
    """Rows for every kernel at every width (the cross-entropy pass at the first width only: its
    logits are 2 GB at the real shape)."""
    out = []
    for i, (d, qkv) in enumerate(widths.items()):
        for name, run, check, moved, like in cases(d, qkv, m, vocab if i == 0 else None):
            try:
                ref_ms, ref_bytes = yardstick = _yardstick(*like)
                row = {"D": d, "kernel": name, "bytes": moved, "add_GBps": ref_bytes / ref_ms / 1e6,
                       **_timed(run, check, moved, yardstick)}
                row["GBps"] = moved / row["ms"] / 1e6
                out.append(row)
                log(f"  D={d} {name:16s} {row['ms']:.4f} ms  {row['GBps']:7.0f} GB/s  x add {row['x_add']:.3f}")
            except Exception as exc:  # noqa: BLE001
                NOTES.append(f"D={d} {name}: {type(exc).__name__}: {str(exc)[:200]}")
    return out


def _graph_ms(run) -> float | None:
    """run's time replayed as a CUDA graph: its kernels without the host's launch work (None where
    there are no graphs, on the CPU harness, or where capture fails: harness.graph_ms says why)."""
    return harness.graph_ms(run) if torch.cuda.is_available() else None


def sweep(m: int = M, widths: tuple[int, ...] = tuple(QKV), tilings: list = TILINGS) -> list[dict]:
    """rms_backward under each tiling at each width: ms, x add, and whether it is the default."""
    dev, bf16, out = harness.DEVICE, torch.bfloat16, []
    for d in widths:
        x, dy = torch.randn(m, d, device=dev).to(bf16), torch.randn(m, d, device=dev).to(bf16)
        g = torch.rand(d, device=dev) + 0.5
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
        check, yardstick = _rms_backward_check(dy, x, g), _yardstick(dy, x)
        moved, default = _bytes(dy, x, x) + 4 * m, rowwise.rms_backward_tiling(d)
        for t in tilings:
            try:
                row = _timed(lambda: rowwise.rms_backward(dy, x, g, rstd, t), check, moved, yardstick)  # noqa: B023
            except Exception as exc:  # noqa: BLE001
                NOTES.append(f"sweep D={d} {tuple(t)}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            out.append({"D": d, "tiling": list(t), "default": t == default, **row})
            log(f"  sweep D={d} {tuple(t)} {row['ms']:.4f} ms  x add {row['x_add']:.3f}  graph {_cell(row['graph_ms'])} ms"
                f"{'  (default)' if t == default else ''}")
    return out


def sweep_table(rows: list[dict]) -> str:
    lines = ["| D | rows | programs/SM | warps | stages | ms | x add | as a CUDA graph, ms |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["D"], r["ms"])):
        rows_, per_sm, warps, stages = r["tiling"]
        lines.append(f"| {r['D']} | {rows_} | {per_sm} | {warps} | {stages} | {r['ms']:.4f}{' (default)' if r['default'] else ''}"
                     f" | {r['x_add']:.3f} | {_cell(r.get('graph_ms'))} |")
    return "\n".join(lines)


def _cell(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.4f}"


def table(rows: list[dict]) -> str:
    lines = ["| D | kernel | ms | MB moved | GB/s | torch.add GB/s | x add | as a CUDA graph, ms |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['D']} | {r['kernel']} | {r['ms']:.4f} | {r['bytes'] / 1e6:.0f} | {r['GBps']:.0f} | "
              f"{r['add_GBps']:.0f} | {r['x_add']:.3f} | {_cell(r.get('graph_ms'))} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/rowwise"))
    ap.add_argument("--merge", type=Path, help="write <out>/rowwise.{json,md} from a measured JSON")
    ap.add_argument("--sweep", action="store_true", help="also rms_backward under every tiling of TILINGS")
    args = ap.parse_args()
    data = harness.measured_or_merged(
        args.merge, "rowwise_bandwidth.py", f"do_bench median, bf16 activations, M={M}; each kernel checked against a "
        "PyTorch formula first; x add = its bytes per ms over torch.add's (same sizes, same run)",
        lambda: {"rows": measure(), **({"sweep": sweep()} if args.sweep else {})})
    text = table(data["rows"])
    if data.get("sweep"):
        text += "\n\nrms_backward per tiling, fastest first:\n\n" + sweep_table(data["sweep"])
    harness.write_results(args.out, "rowwise", data, text)
    log(text)


if __name__ == "__main__":
    main()
