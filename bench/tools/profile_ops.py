"""Where the time of coda.ops and the block goes, kernel by kernel, on a GPU.

For each op (forward + backward, the bench/ops_block.py shapes at D=2048, FFN=8192,
M=8192) and, beside it, its eager PyTorch version: one warm-up (coda compiles there, and tunes
under CODA_AUTOTUNE=1), then torch.profiler over a few iterations; per kernel name: launches and
device microseconds per iteration. coda's GEMM kernels are named `coda_<epilogue>`. Then, per op, the host time to
enqueue a step beside its wall time (does the GPU wait for Python?), and the LM-head GEMM at
each row-group size (GROUP_M) beside cuBLAS.

    python bench/tools/profile_ops.py --out DIR [--ops rmsnorm_linear,swiglu_mlp,linear_ce,block]
    python bench/tools/profile_ops.py --merge DIR/profile_ops.json --out bench/results   # markdown
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared harness

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import coda
from coda.models import BlockWeights, NativeBlockWeights, block_segment, reference_block_segment
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

    nbw = NativeBlockWeights.from_standard(bw).leaves()  # coda's layouts, stored: no per-call copies

    def block(impl, weights=bw):
        def run():
            x2, qkv = impl(attn, x, pos, weights)
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
            "coda_native": _grad_step(block(block_segment, nbw), (attn, x) + nbw.tensors(), go_block),
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


def host_and_wall(step, iters: int = 5) -> dict[str, float]:
    """Host ms to enqueue one forward+backward (until step() returns) and wall ms until the GPU
    is done. Host close to wall means the GPU waited for Python: a kernel sum below wall is then
    launch overhead, not device work."""
    step()
    torch.cuda.synchronize()
    host = wall = 0.0
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host += t1 - t0
        wall += time.perf_counter() - t0
    return {"host": host / iters * 1e3, "wall": wall / iters * 1e3}


def idle_gaps(step, top: int = 6) -> dict:
    """Where the GPU waits inside one forward+backward: the gaps between consecutive device
    activities, each with the lag of its launch call behind the previous activity's end (lag > 0:
    the host was late, the gap is host time) and the innermost host op that made the call. The
    profiler's own host overhead (CPU activity on) widens the gaps somewhat."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = [e for e in json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
    calls = {e["args"]["correlation"]: e for e in events
             if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    host_ops = [e for e in events if e.get("cat") == "cpu_op"]

    def innermost(call: dict) -> str:
        around = [o for o in host_ops if o["tid"] == call["tid"] and o["ts"] <= call["ts"] <= o["ts"] + o["dur"]]
        return max(around, key=lambda o: o["ts"])["name"] if around else "?"

    gaps = []
    for prev, cur in zip(device, device[1:]):
        end = prev["ts"] + prev["dur"]
        if cur["ts"] - end <= 0:
            continue
        call = calls.get(cur.get("args", {}).get("correlation"))
        gaps.append({"us": cur["ts"] - end, "lag_us": None if call is None else call["ts"] - end,
                     "next": cur["name"][:70], "host_op": "?" if call is None else innermost(call)[:70]})
    return {"idle_ms": sum(g["us"] for g in gaps) / 1e3,
            "span_ms": (device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]) / 1e3 if device else 0.0,
            "top": sorted(gaps, key=lambda g: -g["us"])[:top]}


def row_groups(m: int = 8192, d: int = 2048, v: int = 128256) -> dict[str, float]:
    """The LM-head GEMM (plain, and with the statistics epilogue, weight [V, D]) at the tile coda picks
    (tuned under CODA_AUTOTUNE=1, else the default) with each GROUP_M, beside cuBLAS: with the tile order grouping GROUP_M row tiles, the 0.5 GB weight
    is read from memory m / (BLOCK_M * GROUP_M) times."""
    import triton

    from coda.ops import epilogues as E
    from coda.runtime import run
    from coda.runtime.launch import chosen_config, graph_of

    x, w = rand(m, d), rand(v, d, scale=d**-0.5)
    t = torch.randint(0, v, (m,), device="cuda")
    times = {"cublas": triton.testing.do_bench(lambda: x @ w.T, return_mode="median")}
    for label, ep, ops in (("plain", None, {}), ("lm_head_stats", E.lm_head(torch.bfloat16), {"target": t})):
        graph = graph_of(ep)
        coda.gemm(x, w.T, ep, **ops)  # picks the config (tunes under CODA_AUTOTUNE=1)
        base = chosen_config(graph, x, w.T, ops)
        for g in (4, 8, 16, 32, 64):
            cfg = base.model_copy(update={"group_m": g})
            times[f"{label} group{g}{' (tuned)' if g == base.group_m else ''}"] = triton.testing.do_bench(
                lambda: run(graph, x, w.T, ops, config=cfg), return_mode="median")
    log("== LM-head GEMM M=%d V=%d D=%d by GROUP_M: " % (m, v, d) + ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()))
    return times


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def markdown(result: dict, note: str | None) -> str:
    """Per op and variant: total kernel time and the kernels over 1% of it."""
    lines = ["# profile_ops", "", "Device time per forward+backward, kernel by kernel (torch.profiler, mean of "
             f"{ITERS} iterations after a warm-up), D=2048, FFN=8192, M=8192, V=128256. Produced by "
             "`bench/tools/profile_ops.py`.", ""]
    if note:
        lines += [note, ""]
    for key, rows in result.items():
        if key == "idle_gaps":
            lines += ["## idle_gaps", "", "GPU idle time inside one profiled forward+backward (CPU activity on), and the "
                      "largest gaps: lag = launch call after the previous kernel's end (> 0: the host was late); launched "
                      "from = the innermost host op around the launch call (GeneratedBackwardFor_X is custom op X's "
                      "autograd wrapper running X forward).", ""]
            for op, g in rows.items():
                lines += [f"### {op}: {g['idle_ms']:.3f} ms idle of {g['span_ms']:.3f} ms", "",
                          "| gap us | lag us | next on the GPU | launched from |", "|---|---|---|---|"]
                lines += [f"| {t['us']:.0f} | {_us(t['lag_us'])} | `{t['next']}` | `{t['host_op']}` |" for t in g["top"]]
                lines.append("")
            continue
        if isinstance(rows, dict) and all(isinstance(t, dict) for t in rows.values()):
            lines += [f"## {key}", "", "| op | kernels ms | host ms | wall ms |", "|---|---|---|---|"]
            lines += [f"| {op} | {t['kernels']:.3f} | {t['host']:.3f} | {t['wall']:.3f} |" for op, t in rows.items()]
            lines.append("")
            continue
        if isinstance(rows, dict):
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
    timing = {}
    gaps = {}
    for op in args.ops.split(","):
        for variant, step in work[op].items():
            rows = kernel_table(step)
            result[f"{op}/{variant}"] = rows
            kernels = sum(r["us"] for r in rows) / 1e3
            timing[f"{op}/{variant}"] = {"kernels": kernels, **host_and_wall(step)}
            gaps[f"{op}/{variant}"] = idle_gaps(step)
            log(f"== {op} {variant}: {kernels:.3f} ms of kernels per fwd+bwd; host {timing[f'{op}/{variant}']['host']:.3f} ms, "
                f"wall {timing[f'{op}/{variant}']['wall']:.3f} ms")
            for r in rows[:14]:
                log(f"   {r['us'] / 1e3:8.3f} ms  x{r['calls']:<4g} {r['kernel'][:90]}")
            g = gaps[f"{op}/{variant}"]
            log(f"   idle {g['idle_ms']:.3f} ms of {g['span_ms']:.3f} ms; largest gaps (us, launch lag us, next, host op):")
            for t in g["top"]:
                log(f"     {t['us']:7.1f} {_us(t['lag_us']):>8} {t['next'][:50]:50s} {t['host_op'][:50]}")
    result["host_and_wall_ms"] = timing
    result["idle_gaps"] = gaps
    result["lm_head_gemm_by_group_m_ms"] = row_groups()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_ops.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
