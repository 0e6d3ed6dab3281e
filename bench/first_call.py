"""Seconds to the first finished training step on first use (issue 27), cold and warm, and what
each kernel's first launch cost.

Each case runs in a fresh process with coda's default settings (every CODA_* variable unset but
the cache and the compile record), twice: cold, on an empty CODA_CACHE_DIR and an empty
TRITON_CACHE_DIR (so Triton compiles every kernel, as on a fresh install), then warm, a second
fresh process on the same two caches. A process times `import torch, coda`, the setup (model
or inputs built, on the GPU), the first training step (forward, backward, fused AdamW; ended by
a device synchronize) and a second one. The cold process's CODA_COMPILE_LOG
(coda.runtime.compile_log) gives each launch plan's first launch: where Triton compiled the kernel.

Cases:
  llama_1b     coda.models.LlamaForCausalLM shaped as Llama-3.2-1B (D=2048, FFN=8192, 16 layers,
               32 q / 8 kv heads, head_dim 64, V=128256, tied embeddings), batch 2 x seq 4096, bf16
  block_d2048  the block of bench/ops_block.py (block_case's coda_native step: native weights,
  block_d4096  forward+backward), M=8192, D/FFN 2048/8192 and 4096/14336, then AdamW on its weights
  tiny         a 1-layer model (batch 1 x seq 8): a smoke run of the script, on the CPU too

    python bench/first_call.py --out DIR [--cases llama_1b,block_d2048,block_d4096] [--timeout 500]
    python bench/first_call.py --merge A/first_call.json [B/first_call.json ...] --out bench/results [--note ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("llama_1b", "block_d2048", "block_d4096")
BLOCK_M = 8192
PROTOCOL = ("Each case in a fresh process with coda's default settings (CODA_AUTOTUNE unset: no tuning), cold (empty "
            "CODA_CACHE_DIR and TRITON_CACHE_DIR) then warm (a second fresh process on the same caches). "
            "first step = wall clock of the first training step (forward, backward, fused AdamW) to a device "
            "synchronize; to first step = from the process's start of `import torch, coda` to that point (import, "
            "setup, first step); second step = the next step, for scale. Compile rows: CODA_COMPILE_LOG's first "
            "launch of every launch plan in the cold process (Triton's compile, or milliseconds where an earlier "
            "plan had compiled the binary) and, matched in order, the warm process's (a load from the caches).")


# -- one case, in this process ----------------------------------------------------------------

def _llama(tiny: bool):
    """(step, parameters) of the coda Llama model of the case, bf16 on the GPU (fp32 on the CPU)."""
    import torch

    import coda

    if tiny:
        shape = coda.models.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
        batch, seq = 1, 8
    else:
        shape = coda.models.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                        head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                                        rope_scaling=(32.0, 1.0, 4.0, 8192.0), tie_word_embeddings=True)
        batch, seq = 2, 4096
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    model = coda.models.LlamaForCausalLM(shape, device=device, dtype=dtype)
    ids = torch.randint(0, shape.vocab_size, (batch, seq), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _block(d: int):
    """The step of bench/ops_block.py's block (native weights, forward+backward) at M=8192, then
    fused AdamW on its weights (its leaves after the attention output and the residual)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ops_block

    case = ops_block.block_case(BLOCK_M, d, ops_block.WIDTHS[d])
    leaves = case["native_params"]
    fwd_bwd = ops_block.fwd_bwd(case["ours_native"], leaves, case["go"])
    weights = leaves[2:]
    opt = torch.optim.AdamW(weights, lr=1e-4, fused=True)

    def step() -> None:
        _, *grads = fwd_bwd()
        for w, g in zip(weights, grads[2:]):
            w.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run_case(case: str) -> dict[str, float]:
    """Time import, setup, the first and the second step of `case` in this process."""
    start = time.perf_counter()
    import torch

    import coda  # noqa: F401

    imported = time.perf_counter()
    step = _llama(case == "tiny") if case in ("llama_1b", "tiny") else _block(int(case.removeprefix("block_d")))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    built = time.perf_counter()
    step()
    sync()
    first = time.perf_counter()
    step()
    sync()
    second = time.perf_counter()
    return {"import_s": imported - start, "setup_s": built - imported, "first_step_s": first - built,
            "to_first_step_s": first - start, "second_step_s": second - first}


# -- the driver ---------------------------------------------------------------------------------

def child_env(cache: Path, log: Path) -> dict[str, str]:
    """The environment of a case's process: default settings, its caches and compile record."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODA_") or k == "CODA_COMMIT"}
    env.pop("TRITON_CACHE_DIR", None)
    env.update(CODA_CACHE_DIR=str(cache / "coda"), TRITON_CACHE_DIR=str(cache / "triton"), CODA_COMPILE_LOG=str(log),
               PYTHONUNBUFFERED="1")
    return env


def spawn(case: str, cache: Path, log: Path, timeout: float) -> dict:
    """One process of `case` on `cache`: its timings, or {"error": why}."""
    result = log.with_suffix(".result.json")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", case, "--result", str(result)]
    try:
        proc = subprocess.run(cmd, env=child_env(cache, log), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no step within {timeout:.0f} s"}
    if proc.returncode != 0 or not result.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"}
    return json.loads(result.read_text())


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compile_rows(case: str, cold: list[dict], warm: list[dict]) -> list[dict]:
    """The cold process's first launches, each with the warm process's launch of the same kernel
    and config in the same order (None where the warm process had none)."""
    pending: dict[tuple, list[float]] = {}
    for r in warm:
        pending.setdefault((r["kernel"], r["backend"], r["config"]), []).append(r["seconds"])
    rows = []
    for r in cold:
        queue = pending.get((r["kernel"], r["backend"], r["config"]), [])
        rows.append({"case": case, "kernel": r["kernel"], "backend": r["backend"], "config": r["config"],
                     "compile_s": r["seconds"], "warm_s": queue.pop(0) if queue else None})
    return rows


def measure(cases: list[str], timeout: float, out: Path) -> dict:
    """Cold then warm per case; the data so far is written after every process."""
    data: dict = {"meta": meta(), "rows": [], "compile": [], "notes": []}
    for case in cases:
        with tempfile.TemporaryDirectory(prefix=f"first_call_{case}_") as tmp:
            cache = Path(tmp)
            logs = {when: cache / f"compile_{when}.jsonl" for when in ("cold", "warm")}
            results = {}
            for when in ("cold", "warm"):
                t0 = time.time()
                results[when] = spawn(case, cache, logs[when], timeout)
                print(f"[first_call] {case} {when}: {results[when]} ({time.time() - t0:.0f} s)", flush=True)
            tuned = list((cache / "coda" / "tuning").glob("*.json"))
            row = {"case": case, "tuning_files": len(tuned)}
            for when, r in results.items():
                if "error" in r:
                    data["notes"].append(f"{case} {when}: {r['error']}")
                for key in ("first_step_s", "to_first_step_s", "import_s", "setup_s", "second_step_s"):
                    row[f"{when}_{key}"] = r.get(key)
            data["rows"].append(row)
            data["compile"] += compile_rows(case, read_log(logs["cold"]), read_log(logs["warm"]))
        write(data, out)
    return data


def meta() -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import harness

    if torch.cuda.is_available():
        return harness.run_meta(PROTOCOL)
    import triton

    return {"gpu": "none (CPU, Triton's interpreter)", "torch": torch.__version__, "triton": triton.__version__,
            "commit": harness.commit(), "protocol": PROTOCOL}


# -- the table ----------------------------------------------------------------------------------

def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(data: dict) -> str:
    lines = ["| case | cold: first step (s) | warm: first step (s) | cold: to first step (s) | warm: to first step (s) "
             "| second step (s) | tuning files |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        second = "-" if r["warm_second_step_s"] is None else f"{r['warm_second_step_s']:.3f}"
        lines.append(f"| {r['case']} | {_s(r['cold_first_step_s'])} | {_s(r['warm_first_step_s'])} | "
                     f"{_s(r['cold_to_first_step_s'])} | {_s(r['warm_to_first_step_s'])} | {second} | "
                     f"{r['tuning_files']} |")
    lines += ["", "First launches in the cold process, slowest first (per case: launches, their sum):", ""]
    for case in dict.fromkeys(c["case"] for c in data["compile"]):
        rows = sorted((c for c in data["compile"] if c["case"] == case), key=lambda c: -c["compile_s"])
        lines.append(f"* {case}: {len(rows)} first launches, {sum(c['compile_s'] for c in rows):.1f} s")
    lines += ["", "| case | kernel | backend | config | cold (s) | warm (s) |", "|---|---|---|---|---:|---:|"]
    for c in sorted(data["compile"], key=lambda c: -c["compile_s"]):
        warm = "-" if c["warm_s"] is None else f"{c['warm_s']:.2f}"
        lines.append(f"| {c['case']} | {c['kernel']} | {c['backend']} | {c['config']} | {c['compile_s']:.2f} "
                     f"| {warm} |")
    return "\n".join(lines)


def write(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_call.json").write_text(json.dumps(data, indent=1))
    m = data["meta"]
    md = ["# first_call", "", f"{m['gpu']}, torch {m['torch']}, triton {m['triton']}, commit {m['commit']}.", "",
          m["protocol"], ""] + ([m["note"], ""] if m.get("note") else []) + [table(data), ""]
    md += [f"* {n}" for n in data["notes"]]
    (out / "first_call.md").write_text("\n".join(md) + "\n")


def merge(paths: list[Path], note: str | None) -> dict:
    """One table from the JSON of one or more runs (each with its cases); the first run's meta."""
    runs = [json.loads(p.read_text()) for p in paths]
    data = {"meta": dict(runs[0]["meta"]), "rows": [], "compile": [], "notes": []}
    for run in runs:
        for part in ("rows", "compile", "notes"):
            data[part] += run[part]
    if note:
        data["meta"]["note"] = note
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES + ('tiny',))}")
    ap.add_argument("--timeout", type=float, default=500, help="seconds per process")
    ap.add_argument("--merge", type=Path, nargs="+", help="write <out>/first_call.{json,md} from measured JSON files")
    ap.add_argument("--note")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.result.write_text(json.dumps(run_case(args.child)))
        return
    if args.out is None:
        ap.error("--out is required")
    if args.merge:
        write(merge(args.merge, args.note), args.out)
        return
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES + ("tiny",))
    if unknown:
        ap.error(f"unknown cases: {', '.join(sorted(unknown))}")
    import torch

    if not torch.cuda.is_available() and cases != ["tiny"]:
        sys.exit("first_call.py measures on a CUDA GPU (--cases tiny runs anywhere); --merge runs anywhere")
    measure(cases, args.timeout, args.out)


if __name__ == "__main__":
    main()
