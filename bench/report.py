"""The results page, docs/PERFORMANCE.md, generated from the committed JSON in bench/results/: the
latest figure of each benchmark with the machine, versions and commit its file records, the
protocol, and the command that measures each one again. Every number on the page is read from a
results file; the page names each file it reads.

    python bench/report.py                 # writes docs/PERFORMANCE.md
    python bench/report.py --check         # exits 1 if the committed page is not what the JSON gives
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import first_call
import train

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TOOLS = ROOT / "bench" / "tools"
PAGE = ROOT / "docs" / "PERFORMANCE.md"
# On the H200: the measuring commit recorded, coda's default configs (untuned), results under $OUT.
DEVICE_ENV = "export CODA_COMMIT=$(git rev-parse --short HEAD) CODA_AUTOTUNE=0 OUT=/tmp/out\n"


def cell(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None else x / y


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


# -- one renderer per benchmark's JSON -------------------------------------------------------------

def fused_gemms(data: dict) -> str:
    """gemm_epilogues: each op's fused GEMM against its bare GEMM (cuBLAS, and coda's own) and the peers."""
    rows = [[s["op"], str(s["M"]), str(s["N"]), str(s["K"]), cell(s.get("ms_cublas_gemm")), cell(s.get("ms_coda")),
             cell(ratio(s.get("ms_coda"), s.get("ms_cublas_gemm")), 2), cell(s["coda_gemm/cublas_gemm"], 2),
             *(cell(s[k], 2) for k in ("eager/coda", "compile/coda", "liger/coda"))] for s in data["summary"]]
    return markdown_table(["op", "M", "N", "K", "cuBLAS GEMM ms", "coda ms", "coda / cuBLAS GEMM",
                           "coda GEMM / cuBLAS GEMM", "eager / coda", "compile / coda", "Liger / coda"], rows)


def ops(data: dict) -> str:
    """ops_block: each op forward and forward+backward against the sum of its bare GEMMs and the peers."""
    rows = [[s["op"], str(s["M"]), str(s["N"]), str(s["K"]), cell(s["ms_gemms"]), cell(s.get("ms_coda")),
             *(cell(s[k], 2) for k in ("coda/gemms", "eager/coda", "compile/coda", "liger/coda"))]
            for s in data["summary"]]
    return markdown_table(["op", "M", "N", "K", "bare GEMMs ms", "coda ms", "coda / bare GEMMs", "eager / coda",
                           "compile / coda", "Liger / coda"], rows)


def block_kernels(data: dict) -> str:
    """block_kernels' kernel rows: each GEMM of the block on the backend the runtime chose, against the
    bare cuBLAS GEMM of the same operands."""
    rows = [[str(r["D"]), r["kernel"], str(r["gemm"]), r["backend"], cell(r["ms"]), cell(r["bare_gemm_ms"]),
             cell(r["ms"] / r["bare_gemm_ms"], 2)] for r in data["rows"] if r["chosen"]]
    return markdown_table(["D", "kernel", "GEMM [M, N, K]", "backend", "ms", "bare cuBLAS ms", "ratio"], rows)


def block_rows(data: dict) -> str:
    """block_kernels' block rows: forward+backward of the block per variant, each divided by the SoL
    timed right before it (sol_ms)."""
    rows = [[str(r["D"]), str(r["FFN"]), r["variant"], cell(r["ms"]), cell(r.get("sol_ms")),
             cell(ratio(r["ms"], r.get("sol_ms")), 3)] for r in data["block"]]
    return markdown_table(["D", "FFN", "variant", "ms", "SoL ms", "/ SoL"], rows)


def training(data: dict) -> str:
    """train: bench/train.py's own table, of the step rows."""
    return train.table([r for r in data["rows"] if "step_ms" in r or "skipped" in r])


def first_calls(data: dict) -> str:
    """first_call: bench/first_call.py's own table (seconds to the first step, each first compile)."""
    return first_call.table(data)


def fsdp(data: dict) -> str:
    r = data["result"]
    return markdown_table(["world", "parameters", "ms / step", "tokens/s per GPU", f"peak GiB ({r['peak_kind']})"],
                          [[str(r["world"]), f"{r['parameters']:,}", cell(r["step_ms"], 1),
                            f"{r['tokens_per_s_per_gpu'] / 1e3:.1f}k", cell(r["peak_mem_gib"], 1)]])


@dataclass(frozen=True)
class Section:
    """One benchmark's latest figures: which committed file, what it measures, how it was run."""

    title: str
    file: str  # under bench/results/
    what: str
    reproduce: str
    render: Callable[[dict], str]


SECTIONS = (
    Section("Fused GEMMs against their bare GEMM and the peers", "gemm_epilogues.json",
            "Each forward epilogue fused into its GEMM (coda) against the same GEMM with no epilogue (cuBLAS, and "
            "coda's template with none), the unfused PyTorch sequence (eager), torch.compile of it and Liger-Kernel.",
            f"{DEVICE_ENV}bash bench/gpu_session.sh epilogues\n"
            "python bench/gemm_epilogues.py --merge $OUT/epilogues.json --out bench/results", fused_gemms),
    Section("Ops and the block, forward and forward+backward", "ops_block.json",
            "coda.ops (RMSNorm + linear, the SwiGLU MLP, linear + cross-entropy, the block) against the sum of "
            "their bare cuBLAS GEMMs and the peers.",
            f"{DEVICE_ENV}bash bench/gpu_session.sh ops\n"
            "python bench/ops_block.py --merge $OUT/ops_block.json --out bench/results", ops),
    Section("The block's GEMMs, kernel by kernel", "block_kernels_c0550e6/block_kernels.json",
            "Every GEMM of the block forward+backward, replayed alone on the operands the block gave it, on the "
            "backend the runtime chose, against the bare cuBLAS GEMM of the same operands.",
            f"{DEVICE_ENV}bash bench/gpu_session.sh block\n"
            "python bench/block_kernels.py --merge $OUT/block_kernels.json --out bench/results/block_kernels_<commit>",
            block_kernels),
    Section("The block against its speed of light and the peers", "block_rows_f0e466d/block_kernels.json",
            "The Llama block forward+backward (M = 8192) per variant, each divided by the SoL timed right before "
            "it: the block's 12 bare cuBLAS GEMMs replayed back to back in one CUDA graph.",
            f"{DEVICE_ENV}bash bench/gpu_session.sh block   # kernel rows, then each width's block rows in a fresh "
            "process\npython bench/block_kernels.py --merge $OUT/block_kernels.json --out bench/results/block_rows_<commit>",
            block_rows),
    Section("End-to-end training per model family", "train.json",
            "Forward + backward + fused AdamW of whole models, bf16, batch x seq tokens a step, each variant in its "
            "own process.",
            f"{DEVICE_ENV}TRAIN_ARGS=\"--models llama3.2-1b\" bash bench/gpu_session.sh train   # a model a device "
            "call; add --packed for packed rows\npython bench/train.py --merge OUT1/train.json OUT2/train.json --out "
            "bench/results",
            training),
    Section("Seconds to the first training step", "first_call.json",
            "A fresh process with coda's default settings (no tuning): the first training step from empty caches "
            "(cold: every kernel compiled) and from warm ones, and each kernel's first compile.",
            f"{DEVICE_ENV}FIRST_CALL_ARGS=\"--cases llama_1b\" bash bench/gpu_session.sh first_call   # or "
            "block_d2048,block_d4096\npython bench/first_call.py --merge OUT1/first_call.json OUT2/first_call.json "
            "--out bench/results",
            first_calls),
    Section("coda's model under FSDP2", "fsdp2.json",
            "The coda Llama-3.2-1B model sharded with FSDP2 (fully_shard per layer, bf16 parameters, fp32 "
            "reduction and master weights), batch 2 x 4096 a rank.",
            f"{DEVICE_ENV}torchrun --standalone --nproc_per_node=1 bench/tools/train_fsdp.py --model 1b --shape 2x4096 "
            "--steps 20 --reference --out $OUT   # world size = --nproc_per_node", fsdp),
)


def provenance(meta: dict) -> str:
    """Machine, versions and commit, as the file records them (a field it lacks is said to be missing)."""
    machine = meta.get("gpu") or meta.get("device") or "not recorded"
    versions = [f"{name} {meta[k]}" for name, k in (("torch", "torch"), ("triton", "triton"),
                                                    ("transformers", "transformers"), ("Liger-Kernel", "liger_kernel"),
                                                    ("Liger-Kernel", "liger")) if meta.get(k)]
    return f"{machine}; {', '.join(versions)}; commit {meta.get('commit') or 'not recorded in the file'}."


def section(s: Section) -> list[str]:
    data = json.loads((RESULTS / s.file).read_text())
    meta = data["meta"]
    note = meta.get("note") or data.get("note")  # (fsdp2.json keeps its note beside meta)
    md = [f"## {s.title}", "", s.what, "", f"From `bench/results/{s.file}`: {provenance(meta)}"]
    if meta.get("protocol"):
        md += ["", f"Protocol of this run: {meta['protocol']}"]
    if note:
        md += ["", f"Run note: {note}"]
    md += ["", s.render(data), ""]
    if data.get("notes"):
        md += [f"* {n}" for n in data["notes"]] + [""]
    md += ["Measure again (on the H200, from the repository root):", "", "```bash", s.reproduce, "```", ""]
    return md


PROTOCOL = """\
## How these figures are measured

* GPU numbers come from the H200, or where a results file records an H100 80GB, from the H100
  that the loan gave that day; every ratio is within one file, one machine. A CPU run of the
  scripts checks their wiring, not speed.
* Every claim is a ratio of variants timed in the same process on the same inputs, never an
  absolute time carried between runs: the machine is shared and its clock moves.
* Every variant is checked against its fp32 reference before it is timed.
* Timing: `triton.testing.do_bench` median after its warm-up (kernels and ops); training steps:
  warm-up steps, then the median of timed steps (CUDA events), each variant in its own process.
* Random bf16 inputs (never zeros), fp32 statistics; working sets larger than the 60 MB L2.
* A fused GEMM's limit is its bare GEMM: the same operands through cuBLAS with no epilogue.
  The block's speed of light (SoL) is its 12 bare cuBLAS GEMMs (forward 4, backward 8) replayed
  back to back in one CUDA graph, timed in the same run as the variants.
* Peers: eager PyTorch with the best standard ops, torch.compile (default and
  max-autotune-no-cudagraphs; "compile" is the faster measured), Liger-Kernel.
* Each results file records the GPU, the versions and the commit measured; the sections below
  quote them. coda runs untuned (its default configs) unless a run note says otherwise.
"""


RUNNING = """\
## Running on the H200

* Each measuring command on this page is one device call, from the repository root; results go
  under `$OUT`. The `--merge` commands, which write `bench/results/`, run anywhere.
* `bash bench/gpu_session.sh STEP...` runs one or more steps; the top of `bench/gpu_session.sh`
  lists them, most with a rough duration. With no step it runs `tests`, `epilogues` and `ops`.
* The device machine has no network: pydantic (and Liger-Kernel, for the peers) travel as wheels
  in a git-ignored `.whl/`, which `bench/gpu_session.sh` and `bench/tools/ncu_epilogue.sh` install
  into `/tmp/site`.
* Export `CODA_COMMIT` (the commit of the tree sent): the results record it, since the device
  copy's `.git` may be stale; `bench/gpu_session.sh` refuses a measuring step without it.
* coda runs untuned (`CODA_AUTOTUNE` defaults to `0`). With `CODA_AUTOTUNE=1` it tunes each new
  shape on first use; tuned configs come back as `$OUT/tuning.tgz`, and carried as `.tuning.tgz`
  they seed the next call.
* Each step stops after `STEP_TIMEOUT` seconds (540 by default).

The steps with no section below:

```bash
bash bench/gpu_session.sh tests          # the GPU tier: the test suite on CUDA tensors, larger shapes
bash bench/gpu_session.sh tests_triton   # the same with CODA_BACKEND=triton
bash bench/gpu_session.sh profile rowwise timeline   # investigation tools (bench/tools/)
```
"""


def tool_summary(path: Path) -> str:
    """A tool's first sentence: of its docstring (Python) or of its leading comment block (shell)."""
    if path.suffix == ".py":
        text = ast.get_docstring(ast.parse(path.read_text())) or ""
    else:
        lines = path.read_text().splitlines()[1:]  # (after the #! line)
        text = " ".join(line.lstrip("# ") for line in lines[:next(i for i, l in enumerate(lines) if not l.startswith("#"))])
    return re.split(r"(?<=[.?])\s", " ".join(text.split()), maxsplit=1)[0]


def tools() -> list[str]:
    return ["## Investigation tools", "",
            "`bench/tools/` holds the scripts that explain the figures above (profiles, timelines, Nsight Compute "
            "counters, bandwidth probes); their results, under `bench/results/`, are quoted where the design "
            "notes use them, not summarized here.", ""] + \
           [f"* `bench/tools/{p.name}`: {tool_summary(p)}" for p in sorted(TOOLS.iterdir()) if p.suffix in (".py", ".sh")] + [""]


def first_line(md: Path) -> str:
    """The first line of prose in a markdown file (its heading and table rows passed over), as a
    one-line summary of a results entry."""
    for line in md.read_text().splitlines():
        text = line.strip()
        if text and not text.startswith(("#", "|", "```")):
            return re.split(r"(?<=[.;])\s", text, maxsplit=1)[0]
    return ""


def describe(entry: Path) -> str:
    """What a committed results entry holds, from its README or its markdown table's first line."""
    if entry.is_dir():
        pages = [entry / "README.md"] + sorted(entry.glob("*.md"))
        page = next((p for p in pages if p.exists()), None)
        return first_line(page) if page else f"{sum(1 for _ in entry.iterdir())} files (raw data)"
    if entry.suffix == ".md":
        return first_line(entry)
    return {".png": "a figure", ".txt": "a log", ".json": "the raw data"}.get(entry.suffix, "")


def every_result() -> list[str]:
    """Every file and folder under bench/results/, linked: those the sections above summarize marked,
    the others (investigations the design notes and HISTORY.md quote) with a line on what they hold.
    A JSON file beside its own markdown table is listed with the table."""
    summarized = {s.file.split("/")[0] for s in SECTIONS}
    rows = []
    for entry in sorted(RESULTS.iterdir()):
        if entry.suffix == ".json" and entry.with_suffix(".md").exists():
            continue
        name = entry.name + ("/" if entry.is_dir() else "")
        mark = "summarized above" if entry.name in summarized or entry.with_suffix(".json").name in summarized \
            else describe(entry)
        rows.append(f"* [`bench/results/{name}`](../bench/results/{name}): {mark}")
    return ["## Every committed result", ""] + rows + [""]


def render() -> str:
    md = ["# Performance", "",
          "Generated by `python bench/report.py` from the results committed in `bench/results/`; edit those, "
          "not this page.", "", PROTOCOL, RUNNING]
    for s in SECTIONS:
        md += section(s)
    md += tools()
    md += every_result()
    md += ["## Results files summarized here", ""] + [f"* `bench/results/{s.file}`" for s in SECTIONS]
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=PAGE)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args()
    page = render()
    if args.check:
        if args.out.read_text() != page:
            sys.exit(f"{args.out} is stale: run python bench/report.py")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)


if __name__ == "__main__":
    main()
