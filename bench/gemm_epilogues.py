"""The GEMM + forward-epilogue benchmark suite (the benchmark protocol in docs/DESIGN.md), on a GPU.

Ops, each against its bare GEMM and its peers (variants named as in the benchmark protocol, docs/DESIGN.md):
  gemm          plain GEMM: cublas_gemm vs coda_gemm (square sweep and transformer shapes)
  rmsnorm_gemm  F.linear(F.rms_norm(x, g), W); coda applies rstd per row in the epilogue
                (h = x*g and rstd come from the producer GEMM upstream, docs/ALGEBRA.md 1)
  swiglu        silu(gate) * up of the gate/up GEMM; coda reads interleaved weights (pairs)
  rope          fused QKV GEMM + half-split RoPE on q and k (v unrotated); coda's weight rows
                are pair-permuted, outputs are un-permuted for the correctness check only
  residual_norm down projection + residual add, then RMSNorm; coda stores x, h = x*g and
                per-row sum of squares, the normalized tensor is never written (rstd finalize)
  lm_head_ce    LM head + cross-entropy forward; coda writes per-tile logsumexp and the
                target logit, the logits are never written

Every variant is checked against an fp32 reference before it is timed (relative Frobenius
error < 2e-2; for lm_head_ce, |loss - ref| < 1e-2). Inputs are random, bf16; working sets
exceed the 60 MB L2. coda runs its default configs; under CODA_AUTOTUNE=1 it tunes each (op, shape)
on its first call (the autotuner, with the epilogue fused in). compile = the faster of the compile_* rows.

    python bench/gemm_epilogues.py --ops gemm,swiglu --out DIR      # measure, write DIR/<part>.json
    python bench/gemm_epilogues.py --merge DIR/*.json --out bench/results   # table + plot
"""

import argparse
import importlib.metadata
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import coda
import harness
from harness import NOTES, ROWS, by_shape, compiled, fastest_compile, log, rand, ratio, record, rel_err

OPS = ("gemm", "rmsnorm_gemm", "swiglu", "rope", "residual_norm", "lm_head_ce")
PRIMARY = dict(m=8192, d=2048, ffn=8192)
EIGHT_B = dict(m=8192, d=4096, ffn=14336)


def liger():
    try:
        import liger_kernel.ops as ops  # noqa: F401
        from liger_kernel.ops import cross_entropy, fused_add_rms_norm, rms_norm, rope, swiglu
    except Exception as exc:  # noqa: BLE001
        NOTES.append(f"Liger-Kernel not importable: {exc}")
        return None
    return {"ce": cross_entropy, "add_rms": fused_add_rms_norm, "rms": rms_norm, "rope": rope, "swiglu": swiglu}


# -- ops ---------------------------------------------------------------------------------

def peers(op: str, shape, *, cublas, coda_gemm, eager, coda_fn, check, modes, liger_fn=None, liger_check=None,
          coda_check=None) -> None:
    """One op's rows in the protocol's order: its bare GEMMs, eager, compile, Liger, the fused kernel."""
    record(op, shape, "cublas_gemm", cublas)
    record(op, shape, "coda_gemm", coda_gemm)
    record(op, shape, "eager", eager, check)
    compiled(op, shape, eager, check, modes)
    if liger_fn is not None:
        record(op, shape, "liger", liger_fn, liger_check or check)
    record(op, shape, "coda", coda_fn, coda_check or check)


def bench_gemm(coda) -> None:
    shapes = [(s, s, s) for s in (2048, 4096, 8192)] + [(8192, 16384, 2048), (8192, 2048, 8192), (8192, 3072, 2048),
                                                          (16384, 16384, 2048), (8192, 28672, 4096), (8192, 4096, 14336)]
    for m, n, k in shapes:
        a, w = rand(m, k), rand(n, k)
        ref = a.float() @ w.float().T
        record("gemm", (m, n, k), "cublas_gemm", lambda: a @ w.T, lambda r: rel_err(r, ref))
        record("gemm", (m, n, k), "coda_gemm", lambda: coda.gemm(a, w.T), lambda r: rel_err(r, ref))


def bench_rmsnorm_gemm(coda, lg, m: int, d: int, ffn: int, modes: list[str]) -> None:
    eps, n = 1e-6, 2 * ffn
    x, g, w = rand(m, d), (1 + 0.1 * torch.randn(d, device=harness.DEVICE)).to(torch.bfloat16), rand(n, d, scale=d**-0.5)
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    ref = (xf * rstd[:, None] * g.float()) @ w.float().T
    h = (xf * g.float()).to(torch.bfloat16)  # from the producer GEMM's epilogue

    @coda.epilogue
    def row_scale(acc, rstd: coda.VecM):
        return acc * rstd

    def eager():
        return F.linear(F.rms_norm(x, (d,), g, eps), w)

    chk = lambda r: rel_err(r, ref)  # noqa: E731
    shape = (m, n, d)
    peers("rmsnorm_gemm", shape, cublas=lambda: x @ w.T, coda_gemm=lambda: coda.gemm(h, w.T), eager=eager,
          coda_fn=lambda: coda.gemm(h, w.T, row_scale, rstd=rstd), check=chk, modes=modes,
          liger_fn=(lambda: F.linear(lg["rms"].LigerRMSNormFunction.apply(x, g, eps), w)) if lg else None)


def bench_swiglu(coda, lg, m: int, d: int, ffn: int, modes: list[str]) -> None:
    w_gate, w_up = rand(ffn, d, scale=d**-0.5), rand(ffn, d, scale=d**-0.5)
    x = rand(m, d)
    w_cat = torch.cat([w_gate, w_up])
    w_il = torch.stack([w_gate, w_up], 1).reshape(2 * ffn, d)
    gu = x.float() @ w_cat.float().T
    ref = F.silu(gu[:, :ffn]) * gu[:, ffn:]
    del gu

    @coda.epilogue
    def swiglu(acc):
        gate, up = coda.pairs(acc)
        return coda.silu(gate) * up

    def eager():
        gt, u = F.linear(x, w_cat).chunk(2, dim=-1)
        return F.silu(gt) * u

    chk = lambda r: rel_err(r, ref)  # noqa: E731
    shape = (m, 2 * ffn, d)
    peers("swiglu", shape, cublas=lambda: x @ w_cat.T, coda_gemm=lambda: coda.gemm(x, w_il.T), eager=eager,
          coda_fn=lambda: coda.gemm(x, w_il.T, swiglu), check=chk, modes=modes,
          liger_fn=(lambda: lg["swiglu"].LigerSiLUMulFunction.apply(F.linear(x, w_gate), F.linear(x, w_up)))
          if lg else None)


def bench_rope(coda, lg, m: int, d: int, modes: list[str], heads: int = 32, kv_heads: int = 8) -> None:
    hd = d // heads
    nq, nkv = heads * hd, kv_heads * hd
    n = nq + 2 * nkv
    x, w = rand(m, d), rand(n, d, scale=d**-0.5)
    pos = torch.arange(m, device=harness.DEVICE) % 4096
    inv = 10000.0 ** (-torch.arange(0, hd, 2, device=harness.DEVICE).float() / hd)  # [hd/2]
    theta = pos[:, None].float() * inv[None, :]
    cos = torch.cat([theta.cos(), theta.cos()], -1)  # [m, hd], the standard cache
    sin = torch.cat([theta.sin(), theta.sin()], -1)

    def rot(t: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # [m, h, hd]
        t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
        return t * c[:, None] + torch.cat([-t2, t1], -1) * s[:, None]

    def eager_f(cs, sn):
        def run():
            qkv = F.linear(x, w)
            q, k, v = qkv.split([nq, nkv, nkv], -1)
            q = rot(q.view(m, heads, hd), cs, sn).reshape(m, nq)
            k = rot(k.view(m, kv_heads, hd), cs, sn).reshape(m, nkv)
            return torch.cat([q, k, v], -1)
        return run

    qkv_f = x.float() @ w.float().T
    q, k, v = qkv_f.split([nq, nkv, nkv], -1)
    ref = torch.cat([rot(q.view(m, heads, hd), cos, sin).reshape(m, nq),
                     rot(k.view(m, kv_heads, hd), cos, sin).reshape(m, nkv), v], -1)
    del qkv_f, q, k, v

    # coda: permute q/k rows so each rotation pair (i, i + hd/2) is two adjacent columns.
    per_head = torch.stack([torch.arange(hd // 2), torch.arange(hd // 2) + hd // 2], 1).reshape(hd)
    perm = torch.cat([(h * hd + per_head) for h in range(heads + kv_heads)] +
                     [torch.arange(nq + nkv, n)]).to(harness.DEVICE)
    w_perm = w[perm]
    freq = torch.cat([inv.repeat(heads + kv_heads), torch.zeros(nkv // 2, device=harness.DEVICE)])  # [n/2]; 0 for v
    unperm = torch.argsort(perm)

    @coda.epilogue
    def rope(acc, pos: coda.VecM, freq: coda.VecN(width=0.5)):
        th = pos * freq
        a, b = coda.pairs(acc)
        c, s = coda.cos(th), coda.sin(th)
        return coda.interleave(a * c - b * s, a * s + b * c)

    bf_cos, bf_sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    eager = eager_f(bf_cos, bf_sin)
    chk = lambda r: rel_err(r, ref)  # noqa: E731
    shape = (m, n, d)
    def liger_rope():
        qkv = F.linear(x, w)
        q, k, v = qkv.split([nq, nkv, nkv], -1)
        qr, kr = lg["rope"].rope_forward(q.view(1, m, heads, hd).transpose(1, 2), k.view(1, m, kv_heads, hd).transpose(1, 2),
                                         bf_cos[None], bf_sin[None])[:2]
        return qr, kr, v

    def liger_check(r) -> float:
        return rel_err(torch.cat([r[0].transpose(1, 2).reshape(m, nq), r[1].transpose(1, 2).reshape(m, nkv), r[2]], -1), ref)

    peers("rope", shape, cublas=lambda: x @ w.T, coda_gemm=lambda: coda.gemm(x, w_perm.T), eager=eager,
          coda_fn=lambda: coda.gemm(x, w_perm.T, rope, pos=pos, freq=freq), check=chk, modes=modes,
          liger_fn=liger_rope if lg else None, liger_check=liger_check, coda_check=lambda r: rel_err(r[:, unperm], ref))


def bench_residual_norm(coda, lg, m: int, d: int, ffn: int, modes: list[str]) -> None:
    eps = 1e-6
    y, w, x_prev = rand(m, ffn), rand(d, ffn, scale=ffn**-0.5), rand(m, d)
    g = (1 + 0.1 * torch.randn(d, device=harness.DEVICE)).to(torch.bfloat16)
    xf = y.float() @ w.float().T + x_prev.float()
    ref_n = F.rms_norm(xf, (d,), g.float(), eps)

    @coda.epilogue
    def residual_norm(acc, residual: coda.Tile, g: coda.VecN):
        x = acc + residual
        return {"x": x, "h": x * g, "ss": coda.reduce_n(x * x, "sum")}

    def eager():
        x = x_prev + F.linear(y, w)
        return x, F.rms_norm(x, (d,), g, eps)

    def fused():
        out = coda.gemm(y, w.T, residual_norm, residual=x_prev, g=g)
        return out["x"], out["h"], torch.rsqrt(out["ss"] / d + eps)

    chk = lambda r: max(rel_err(r[0], xf), rel_err(r[1], ref_n))  # noqa: E731
    shape = (m, d, ffn)
    peers("residual_norm", shape, cublas=lambda: y @ w.T, coda_gemm=lambda: coda.gemm(y, w.T), eager=eager,
          coda_fn=fused, check=chk, modes=modes,
          liger_fn=(lambda: lg["add_rms"].LigerFusedAddRMSNormFunction.apply(F.linear(y, w), x_prev, g, eps)[::-1])
          if lg else None,
          coda_check=lambda r: max(rel_err(r[0], xf), rel_err(r[1].float() * r[2][:, None], ref_n)))


def bench_lm_head_ce(coda, lg, m: int, d: int, vocab: int, modes: list[str]) -> None:
    h, w = rand(m, d), rand(vocab, d, scale=d**-0.5)
    target = torch.randint(0, vocab, (m,), device=harness.DEVICE)
    ref = F.cross_entropy(h.float() @ w.float().T, target)

    @coda.epilogue
    def ce_stats(acc, target: coda.VecM):
        return {"lse": coda.reduce_n(acc, "logsumexp"),
                "tgt": coda.reduce_n(coda.where(coda.col_index() == target, acc, 0.0), "sum")}

    def eager():
        return F.cross_entropy(F.linear(h, w).float(), target)

    def fused():
        s = coda.gemm(h, w.T, ce_stats, target=target)
        return (s["lse"] - s["tgt"]).mean()

    chk = lambda r: abs(r.item() - ref.item()) / 10  # noqa: E731  (loss ~ log V: absolute error / 10 < 2e-2)
    shape = (m, vocab, d)
    peers("lm_head_ce", shape, cublas=lambda: h @ w.T, coda_gemm=lambda: coda.gemm(h, w.T), eager=eager,
          coda_fn=fused, check=chk, modes=modes,
          liger_fn=(lambda: lg["ce"].LigerCrossEntropyFunction.apply(F.linear(h, w), target, None)[0]) if lg else None)


# -- reporting ---------------------------------------------------------------------------

def summarize(rows: list[dict]) -> list[dict]:
    """One record per (op, shape): ms per variant plus the protocol's ratios."""
    out = []
    for (op, m, n, k), v in by_shape(rows).items():
        c = fastest_compile(v)
        coda_ms = v.get("coda", v.get("coda_gemm") if op == "gemm" else None)
        out.append({
            "op": op, "M": m, "N": n, "K": k, **{f"ms_{key}": val for key, val in v.items()}, "ms_compile": c,
            "coda/coda_gemm": ratio(v.get("coda"), v.get("coda_gemm")),
            "coda_gemm/cublas_gemm": ratio(v.get("coda_gemm"), v.get("cublas_gemm")),
            "eager/coda": ratio(v.get("eager"), coda_ms), "compile/coda": ratio(c, coda_ms),
            "liger/coda": ratio(v.get("liger"), coda_ms),
        })
    return out


def table(summary: list[dict]) -> str:
    cols = ["cublas_gemm", "coda_gemm", "eager", "compile", "liger", "coda"]
    ratios = ["coda/coda_gemm", "coda_gemm/cublas_gemm", "eager/coda", "compile/coda", "liger/coda"]
    f = lambda x, p: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    lines = ["| op | M | N | K | " + " | ".join(f"{c} ms" for c in cols) + " | " + " | ".join(ratios) + " |",
             "|" + "---|" * (4 + len(cols) + len(ratios))]
    for s in summary:
        lines.append(f"| {s['op']} | {s['M']} | {s['N']} | {s['K']} | "
                     + " | ".join(f(s.get(f"ms_{c}"), 3) for c in cols) + " | "
                     + " | ".join(f(s[r], 2) for r in ratios) + " |")
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["coda/coda_gemm", "coda_gemm/cublas_gemm", "eager/coda", "compile/coda", "liger/coda"]
    labels = [f"{s['op']}\n{s['M']}x{s['N']}x{s['K']}" for s in summary]
    fig, ax = plt.subplots(figsize=(max(10, 0.9 * len(summary)), 5))
    width = 0.16
    for i, key in enumerate(keys):
        vals = [s[key] if s[key] is not None else math.nan for s in summary]
        ax.bar([j + (i - 2) * width for j in range(len(summary))], vals, width, label=key)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(summary)))
    ax.set_xticklabels(labels, fontsize=6, rotation=90)
    ax.set_ylabel("ratio")
    ax.set_title("coda GEMM epilogues on the H200: overhead (<=1.05 target) and speedups (>1 is coda faster)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def merge(parts: list[Path], out: Path, name: str, note: str | None = None) -> None:
    rows, notes, meta = [], [], None
    for p in parts:
        data = json.loads(p.read_text())
        rows += data["rows"]
        notes += data.get("notes", [])
        meta = meta or data["meta"]
    summary = summarize(rows)
    out.mkdir(parents=True, exist_ok=True)
    if note:
        meta = {**meta, "note": note}
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary, "notes": notes}, indent=1))
    md = [f"# {name}", "", f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, coda {meta['coda']}.", "",
          meta["protocol"], "", f"Produced by `bench/gemm_epilogues.py` (parts: {', '.join(p.name for p in parts)}).", "",
          *([note, ""] if note else []),
          table(summary), ""]
    if notes:
        md += ["Notes (variants that failed or were skipped):", ""] + [f"* {n}" for n in notes] + [""]
    (out / f"{name}.md").write_text("\n".join(md))
    plot(summary, out / f"{name}.png")
    log(table(summary))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--part", default="part", help="name of the JSON written by a measuring run")
    p.add_argument("--name", default="gemm_epilogues")
    p.add_argument("--merge", nargs="*", type=Path, help="merge measured parts into <out>/<name>.{json,md,png}")
    p.add_argument("--note", help="with --merge: a line for the table (e.g. which commit was measured)")
    args = p.parse_args()
    if args.merge:
        merge(args.merge, args.out, args.name, args.note)
        return
    if not torch.cuda.is_available():
        sys.exit("gemm_epilogues.py measures on a CUDA GPU; --merge runs anywhere")
    import triton

    torch.manual_seed(0)
    lg = liger()
    both = ["default", "max-autotune-no-cudagraphs"]
    ops = args.ops.split(",")
    log(f"GPU {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    t0 = time.time()
    autotune = os.environ.get("CODA_AUTOTUNE", "0")
    meta = harness.run_meta(
        "triton.testing.do_bench median (warmup 50 ms, rep 200 ms), one process per part; bf16 random inputs; every "
        "variant checked against an fp32 reference before timing; working sets exceed L2. compile = faster of "
        "torch.compile default and max-autotune-no-cudagraphs (max-autotune only at M=8192 D=2048 FFN=8192; default "
        "elsewhere). " + ("coda untuned (its default configs)." if autotune == "0" else
                          "coda tuned per (op, shape) by its autotuner on first call."),
        coda=coda.__version__, liger=importlib.metadata.version("liger-kernel") if lg else None, autotune=autotune)
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every op, so a run cut short keeps what it measured
        (args.out / f"{args.part}.json").write_text(json.dumps({"meta": meta, "rows": ROWS, "notes": NOTES}, indent=1))

    if "gemm" in ops:
        bench_gemm(coda)
        save()
    if "rmsnorm_gemm" in ops:
        bench_rmsnorm_gemm(coda, lg, **PRIMARY, modes=both)
        bench_rmsnorm_gemm(coda, lg, **EIGHT_B, modes=["default"])
        save()
    if "swiglu" in ops:
        bench_swiglu(coda, lg, **PRIMARY, modes=both)
        bench_swiglu(coda, lg, **EIGHT_B, modes=["default"])
        bench_swiglu(coda, lg, m=16384, d=2048, ffn=8192, modes=["default"])
        save()
    if "rope" in ops:
        bench_rope(coda, lg, PRIMARY["m"], PRIMARY["d"], modes=both)
        bench_rope(coda, lg, EIGHT_B["m"], EIGHT_B["d"], modes=["default"])
        save()
    if "residual_norm" in ops:
        bench_residual_norm(coda, lg, **PRIMARY, modes=both)
        bench_residual_norm(coda, lg, **EIGHT_B, modes=["default"])
        save()
    if "lm_head_ce" in ops:
        bench_lm_head_ce(coda, lg, 8192, 2048, 128256, modes=["default"])
        bench_lm_head_ce(coda, lg, 8192, 2048, 32768, modes=["default"])
    save()
    log(f"measured {len(ROWS)} rows in {time.time() - t0:.0f} s")
    log(table(summarize(ROWS)))


if __name__ == "__main__":
    main()
