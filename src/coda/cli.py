"""The `coda` command: `demo` (a fused RMSNorm + SwiGLU GEMM pair, checked and, on a GPU,
timed), `tune` (tune ahead of time: epilogues on given shapes, or a model's training step;
coda.pretune) and `--version`. Arguments are checked as they are parsed: a bad one is a
one-line error and exit status 2.

The demo runs docs/ALGEBRA.md sections 1-2 on one MLP input: a producer GEMM (the
attention output projection) whose epilogue adds the residual, stores h = x * g and
the per-row sum of squares; then the gate/up GEMM whose epilogue applies the RMSNorm
row scale and SwiGLU. It prints the IR, compares against both the fp32 oracle and an
unfused standard-layout PyTorch implementation, and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import NoReturn

import torch
import torch.nn.functional as F

import coda
from coda import pretune


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


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def shape(text: str) -> tuple[int, int, int]:
    """M,N,K: three positive integers."""
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"takes M,N,K (three positive integers), got {text!r}")
    try:
        return tuple(positive_int(p.strip()) for p in parts)  # type: ignore[return-value]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"takes M,N,K (three positive integers), got {text!r}") from None


def setting(text: str) -> tuple[str, object]:
    """key=value; the value as JSON where it parses (numbers, true/false, objects), else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"takes key=value, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="coda", description="coda command line")
    p.add_argument("--version", action="version", version=f"%(prog)s {coda.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the fused RMSNorm + SwiGLU demo and check it against the reference")
    d.add_argument("--m", type=positive_int, help="tokens (default 96 on CPU, 8192 on GPU)")
    d.add_argument("--d", type=positive_int, help="model width (default 64 on CPU, 2048 on GPU)")
    d.add_argument("--ffn", type=positive_int, help="MLP width (default 80 on CPU, 8192 on GPU)")
    t = sub.add_parser(
        "tune", help="tune ahead of time (GPU only; fills the tuning cache that CODA_AUTOTUNE=1 reads)",
        description="Either epilogues on given shapes (coda tune plain mod:epilogue --shape M,N,K), or every GEMM "
                    "of a model's training step (coda tune --hf-config LlamaConfig --set hidden_size=2048 ... "
                    "--batch 2 --seq 4096).")
    t.add_argument("targets", nargs="*", help="'plain' or module:epilogue (a @coda.epilogue object)")
    t.add_argument("--shape", type=shape, action="append", default=[],
                   help="M,N,K (repeatable); b is an nn.Linear weight view")
    t.add_argument("--dtype", choices=sorted(pretune.DTYPES), help="the epilogues' inputs (default bf16)")
    t.add_argument("--int", dest="ints", action="append", default=[], help="operand to fill with integer ids in [0, N)")
    t.add_argument("--hf-config", help="a transformers config.json (or its directory), or a config class name "
                                       "such as LlamaConfig: tune the coda model of that shape")
    t.add_argument("--set", dest="overrides", type=setting, action="append", default=[],
                   help="key=value: a config field (repeatable; the value as JSON where it parses)")
    t.add_argument("--batch", type=positive_int, help="sequences per step (with --hf-config)")
    t.add_argument("--seq", type=positive_int, help="tokens per sequence (with --hf-config)")
    t.add_argument("--force", action="store_true", help="retune even when a cached entry exists")
    return p


def _tune(args: argparse.Namespace) -> list[str]:
    """What `coda tune` was asked, checked (a TuneError says what is wrong), then done."""
    if args.hf_config is not None:
        if args.targets or args.shape or args.dtype or args.ints:
            raise pretune.TuneError("--hf-config tunes a model (bf16): give no epilogues, --shape, --dtype or --int "
                                    "with it")
        if args.batch is None or args.seq is None:
            raise pretune.TuneError("--hf-config needs --batch and --seq (the training step's shape)")
        pretune.require_gpu()  # before reading the config: importing transformers takes seconds
        model = pretune.model_shape(pretune.hf_config(args.hf_config, dict(args.overrides)))
        return pretune.tune_model(model, args.batch, args.seq, args.force)
    if not args.targets or not args.shape:
        raise pretune.TuneError("give epilogues and --shape M,N,K, or --hf-config with --batch and --seq")
    if args.overrides or args.batch is not None or args.seq is not None:
        raise pretune.TuneError("--set, --batch and --seq go with --hf-config")
    return pretune.tune_epilogues(args.targets, args.shape, args.dtype or "bf16", args.ints, args.force)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "tune":
        try:
            lines = _tune(args)
        except pretune.TuneError as exc:
            print(f"coda tune: error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0
    gpu = not coda.runtime.interpreting()
    m = args.m if args.m is not None else (8192 if gpu else 96)
    dm = args.d if args.d is not None else (2048 if gpu else 64)
    ffn = args.ffn if args.ffn is not None else (8192 if gpu else 80)
    return 0 if demo(gpu, m, dm, ffn) else 1


if __name__ == "__main__":
    sys.exit(main())
