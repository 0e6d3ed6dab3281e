"""coda.models.LlamaForCausalLM trained under FSDP2 (issue 13): per-step loss, tokens/s per GPU, peak memory.

    torchrun --standalone --nproc_per_node=8 bench/tools/train_fsdp.py --model 8b --shape 2x4096 --out DIR
    torchrun --standalone --nproc_per_node=2 bench/tools/train_fsdp.py --model 1b --steps 20 --reference --out DIR
    torchrun --standalone --nproc_per_node=2 bench/tools/train_fsdp.py --tiny --out DIR     # CPU, gloo
    python bench/tools/train_fsdp.py --tiny --out DIR                                      # one process, world 1

The model is built from a config (random init from --seed, the same on every rank, fp32), then
`fully_shard` is applied to every LlamaLayer and to the model with MixedPrecisionPolicy(param_dtype
= --param-dtype (bf16), reduce_dtype=fp32): each rank holds a 1/N shard of the fp32 weights, gradients
and AdamW state, the layers' bf16 weights are all-gathered per layer (layer i+1's gather issued from
layer i's forward) and resharded after its forward, the gradients are reduce-scattered in fp32 by
FSDP2. Each rank trains on its own synthetic batch (--shape is per rank: batch x seq) for --warmup +
--steps AdamW steps; the loss printed is the mean over ranks. Step time: wall clock around the step
(after a device synchronize); tokens/s per GPU = batch * seq / step time; peak memory =
max_memory_allocated over the timed steps, the largest of the ranks (CPU: the processes' peak RSS).

--reference: afterwards rank 0 alone trains the unsharded model from the same init on the same
batches (all ranks' batches one after another each step, each on a --param-dtype copy of the fp32
weights, gradients summed in fp32 and divided by N, the same AdamW): what FSDP2 computes, without
sharding (so it needs the whole model on one device: about 18 bytes per parameter, with --layers to
shrink it). The JSON gets both loss curves and their largest difference (0 on the CPU, where every
kernel is deterministic; on a GPU attention's backward may not be).

On a GPU, NCCL_NVLS_ENABLE is set to 0 (NVLink multicast stays off). Output: DIR/train_fsdp.json
and DIR/train_fsdp.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared harness

# Llama-3.2-1B and Llama-3-8B shapes (coda LlamaConfig fields), and a tiny one for the CPU.
MODELS = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
               rope_scaling=(32.0, 1.0, 4.0, 8192.0), tie_word_embeddings=True),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
               rope_scaling=(8.0, 1.0, 4.0, 8192.0), tie_word_embeddings=False),
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True),
}


def log(msg: str) -> None:
    print(f"[train_fsdp] {msg}", flush=True)


def setup_env(gpu: bool) -> None:
    """Before the process group exists: NVLink multicast off on a GPU (whatever the caller set), and
    the rendezvous variables of a one-process run when not started by torchrun."""
    if gpu:
        if os.environ.get("NCCL_NVLS_ENABLE", "0") != "0":
            log(f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} overridden to 0")
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def build(args, device):
    """The model from --seed, identical on every rank (so the shards form one model, and the
    reference starts where the sharded run did)."""
    import torch

    from coda.models.llama import LlamaConfig, LlamaForCausalLM

    shape = dict(MODELS[args.model])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    torch.manual_seed(args.seed)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**shape), checkpoint=args.checkpoint)


def batch(args, step: int, rank: int, device):
    """Rank `rank`'s synthetic tokens at `step`: a random half sequence repeated once per row (the
    second half is learnable), labels = inputs."""
    import torch

    b, s = args.batch, args.seq
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    half = torch.randint(0, MODELS[args.model]["vocab_size"], (b, (s + 1) // 2), generator=g)
    return torch.cat([half, half], 1)[:, :s].to(device)


def optimizer(args, params, gpu: bool):
    import torch

    # foreach=False on the CPU: per-element updates, so a shard's equals the whole tensor's.
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1, **({"fused": True} if gpu else {"foreach": False}))


def sync(gpu: bool) -> None:
    import torch

    if gpu:
        torch.cuda.synchronize()


def peak_gib(gpu: bool) -> float:
    import torch

    if gpu:
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def train_sharded(args, gpu: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    t0 = time.time()
    model = build(args, device)
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, args.param_dtype), reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    layers = list(model.layers)
    for this, nxt in zip(layers, layers[1:]):
        this.set_modules_to_forward_prefetch([nxt])
    opt = optimizer(args, model.parameters(), gpu)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        log(f"{args.model} ({len(layers)} layers, {n_params / 1e6:.1f}M parameters) sharded over {world} "
            f"{'GPUs' if gpu else 'CPU processes'} in {time.time() - t0:.1f} s; "
            f"{args.batch}x{args.seq} tokens per rank")
    steps = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and gpu:
            torch.cuda.reset_peak_memory_stats()
        ids = batch(args, step, rank, device)
        sync(gpu)
        t = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(gpu)
        ms = (time.perf_counter() - t) * 1e3
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)  # the mean over ranks (gloo has no AVG)
        row = {"step": step, "loss": mean.item() / world, "ms": ms, "timed": step >= args.warmup,
               "tokens_per_s_per_gpu": args.batch * args.seq / ms * 1e3}
        steps.append(row)
        if rank == 0:
            log(f"step {step + 1}/{args.warmup + args.steps}{'' if row['timed'] else ' (warm-up)'}: "
                f"loss {row['loss']:.4f}, {ms:.1f} ms, {row['tokens_per_s_per_gpu'] / 1e3:.2f}k tokens/s per "
                f"{'GPU' if gpu else 'rank'}")
    peak = torch.tensor([peak_gib(gpu)], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    timed = [r["ms"] for r in steps if r["timed"]] or [r["ms"] for r in steps]
    step_ms = statistics.median(timed)
    return {"world": world, "parameters": n_params, "steps": steps, "step_ms": step_ms,
            "tokens_per_s_per_gpu": args.batch * args.seq / step_ms * 1e3, "peak_mem_gib": peak.item(),
            "peak_kind": "max_memory_allocated" if gpu else "peak RSS"}


def train_reference(args, world: int, gpu: bool) -> tuple[list[float], float]:
    """The unsharded run (see the module docstring): per step, the mean of the ranks' losses, and
    the median time of the timed steps (at world size 1 the same work as the sharded step, less
    FSDP2's casts and collectives)."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    master = build(args, device)
    work = build(args, "meta").to(getattr(torch, args.param_dtype))
    work.to_empty(device=device)
    work.train(master.training)
    opt = optimizer(args, master.parameters(), gpu)
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        sync(gpu)
        t0 = time.perf_counter()
        with torch.no_grad():
            for w, p in zip(work.parameters(), master.parameters()):
                w.copy_(p)
        grads = [torch.zeros_like(p) for p in master.parameters()]
        total = torch.zeros(1, device=device)  # fp32, as the sharded run's all-reduce sums
        for r in range(world):
            ids = batch(args, step, r, device)
            loss = work(ids, labels=ids).loss
            loss.backward()
            for acc, w in zip(grads, work.parameters()):
                acc += w.grad.float()
                w.grad = None
            total += loss.detach().float()
        for p, acc in zip(master.parameters(), grads):
            p.grad = acc / world
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item() / world)
        sync(gpu)
        if step >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        log(f"reference step {step + 1}/{args.warmup + args.steps}: loss {losses[-1]:.4f}")
    return losses, statistics.median(times)


def markdown(data: dict) -> str:
    m, r = data["meta"], data["result"]
    lines = ["# train_fsdp", "", f"{m['device']} x {r['world']}, torch {m['torch']}, triton {m['triton']}; "
             f"{m['model']} ({m['layers']} layers, {r['parameters'] / 1e6:.1f}M parameters), {m['batch']}x{m['seq']} "
             f"tokens per rank, params {m['param_dtype']} / reduce fp32, activation checkpointing "
             f"{'on' if m['checkpoint'] else 'off'}.",
             "", f"Median step {r['step_ms']:.1f} ms over {m['steps']} timed steps: "
             f"{r['tokens_per_s_per_gpu'] / 1e3:.2f}k tokens/s per GPU, peak {r['peak_mem_gib']:.2f} GiB "
             f"({r['peak_kind']}, largest rank).", ""]
    ref = data.get("reference")
    lines += ["| step | loss | " + ("reference loss | " if ref else "") + "ms | tokens/s per GPU |",
              "|---|---|" + ("---|" if ref else "") + "---|---|"]
    for i, s in enumerate(r["steps"]):
        cells = [str(s["step"] + 1) + ("" if s["timed"] else " (warm-up)"), f"{s['loss']:.4f}"]
        cells += [f"{ref['losses'][i]:.4f}"] if ref else []
        cells += [f"{s['ms']:.1f}", f"{s['tokens_per_s_per_gpu'] / 1e3:.2f}k"]
        lines.append("| " + " | ".join(cells) + " |")
    if ref:
        lines += ["", f"Unsharded reference (rank 0 alone, the same init, batches and mixed precision): "
                  f"max |loss - reference| = {ref['max_abs_diff']:.3g}"
                  + (f"; its median step {ref['step_ms']:.1f} ms (all ranks' batches one after another)."
                     if "step_ms" in ref else ".")]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="1b")
    ap.add_argument("--layers", type=int, default=0, help="override the model's layer count")
    ap.add_argument("--shape", default="2x4096", help="batch x seq per rank")
    ap.add_argument("--steps", type=int, help="timed steps (default 10; --tiny: 2)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 3; --tiny: 1)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing per layer")
    ap.add_argument("--reference", "--world1-reference", dest="reference", action="store_true",
                    help="also train unsharded on rank 0 and compare the losses")
    ap.add_argument("--tiny", action="store_true", help="CPU with gloo, the tiny model, 2x16 tokens, 1+2 steps")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.tiny:
        args.model, args.shape = "tiny", "2x16"
    args.steps = (2 if args.tiny else 10) if args.steps is None else args.steps
    args.warmup = (1 if args.tiny else 3) if args.warmup is None else args.warmup
    args.batch, args.seq = (int(v) for v in args.shape.split("x"))

    import torch

    gpu = torch.cuda.is_available() and not args.tiny
    setup_env(gpu)
    import coda  # noqa: F401  (before Triton is imported: it picks the interpreter without a GPU)
    import torch.distributed as dist

    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo")
    if not gpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    result = train_sharded(args, gpu)
    rank, world = dist.get_rank(), dist.get_world_size()
    # The sharded model and its optimizer are freed here, while the process group and the
    # interpreter are alive: FSDP's modules hold reference cycles (hooks), which only the
    # collector frees, and a gloo work object left to interpreter shutdown aborted a rank
    # ("terminate called without an active exception") in one CPU run.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()  # the reference runs on rank 0 alone, without collectives
    if rank != 0:
        return
    import triton

    import harness

    data = {"meta": {"commit": harness.commit(), "torch": torch.__version__, "triton": triton.__version__, "coda": coda.__version__,
                     "python": platform.python_version(),
                     "device": torch.cuda.get_device_name() if gpu else "cpu (gloo)", "model": args.model,
                     "layers": args.layers or MODELS[args.model]["num_hidden_layers"], "batch": args.batch,
                     "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "lr": args.lr, "seed": args.seed,
                     "param_dtype": args.param_dtype, "checkpoint": args.checkpoint,
                     "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")},
            "result": result}
    if args.reference:
        losses, ref_ms = train_reference(args, world, gpu)
        data["reference"] = {"losses": losses, "step_ms": ref_ms, "max_abs_diff": max(
            abs(a - s["loss"]) for a, s in zip(losses, result["steps"]))}
        log(f"reference: max |loss - reference| = {data['reference']['max_abs_diff']:.3g}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_fsdp.json").write_text(json.dumps(data, indent=1))
    (args.out / "train_fsdp.md").write_text(markdown(data))
    log(f"median step {result['step_ms']:.1f} ms, {result['tokens_per_s_per_gpu'] / 1e3:.2f}k tokens/s per GPU, "
        f"peak {result['peak_mem_gib']:.2f} GiB; wrote {args.out / 'train_fsdp.json'} and train_fsdp.md")


if __name__ == "__main__":
    main()
