"""The `coda` command: `demo` (a fused RMSNorm + SwiGLU GEMM pair, checked and, on a GPU,
timed) and `tune` (pre-tune epilogues for given shapes).

It runs docs/ALGEBRA.md sections 1-2 on one MLP input: a producer GEMM (the
attention output projection) whose epilogue adds the residual, stores h = x * g and
the per-row sum of squares; then the gate/up GEMM whose epilogue applies the RMSNorm
row scale and SwiGLU. It prints the IR, compares against both the fp32 oracle and an
unfused standard-layout PyTorch implementation, and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch
import torch.nn.functional as F

import coda


@coda.epilogue
def residual_norm_stats(acc, residual: coda.Tile, norm_weight: coda.VecN):
    """x = attn_out @ Wo.T + residual; h = x * g (the next GEMM's input); sum of x^2 per row."""
    x = acc + residual
    return {"x": x, "h": x * norm_weight, "sumsq": coda.reduce_n(x * x, "sum")}


@coda.epilogue
def rms_swiglu(acc, rstd: coda.VecM):
    """Row-scale by rstd (the RMSNorm), then SwiGLU over interleaved gate/up columns."""
    z = acc * rstd
    gate, up = coda.pairs(z)
    return {"z": z, "y": coda.silu(gate) * up}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def demo(gpu: bool, m: int, d: int, ffn: int, eps: float = 1e-6) -> bool:
    dev, dt = ("cuda" if gpu else "cpu"), torch.bfloat16
    torch.manual_seed(0)
    attn = torch.randn(m, d, device=dev).to(dt)
    w_o = (torch.randn(d, d, device=dev) / d**0.5).to(dt)
    x0 = torch.randn(m, d, device=dev).to(dt)
    g = (1 + 0.1 * torch.randn(d, device=dev)).to(dt)
    w_gate = (torch.randn(ffn, d, device=dev) / d**0.5).to(dt)
    w_up = (torch.randn(ffn, d, device=dev) / d**0.5).to(dt)
    w_gu = torch.stack([w_gate, w_up], dim=1).reshape(2 * ffn, d)  # rows g0, u0, g1, u1, ...

    print(f"coda demo on {'the GPU' if gpu else 'the CPU (Triton interpreter)'}: M={m} D={d} FFN={ffn}, bf16")
    print("\n" + str(residual_norm_stats.graph) + "\n\n" + str(rms_swiglu.graph) + "\n")

    def fused() -> tuple[dict, dict, torch.Tensor]:
        p = coda.gemm(attn, w_o.T, residual_norm_stats, residual=x0, norm_weight=g)
        rstd = torch.rsqrt(p["sumsq"] / d + eps)  # the tiny finalize
        return p, coda.gemm(p["h"], w_gu.T, rms_swiglu, rstd=rstd), rstd

    def unfused() -> torch.Tensor:
        x = F.linear(attn, w_o) + x0
        hn = F.rms_norm(x, (d,), g, eps)
        return F.silu(F.linear(hn, w_gate)) * F.linear(hn, w_up)

    t0 = time.time()
    p, c, rstd = fused()
    print(f"fused run (first call JIT-generates both kernels): {time.time() - t0:.1f} s")

    checks = []
    ref_p = residual_norm_stats.reference(attn, w_o.T, residual=x0, norm_weight=g)
    ref_c = rms_swiglu.reference(p["h"], w_gu.T, rstd=rstd)
    for name, out, ref in (("x", p["x"], ref_p["x"]), ("h", p["h"], ref_p["h"]), ("sumsq", p["sumsq"], ref_p["sumsq"]),
                           ("z", c["z"], ref_c["z"]), ("y", c["y"], ref_c["y"])):
        limit = 1e-5 if out.dtype == torch.float32 else 8e-3  # fp32 partial sums / one bf16 rounding
        checks.append((f"{name} vs fp32 oracle", _rel(out, ref), limit))
    # Standard layout, fp32 math on the same bf16 inputs: only bf16 roundings differ.
    xf = attn.float() @ w_o.float().T + x0.float()
    hn = F.rms_norm(xf, (d,), g.float(), eps)
    y_std = F.silu(hn @ w_gate.float().T) * (hn @ w_up.float().T)
    checks.append(("y vs unfused PyTorch (fp32)", _rel(c["y"], y_std), 3e-2))
    ok = True
    for name, err, limit in checks:
        good = err < limit
        ok &= good
        print(f"  {'ok  ' if good else 'FAIL'} {name:32s} relative error {err:.2e} (limit {limit:.0e})")

    if gpu:
        import triton

        ms_f = triton.testing.do_bench(fused, return_mode="median")
        ms_u = triton.testing.do_bench(unfused, return_mode="median")
        print(f"\n  fused (2 coda GEMMs + finalize): {ms_f:.3f} ms   unfused PyTorch eager: {ms_u:.3f} ms   "
              f"speedup {ms_u / ms_f:.2f}x")
    print("\nPASS" if ok else "\nFAIL")
    return ok


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_epilogue(target: str) -> coda.Epilogue | None:
    """`plain` (no epilogue) or `package.module:name` naming a @coda.epilogue."""
    if target == "plain":
        return None
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"coda tune: {target!r} is not 'plain' or 'module:epilogue'")
    ep = getattr(importlib.import_module(module_name), attr, None)
    if not isinstance(ep, coda.Epilogue):
        raise SystemExit(f"coda tune: {target} is not a @coda.epilogue (got {type(ep).__name__})")
    return ep


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"coda tune: --shape takes M,N,K (three integers), got {text!r}") from None
    return m, n, k


def tune_command(targets: list[str], shapes: list[str], dtype: str, ints: list[str], force: bool) -> int:
    """Pre-tune epilogues on given shapes: run each once so the autotuner fills its cache."""
    if coda.runtime.interpreting():
        print("coda tune: tuning needs a CUDA GPU (kernels here run in Triton's interpreter)", file=sys.stderr)
        return 2
    # The command exists to tune: CODA_AUTOTUNE=0 (skip tuning) would make it a silent no-op.
    os.environ["CODA_AUTOTUNE"] = "force" if force else "1"
    dt = _DTYPES[dtype]
    for target in targets:
        ep = load_epilogue(target)
        graph = coda.runtime.graph_of(ep)
        for m, n, k in map(parse_shape, shapes):
            a = torch.randn(m, k, device="cuda").to(dt)
            w = torch.randn(n, k, device="cuda").to(dt)
            ops = {}
            for s in graph.operands:
                cols = int(n * s.frac_width)
                if s.name in ints:
                    size = {"scalar": (), "vec_m": (m,), "vec_n": (cols,), "tile": (m, cols)}[s.kind.value]
                    ops[s.name] = torch.randint(0, n, size, device="cuda")
                elif s.kind.value == "scalar":
                    ops[s.name] = 1.0
                elif s.kind.value == "vec_m":
                    ops[s.name] = torch.rand(m, device="cuda")
                elif s.kind.value == "vec_n":
                    ops[s.name] = torch.rand(cols, device="cuda").to(dt)
                else:
                    ops[s.name] = torch.randn(m, cols, device="cuda").to(dt)
            coda.gemm(a, w.T, ep, **ops)
            torch.cuda.synchronize()
            cfg = coda.runtime.launch.chosen_config(graph, a, w.T, ops)
            print(f"{target} M={m} N={n} K={k} {dtype}: {cfg.model_dump() if cfg else 'default'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coda", description="coda command line")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the fused RMSNorm + SwiGLU demo and check it against the reference")
    d.add_argument("--m", type=int, help="tokens (default 96 on CPU, 8192 on GPU)")
    d.add_argument("--d", type=int, help="model width (default 64 on CPU, 2048 on GPU)")
    d.add_argument("--ffn", type=int, help="MLP width (default 80 on CPU, 8192 on GPU)")
    t = sub.add_parser("tune", help="pre-tune epilogues for given shapes (GPU only; fills the tuning cache)")
    t.add_argument("targets", nargs="+", help="'plain' or module:epilogue (a @coda.epilogue object)")
    t.add_argument("--shape", action="append", required=True, help="M,N,K (repeatable); b is an nn.Linear weight view")
    t.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    t.add_argument("--int", dest="ints", action="append", default=[], help="operand to fill with integer ids in [0, N)")
    t.add_argument("--force", action="store_true", help="retune even when a cached winner exists")
    args = parser.parse_args(argv)
    if args.command == "tune":
        return tune_command(args.targets, args.shape, args.dtype, args.ints, args.force)
    gpu = not coda.runtime.interpreting()
    m = args.m or (8192 if gpu else 96)
    dm = args.d or (2048 if gpu else 64)
    ffn = args.ffn or (8192 if gpu else 80)
    return 0 if demo(gpu, m, dm, ffn) else 1


if __name__ == "__main__":
    sys.exit(main())
