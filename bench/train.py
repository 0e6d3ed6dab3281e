"""End-to-end training step per model family: tokens/s and peak memory per variant.

Models (transformers classes at the published shapes, random init):
  llama3.2-1b  D=2048, FFN=8192, 16 layers, 32 q / 8 kv heads of 64, V=128256, tied, rope llama3
  qwen3-1.7b   D=2048, FFN=6144, 28 layers, 16 q / 8 kv heads of 128, QK-norm, V=151936, tied
  gemma3-1b    D=1152, FFN=6912, 26 layers, 4 q / 1 kv heads of 256, V=262144, tied, sliding window 512
               on 5 of every 6 layers
  qwen2.5-1.5b D=1536, FFN=8960, 28 layers, 12 q / 2 kv heads of 128, q/k/v biases, V=151936, tied
  phi3-mini    D=3072, FFN=8192, 32 layers, 32 heads of 96, V=32064, untied, fused qkv and gate/up
               projections, sliding window 2047 (Phi-3-mini-4k's shape)
  olmo2-1b     D=2048, FFN=8192, 16 layers, 16 heads of 128, V=100352, untied; post-norms, whole-width
               q/k norms (OLMo-2-0425-1B's shape)
Variants, each in its own process (patching libraries change classes globally):
  hf_eager      the transformers model (SDPA attention; eager where the model has no SDPA path: gpt-oss)
  hf_liger      Liger-Kernel's instance patching for the model's family
  coda          coda's model of the same weights (coda.models.from_hf)
  coda_compile  torch.compile(fullgraph=True) of it
  coda_patch    coda.patch on the transformers model
  coda_tuned    coda with CODA_AUTOTUNE=1: the tuning cache's configs (fill it first with `coda tune
                --hf-config ...` at the same shapes; a key not in it is tuned during the warm-up)
Before it is timed, each variant's logits on the first sequence are checked against transformers'
on the same weights (coda_compile's before it is compiled): their relative error against
transformers' in the same dtype and in fp32 is in its row, and over CHECK_TOLERANCE or twice
transformers' own error against fp32, whichever is larger, the variant fails. A coda variant for a
family coda does not support (from_hf raises ValueError, coda.patch TypeError) is a row marked
skipped, with the error's text; a variant that fails otherwise is a note.
Step: forward, backward, fused AdamW, bf16 parameters, synthetic tokens (labels = inputs). With
--packed each row holds documents of seq/8 to seq/2 tokens (512-2048 at 4096): position_ids restart
at 0 per document and the first token of each document is not a target. Per variant: warm-up steps,
the median of timed steps (CUDA events; wall clock on the CPU), peak memory (max_memory_allocated
over the timed steps) and one profiled step's kernel time split into GEMMs / attention / the rest.

    python bench/train.py --out DIR                                   # every model and variant (GPU)
    python bench/train.py --out DIR --models qwen3-1.7b --variants hf_eager,coda --packed
    python bench/train.py --tiny --out DIR                            # CPU smoke: tiny models, 1+1 steps
    python bench/train.py --merge A/train.json B/train.json --out bench/results --note "..."

Rows accumulate in DIR/train.json (a rerun replaces the rows it measures); --merge combines the
files of several device calls into bench/results/train.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

VARIANTS = ("hf_eager", "hf_liger", "coda", "coda_compile", "coda_patch", "coda_tuned")
DEFAULT_VARIANTS = VARIANTS[:-1]  # coda_tuned only when asked: it needs a filled tuning cache
# A variant's logits against transformers' in fp32 on the same (bf16) weights and sequence, relative
# error: within this or twice transformers' own bf16 error, whichever is larger. bf16 noise was ~0.004 at
# --tiny and 0.05 at Phi-3-mini's 32 layers (H100: Liger 0.052, coda 0.057 against HF in bf16); coda's
# Llama model reading a Qwen3 checkpoint (no QK-norm) was 0.32 off.
CHECK_TOLERANCE = 0.05
GEMM_KERNELS = ("gemm", "coda_", "cutlass", "xmma", "nvjet", "cublas", "matmul", "_mm_", "sm90_", "wgmma")
ATTENTION_KERNELS = ("flash", "fmha", "attention", "attn", "sdpa")


@dataclass(frozen=True)
class Family:
    """A model: its transformers config and model classes, the config at the published shape, and
    what --tiny changes (the family's structure kept: QK-norm, head counts' ratio, sliding windows)."""

    config_class: str
    model_class: str
    config: dict
    tiny: dict

    def shape(self, tiny: bool, layers: int) -> dict:
        """The config's fields: the published ones, or --tiny's; `layers` (when set) layers."""
        shape = dict(self.config, **(self.tiny if tiny else {}))
        return {**shape, "num_hidden_layers": layers} if layers else shape


_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=128)
MODELS = {
    "llama3.2-1b": Family("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        tiny=dict(_TINY, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "qwen3-1.7b": Family("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), tiny=_TINY),
    "gemma3-1b": Family("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, vocab_size=262144, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768,
        query_pre_attn_scalar=256, sliding_window=512),  # (every 6th layer global: transformers' default pattern)
        tiny=dict(_TINY, num_key_value_heads=1, query_pre_attn_scalar=16, sliding_window=4)),
    "qwen2.5-1.5b": Family("Qwen2Config", "Qwen2ForCausalLM", dict(  # q/k/v biases
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), tiny=_TINY),
    "phi3-mini": Family("Phi3Config", "Phi3ForCausalLM", dict(  # fused qkv_proj and gate_up_proj
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=32064, tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=4096,
        original_max_position_embeddings=4096, sliding_window=2047, pad_token_id=32000,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        tiny=dict(_TINY, num_key_value_heads=4, sliding_window=5, pad_token_id=0)),
    "olmo2-1b": Family("Olmo2Config", "Olmo2ForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=100352, tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), tiny=dict(_TINY, num_key_value_heads=4)),
    "smollm3-3b": Family("SmolLM3Config", "SmolLM3ForCausalLM", dict(  # every 4th layer without RoPE
        hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
        vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=65536,
        pad_token_id=128004, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0}),
        tiny=dict(_TINY, num_hidden_layers=4, pad_token_id=0)),
    "granite3.3-2b": Family("GraniteConfig", "GraniteForCausalLM", dict(  # its four multipliers
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=49159, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
        attention_multiplier=0.015625, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0}), tiny=_TINY),
    # RoPE over interleaved pairs of half of each head, q/k/v biases, norms on the attention and MLP
    # outputs; 9B: all 40 layers' weights and AdamW states do not fit 80 GB with the activations, so
    # time it with --layers (e.g. 12)
    "glm4-9b": Family("Glm4Config", "Glm4ForCausalLM", dict(
        hidden_size=4096, intermediate_size=13696, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=2,
        head_dim=128, vocab_size=151552, tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=32768,
        attention_bias=True, pad_token_id=151329,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        tiny=dict(_TINY, pad_token_id=0)),
    # YaRN and Llama 4's query scale by position (1 below 16384 tokens); Liger has no kernels for it
    "ministral3-3b": Family("Ministral3Config", "Ministral3ForCausalLM", dict(
        hidden_size=3072, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=131072, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=262144,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                         "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}),
        tiny=dict(_TINY, rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                          "original_max_position_embeddings": 4, "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "llama_4_scaling_beta": 0.1})),
    # coda.patch only (HF's experts, router, attention with sinks, and RoPE kept: 32 experts, top 4); time
    # it with --layers (e.g. 8)
    "gpt-oss-20b": Family("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, vocab_size=201088, tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=131072,
        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
        tiny=dict(_TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)),
    # coda.patch only (HF's router and experts kept: 128, top 8); 30B: time it with --layers (e.g. 4)
    "qwen3-30b-a3b": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=40960,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        tiny=dict(_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
}


def log(msg: str) -> None:
    print(f"[train] {msg}", flush=True)


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

class Unsupported(Exception):
    """coda refused the family (its ValueError or TypeError): the row is recorded as skipped."""


def hf_model(family: Family, device: str, seed: int, tiny: bool, layers: int):
    """The transformers model in bf16, its rotary inverse frequencies kept in fp32: `.to(bfloat16)`
    would round them too, RoPE angles off by up to pos * 2**-9 radians (whole turns at pos 4096), a
    different function from the fp32-frequency RoPE that coda computes from the config."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, family.config_class)(**family.shape(tiny, layers))
    # SDPA where the model class has it (gpt-oss's sinks have none: eager, transformers' default for it)
    model_class = getattr(transformers, family.model_class)
    cfg._attn_implementation = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    # Training builds no KV cache; with one (the config's default) transformers skips its per-document
    # masking of packed rows and attends across documents.
    cfg.use_cache = False
    with torch.device(device):
        hf = model_class(cfg)
    freqs = {name: buf.clone() for name, buf in hf.named_buffers() if name.endswith("inv_freq")}
    hf = hf.to(torch.bfloat16)
    for name, buf in freqs.items():
        owner, attr = hf.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        setattr(owner, attr, buf)
    return hf


def coda_from_hf(hf):
    """coda's model of `hf`: coda.models.from_hf where the library has it (every family it supports,
    the others refused); before it, LlamaForCausalLM.from_hf, which reads any config as a Llama one,
    so a family other than llama is refused here rather than measured as a different model."""
    import coda

    from_hf = getattr(coda.models, "from_hf", None)
    if from_hf is None:
        if hf.config.model_type != "llama":
            raise ValueError(f"model_type {hf.config.model_type!r}: this coda has no coda.models.from_hf, and "
                             "LlamaForCausalLM.from_hf takes llama only")
        from_hf = coda.models.LlamaForCausalLM.from_hf
    return from_hf(hf)


def build(variant: str, hf):
    """The variant's model from the transformers model `hf` (patched in place, or converted), not yet
    compiled: what the logits check runs."""
    import coda

    if variant == "hf_eager":
        return hf
    if variant == "hf_liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        if hf.config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:  # (Liger would log it and patch nothing)
            raise ValueError(f"Liger-Kernel has no kernels for model_type {hf.config.model_type!r}")
        _apply_liger_kernel_to_instance(model=hf)
        return hf
    if variant not in ("coda", "coda_compile", "coda_patch", "coda_tuned"):
        raise ValueError(f"unknown variant {variant!r}")
    try:
        return coda.patch(hf) if variant == "coda_patch" else coda_from_hf(hf)
    except (ValueError, TypeError) as exc:
        raise Unsupported(f"{type(exc).__name__}: {exc}") from exc


def fp32_logits(hf, inputs: dict):
    """transformers' logits of the same weights computed in fp32 (a copy: the bf16 model keeps its
    fp32 rotary frequencies), the measure of every variant's and of transformers' own bf16 error."""
    import copy

    import torch

    exact = copy.deepcopy(hf).float()
    with torch.no_grad():
        logits = exact(**inputs).logits.float()
    del exact
    return logits


def relative_error(out, reference) -> float:
    return ((out.float() - reference.float()).norm() / reference.float().norm()).item()


def logits_errors(model, inputs: dict, *references) -> list[float]:
    """The relative errors of the model's logits (one forward) against each of transformers'
    (`references`, the same weights and inputs): each variant is checked before it is timed."""
    import torch

    with torch.no_grad():
        out = model(**inputs).logits
    return [relative_error(out, r) for r in references]


def batches(vocab: int, batch: int, seq: int, packed: bool, device: str, count: int = 4) -> list[dict]:
    """A fixed set of synthetic batches (the same in every process): random token sequences, each
    repeated once inside its row so that there is something to learn. Packed: documents of seq/8 to
    seq/2 tokens, positions restarting at each, no target across a document boundary."""
    import torch

    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(count):
        half = torch.randint(0, vocab, (batch, (seq + 1) // 2), generator=g)
        ids = torch.cat([half, half], 1)[:, :seq]
        step = {"input_ids": ids, "labels": ids.clone()}
        if packed:
            positions = []
            for row in range(batch):
                pos, start = [], 0
                while start < seq:
                    n = int(torch.randint(max(seq // 8, 1), max(seq // 2, 1) + 1, (1,), generator=g))
                    pos.append(torch.arange(min(n, seq - start)))
                    if start:
                        step["labels"][row, start] = -100  # (HF shifts: the previous document does not predict it)
                    start += n
                positions.append(torch.cat(pos))
            step["position_ids"] = torch.stack(positions)
        out.append({k: v.to(device) for k, v in step.items()})
    return out


def run_variant(args) -> dict:
    import coda  # noqa: F401  (before anything imports Triton: it picks the interpreter without a GPU)
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    cuda = device == "cuda"
    batch, seq = (int(v) for v in args.shape.split("x"))
    family = MODELS[args.model]
    row = {"model": args.model, "seq": seq, "batch": batch, "packed": args.packed, "variant": args.variant}
    shape = family.shape(args.tiny, args.layers)
    data = batches(shape["vocab_size"], batch, seq, args.packed, device)
    t0 = time.time()
    hf = hf_model(family, device, args.seed, args.tiny, args.layers)
    check = {k: v[:1] for k, v in data[0].items() if k != "labels"}  # the first sequence, logits returned
    with torch.no_grad():
        reference = hf(**check).logits
    exact = fp32_logits(hf, check)
    hf_err = relative_error(reference, exact)
    try:
        model = build(args.variant, hf)
    except Unsupported as exc:
        return {**row, "skipped": str(exc)[:500]}
    del hf  # (a converted model holds its own weights: the peak below counts the model trained only)
    row["logits_rel_err"], row["logits_fp32_err"] = logits_errors(model, check, reference, exact)
    row["hf_logits_fp32_err"] = hf_err
    del reference, exact
    bound = max(CHECK_TOLERANCE, 2 * hf_err)
    if not row["logits_fp32_err"] < bound:
        raise AssertionError(f"logits off transformers' fp32 by {row['logits_fp32_err']:.3g} (relative), over "
                             f"{bound:.3g} (transformers' own bf16: {hf_err:.3g})")
    if args.variant == "coda_compile":  # the CPU smoke run checks the wiring only
        model = torch.compile(model, fullgraph=True, backend="eager" if device == "cpu" else "inductor")
    row["layers"] = shape["num_hidden_layers"]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, fused=cuda)

    def step(i: int):
        loss = model(**data[i % len(data)]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(args.warmup):
        step(i)
    log(f"{args.variant} {args.model} {args.shape}{' packed' if args.packed else ''}: built and warmed up in "
        f"{time.time() - t0:.0f} s")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = cuda_step_ms(step, args.steps)
    else:
        times = []
        for i in range(args.steps):
            t = time.perf_counter()
            float(step(i))
            times.append((time.perf_counter() - t) * 1e3)
    step_ms = statistics.median(times)
    row.update(step_ms=step_ms, tokens_per_s=batch * seq / step_ms * 1e3,
               peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
    if cuda:
        row["breakdown_ms"], row["top_kernels"] = breakdown(lambda: step(0))
    return row


def cuda_step_ms(step, count: int) -> list[float]:
    """step(0), ..., step(count - 1), each timed with CUDA events (ms)."""
    import torch

    times = []
    for i in range(count):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def breakdown(step, top: int = 30) -> tuple[dict[str, float], list[dict]]:
    """One step's GPU kernel time by category (ms), and its `top` kernels by time (name, launches,
    ms), from torch.profiler: where two variants' categories differ, the kernels say why."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out = {"gemms": 0.0, "attention": 0.0, "other": 0.0}
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            out[category(evt.name)] += evt.device_time / 1e3
            kernels[evt.name].append(evt.device_time / 1e3)
    out["total"] = sum(out.values())
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return out, [{"kernel": name[:160], "launches": len(t), "ms": sum(t)} for name, t in ranked]


# -- the driver: every (model, shape, variant) in a process of its own ------------------------------

def spawn(args, model: str, shape: str, variant: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--shape", shape, "--variant", variant,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr), "--seed", str(args.seed),
           "--layers", str(args.layers)] + ["--tiny"] * args.tiny + ["--packed"] * args.packed
    # every other variant runs untuned, whatever the caller's environment says
    env = {**os.environ, "CODA_AUTOTUNE": "1" if variant == "coda_tuned" else "0"}
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    sys.stderr.write(proc.stderr[-3000:] if proc.returncode else "")
    for line in proc.stdout.splitlines():
        if line.startswith("[train] "):
            print(line, flush=True)
        if line.startswith("ROW "):
            return {**json.loads(line[4:]), "wall_s": round(time.time() - t0, 1)}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"exit {proc.returncode}: {tail[0][:300]}"}


def key(row: dict) -> tuple:
    """What a row measures, and on which GPU (merged rows carry theirs); rows of older files
    (train_llama.json) have no packed flag."""
    return row.get("gpu"), row["model"], row["seq"], row["batch"], row.get("packed", False), row["variant"]


def drive(args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "train.json"
    data = json.loads(path.read_text()) if path.exists() else {"rows": [], "notes": []}
    data["meta"] = meta(args)
    shapes = args.shapes.split(",") if args.shapes else (["2x8"] if args.tiny else ["2x4096"])
    for model in args.models.split(","):
        if model not in MODELS:
            sys.exit(f"unknown model {model!r}: one of {', '.join(MODELS)}")
        for shape in shapes:
            for variant in args.variants.split(","):
                row = spawn(args, model, shape, variant)
                what = f"{model} {shape}{' packed' if args.packed else ''} {variant}"
                if "error" in row:
                    log(f"FAILED {what}: {row['error']}")
                    data["notes"] = [n for n in data["notes"] if not n.startswith(f"{what}:")] + [f"{what}: {row['error']}"]
                else:
                    data["rows"] = [r for r in data["rows"] if key(r) != key(row)] + [row]
                    log(f"{what}: skipped ({row['skipped']})" if "skipped" in row else
                        f"{what}: {row['step_ms']:.1f} ms/step, {row['tokens_per_s'] / 1e3:.1f}k tokens/s, "
                        f"peak {row['peak_mem_gib'] or 0:.1f} GiB")
                path.write_text(json.dumps(data, indent=1))  # after every variant: a later timeout loses nothing


def meta(args) -> dict:
    import torch

    import coda
    import harness

    info = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu",
            "torch": torch.__version__, "python": platform.python_version(), "commit": harness.commit(),
            "coda": coda.__version__,
            "protocol": f"bf16 parameters, fused AdamW (lr {args.lr}), synthetic tokens (labels = inputs); "
                        f"{args.warmup} warm-up steps, median of {args.steps} timed steps (CUDA events; wall clock on "
                        "the CPU); peak = max_memory_allocated over the timed steps; breakdown = one profiled step's "
                        "kernel time; each variant in its own process"}
    for mod, dist in (("transformers", "transformers"), ("triton", "triton"), ("liger_kernel", "liger-kernel")):
        try:  # by distribution: liger_kernel has no __version__
            info[mod] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[mod] = None
    return info


# -- results ---------------------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
    """One line a row: time, throughput, memory, the kernel-time split, tokens/s against the
    transformers variants of the same model, shape, GPU and commit, and the logits check; a skipped row
    says so. GPU and commit columns appear where the rows come from several."""
    peers = ("hf_eager", "hf_liger")
    varying = [c for c in ("gpu", "commit") if len({r[c] for r in rows if r.get(c)}) > 1]
    columns = [{"gpu": "GPU"}.get(c, c) for c in varying] + [
        "model", "batch x seq", "packed", "variant", "ms", "tokens/s", "peak GiB", "GEMMs", "attention",
        "everything else", *(f"vs {p}" for p in peers), "logits vs transformers"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    base = {(key(r), r.get("commit")): r["tokens_per_s"] for r in rows if "tokens_per_s" in r}
    for r in rows:
        model = r["model"] + (f" ({r['layers']} layers)" if r.get("layers") else "")
        head = [r.get(c, "-") for c in varying] + [
            model, f"{r['batch']} x {r['seq']}", "yes" if r.get("packed") else "no", r["variant"]]
        if "skipped" in r:
            lines.append("| " + " | ".join(head + ["skipped"] + ["-"] * (6 + len(peers))) + " |")
            continue
        b = r.get("breakdown_ms") or {}
        ratios = [base.get((key({**r, "variant": p}), r.get("commit"))) for p in peers]
        cells = [f"{r['step_ms']:.1f}", f"{r['tokens_per_s'] / 1e3:.1f}k",
                 "-" if r.get("peak_mem_gib") is None else f"{r['peak_mem_gib']:.1f}",
                 *(f"{b[k]:.1f}" if k in b else "-" for k in ("gemms", "attention", "other")),
                 *(f"{r['tokens_per_s'] / p:.2f}" if p else "-" for p in ratios),
                 "-" if r.get("logits_rel_err") is None else f"{r['logits_rel_err']:.1e}"]
        lines.append("| " + " | ".join(head + cells) + " |")
    return "\n".join(lines)


def markdown(data: dict, name: str) -> str:
    """A results file's page: the machine and versions, the protocol, the note, the table, the skipped
    variants with their reasons, then the notes."""
    m = data["meta"]
    md = [f"# {name}", "", f"{m['gpu']}, torch {m['torch']}, transformers {m.get('transformers')}, "
          f"triton {m.get('triton')}, Liger {m.get('liger_kernel')}, commit {m.get('commit')}.", "", m["protocol"], "",
          *([m["note"], ""] if m.get("note") else []), table(data["rows"]), ""]
    md += [f"* skipped: {r['model']} {r['batch']} x {r['seq']} {r['variant']}: {r['skipped']}"
           for r in data["rows"] if "skipped" in r]
    md += [f"* {n}" for n in data.get("notes", [])]
    return "\n".join(md) + "\n"


def merge(paths: list[Path], out: Path, note: str | None) -> None:
    """One table from the JSON of one or more runs (device calls); a later row replaces an earlier
    one of the same GPU, model, shape, packing and variant; rows are listed by GPU, commit, packing,
    model and variant. Each row keeps its run's GPU and commit, and the meta names the GPUs and
    commits of the rows kept, each once (a loan may give an H100 for an H200)."""
    data: dict = {"rows": [], "notes": []}
    for path in paths:
        part = json.loads(path.read_text())
        part["rows"] = [{**r, "gpu": r.get("gpu", part["meta"]["gpu"]),
                         "commit": r.get("commit", part["meta"].get("commit"))} for r in part["rows"]]
        keys = {key(r) for r in part["rows"]}
        data["rows"] = [r for r in data["rows"] if key(r) not in keys] + part["rows"]
        data["notes"] = [n for n in data["notes"] if n not in part.get("notes", [])] + part.get("notes", [])
        data["meta"] = dict(part["meta"])
    order = {name: i for i, name in enumerate([*MODELS, *VARIANTS])}
    data["rows"].sort(key=lambda r: (r["gpu"], str(r["commit"]), r.get("packed", False), order.get(r["model"], 99),
                                     r["batch"], r["seq"], order.get(r["variant"], 99)))
    data["meta"]["gpu"] = " and ".join(dict.fromkeys(r["gpu"] for r in data["rows"]))
    data["meta"]["commit"] = ", ".join(dict.fromkeys(str(r["commit"]) for r in data["rows"]))
    if note:
        data["meta"]["note"] = note
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(json.dumps(data, indent=1))
    (out / "train.md").write_text(markdown(data, "train"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--shapes", help="batch x seq, e.g. 2x4096,4x8192 (default 2x4096; --tiny 2x8)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--packed", action="store_true", help="documents of seq/8 to seq/2 tokens per row")
    ap.add_argument("--layers", type=int, default=0, help="override the models' layer count")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=540, help="seconds per variant process")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models of each family, 1+1 steps")
    ap.add_argument("--merge", type=Path, nargs="+", help="write <out>/train.{json,md} from measured JSONs")
    ap.add_argument("--note")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out, args.note)
    if args.worker:
        print("ROW " + json.dumps(run_variant(args)), flush=True)
        return
    if args.tiny and "--steps" not in sys.argv:
        args.steps, args.warmup = 1, 1
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1] / "src"))
    drive(args)


if __name__ == "__main__":
    main()
