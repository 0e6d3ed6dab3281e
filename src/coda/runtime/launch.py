"""gemm(): validate, choose a config, fetch the plan (kernel + fixed launch arguments), launch.

Repeated calls with the same tensor metadata reuse a plan; the modules beside this one hold
the rest: `choose` (backend and config), `config` (the model, the code budget, the fit to the
GPU), `triton_backend` and `gluon_backend` (what is particular to each backend: whether it can
run the call, its default, its resources, its launch constants), `specialize` (specialization
and kernel lookup), `tma` (TMA legality), `plan` (launch arguments, finalize)."""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from ..codegen import generate
from ..ir.graph import Graph
from ..ir.trace import trace
from . import autotune, choose
from .backends import backend_of
from .cache import stats
from .config import Config, check_config, default_config
from .device import interpreting, num_programs, smem_limit
from .empty import empty_outputs, is_degenerate, zero_k_inputs
from .plan import Plan
from . import guard
from .specialize import call_smem_bytes, kernel_for, smem_of, specialize
from .threads import build_lock
from .validate import Call, validate


def _identity(acc):
    return acc


PLAIN = trace(_identity)


def run(
    graph: Graph, a: object, b: object, operands: Mapping[str, object], *,
    out: object = None, config: Config | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Compute graph(a @ b); `config` overrides the tuned (or default) tile configuration."""
    interpret = interpreting()
    key = _call_key(graph, a, b, operands, out, config)
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        with build_lock:  # one thread at a time builds (and tunes, compiles): coda.runtime.threads
            call = validate(graph, a, b, operands, out, interpret)
            if is_degenerate(call):  # M, N or K is 0: never planned, so every such call comes here
                if call.m and call.n:
                    cfg = config or default_config(graph, call.in_dtype, interpret, call.m, call.n, 1)  # no tuning
                    return run(graph, *zero_k_inputs(call), operands, out=out, config=cfg)
                return empty_outputs(call)
            cfg = config or choose.pick_config(call, interpret, _tuning_launch)
            check_config(graph, cfg)
            if config is not None and not interpret:
                _check_fits(call, config)
            plan = make_plan(call, cfg, interpret)
            if key is not None:
                if len(_plans) >= _MAX_PLANS:
                    _plans.clear()
                _plans[key] = plan
            return plan.execute(call.a, call.b, call.operands, call.out)[0]
    stats["memory_hits"] += 1
    return plan.execute(a, b, operands, _out_dict(graph, out))[0]


# Validated calls by everything validation looks at (tensor metadata, operand forms, out=,
# config, tuning mode): a repeated call skips validation, specialization and config choice.
_plans: dict[tuple, Plan] = {}
_MAX_PLANS = 4096


def _meta(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return (v.shape, v.stride(), v.dtype, v.device, v.data_ptr() % 16)
    return type(v)


def _call_key(graph: Graph, a: object, b: object, operands: Mapping[str, object], out: object,
              config: Config | None) -> tuple | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if out is None or isinstance(out, torch.Tensor):
        outs: object = _meta(out)
    elif isinstance(out, dict):
        outs = tuple((k, _meta(v)) for k, v in out.items())
    else:
        return None
    ops = tuple((k, _meta(v)) for k, v in operands.items())
    return (graph.hash, _meta(a), _meta(b), ops, outs, config, autotune.mode(), choose.backend_setting())


def _out_dict(graph: Graph, out: object) -> dict:
    if out is None:
        return {}
    if isinstance(out, torch.Tensor):
        return {graph.outputs[0].name: out}
    return out  # type: ignore[return-value]


def _check_fits(call: Call, cfg: Config) -> None:
    """A given config must fit the GPU's shared memory: say so before anything launches (Triton's
    OutOfResources would come from inside the launch). Its registers are the caller's choice:
    Triton spills, and gluon-hopper's register budget is a Config rule."""
    need, limit = call_smem_bytes(call, cfg), smem_limit(call.a.device)
    if need > limit:
        raise ValueError(f"coda.gemm: the given Config cannot run epilogue {call.graph.name!r} on this GPU: it "
                         f"needs {need} bytes of shared memory (at most {limit}); pass a smaller one "
                         f"(fewer num_stages, more subtiles, smaller blocks) or none")


def chosen_config(graph: Graph, a: torch.Tensor, b: torch.Tensor, operands: Mapping[str, object]) -> Config | None:
    """The config this process chose for such a call (after one has run), or None."""
    return choose.chosen_config(validate(graph, a, b, operands, None, interpreting()), interpreting())


def _tuning_launch(call: Call, cfg: Config) -> tuple[object, Callable[[], object]]:
    """One validated launch of a candidate config: (Triton's compiled kernel, a relaunch of the
    plan built, which the tuner times: a later call's work, not this build's)."""
    plan = make_plan(call, cfg, False)
    kernel = plan.execute(call.a, call.b, call.operands, call.out)[1]
    return kernel, lambda: plan.execute(call.a, call.b, call.operands, call.out)


def make_plan(call: Call, cfg: Config, interpret: bool) -> Plan:
    spec, kernel = kernel_for(call, interpret, cfg)
    return Plan.build(call, spec, kernel, cfg, num_programs(call.a.device))


def gemm(a: object, b: object, epilogue: object = None, *, out: object = None, **operands: object):
    """epilogue(a @ b) in one persistent GEMM kernel. The contract: docs/DESIGN.md, "The contract"."""
    return guard.gemm(a, b, epilogue, out, operands)  # autograd, aliasing, torch.compile: coda.runtime.guard


def graph_of(epilogue: object) -> Graph:
    if epilogue is None:
        return PLAIN
    graph = getattr(epilogue, "graph", None)
    if not isinstance(graph, Graph):
        raise TypeError(
            f"coda.gemm: epilogue must be a @coda.epilogue function or None, got {type(epilogue).__name__}"
        )
    return graph


def source(graph: Graph, a: object, b: object, operands: Mapping[str, object], out: object = None) -> str:
    """The source gemm() would run for these inputs with the default config of the preferred
    backend; a leading comment says which backend that is and, if not gluon-hopper, why."""
    interpret = interpreting()
    call = validate(graph, a, b, operands, out, interpret)
    backend = choose.backends_for(call, interpret)[0]
    cfg = default_config(graph, call.in_dtype, interpret, call.m, call.n, call.k, backend, smem_of(call))
    reason = backend_of("gluon-hopper").unsupported(call, interpret)
    why = "" if backend == "gluon-hopper" else f": {reason or 'measured faster for this kind of epilogue'}"
    return f"# coda backend: {backend}{why}\n" + generate(graph, specialize(call, interpret, cfg))
