"""Where the time of coda.ops and the block goes, kernel by kernel, on a GPU.

For each op (forward + backward, the bench/ops_block.py shapes at D=2048, FFN=8192,
M=8192) and, beside it, its eager PyTorch version: one warm-up (coda tunes there), then
torch.profiler over a few iterations; per kernel name: launches and device microseconds per
iteration. coda's GEMM kernels are named `coda_<epilogue>`.

    python bench/profile_ops.py --out DIR [--ops rmsnorm_linear,swiglu_mlp,linear_ce,block]
    python bench/profile_ops.py --merge DIR/profile_ops.json --out bench/results   # markdown
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import coda
from coda.models import BlockWeights, block_segment, reference_block_segment
from harness import log, rand

ITERS = 3


def _grad_step(f, params, grad_out=None):
    def step():
        out = f()
        torch.autograd.grad(out, params, grad_out if grad_out is not None else torch.ones_like(out))
    return step


def workloads(m: int, d: int, f: int, v: int) -> dict[str, dict[str, object]]:
    """op -> {variant: a callable running forward + backward once}."""
    x = rand(m, d, grad=True)
    g = (1 + 0.1 * rand(d)).detach().requires_grad_()
    w_n = rand(2 * f, d, scale=d**-0.5, grad=True)
    wg, wu, wd = (rand(f, d, scale=d**-0.5, grad=True), rand(f, d, scale=d**-0.5, grad=True),
                  rand(d, f, scale=f**-0.5, grad=True))
    w_v = rand(v, d, scale=d**-0.5, grad=True)
    t = torch.randint(0, v, (m,), device="cuda")
    heads, kv = 32, 8
    hd = d // heads
    bw = BlockWeights(wo=rand(d, d, scale=d**-0.5, grad=True), g_ffn=g, w_gate=wg, w_up=wu, w_down=wd,
                      g_attn=(1 + 0.1 * rand(d)).detach().requires_grad_(), wq=rand(d, d, scale=d**-0.5, grad=True),
                      wk=rand(kv * hd, d, scale=d**-0.5, grad=True), wv=rand(kv * hd, d, scale=d**-0.5, grad=True),
                      n_heads=heads, n_kv_heads=kv)
    attn = rand(m, d, grad=True)
    pos = torch.arange(m, device="cuda") % 4096
    block_params = (attn, x) + bw.tensors()
    n_qkv = (heads + 2 * kv) * hd
    go_block = rand(m, d + n_qkv)

    def block(impl):
        def run():
            x2, qkv = impl(attn, x, pos, bw)
            return torch.cat([x2, qkv], -1)
        return run

    return {
        "rmsnorm_linear": {
            "coda": _grad_step(lambda: coda.ops.rmsnorm_linear(x, g, w_n), (x, g, w_n)),
            "eager": _grad_step(lambda: F.linear(F.rms_norm(x, (d,), g, 1e-6), w_n), (x, g, w_n)),
        },
        "swiglu_mlp": {
            "coda": _grad_step(lambda: coda.ops.swiglu_mlp(x, wg, wu, wd), (x, wg, wu, wd)),
            "eager": _grad_step(lambda: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd), (x, wg, wu, wd)),
        },
        "linear_ce": {
            "coda": _grad_step(lambda: coda.ops.linear_cross_entropy(x, w_v, t), (x, w_v)),
            "eager": _grad_step(lambda: F.cross_entropy(F.linear(x, w_v).float(), t), (x, w_v)),
        },
        "block": {
            "coda": _grad_step(block(block_segment), block_params, go_block),
            "eager": _grad_step(block(reference_block_segment), block_params, go_block),
        },
    }


def kernel_table(step) -> list[dict]:
    """Per kernel name: launches and device microseconds per iteration, slowest first."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if us > 0:
            rows.append({"kernel": e.key, "calls": e.count / ITERS, "us": us / ITERS})
    return sorted(rows, key=lambda r: -r["us"])


def in_place_vs_fresh(m: int = 8192, d: int = 2048, k: int = 16384) -> dict[str, float]:
    """The RMSNorm-backward GEMM with the residual gradient (the block's largest), timed writing
    dx over its `grad` operand (out=grad) and into a fresh tensor: the block profile showed this
    kernel far slower in the block (in place) than when tuned (fresh scratch outputs)."""
    import triton

    from coda.ops import epilogues as E

    dz, w = rand(m, k), rand(k, d, scale=k**-0.5)
    x, grad = rand(m, d), rand(m, d)
    ops = dict(x=x, norm_weight=(1 + 0.1 * rand(d)), rstd=torch.rand(m, device="cuda") + 0.5,
               zdz_over_d=torch.randn(m, device="cuda"))
    ep = E.rmsnorm_backward_residual
    fresh = torch.empty_like(grad)
    times = {
        "fresh": triton.testing.do_bench(lambda: coda.gemm(dz, w, ep, out={"dx": fresh}, grad=grad, **ops),
                                         return_mode="median"),
        "in_place": triton.testing.do_bench(lambda: coda.gemm(dz, w, ep, out={"dx": grad}, grad=grad, **ops),
                                            return_mode="median"),
        "plain_gemm": triton.testing.do_bench(lambda: coda.gemm(dz, w), return_mode="median"),
        "cublas": triton.testing.do_bench(lambda: dz @ w, return_mode="median"),
    }
    log("== rmsnorm_backward_residual M=%d N=%d K=%d: " % (m, d, k) + ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()))
    return times


def markdown(result: dict, note: str | None) -> str:
    """Per op and variant: total kernel time and the kernels over 1% of it."""
    lines = ["# profile_ops", "", "Device time per forward+backward, kernel by kernel (torch.profiler, mean of "
             f"{ITERS} iterations after a warm-up), D=2048, FFN=8192, M=8192, V=128256. Produced by "
             "`bench/profile_ops.py`.", ""]
    if note:
        lines += [note, ""]
    for key, rows in result.items():
        if not isinstance(rows, list):
            lines += [f"## {key}", "", ", ".join(f"{n}: {t:.3f} ms" for n, t in rows.items()), ""]
            continue
        total = sum(r["us"] for r in rows)
        lines += [f"## {key}: {total / 1e3:.3f} ms of kernels", "", "| ms | launches | kernel |", "|---|---|---|"]
        lines += [f"| {r['us'] / 1e3:.3f} | {r['calls']:g} | `{r['kernel'][:80]}` |" for r in rows if r["us"] > 0.01 * total]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="rmsnorm_linear,swiglu_mlp,linear_ce,block")
    p.add_argument("--out", type=Path, default=Path("/tmp/coda-profile"))
    p.add_argument("--merge", type=Path, help="write <out>/profile_ops.{json,md} from a measured JSON")
    p.add_argument("--note", help="with --merge: a line for the page (e.g. which commit was measured)")
    args = p.parse_args()
    if args.merge:
        result = json.loads(args.merge.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_ops.json").write_text(json.dumps(result, indent=1))
        (args.out / "profile_ops.md").write_text(markdown(result, args.note))
        return
    if not torch.cuda.is_available():
        sys.exit("profile_ops.py profiles on a CUDA GPU")
    torch.manual_seed(0)
    work = workloads(8192, 2048, 8192, 128256)
    result = {}
    for op in args.ops.split(","):
        for variant, step in work[op].items():
            rows = kernel_table(step)
            result[f"{op}/{variant}"] = rows
            log(f"== {op} {variant}: {sum(r['us'] for r in rows) / 1e3:.3f} ms of kernels per fwd+bwd")
            for r in rows[:14]:
                log(f"   {r['us'] / 1e3:8.3f} ms  x{r['calls']:<4g} {r['kernel'][:90]}")
    result["rmsnorm_backward_residual_in_place_vs_fresh_ms"] = in_place_vs_fresh()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_ops.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
