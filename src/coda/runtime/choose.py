"""Which backend and config a call runs with: tuned (both backends, epilogue fused in), cached,
or the default; and why a call that could not take gluon-hopper runs Triton instead."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Callable

import torch
import triton

from .. import __version__
from ..ir.primitives import BACKENDS
from . import autotune
from .backends import backend_of
from .config import Config, default_config
from .device import device_name
from .fingerprint import GENERATOR
from .specialize import make_spec, smem_of, spec_fields
from .validate import Call

log = logging.getLogger("coda")


def backend_setting() -> str:
    """CODA_BACKEND: `auto` (default: gluon-hopper on sm_90 where it can run the program, else
    triton), `triton`, or `gluon-hopper` (an error where it cannot run the program)."""
    value = os.environ.get("CODA_BACKEND", "auto").strip().lower()
    if value not in ("auto",) + BACKENDS:
        raise ValueError(f"CODA_BACKEND must be auto, triton or gluon-hopper, got {value!r}")
    return value


def backends_for(call: Call, interpret: bool) -> tuple[str, ...]:
    """The backends this call may run on, preferred first; says (debug log) why not Gluon.

    Gluon-hopper goes first wherever it can run the program (CODA_AUTOTUNE=0 runs the first
    backend; tuning times both). Measured on the H200 (bench/results/plain_choice/, template
    v4, untuned): the Llama block's step in fresh processes with its plain GEMMs on gluon-hopper
    rather than Triton, 16.61 against 16.72-16.73 ms as a CUDA graph at D=4096, 4.94 against
    4.94 at D=2048; every fused epilogue was already faster on gluon-hopper at template v2."""
    setting = backend_setting()
    if setting == "triton":
        return ("triton",)
    reason = backend_of("gluon-hopper").unsupported(call, interpret)
    if reason is None:
        if setting == "gluon-hopper":
            return ("gluon-hopper",)
        return ("gluon-hopper", "triton")
    if setting == "gluon-hopper":
        raise ValueError(f"coda.gemm: CODA_BACKEND=gluon-hopper cannot run {call.graph.name}: {reason}")
    log.debug("coda: %s runs on the triton backend: %s", call.graph.name, reason)
    return ("triton",)


# (graph hash, M bucket, N, K, specialization fields, mode, backends) -> chosen config, for this process.
_chosen: dict[tuple, Config] = {}


def _memo(call: Call, fields: tuple, backends: tuple[str, ...]) -> tuple:
    """The in-process key of a config choice: the tuning key's parts, before any hashing."""
    return (call.graph.hash, autotune.m_bucket(call.m), call.n, call.k, fields, autotune.mode(), backends)


def pick_config(call: Call, interpret: bool, launch) -> Config:
    """The config for a validated call; `launch(call, cfg)` runs one (the tuner's benchmark)."""
    graph, m, n, k = call.graph, call.m, call.n, call.k
    backends = backends_for(call, interpret)  # raises if CODA_BACKEND forces a backend that cannot run this
    if interpret:
        return default_config(graph, call.in_dtype, True, m, n, k)
    fields = spec_fields(call, interpret)
    memo = _memo(call, fields, backends)
    cfg = _chosen.get(memo)
    if cfg is not None:
        return cfg
    key = autotune.TuneKey(
        graph=graph.hash, m_bucket=autotune.m_bucket(m), n=n, k=k, spec=make_spec(fields).key(),
        gpu=device_name(call.a.device), triton=triton.__version__, coda=__version__, generator=GENERATOR,
        backends=backends,
    )
    # Tuning runs the fused kernel on the caller's inputs into scratch outputs of the same
    # dtypes, so out= tensors (possibly aliasing operands) are never touched.
    scratch = replace(call, out={name: torch.empty_like(t) for name, t in call.out.items()})
    compiled: dict[Config, object] = {}

    def run(c: Config) -> Callable[[], object]:
        compiled[c], again = launch(scratch, c)
        return again

    def spills(c: Config) -> int | None:
        return getattr(compiled.get(c), "n_spills", None)

    size = call.a.element_size()
    cfg = _chosen[memo] = autotune.choose(graph, key, call.in_dtype, size, size, m, n, k, run, spills, smem_of(call))
    return cfg


def chosen_config(call: Call, interpret: bool) -> Config | None:
    """The config this process chose for such a call (after one has run), or None."""
    backends = backends_for(call, interpret)
    return _chosen.get(_memo(call, spec_fields(call, interpret), backends))
