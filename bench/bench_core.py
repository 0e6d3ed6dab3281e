"""First H200 benchmark of coda core (BENCH.md protocol).

coda's plain GEMM vs cuBLAS (square sweep and transformer shapes), and two fused
epilogues vs eager PyTorch and torch.compile at M=8192, D=2048, FFN=8192:

* swiglu: y = silu(gate) * up from the gate+up GEMM (N = 2*FFN). coda reads
  interleaved weights (`pairs`), eager/compile use the standard chunked layout.
* rmsnorm_gemm: F.linear(F.rms_norm(x, g), W). coda runs the consumer half of
  TRANSFORMER.md section 1: `(x*g) @ W.T` scaled by rstd per row in the epilogue;
  h = x*g and rstd come from the producer GEMM's epilogue upstream, so they are
  inputs here (documented in the results).

Every variant is checked against an fp32 reference before it is timed. Working sets
exceed the 60 MB L2 at these shapes. Usage (on the GPU machine):

    python bench/bench_core.py --out bench/results [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import coda

ROWS: list[dict] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def record(op: str, m: int, n: int, k: int, variant: str, fn, ref: torch.Tensor | None, pick=lambda r: r) -> float:
    if ref is not None:
        err = rel_err(pick(fn()), ref)
        if not err < 2e-2:
            raise AssertionError(f"{op}/{variant}: relative error {err:.3g} vs fp32 reference")
    ms = timed(fn)
    tflops = 2.0 * m * n * k / (ms * 1e-3) / 1e12
    ROWS.append({"op": op, "M": m, "N": n, "K": k, "variant": variant, "ms": ms, "tflops": tflops})
    log(f"  {op:14s} M={m:6d} N={n:6d} K={k:6d} {variant:22s} {ms:8.4f} ms {tflops:7.1f} TFLOP/s")
    return ms


def compiled_variants(op: str, m: int, n: int, k: int, fn, ref, pick, modes: list[str]) -> None:
    for mode in modes:
        cfn = torch.compile(fn) if mode == "default" else torch.compile(fn, mode=mode)
        t0 = time.time()
        cfn()
        torch.cuda.synchronize()
        log(f"  (torch.compile {mode}: {time.time() - t0:.1f} s to compile)")
        record(op, m, n, k, f"compile_{mode}", cfn, ref, pick)


def bench_plain(shapes: list[tuple[int, int, int]]) -> None:
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.float().T
        record("gemm", m, n, k, "cublas_gemm", lambda: a @ w.T, ref)
        record("gemm", m, n, k, "coda_gemm", lambda: coda.gemm(a, w.T), ref)
        del ref


@coda.epilogue
def swiglu(acc):
    gate, up = coda.pairs(acc)
    return coda.silu(gate) * up


@coda.epilogue
def row_scale(acc, rstd: coda.VecM):
    return acc * rstd


def bench_swiglu(m: int, d: int, ffn: int, modes: list[str]) -> None:
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w_gate = torch.randn(ffn, d, device="cuda", dtype=torch.bfloat16) / d**0.5
    w_up = torch.randn(ffn, d, device="cuda", dtype=torch.bfloat16) / d**0.5
    w_cat = torch.cat([w_gate, w_up])  # standard: gate rows then up rows
    w_il = torch.stack([w_gate, w_up], 1).reshape(2 * ffn, d)  # interleaved rows for coda
    gu = x.float() @ w_cat.float().T
    ref = F.silu(gu[:, :ffn]) * gu[:, ffn:]
    del gu

    def eager():
        g, u = F.linear(x, w_cat).chunk(2, dim=-1)
        return F.silu(g) * u

    n, k = 2 * ffn, d
    record("swiglu", m, n, k, "cublas_gemm", lambda: x @ w_cat.T, None)
    record("swiglu", m, n, k, "coda_gemm", lambda: coda.gemm(x, w_il.T), None)
    record("swiglu", m, n, k, "eager", eager, ref)
    compiled_variants("swiglu", m, n, k, eager, ref, lambda r: r, modes)
    record("swiglu", m, n, k, "coda", lambda: coda.gemm(x, w_il.T, swiglu), ref)


def bench_rmsnorm_gemm(m: int, d: int, n: int, modes: list[str]) -> None:
    eps = 1e-6
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    g = (1 + 0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16)
    w = torch.randn(n, d, device="cuda", dtype=torch.bfloat16) / d**0.5
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    ref = (xf * rstd[:, None] * g.float()) @ w.float().T
    h = (xf * g.float()).to(torch.bfloat16)  # produced upstream by the previous GEMM's epilogue

    def eager():
        return F.linear(F.rms_norm(x, (d,), g, eps), w)

    record("rmsnorm_gemm", m, n, d, "cublas_gemm", lambda: x @ w.T, None)
    record("rmsnorm_gemm", m, n, d, "coda_gemm", lambda: coda.gemm(h, w.T), None)
    record("rmsnorm_gemm", m, n, d, "eager", eager, ref)
    compiled_variants("rmsnorm_gemm", m, n, d, eager, ref, lambda r: r, modes)
    record("rmsnorm_gemm", m, n, d, "coda", lambda: coda.gemm(h, w.T, row_scale, rstd=rstd), ref)


def table(rows: list[dict]) -> str:
    """Markdown: one line per (op, shape) with ms per variant and the BENCH.md ratios."""
    groups: dict[tuple, dict[str, float]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["M"], r["N"], r["K"]), {})[r["variant"]] = r["ms"]
    lines = [
        "| op | M | N | K | cublas_gemm | coda_gemm | eager | compile | coda | coda/coda_gemm | coda_gemm/cublas | eager/coda | compile/coda |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: float | None, p: int = 3) -> str:
        return "-" if x is None else f"{x:.{p}f}"

    for (op, m, n, k), v in groups.items():
        comp = [t for name, t in v.items() if name.startswith("compile_")]
        c = min(comp) if comp else None
        coda_ms = v.get("coda", v.get("coda_gemm") if op == "gemm" else None)
        ratio = lambda x, y: None if x is None or y is None else x / y  # noqa: E731
        lines.append(
            f"| {op} | {m} | {n} | {k} | {f(v.get('cublas_gemm'))} | {f(v.get('coda_gemm'))} | {f(v.get('eager'))} "
            f"| {f(c)} | {f(v.get('coda'))} | {f(ratio(v.get('coda'), v.get('coda_gemm')), 2)} "
            f"| {f(ratio(v.get('coda_gemm'), v.get('cublas_gemm')), 2)} | {f(ratio(v.get('eager'), coda_ms), 2)} "
            f"| {f(ratio(c, coda_ms), 2)} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--name", default="core_first")
    p.add_argument("--quick", action="store_true", help="skip max-autotune compile and the 8192^3 square")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_core.py needs a CUDA GPU")
    modes = ["default"] if args.quick else ["default", "max-autotune-no-cudagraphs"]
    squares = [2048, 4096] if args.quick else [2048, 4096, 8192]
    log(f"GPU {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    torch.manual_seed(0)
    bench_plain([(s, s, s) for s in squares] + [(8192, 16384, 2048), (8192, 2048, 8192), (8192, 3072, 2048)])
    bench_swiglu(8192, 2048, 8192, modes)
    bench_rmsnorm_gemm(8192, 2048, 16384, modes)
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "coda": coda.__version__, "python": platform.python_version(),
        "protocol": "triton.testing.do_bench median (warmup 50 ms, rep 200 ms); bf16 operands; "
                    "each variant checked against an fp32 reference (relative Frobenius error < 2e-2) before timing; "
                    "working sets exceed L2. compile = faster of the compile_* rows. rmsnorm_gemm coda takes h = x*g and "
                    "rstd as inputs (produced by the upstream GEMM epilogue, TRANSFORMER.md section 1).",
        "configs": "coda default config (no autotuning yet): 128x128x64, 8 warps, 4 stages",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": ROWS}, indent=1))
    md = f"# {args.name}\n\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, coda {meta['coda']}.\n\n"
    md += meta["protocol"] + "\n\n" + meta["configs"] + "\n\n" + table(ROWS) + "\n"
    (args.out / f"{args.name}.md").write_text(md)
    log("\n" + table(ROWS))


if __name__ == "__main__":
    main()
