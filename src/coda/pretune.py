"""Tuning ahead of time (`coda tune`): epilogues on given shapes, or every GEMM of a model's
training step, so that later runs with CODA_AUTOTUNE=1 read the tuning cache instead of
stalling on their first calls.

The model is built from a transformers config (a config.json, or a config class named with
field overrides) as coda.models.LlamaForCausalLM, randomly initialized, bf16, on the GPU. One
forward+backward at the default configs finds the step's GEMM keys (and compiles the defaults,
which the tuner times first); a second one, with tuning on, tunes each key not yet cached.
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path

import torch

from . import runtime
from .epilogue import Epilogue
from .models import LlamaConfig, LlamaForCausalLM
from .runtime import autotune, launch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NO_GPU = "tuning needs a CUDA GPU (kernels here run in Triton's interpreter)"


class TuneError(Exception):
    """A request `coda tune` cannot carry out, with a one-line reason for the user."""


def load_epilogue(target: str) -> Epilogue | None:
    """`plain` (no epilogue) or `package.module:name` naming a @coda.epilogue."""
    if target == "plain":
        return None
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise TuneError(f"{target!r} is not 'plain' or 'module:epilogue'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TuneError(f"cannot import {module_name}: {exc}") from None
    ep = getattr(module, attr, None)
    if not isinstance(ep, Epilogue):
        raise TuneError(f"{target} is not a @coda.epilogue (got {type(ep).__name__})")
    return ep


def hf_config(spec: str, overrides: dict[str, object]) -> object:
    """A transformers config: from a config.json (or a directory holding one), or the config class
    of that name built with `overrides`. Overrides must name fields the config has."""
    try:
        import transformers
    except ImportError:
        raise TuneError("--hf-config needs transformers: pip install 'coda-gemm[hf]'") from None
    path = Path(spec)
    if path.exists():
        try:
            base = transformers.AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise TuneError(f"cannot read a transformers config from {path}: {exc}") from None
    else:
        cls = getattr(transformers, spec, None)
        if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
            raise TuneError(f"--hf-config {spec!r} is neither a file nor a transformers config class "
                            "(e.g. LlamaConfig)")
        base = cls()
    unknown = sorted(set(overrides) - set(base.to_dict()))
    if unknown:
        raise TuneError(f"{type(base).__name__} has no field {', '.join(unknown)}")
    if path.exists():
        return transformers.AutoConfig.from_pretrained(path, **overrides)
    return type(base)(**overrides)


def model_shape(config: object) -> LlamaConfig:
    """The coda model's shape for a transformers config, or a TuneError saying why it has none."""
    try:
        return LlamaConfig.from_hf(config)
    except (AttributeError, TypeError, ValueError) as exc:
        raise TuneError(str(exc)) from None


def _operands(graph, m: int, n: int, dtype: torch.dtype, ints: list[str]) -> dict[str, object]:
    """Random operands of each of the epilogue's kinds; `ints` names integer-id operands."""
    ops: dict[str, object] = {}
    for s in graph.operands:
        cols = int(n * s.frac_width)
        if s.name in ints:
            size = {"scalar": (), "vec_m": (m,), "vec_n": (cols,), "tile": (m, cols)}[s.kind.value]
            ops[s.name] = torch.randint(0, n, size, device="cuda")
        elif s.kind.value == "scalar":
            ops[s.name] = 1.0
        elif s.kind.value == "vec_m":
            ops[s.name] = torch.rand(m, device="cuda")
        elif s.kind.value == "vec_n":
            ops[s.name] = torch.rand(cols, device="cuda").to(dtype)
        else:
            ops[s.name] = torch.randn(m, cols, device="cuda").to(dtype)
    return ops


def require_gpu() -> None:
    """TuneError where kernels run in Triton's interpreter: there is nothing to time."""
    if runtime.interpreting():
        raise TuneError(NO_GPU)


def tune_epilogues(targets: list[str], shapes: list[tuple[int, int, int]], dtype: str, ints: list[str],
                   force: bool) -> list[str]:
    """Run each epilogue once per shape (b an nn.Linear weight view) with tuning on; a line per run."""
    epilogues = [(target, load_epilogue(target)) for target in targets]
    require_gpu()
    # The command exists to tune: CODA_AUTOTUNE=0 (the default) would make it a silent no-op.
    os.environ["CODA_AUTOTUNE"] = "force" if force else "1"
    dt = DTYPES[dtype]
    lines = []
    for target, ep in epilogues:
        graph = runtime.graph_of(ep)
        for m, n, k in shapes:
            a = torch.randn(m, k, device="cuda").to(dt)
            w = torch.randn(n, k, device="cuda").to(dt)
            ops = _operands(graph, m, n, dt, ints)
            runtime.gemm(a, w.T, ep, **ops)
            torch.cuda.synchronize()
            cfg = launch.chosen_config(graph, a, w.T, ops)
            lines.append(f"{target} M={m} N={n} K={k} {dtype}: {cfg.model_dump() if cfg else 'default'}")
    return lines


def tune_model(shape: LlamaConfig, batch: int, seq: int, force: bool) -> list[str]:
    """Tune every GEMM key of one training step (forward+backward) of the model at batch x seq;
    a line per key tuned, then a summary."""
    require_gpu()
    torch.manual_seed(0)
    model = LlamaForCausalLM(shape, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, shape.vocab_size, (batch, seq), device="cuda")

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        torch.cuda.synchronize()

    t0 = time.time()
    os.environ["CODA_AUTOTUNE"] = "0"  # find the keys (and compile the defaults) without tuning
    step()
    keys = autotune.SESSION.asked
    autotune.SESSION.planned = sum(1 for k in keys if force or autotune.load_entry(k) is None)
    print(f"[coda tune] {len(keys)} GEMM keys in a {batch}x{seq} step, {autotune.SESSION.planned} to tune "
          f"(the untuned step took {time.time() - t0:.0f} s)", flush=True)
    os.environ["CODA_AUTOTUNE"] = "force" if force else "1"
    step()
    lines = []
    for name, entry, seconds in autotune.SESSION.tuned:
        k = entry.key
        kept = "default" if entry.config is None else autotune.label(entry.config)
        baseline = "-" if entry.default_ms is None else f"{entry.default_ms:.4f}"
        lines.append(f"{name} M<={k.m_bucket} N={k.n} K={k.k}: {kept}, {entry.ms:.4f} ms "
                     f"(default {baseline} ms; {seconds:.0f} s)")
    kept = sum(entry.config is not None for _, entry, _ in autotune.SESSION.tuned)
    lines.append(f"{len(autotune.SESSION.tuned)} keys tuned in {time.time() - t0:.0f} s, {kept} with a config "
                 f"{autotune.MARGIN:.0%} faster than the default; the cache is {runtime.cache_dir()}. "
                 f"Runs with CODA_AUTOTUNE=1 read it.")
    return lines
