"""Config sweep on the H200: which template options and tiles make coda's GEMM fast.

For each problem, every config is checked against the fp32 reference, then timed
(do_bench median) beside cuBLAS in the same process. Rows go to
`<out>/sweep.json` as they are measured, so a run cut short still reports.

    python bench/sweep_configs.py --out bench/results/sweep
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import triton

import coda
from coda.runtime import run


@coda.epilogue
def swiglu(acc, rstd: coda.VecM):
    gate, up = coda.pairs(acc * rstd)
    return coda.silu(gate) * up


@coda.epilogue
def residual_norm(acc, residual: coda.Tile, g: coda.VecN):
    x = acc + residual
    return {"x": x, "h": x * g, "ss": coda.reduce_n(x * x, "sum")}


def problems(dev: str) -> list[tuple[str, object, torch.Tensor, torch.Tensor, dict]]:
    bf = torch.bfloat16
    out = []
    for m, n, k in ((8192, 16384, 2048), (8192, 2048, 8192)):
        a = torch.randn(m, k, device=dev, dtype=bf)
        w = torch.randn(n, k, device=dev, dtype=bf)
        out.append((f"gemm_{m}x{n}x{k}", None, a, w.T, {}))
    a = torch.randn(8192, 2048, device=dev, dtype=bf)
    w = torch.randn(16384, 2048, device=dev, dtype=bf) / 45
    out.append(("swiglu_8192x16384x2048", swiglu, a, w.T, {"rstd": torch.rand(8192, device=dev) + 0.5}))
    a = torch.randn(8192, 8192, device=dev, dtype=bf)
    w = torch.randn(2048, 8192, device=dev, dtype=bf) / 90
    ops = {"residual": torch.randn(8192, 2048, device=dev, dtype=bf), "g": torch.randn(2048, device=dev, dtype=bf)}
    out.append(("residual_norm_8192x2048x8192", residual_norm, a, w.T, ops))
    return out


def configs() -> list[coda.Config]:
    shapes = [(128, 128, 4), (128, 128, 8), (128, 256, 8)]
    grid = itertools.product(shapes, (3, 4), (False, True), (False, True))
    return [
        coda.Config(block_m=bm, block_n=bn, block_k=64, num_warps=w, num_stages=s, flatten=f, tma_store=t)
        for (bm, bn, w), s, f, t in grid
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("bench/results/sweep"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for name, ep, a, b, ops in problems("cuda"):
        graph = coda.runtime.graph_of(ep)
        ref = ep.reference(a, b, **ops) if ep else (a.float() @ b.float())
        ref = ref if isinstance(ref, dict) else {"out": ref}
        ms_cublas = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median")
        rows.append({"problem": name, "variant": "cublas_gemm", "ms": ms_cublas})
        print(f"{name}: cublas {ms_cublas:.4f} ms", flush=True)
        for cfg in configs():
            t0 = time.time()
            try:
                res = run(graph, a, b, ops, config=cfg)
                res = res if isinstance(res, dict) else {"out": res}
                err = max(((res[k].float() - ref[k]).norm() / ref[k].norm()).item() for k in ref)
                ms = triton.testing.do_bench(lambda: run(graph, a, b, ops, config=cfg), warmup=50, rep=200,
                                             return_mode="median")
                row = {"problem": name, "variant": "coda", "config": cfg.model_dump(), "ms": ms, "rel_err": err,
                       "vs_cublas": ms / ms_cublas}
                print(f"  {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} flat={cfg.flatten:d} "
                      f"tma_st={cfg.tma_store:d}: {ms:.4f} ms ({ms / ms_cublas:.3f}x cublas) err {err:.1e} "
                      f"[{time.time() - t0:.1f}s]", flush=True)
            except Exception as exc:  # a config that does not compile or run is a finding too
                row = {"problem": name, "variant": "coda", "config": cfg.model_dump(), "error": repr(exc)[:300]}
                print(f"  {cfg}: FAILED {repr(exc)[:200]}", flush=True)
            rows.append(row)
            (args.out / "sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        torch.cuda.empty_cache()
    for name in dict.fromkeys(r["problem"] for r in rows):
        ok = [r for r in rows if r["problem"] == name and r["variant"] == "coda" and "ms" in r]
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        if best:
            print(f"BEST {name}: {best['ms']:.4f} ms = {best['vs_cublas']:.3f}x cublas, {best['config']}")


if __name__ == "__main__":
    main()
