"""Where a training step's time goes outside its kernels: the step (CUDA events) against the sum of
its kernels, the host's time to enqueue it, and every operation that waits for the GPU (each sync
drains the queue, and the GPU then idles while Python launches the next kernels), with the source
line that asked for it.

It says whether a step's time beyond its kernels is host launch time or synchronizations, and where
they come from. On the H200 at 296fb23 (bench/results/step_gaps_296fb23/) Gemma 3 was host-bound
(unpacked: a 153.1 ms step, 118.4 ms of kernels, 141.3 ms to enqueue); on the H100 at 3315958
(bench/results/step_gaps_3315958/) every family is GPU-bound (Gemma 3: 136.3, 129.8, 84.1 ms).
Each row also holds a host profile of the enqueue (cProfile, grouped by coda module, torch
package and builtin) to say where that host time goes.

    python bench/tools/step_gaps.py --out DIR [--models gemma3-1b] [--variants coda] [--packed]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402  (bench/train.py: the models, variants and batches measured there)


def _sync_sites(step) -> dict[str, int]:
    """The source lines (outside torch) whose calls synchronized with the GPU during one step."""
    import torch

    sites: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith("Synchronization debug mode is a prototype"):  # the mode's own notice
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and "warnings" not in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
        sites[f"{str(message)[:60]} at {where}"] += 1

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = original
    return dict(sites.most_common(20))


def _where(filename: str, function: str) -> str:
    """A profile entry's group: coda's module, torch's Python package, or the C++ builtin called."""
    if "/coda/" in filename:
        return "coda/" + filename.rsplit("/coda/", 1)[1]
    if "/torch/" in filename:
        return "torch/" + "/".join(filename.rsplit("/torch/", 1)[1].split("/")[:2])
    if "/triton/" in filename:
        return "triton/" + "/".join(filename.rsplit("/triton/", 1)[1].split("/")[:2])
    if filename == "~":
        return "builtin " + function[:70]
    return Path(filename).name


def _host_profile(step, steps: int = 3) -> dict:
    """Where the host's time goes while it enqueues a step (cProfile: its own overhead inflates
    many small calls, so read the shares, not the milliseconds): self time per group (coda module,
    torch or triton package, C++ builtin) and the functions with the most self time, per step."""
    profile = cProfile.Profile()
    profile.enable()
    for i in range(steps):
        step(i)
    profile.disable()
    stats = pstats.Stats(profile).stats
    groups: collections.Counter = collections.Counter()
    functions = []
    for (filename, line, function), (_, calls, self_s, cumulative_s, _) in stats.items():
        group = _where(filename, function)
        groups[group] += self_s * 1e3 / steps
        functions.append((self_s, group if filename == "~" else f"{group}:{line} {function}", calls // steps, cumulative_s))
    total = sum(groups.values())
    top = sorted(functions, reverse=True)[:30]
    return {"profiled_ms": round(total, 2),
            "groups_ms": {k: round(v, 3) for k, v in groups.most_common(30)},
            "functions": [{"where": w, "calls": c, "self_ms": round(s * 1e3 / steps, 3),
                           "cumulative_ms": round(cu * 1e3 / steps, 3)} for s, w, c, cu in top]}


def measure(model_name: str, variant: str, packed: bool, batch: int, seq: int) -> dict:
    import torch

    family = train.MODELS[model_name]
    shape = family.shape(False, 0)
    data = train.batches(shape["vocab_size"], batch, seq, packed, "cuda")
    model = train.build(variant, train.hf_model(family, "cuda", 0, False, 0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4, fused=True)

    def step(i: int = 0) -> None:
        model(**data[i % len(data)]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    events, host = [], []
    for i in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        step(i)
        host.append((time.perf_counter() - t) * 1e3)
        end.record()
        end.synchronize()
        events.append(start.elapsed_time(end))
    kernels, _ = train.breakdown(step)
    row = {"model": model_name, "variant": variant, "packed": packed,
           "step_ms": sorted(events)[2], "host_enqueue_ms": sorted(host)[2], "kernel_ms": kernels["total"],
           "sync_sites": _sync_sites(step), "host_profile": _host_profile(step)}
    groups = ", ".join(f"{k} {v:.1f}" for k, v in list(row["host_profile"]["groups_ms"].items())[:6])
    print(f"{model_name} {variant} packed={packed}: step {row['step_ms']:.1f} ms, host enqueue "
          f"{row['host_enqueue_ms']:.1f} ms, kernels {row['kernel_ms']:.1f} ms, "
          f"{sum(row['sync_sites'].values())} syncs; host profile (ms a step): {groups}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="gemma3-1b")
    ap.add_argument("--variants", default="coda")
    ap.add_argument("--packed", default="yes,no", help="yes, no or both (yes,no)")
    ap.add_argument("--shape", default="2x4096")
    args = ap.parse_args()
    batch, seq = (int(v) for v in args.shape.split("x"))
    rows = []
    for model_name in args.models.split(","):
        for variant in args.variants.split(","):
            for packed in args.packed.split(","):
                rows.append(measure(model_name, variant, packed == "yes", batch, seq))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_gaps.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
