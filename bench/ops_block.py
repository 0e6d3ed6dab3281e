"""coda.ops and the section-7 block on a GPU, forward and forward+backward (the benchmark protocol in docs/DESIGN.md).

Per op and shape, variants:
  gemms    the op's bare cuBLAS GEMMs, each timed alone and summed (its speed of light)
  eager    the standard PyTorch implementation (what coda.ops is a drop-in for)
  compile  torch.compile of eager (default mode)
  liger    Liger-Kernel's equivalent where it has one (fused linear cross-entropy; the
           block with Liger's RMSNorm, SiLU-mul and RoPE kernels around cuBLAS GEMMs)
  coda     coda.ops / coda.models
Every variant's outputs and gradients are checked against an fp32 reference first.

    python bench/ops_block.py --out DIR [--ops rmsnorm_linear,swiglu_mlp,linear_ce,linear_ce_options,block]
    python bench/ops_block.py --merge DIR/ops_block.json --out bench/results
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import coda
from coda.models import BlockWeights, NativeBlockWeights, block_segment, qkv_to_standard, reference_block_segment
import harness
from harness import NOTES, ROWS, by_shape, fastest_compile, log, rand, ratio, record, rel_err

OPS = ("rmsnorm_linear", "swiglu_mlp", "linear_ce", "linear_ce_options", "block")


def max_err(outs, refs) -> float:
    return max(rel_err(o, r) for o, r in zip(outs, refs))


def fwd_bwd(f, params, grad_out=None):
    """A callable running f forward and backward; returns (output, *grads). f may return a tuple of
    outputs; grad_out is then the tuple of their gradients."""
    def run():
        out = f()
        go = grad_out if grad_out is not None else torch.ones_like(out)
        return (out, *torch.autograd.grad(out, params, go))
    return run


def joined(result: tuple) -> tuple:
    """A block step's (x2, qkv), *grads as its fp32 reference has them: the two outputs in one
    tensor. The steps themselves return them apart, so that no timed step pays for a copy that
    the block does not make (and that SoL does not have)."""
    (x2, qkv), *grads = result
    return (torch.cat([x2, qkv], -1), *grads)


def sol_replay(shapes: list[tuple[int, int, int]]):
    """The block's speed of light: its bare cuBLAS GEMMs (M, N, K) back to back, captured once in one
    CUDA graph (warmed up outside capture); the graph's replay."""
    pairs = [(rand(mm, k), rand(n, k, scale=k**-0.5)) for mm, n, k in shapes]
    return harness.graphed(lambda: [a @ w.T for a, w in pairs])


def block_steps(case: dict) -> dict[str, tuple]:
    """(step, check) of each variant of a block_case: coda_native and every entry of its impls
    (eager, coda, liger where installed), forward+backward; check(result) is the error vs fp32."""
    refs = (case["ref"], *case["refg"])
    steps = {"coda_native": (fwd_bwd(case["ours_native"], case["native_params"], case["go"]), case["native_error"])}
    for name, impl in case["impls"].items():
        steps[name] = (fwd_bwd(impl, case["params"], case["go"]), lambda result: max_err(joined(result), refs))
    return steps


def gemms_sum(op: str, shape, shapes: list[tuple[int, int, int]]) -> None:
    """The speed of light: each bare GEMM (M, N, K) of the op timed with cuBLAS, summed."""
    total = 0.0
    for m, n, k in shapes:
        a, b = rand(m, k), rand(n, k, scale=k**-0.5)  # scaled like the ops' weights (cuBLAS's speed varies with data)
        total += harness.timed(lambda: a @ b.T)
    ROWS.append({"op": op, "M": shape[0], "N": shape[1], "K": shape[2], "variant": "gemms", "ms": total,
                 "gemms": [list(s) for s in shapes]})
    log(f"  {op:24s} gemms (sum of {len(shapes)} cuBLAS) {total:8.4f} ms")


def variants(op: str, shape, impls: dict, params_of, ref_out, ref_grads, grad_out, compile_modes=("default",),
             join=lambda out: out):
    """Forward-only and forward+backward rows for each implementation; `join(output)` is what the
    reference output is compared with (the block's two outputs in one tensor)."""
    for name, f in impls.items():
        params = params_of(name)
        record(f"{op}_fwd", shape, name, f, lambda r: rel_err(join(r), ref_out))
        record(f"{op}_fwdbwd", shape, name, fwd_bwd(f, params, grad_out),
               lambda r: max_err((join(r[0]), *r[1:]), (ref_out, *ref_grads)))
    for mode in compile_modes:
        cf = torch.compile(impls["eager"]) if mode == "default" else torch.compile(impls["eager"], mode=mode)
        record(f"{op}_fwd", shape, f"compile_{mode}", cf, lambda r: rel_err(join(r), ref_out))
        record(f"{op}_fwdbwd", shape, f"compile_{mode}", fwd_bwd(cf, params_of("eager"), grad_out),
               lambda r: max_err((join(r[0]), *r[1:]), (ref_out, *ref_grads)))
        torch._dynamo.reset()


def fp32_reference(f, leaves, grad_out=None):
    """Output and gradients of f on fp32 copies of the leaves."""
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    out = f(*f32)
    go = grad_out.float() if grad_out is not None else torch.ones_like(out)
    return out.detach(), [g.detach() for g in torch.autograd.grad(out, f32, go)]


def bench_rmsnorm_linear(m: int, d: int, n: int) -> None:
    x, g, w = rand(m, d, grad=True), (1 + 0.1 * rand(d)).detach().requires_grad_(), rand(n, d, scale=d**-0.5, grad=True)
    eager = lambda x=x, g=g, w=w: F.linear(F.rms_norm(x, (d,), g, 1e-6), w)  # noqa: E731
    ours = lambda: coda.ops.rmsnorm_linear(x, g, w)  # noqa: E731
    dy = rand(m, n)
    ref, refg = fp32_reference(lambda x, g, w: F.linear(F.rms_norm(x, (d,), g, 1e-6), w), (x, g, w), dy)
    shape = (m, n, d)
    gemms_sum("rmsnorm_linear_fwd", shape, [(m, n, d)])
    gemms_sum("rmsnorm_linear_fwdbwd", shape, [(m, n, d), (m, d, n), (n, d, m)])
    variants("rmsnorm_linear", shape, {"eager": eager, "coda": ours}, lambda _: (x, g, w), ref, refg, dy)


def bench_swiglu_mlp(m: int, d: int, f: int) -> None:
    x = rand(m, d, grad=True)
    wg, wu, wd = rand(f, d, scale=d**-0.5, grad=True), rand(f, d, scale=d**-0.5, grad=True), rand(d, f, scale=f**-0.5, grad=True)

    def std(x, wg, wu, wd):
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    params = (x, wg, wu, wd)
    dout = rand(m, d)
    ref, refg = fp32_reference(std, params, dout)
    impls = {"eager": lambda: std(*params), "coda": lambda: coda.ops.swiglu_mlp(*params)}
    lg = _liger()
    if lg is not None:
        impls["liger"] = lambda: F.linear(lg.swiglu.LigerSiLUMulFunction.apply(F.linear(x, wg), F.linear(x, wu)), wd)
    shape = (m, d, f)
    gemms_sum("swiglu_mlp_fwd", shape, [(m, 2 * f, d), (m, d, f)])
    gemms_sum("swiglu_mlp_fwdbwd", shape, [(m, 2 * f, d), (m, d, f), (m, f, d), (d, f, m), (m, d, 2 * f), (2 * f, d, m)])
    variants("swiglu_mlp", shape, impls, lambda _: params, ref, refg, dout)


def bench_linear_ce(m: int, d: int, v: int) -> None:
    x, w = rand(m, d, grad=True), rand(v, d, scale=d**-0.5, grad=True)
    t = torch.randint(0, v, (m,), device=harness.DEVICE)
    t[::97] = -100

    def std(x, w):
        return F.cross_entropy(F.linear(x, w).float(), t)

    ref, refg = fp32_reference(std, (x, w))
    impls = {"eager": lambda: std(x, w), "coda": lambda: coda.ops.linear_cross_entropy(x, w, t)}
    lg = _liger()
    if lg is not None:
        def liger_ce():
            out = lg.fused_linear_cross_entropy.LigerFusedLinearCrossEntropyFunction.apply(x, w, t)
            return out[0] if isinstance(out, tuple) else out
        impls["liger"] = liger_ce
    shape = (m, v, d)
    gemms_sum("linear_ce_fwd", shape, [(m, v, d)])
    gemms_sum("linear_ce_fwdbwd", shape, [(m, v, d), (m, d, v), (v, d, m)])
    variants("linear_ce", shape, impls, lambda _: (x, w), ref, refg, None)


CE_OPTIONS = {"label_smoothing": 0.1, "lse_square_scale": 1e-4, "softcap": 30.0}  # PaLM's z-loss, Gemma 2's cap


def bench_linear_ce_options(m: int, d: int, v: int) -> None:
    """linear_ce with every option of linear_cross_entropy set (CE_OPTIONS): their cost beside
    the plain rows. No Liger row: its options' signature differs between its releases."""
    x, w = rand(m, d, grad=True), rand(v, d, scale=d**-0.5, grad=True)
    t = torch.randint(0, v, (m,), device=harness.DEVICE)
    t[::97] = -100
    cap, eps, z_scale = CE_OPTIONS["softcap"], CE_OPTIONS["label_smoothing"], CE_OPTIONS["lse_square_scale"]

    def std(x, w):
        z = cap * torch.tanh(F.linear(x, w).float() / cap)
        valid = t != -100
        z_loss = torch.where(valid, torch.logsumexp(z, -1) ** 2, 0.0).sum() / valid.sum()
        return F.cross_entropy(z, t, label_smoothing=eps) + z_scale * z_loss

    ref, refg = fp32_reference(std, (x, w))
    impls = {"eager": lambda: std(x, w), "coda": lambda: coda.ops.linear_cross_entropy(x, w, t, **CE_OPTIONS)}
    shape = (m, v, d)
    gemms_sum("linear_ce_options_fwd", shape, [(m, v, d)])
    gemms_sum("linear_ce_options_fwdbwd", shape, [(m, v, d), (m, d, v), (v, d, m)])
    variants("linear_ce_options", shape, impls, lambda _: (x, w), ref, refg, None)


WIDTHS = {2048: 8192, 4096: 14336}  # the block's benchmarked widths, D -> FFN


def block_case(m: int, d: int, f: int, heads: int = 32, kv: int = 8) -> dict:
    """The block's inputs, implementations and fp32 checks (shared with bench/block_kernels.py)."""
    hd = d // heads

    def p(*shape, s=1.0):
        return rand(*shape, scale=s, grad=True)

    w = BlockWeights(wo=p(d, heads * hd, s=d**-0.5), g_ffn=(1 + 0.1 * rand(d)).detach().requires_grad_(),
                     w_gate=p(f, d, s=d**-0.5), w_up=p(f, d, s=d**-0.5), w_down=p(d, f, s=f**-0.5),
                     g_attn=(1 + 0.1 * rand(d)).detach().requires_grad_(), wq=p(heads * hd, d, s=d**-0.5),
                     wk=p(kv * hd, d, s=d**-0.5), wv=p(kv * hd, d, s=d**-0.5), n_heads=heads, n_kv_heads=kv)
    attn, x0 = p(m, heads * hd), p(m, d)
    pos = torch.arange(m, device=harness.DEVICE) % 4096
    params = (attn, x0) + w.tensors()
    n_qkv = (heads + 2 * kv) * hd

    def eager():
        return reference_block_segment(attn, x0, pos, w)

    def ours():
        x2, qkv = block_segment(attn, x0, pos, w)
        return x2, qkv_to_standard(qkv, w)  # the un-permute is for checking only

    # what a model storing coda's layouts runs: native weights (their own leaves) in, the qkv order
    # attention takes out; checked through the inverse layouts, timed without them
    nw = NativeBlockWeights.from_standard(w).leaves()
    native_params = (attn, x0) + nw.tensors()

    def ours_native(standard_qkv: bool = False):
        x2, qkv = block_segment(attn, x0, pos, nw)
        return x2, qkv_to_standard(qkv, nw) if standard_qkv else qkv

    def f32(*leaves):
        a, x, *ws = leaves
        w32 = BlockWeights(*ws, n_heads=heads, n_kv_heads=kv)
        x2, qkv = reference_block_segment(a, x, pos, w32)
        return torch.cat([x2, qkv], -1)

    go_all = rand(m, d + n_qkv)
    ref, refg = fp32_reference(f32, params, go_all)
    go = (go_all[:, :d].contiguous(), go_all[:, d:].contiguous())  # each output's gradient, as a loss gives them

    def native_error(_result) -> float:
        out, *grads = joined(fwd_bwd(lambda: ours_native(True), native_params, go)())
        weights = NativeBlockWeights(*grads[2:], n_heads=heads, n_kv_heads=kv).to_standard().tensors()
        return max_err((out, *grads[:2], *weights), (ref, *refg))

    impls = {"eager": eager, "coda": ours}
    lg = _liger()
    seq = min(m, 4096)  # pos restarts every 4096 rows: rows are (batch, seq) for Liger's RoPE
    if lg is not None and m % seq == 0:
        impls["liger"] = lambda: liger_block_segment(lg, attn, x0, w, seq)
    fwd = [(m, d, heads * hd), (m, 2 * f, d), (m, d, f), (m, n_qkv, d)]
    bwd = [(m, d, n_qkv), (n_qkv, d, m), (m, f, d), (d, f, m), (m, d, 2 * f), (2 * f, d, m), (m, heads * hd, d),
           (d, heads * hd, m)]
    return {"impls": impls, "params": params, "ref": ref, "refg": refg, "go": go, "ours_native": ours_native,
            "native_params": native_params, "native_error": native_error, "fwd": fwd, "bwd": bwd}


def bench_block(m: int, d: int, f: int, heads: int = 32, kv: int = 8) -> None:
    c = block_case(m, d, f, heads, kv)
    shape = (m, d, f)
    gemms_sum("block_fwd", shape, c["fwd"])
    gemms_sum("block_fwdbwd", shape, c["fwd"] + c["bwd"])
    variants("block", shape, c["impls"], lambda _: c["params"], c["ref"], c["refg"], c["go"],
             join=lambda out: torch.cat(out, -1))
    ref = c["ref"]
    record("block_fwd", shape, "coda_native_layout", c["ours_native"],
           lambda _r: rel_err(torch.cat(c["ours_native"](True), -1), ref))
    record("block_fwdbwd", shape, "coda_native_layout", fwd_bwd(c["ours_native"], c["native_params"], c["go"]),
           c["native_error"])


def liger_block_segment(lg, attn_out: torch.Tensor, x0: torch.Tensor, w: BlockWeights, seq: int):
    """reference_block_segment with Liger-Kernel's RMSNorm, SiLU-mul and RoPE kernels around cuBLAS
    GEMMs (how Liger patches a Hugging Face Llama). Rows are (batch, position < seq); Liger's RMSNorm
    runs with in_place=False (its in_place=True reuses the incoming gradient's storage)."""
    m, hd = x0.shape[0], w.head_dim
    theta = torch.arange(seq, device=x0.device, dtype=torch.float32)[:, None] * w.inv_freq()[None, :]
    cos, sin = torch.cat([theta.cos()] * 2, -1)[None], torch.cat([theta.sin()] * 2, -1)[None]
    norm = lg.rms_norm.LigerRMSNormFunction.apply
    x1 = x0 + F.linear(attn_out, w.wo)
    h = norm(x1, w.g_ffn, w.eps, 0.0, "llama", False)
    x2 = x1 + F.linear(lg.swiglu.LigerSiLUMulFunction.apply(F.linear(h, w.w_gate), F.linear(h, w.w_up)), w.w_down)
    n = norm(x2, w.g_attn, w.eps, 0.0, "llama", False)

    def heads(t: torch.Tensor, count: int) -> torch.Tensor:  # [M, count*hd] -> [batch, count, seq, hd]
        return t.view(m // seq, seq, count, hd).transpose(1, 2)

    q, k = lg.rope.LigerRopeFunction.apply(heads(F.linear(n, w.wq), w.n_heads), heads(F.linear(n, w.wk), w.n_kv_heads),
                                           cos, sin)
    rows = lambda t: t.transpose(1, 2).reshape(m, -1)  # noqa: E731
    return x2, torch.cat([rows(q), rows(k), F.linear(n, w.wv)], -1)


_LIGER: list = []


def _liger():
    if not _LIGER:
        try:
            import liger_kernel.ops.fused_linear_cross_entropy
            import liger_kernel.ops.rms_norm
            import liger_kernel.ops.rope
            import liger_kernel.ops.swiglu  # noqa: F401

            _LIGER.append(sys.modules["liger_kernel"].ops)
        except Exception as exc:  # noqa: BLE001
            NOTES.append(f"Liger-Kernel not importable: {exc}")
            _LIGER.append(None)
    return _LIGER[0]


def summary(rows: list[dict]) -> list[dict]:
    """Ratios per (op, shape); the block also in coda's layouts (coda_native_layout: weights stored
    as NativeBlockWeights, q and k handed to attention in the pair-adjacent head order; the same
    kernels as the coda row without its per-call layout copies)."""
    out = []
    for (op, m, n, k), v in by_shape(rows).items():
        c = fastest_compile(v)
        for label, coda_ms in ((op, v.get("coda")), (f"{op} (native layout)", v.get("coda_native_layout"))):
            if coda_ms is None:
                continue
            out.append({"op": label, "M": m, "N": n, "K": k, **{f"ms_{key}": val for key, val in v.items()},
                        "ms_compile": c, "ms_coda": coda_ms,
                        "coda/gemms": ratio(coda_ms, v.get("gemms")), "eager/coda": ratio(v.get("eager"), coda_ms),
                        "compile/coda": ratio(c, coda_ms), "liger/coda": ratio(v.get("liger"), coda_ms)})
    return out


def table(s: list[dict]) -> str:
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    keys = ["coda/gemms", "eager/coda", "compile/coda", "liger/coda"]
    lines = ["| op | M | N | K | gemms ms | eager ms | compile ms | liger ms | coda ms | " + " | ".join(keys) + " |",
             "|" + "---|" * (9 + len(keys))]
    for r in s:
        lines.append(f"| {r['op']} | {r['M']} | {r['N']} | {r['K']} | {f(r.get('ms_gemms'))} | {f(r.get('ms_eager'))} | "
                     f"{f(r['ms_compile'])} | {f(r.get('ms_liger'))} | {f(r.get('ms_coda'))} | "
                     + " | ".join(f(r[k]) for k in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--merge", type=Path, help="write <out>/ops_block.md from a measured JSON")
    ap.add_argument("--note", help="with --merge: a line for the table (e.g. which commit was measured)")
    args = ap.parse_args()
    if args.merge:
        data = json.loads(args.merge.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        if args.note:
            data["meta"] = {**data["meta"], "note": args.note}
        md = ["# ops_block", "", f"{data['meta']['gpu']}, torch {data['meta']['torch']}, triton {data['meta']['triton']}.",
              "", data["meta"]["protocol"], "", *([args.note, ""] if args.note else []),
              table(summary(data["rows"])), ""]
        md += [f"* {n}" for n in data["notes"]]
        (args.out / "ops_block.json").write_text(json.dumps({**data, "summary": summary(data["rows"])}, indent=1))
        (args.out / "ops_block.md").write_text("\n".join(md) + "\n")
        return
    if not torch.cuda.is_available():
        sys.exit("ops_block.py measures on a CUDA GPU; --merge runs anywhere")
    torch.manual_seed(0)
    ops = args.ops.split(",")
    meta = harness.run_meta("do_bench median; bf16; outputs and gradients checked against fp32 before timing; gemms = "
                            "sum of the op's bare cuBLAS GEMMs (speed of light), each on random inputs, one scaled by "
                            "K^-0.5 like the ops' weights; compile = torch.compile default.",
                            coda=coda.__version__, autotune=os.environ.get("CODA_AUTOTUNE", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def save():
        (args.out / "ops_block.json").write_text(json.dumps({"meta": meta, "rows": ROWS, "notes": NOTES}, indent=1))

    if "rmsnorm_linear" in ops:
        bench_rmsnorm_linear(8192, 2048, 16384)
        save()
    if "swiglu_mlp" in ops:
        bench_swiglu_mlp(8192, 2048, 8192)
        save()
    if "linear_ce" in ops:
        bench_linear_ce(8192, 2048, 128256)
        save()
    if "linear_ce_options" in ops:
        bench_linear_ce_options(8192, 2048, 128256)
        save()
    if "block" in ops:
        for d, f in WIDTHS.items():
            bench_block(8192, d, f)
            save()
    log(f"measured {len(ROWS)} rows in {time.time() - t0:.0f} s")
    log(table(summary(ROWS)))


if __name__ == "__main__":
    main()
