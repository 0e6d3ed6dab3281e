"""End-to-end training step of a Llama model (issue 12): tokens/s and peak memory per variant.

Variants (each measured in its own process: patching libraries change classes globally):
  hf_eager      transformers LlamaForCausalLM (SDPA attention)
  hf_compile    torch.compile of it
  hf_liger      Liger-Kernel's instance patching (apply_liger_kernel_to_llama(model=...))
  coda          coda.models.LlamaForCausalLM.from_hf (native layouts, logits never materialized)
  coda_compile  torch.compile(fullgraph=True) of it
  coda_patch    coda.patch on the HF model
  (not in the default list: coda_checkpoint, coda with activation checkpointing per layer;
   coda_triton, coda with every GEMM on the Triton backend, CODA_BACKEND=triton;
   hf_fp32, the HF model with its bf16-initialized weights in fp32: the loss curve's reference)
Step: forward, backward, fused AdamW (bf16 parameters, synthetic tokens, labels = inputs). Per
variant: warm-up steps, then the median of timed steps (CUDA events; wall clock on the CPU), peak memory
(max_memory_allocated over the timed steps: weights, AdamW state, activations), and a
torch.profiler breakdown of one step's kernel time into GEMMs / attention / everything else.

    python bench/train_llama.py --out DIR                           # all models, shapes, variants (GPU)
    python bench/train_llama.py --out DIR --models 1b --shapes 2x4096 --variants coda,hf_eager
    python bench/train_llama.py --out DIR --loss-curve 100          # coda vs hf_eager from one init
    python bench/train_llama.py --out DIR --loss-curve 100 --variants hf_eager,coda,coda_triton
    python bench/train_llama.py --out DIR --loss-curve 100 --clip 1.0 --variants hf_eager,hf_liger,coda
    python bench/train_llama.py --tiny --out DIR                    # CPU smoke: a tiny model, every variant
    python bench/train_llama.py --merge A/train_llama.json B/train_llama.json --out bench/results --note "..."

Rows accumulate in DIR/train_llama.json (a rerun replaces the rows it measures); --merge combines
the files of several device calls into one table (bench/results/train_llama.{json,md,png}).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("hf_eager", "hf_compile", "hf_liger", "coda", "coda_compile", "coda_patch")
# Llama-3.2-1B and a Llama-3-8B-shaped model (layers: as many as the time allows).
MODELS = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
}
SHAPES = {"1b": ["2x4096", "4x8192"], "8b": ["2x4096"], "tiny": ["2x8"]}
GEMM_KERNELS = ("gemm", "coda_", "cutlass", "xmma", "nvjet", "cublas", "matmul", "_mm_", "sm90_", "wgmma")
ATTENTION_KERNELS = ("flash", "fmha", "attention", "attn", "sdpa")


def log(msg: str) -> None:
    print(msg, flush=True)


def category(kernel: str) -> str:
    """Which part of the step a GPU kernel's time belongs to (coda's GEMMs are named coda_<epilogue>;
    its row passes, _<name>_kernel, are everything else)."""
    name = kernel.lower()
    if any(k in name for k in ATTENTION_KERNELS):
        return "attention"
    if any(k in name for k in GEMM_KERNELS) and not name.startswith("_"):
        return "gemms"
    return "other"


# -- one variant, in this process ---------------------------------------------------------------

def build(variant: str, model_name: str, device: str, seed: int, layers: int = 0):
    import coda  # noqa: F401  (before anything imports Triton: it picks the interpreter without a GPU)
    import torch
    import transformers

    if variant == "coda_triton":  # read per call by coda's runtime: set before the first GEMM
        os.environ["CODA_BACKEND"] = "triton"
    torch.manual_seed(seed)
    shape = dict(MODELS[model_name])
    if layers:
        shape["num_hidden_layers"] = layers
    if int(transformers.__version__.split(".")[0]) < 5:  # v4: rope_theta + rope_scaling
        rope = shape.pop("rope_parameters")
        shape["rope_theta"] = rope.pop("rope_theta")
        shape["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    cfg = transformers.LlamaConfig(**shape, max_position_embeddings=131072)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(cfg)
    # `.to(bfloat16)` would also round the rotary embedding's inv_freq buffer to bf16: RoPE angles
    # off by up to pos * 2**-9 radians (whole turns at pos 4096), a different function from the
    # fp32-frequency RoPE that coda computes from the config. Kept in fp32, as computed.
    freqs = {name: buf.clone() for name, buf in hf.named_buffers() if name.endswith("inv_freq")}
    hf = hf.to(torch.bfloat16)
    for name, buf in freqs.items():
        owner, attr = hf.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        setattr(owner, attr, buf)
    if variant == "hf_fp32":  # the same (bf16-rounded) weights, trained in fp32
        return hf.float()
    compile_backend = "eager" if device == "cpu" else "inductor"  # the CPU smoke run checks the wiring only
    if variant == "hf_eager":
        return hf
    if variant == "hf_compile":
        return torch.compile(hf, backend=compile_backend)
    if variant == "hf_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=hf)
        return hf
    if variant == "coda_patch":
        return coda.patch(hf)
    if variant not in ("coda", "coda_compile", "coda_checkpoint", "coda_triton"):
        raise ValueError(f"unknown variant {variant!r}")
    model = coda.models.LlamaForCausalLM.from_hf(hf, checkpoint=variant == "coda_checkpoint")
    del hf
    if variant == "coda_compile":
        return torch.compile(model, fullgraph=True, backend=compile_backend)
    return model


def batches(vocab: int, batch: int, seq: int, device: str, count: int = 4):
    """A fixed set of synthetic batches (the same in every process): random token sequences, each
    repeated once inside its row so that there is something to learn."""
    import torch

    g = torch.Generator().manual_seed(1234)
    half = torch.randint(0, vocab, (count, batch, (seq + 1) // 2), generator=g)
    return [torch.cat([h, h], 1)[:, :seq].to(device) for h in half]


def watchdog(timeout: int) -> None:
    """Before the driver's timeout, print where the main thread is: every thread's innermost
    frames (faulthandler, also when the GIL is held), then the main thread's outermost ones down
    to where a recursion starts (a deep recursion hides them from faulthandler's 100 frames),
    last, so that they survive the driver's trimming of stderr to its tail."""
    import threading
    import traceback

    main = threading.main_thread().ident
    faulthandler.dump_traceback_later(max(timeout - 20, 1), exit=False)

    def outer() -> None:
        frame = sys._current_frames().get(main)
        if frame is not None:
            stack = traceback.format_stack(frame)
            # down to a recursion: the first line met for the 4th time (nested module calls
            # repeat a line two or three times), with the recursion's first turns
            seen: dict[str, int] = {}
            end = len(stack)
            for i, entry in enumerate(stack):
                where = entry.splitlines()[0]
                seen[where] = seen.get(where, 0) + 1
                if seen[where] == 4:
                    end = i + 1
                    break
            sys.stderr.write(f"[watchdog] main thread, outermost {end} of {len(stack)} stack entries:\n" + "".join(stack[:end]))
            lowering_failures(frame)
            sys.stderr.flush()

    timer = threading.Timer(max(timeout - 10, 1), outer)
    timer.daemon = True
    timer.start()


def lowering_failures(frame) -> None:
    """Inductor can spend minutes formatting an op's argument IR in `call_function` (torch
    2.11 did it for every implicit fallback's log message: coda_compile, before
    coda.runtime.inductor), and a failed lowering's error message is built the same way: print,
    from each Inductor `call_function` frame on the stack, the op being lowered and, where one
    is being handled, the exception it raised, with that exception's innermost frames."""
    import reprlib
    import traceback

    short = reprlib.Repr()
    short.maxstring, short.maxother = 400, 400
    while frame is not None:
        code = frame.f_code
        if code.co_name == "call_function" and code.co_filename.endswith("_inductor/graph.py"):
            target, exc = frame.f_locals.get("target"), frame.f_locals.get("e")
            sys.stderr.write(f"[watchdog] Inductor was lowering {short.repr(target)}\n")
            if isinstance(exc, BaseException):
                sys.stderr.write(f"[watchdog] which raised {type(exc).__name__}: {short.repr(exc.args)}\n"
                                 + "".join(traceback.format_tb(exc.__traceback__)[-8:]))
        frame = frame.f_back


def run_variant(args) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    cuda = device == "cuda"
    batch, seq = (int(v) for v in args.shape.split("x"))
    t0 = time.time()
    model = build(args.variant, args.model, device, args.seed, args.layers)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, fused=cuda)
    data = batches(MODELS[args.model]["vocab_size"], batch, seq, device)

    grad_norms: list[float] = []

    def step(i: int) -> float:
        ids = data[i % len(data)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if args.clip:  # the total norm before clipping
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, args.clip)))
        elif args.loss_curve:  # the gradient's size per step tells a bad update from a bad forward
            grad_norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params]))))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    layers = args.layers or MODELS[args.model]["num_hidden_layers"]
    row = {"model": args.model, "seq": seq, "batch": batch, "variant": args.variant, "layers": layers}
    if args.clip:
        row["clip"] = args.clip
    if args.loss_curve:
        row["losses"] = [float(step(i)) for i in range(args.loss_curve)]
        row["grad_norms"] = grad_norms
        return row
    for i in range(args.warmup):
        step(i)
    log(f"[train_llama] {args.variant} {args.model} {args.shape}: built and warmed up in {time.time() - t0:.0f} s")
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            float(step(i))
            times.append((time.perf_counter() - t) * 1e3)
    step_ms = statistics.median(times)
    row.update(step_ms=step_ms, tokens_per_s=batch * seq / step_ms * 1e3,
               peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
    if cuda and args.breakdown:
        row["breakdown_ms"] = breakdown(lambda: step(0))
    return row


def breakdown(step) -> dict[str, float]:
    """One step's GPU kernel time by category (ms), from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out = {"gemms": 0.0, "attention": 0.0, "other": 0.0}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            out[category(evt.name)] += evt.device_time / 1e3
    out["total"] = sum(out.values())
    return out


# -- the driver: every (model, shape, variant) in a process of its own ------------------------------

def spawn(args, model: str, shape: str, variant: str, loss_curve: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--shape", shape, "--variant", variant,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr), "--seed", str(args.seed),
           "--loss-curve", str(loss_curve), "--layers", str(args.layers), "--timeout", str(args.timeout),
           "--clip", str(args.clip)] + (["--tiny"] if args.tiny else []) + \
          (["--no-breakdown"] if not args.breakdown else [])
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:  # the worker dumped its stack first (see watchdog)
        stacks = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        sys.stderr.write(stacks[-6000:])
        return {"error": f"timed out after {args.timeout} s"}
    sys.stderr.write(proc.stderr[-3000:] if proc.returncode else "")
    for line in proc.stdout.splitlines():
        if line.startswith("[train_llama] "):
            log(line)
        if line.startswith("ROW "):
            row = json.loads(line[4:])
            row["wall_s"] = round(time.time() - t0, 1)
            return row
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"exit {proc.returncode}: {tail[0][:300]}"}


def key(row: dict) -> tuple:
    return row["model"], row["seq"], row["batch"], row["variant"], "losses" in row, row.get("clip", 0.0)


def drive(args) -> None:

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "train_llama.json"
    data = json.loads(path.read_text()) if path.exists() else {"rows": [], "notes": []}
    data["meta"] = meta(args)
    models = ["tiny"] if args.tiny else args.models.split(",")
    jobs = []
    if args.loss_curve:
        model, shape = models[0], (args.shapes.split(",")[0] if args.shapes else SHAPES[models[0]][0])
        jobs = [(model, shape, v, args.loss_curve) for v in (args.variants or "hf_eager,coda").split(",")]
    else:
        for model in models:
            for shape in (args.shapes.split(",") if args.shapes else SHAPES[model]):
                jobs += [(model, shape, v, 0) for v in (args.variants or ",".join(VARIANTS)).split(",")]
    for model, shape, variant, curve in jobs:
        row = spawn(args, model, shape, variant, curve)
        if "error" in row:
            note = f"{model} {shape} {variant}{' loss curve' if curve else ''}: {row['error']}"
            log(f"[train_llama] FAILED {note}")
            data["notes"] = [n for n in data["notes"] if not n.startswith(f"{model} {shape} {variant}:")] + [note]
        else:
            data["rows"] = [r for r in data["rows"] if key(r) != key(row)] + [row]
            if not curve:
                log(f"[train_llama] {model} {shape} {variant}: {row['step_ms']:.1f} ms/step, "
                    f"{row['tokens_per_s'] / 1e3:.1f}k tokens/s, peak {row['peak_mem_gib'] or 0:.1f} GiB"
                    + (f", {row['breakdown_ms']}" if row.get("breakdown_ms") else ""))
        path.write_text(json.dumps(data, indent=1))  # after every job: a later timeout loses nothing


def meta(args) -> dict:
    import torch

    import harness

    info = {"torch": torch.__version__, "python": platform.python_version(), "commit": harness.commit(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu",
            "protocol": f"bf16 parameters, fused AdamW (lr {args.lr}), synthetic tokens (labels = inputs); "
                        f"{args.warmup} warm-up steps, median of {args.steps} timed steps (CUDA events; wall clock on the CPU); peak = "
                        "max_memory_allocated over the timed steps; breakdown = one profiled step's kernel time; "
                        "each variant in its own process"}
    import coda

    info["coda"] = coda.__version__
    for mod, dist in (("transformers", "transformers"), ("triton", "triton"), ("liger_kernel", "liger-kernel")):
        try:  # by distribution: liger_kernel has no __version__
            info[mod] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[mod] = None
    return info


# -- results ---------------------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
    lines = ["| model | batch x seq | variant | ms | tokens/s | peak GiB | GEMMs | attention | everything else |"
             " vs hf_eager | vs hf_compile | vs hf_liger |", "|" + "---|" * 12]
    perf = [r for r in rows if "step_ms" in r]
    base = {(r["model"], r["batch"], r["seq"], r["variant"]): r["tokens_per_s"] for r in perf}
    for r in perf:
        b = r.get("breakdown_ms") or {}
        ratios = [base.get((r["model"], r["batch"], r["seq"], peer)) for peer in ("hf_eager", "hf_compile", "hf_liger")]
        cells = [r["model"] + (f" ({r['layers']} layers)" if r.get("layers") else ""), f"{r['batch']} x {r['seq']}", r["variant"], f"{r['step_ms']:.1f}",
                 f"{r['tokens_per_s'] / 1e3:.1f}k", "-" if r.get("peak_mem_gib") is None else f"{r['peak_mem_gib']:.1f}",
                 *(f"{b[k]:.1f}" if k in b else "-" for k in ("gemms", "attention", "other")),
                 *(f"{r['tokens_per_s'] / p:.2f}" if p else "-" for p in ratios)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_table(rows: list[dict]) -> list[str]:
    """Each loss curve's distance to hf_eager's (and to hf_fp32's, where measured) over their common
    steps, per clipping setting: the curves of two correct bf16 implementations differ too, so
    hf_liger's distance is the yardstick for coda's."""
    curves = [r for r in rows if "losses" in r]
    md = []
    for clip in sorted({r.get("clip", 0.0) for r in curves}):
        group = {r["variant"]: r for r in curves if r.get("clip", 0.0) == clip}
        refs = [v for v in ("hf_eager", "hf_fp32") if v in group]
        if not refs:
            continue
        md += [f"Loss curves, {'no clipping' if not clip else f'gradient norm clipped to {clip}'}: |variant - reference| "
               "per step over the steps both ran (mean over the first 20 / mean over all / max), last step's loss, largest gradient norm.", "",
               "| variant | steps | " + " | ".join(f"vs {r}" for r in refs) + " | last loss | max grad norm |",
               "|---|---|" + "---|" * len(refs) + "---|---|"]
        for v, r in group.items():
            cells = []
            for ref in refs:
                d = [abs(a - b) for a, b in zip(r["losses"], group[ref]["losses"])]
                cells.append(f"{sum(d[:20]) / len(d[:20]):.4f} / {sum(d) / len(d):.4f} / {max(d):.4f}")
            md.append(f"| {v} | {len(r['losses'])} | " + " | ".join(cells) +
                      f" | {r['losses'][-1]:.4f} | {max(r.get('grad_norms') or [float('nan')]):.2f} |")
        md.append("")
    return md


def plot_losses(rows: list[dict], path: Path) -> bool:
    curves = [r for r in rows if "losses" in r]
    if not curves:
        return False
    try:
        import matplotlib
    except ImportError:
        log("[train_llama] no matplotlib: loss-curve PNG skipped")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clips = sorted({r.get("clip", 0.0) for r in curves})
    fig, axes = plt.subplots(1, len(clips), figsize=(7 * len(clips), 4), squeeze=False)
    for ax, clip in zip(axes[0], clips):
        for r in curves:
            if r.get("clip", 0.0) == clip:
                ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{r['variant']} ({r['model']}, {r['batch']}x{r['seq']})")
        ax.set_title("no clipping" if not clip else f"gradient norm clipped to {clip}")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def merge(args) -> None:
    """One table from the JSON of one or more runs (device calls); a later row replaces an earlier
    one of the same model, shape and variant."""
    data: dict = {"rows": [], "notes": []}
    for path in args.merge:
        part = json.loads(path.read_text())
        keys = {key(r) for r in part["rows"]}
        data["rows"] = [r for r in data["rows"] if key(r) not in keys] + part["rows"]
        data["notes"] = [n for n in data["notes"] if n not in part.get("notes", [])] + part.get("notes", [])
        data["meta"] = part["meta"]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.note:
        data["meta"]["note"] = args.note
    m = data["meta"]
    md = ["# train_llama", "", f"{m['gpu']}, torch {m['torch']}, transformers {m.get('transformers')}, "
          f"triton {m.get('triton')}, Liger {m.get('liger_kernel')}.", "", m["protocol"], "",
          *([args.note, ""] if args.note else []), table(data["rows"]), ""]
    md += curve_table(data["rows"])
    if plot_losses(data["rows"], args.out / "train_llama.png"):
        md += ["![loss curves](train_llama.png)", ""]
    md += [f"* {n}" for n in data.get("notes", [])]
    (args.out / "train_llama.json").write_text(json.dumps(data, indent=1))
    (args.out / "train_llama.md").write_text("\n".join(md) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--shapes", help="batch x seq, e.g. 2x4096,4x8192 (default: per model)")
    ap.add_argument("--variants", help=f"default: {','.join(VARIANTS)}; with --loss-curve, hf_eager,coda")
    ap.add_argument("--layers", type=int, default=0, help="override the models' layer count (8b: 8 by default)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=540, help="seconds per variant process")
    ap.add_argument("--loss-curve", type=int, default=0, metavar="STEPS", help="coda vs hf_eager losses instead")
    ap.add_argument("--clip", type=float, default=0.0, help="clip the gradient's total norm to this (0: no clipping)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny model (every variant, 1+1 steps)")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    ap.add_argument("--merge", type=Path, nargs="+", help="write <out>/train_llama.{json,md,png} from measured JSONs")
    ap.add_argument("--note")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.merge:
        return merge(args)
    if args.worker:  # where it is, should the driver's timeout come (a compile that never ends)
        watchdog(args.timeout)
        print("ROW " + json.dumps(run_variant(args)), flush=True)
        return
    if args.tiny and "--steps" not in sys.argv:
        args.steps, args.warmup = 1, 1
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1] / "src"))
    drive(args)


if __name__ == "__main__":
    main()
