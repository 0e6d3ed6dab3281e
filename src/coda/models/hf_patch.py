"""coda.patch: run a transformers decoder model (Llama, Mistral, Ministral, Ministral 3, Qwen2, Qwen3,
Gemma 1, 2 and 3, Phi-3, OLMo 2 and 3, SmolLM3, Granite, GLM, GLM-4, EXAONE 4, Helium, Ernie 4.5,
Seed-OSS, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE, DeepSeek-V3, GLM-4.5, ERNIE 4.5 MoE, gpt-oss)
through coda's ops.

Instance patching, as Liger-Kernel's `_apply_liger_kernel_to_instance`: only the given model's
modules change (their `forward` is rebound), never transformers' classes, so another model in the
same process is untouched. The modules and parameters stay where they are: parameter names,
`state_dict()`, `load_state_dict()` and `.generate()` keep working.

What runs through coda:
* each decoder layer's norm in front of the MLP + the MLP: `coda.ops.rmsnorm_swiglu_mlp` (Llama's
  post-attention norm) or `coda.ops.rmsnorm_geglu_mlp` (Gemma 1's post-attention norm, Gemma 2/3's
  pre-feedforward norm) (the norm's forward passes its input through; the MLP applies the norm
  with the norm's own weight and eps);
* each decoder layer's other RMSNorms: `coda.ops.rmsnorm` (two row passes, forward and backward):
  the input norm, whose output feeds HF's three separate q/k/v projections, so it cannot move into
  one GEMM, and Gemma's sandwich norms on the attention and MLP outputs, which need a whole row of
  the GEMM output before the residual add;
* the attention's q and k norms (Qwen3's and Gemma 3's per head, OLMo 2's whole-width):
  `coda.ops.rmsnorm`;
* RoPE: `coda.ops.rope` (one row pass per tensor each way) in place of the module function
  `apply_rotary_pos_emb` that HF's attention forward calls. The attention module's forward is
  HF's own code, rebound to a copy of its module's globals in which that name is coda's
  (`_with_coda_rope`): no class and no module of transformers changes. A forward that does not
  call the function by that name keeps HF's RoPE;
* the LM head: with labels, `coda.ops.linear_cross_entropy` (HF's loss with its loss arguments,
  lm_loss.py; logits never materialized: `.logits` is None); without labels (`.generate()`), the final norm + LM head as
  `coda.ops.rmsnorm_linear`.
Gemma's norms scale by (1 + w): coda's ops get g = 1 + w in fp32; Granite's final norm carries its
1 / logits_scaling. What stays HF's: the embedding (with Gemma's scale or Granite's multiplier), the
decoder layer's residual adds (with Granite's multiplier), the q/k/v projections (three separate
projections inside HF's attention, which coda does not rewrite), the rotary embedding's cos and sin,
and attention, with whatever the family does there (Qwen2's q/k/v biases, sliding windows, Gemma's
per-layer-type RoPE and attention scale, SmolLM3's layers without RoPE). Which families and config
fields fit: families.py.

Phi-3 is Llama's layout with fused projections: its MLP's gate and up weights are the row halves
of gate_up_proj (`_gate_up`), its fused q/k/v projection stays HF's. GLM's MLP is Phi-3's, GLM-4's
layer adds norms on the attention and MLP outputs (families.Norms); both keep HF's RoPE, which rotates
interleaved pairs (_rotates_halves). Families whose decoder layer
is not Llama's have their own layer patch (_LAYER_PATCHES): OLMo 2 and 3 (norms on the attention and
MLP outputs, no norm in front of the MLP: `coda.ops.swiglu_mlp`, both norms `coda.ops.rmsnorm`).
A sparse MoE layer (Family.moe) keeps HF's router and experts, so its norm in front of them runs
alone; the causal LM's forward adds the routers' load-balancing loss with HF's own function.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.rmsnorm import rmsnorm
from ..ops.rope import rope
from ..ops.rmsnorm_linear import rmsnorm_linear
from ..ops.rmsnorm_gated_mlp import rmsnorm_geglu_mlp, rmsnorm_swiglu_mlp
from ..ops.swiglu_mlp import swiglu_mlp
from . import families
from .autocast import autocast_dtype, cast
from .lm_loss import LOSS_ARGUMENTS, causal_lm_loss

log = logging.getLogger("coda")


def _passthrough(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states


def _gain(norm: nn.Module, head: bool = False) -> torch.Tensor:
    """The RMSNorm's per-column scale g: its weight, or Gemma's 1 + w in fp32 (HF's Gemma3RMSNorm
    scales in fp32 and rounds once, as coda's row pass does; dg maps back to dw unchanged). For the
    LM head's op (`head`), Granite's final norm divides it by logits_scaling (in fp32): logits =
    (norm(x) g / s) W^T."""
    g = 1.0 + norm.weight.float() if norm._coda_unit_offset else norm.weight
    divisor = getattr(norm, "_coda_logits_scaling", None) if head else None
    return g if divisor is None else g.float() / divisor


def _eps(norm: nn.Module) -> float:
    return norm.eps if norm._coda_unit_offset else norm.variance_epsilon  # Gemma's name, Llama's


def _norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rmsnorm(hidden_states, _gain(self), _eps(self))


def _final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF's final norm, except inside the patched causal LM's forward when its output is seen by
    the LM head alone (`_coda_head`, set only for that call): "logits" defers it to the head's fused
    op; "loss" folds Granite's logits scaling into its gain."""
    if self._coda_head == "logits":
        return hidden_states
    if self._coda_head == "loss" and getattr(self, "_coda_logits_scaling", None) is not None:
        return rmsnorm(hidden_states, _gain(self, head=True), _eps(self))
    return self._coda_forward(hidden_states)


# The projections whose weights coda's fused ops read: the dense MLP's, and the LM head.
_MLP_PROJECTIONS = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")
_READS_WEIGHTS = (f"coda's fused ops multiply by these weights directly; {families.MERGE_ADAPTERS}, or train this "
                  "model unpatched")


def _linear_problem(module: object) -> str | None:
    """Why a fused op may not multiply by `module.weight` in the module's place, or None. Only a plain
    nn.Linear computes exactly x @ weight.T: an adapter (peft's LoRA), a quantized layer, a hook or a
    replaced forward adds what an op that reads the weight skips."""
    if type(module) is not nn.Linear:
        return f"is a {type(module).__module__}.{type(module).__qualname__}, not a torch.nn.Linear"
    if module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__:
        return "has forward hooks or a replaced forward"
    return None


def _weight(owner: nn.Module, name: str) -> torch.Tensor:
    """owner.<name>.weight, checked on every call (adapters are often added after patching)."""
    module = getattr(owner, name)
    problem = _linear_problem(module)
    if problem is not None:
        raise TypeError(f"coda.patch: {owner._coda_name}{name} {problem}: {_READS_WEIGHTS}")
    return module.weight


def _gate_up(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP's gate and up weights: its two projections', or the row halves of Phi-3's fused
    gate_up_proj ([gate; up]: HF chunks its output in that order). chunk's two views share one
    SplitBackward: autograd writes both gradients into the fused parameter with one
    concatenation, the only cost over separate weights."""
    if getattr(mlp, "gate_up_proj", None) is not None:
        return _weight(mlp, "gate_up_proj").chunk(2)
    return _weight(mlp, "gate_proj"), _weight(mlp, "up_proj")


def _autocast(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The operands of a fused op that HF computes with nn.Linear, in torch.autocast's dtype where it
    is on (as the Linear would cast them: autocast.py)."""
    dtype = autocast_dtype(tensors[0].device)
    return [cast(t, dtype) for t in tensors]


def _still_patched(norm: nn.Module, forward: Callable) -> bool:
    """Whether calling `norm` still runs patch()'s `forward` and nothing else sees its output: its
    forward not replaced since (Liger-Kernel's instance patch rebinds norms' forwards; transformers'
    Trainer applies it with use_liger_kernel=True) and no forward hooks."""
    return getattr(norm.forward, "__func__", None) is forward and not norm._forward_hooks


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    norm = self._coda_norm
    if not _still_patched(norm, _passthrough):
        raise RuntimeError(
            f"coda.patch: {norm._coda_name} has forward hooks, or its forward was replaced after patching (as "
            "Liger-Kernel's instance patch does; Trainer applies it with use_liger_kernel=True): coda's fused MLP "
            "applies this norm itself and the norm's own call passes its input through, so a hook would see "
            "the norm's input and a replaced norm would apply twice. Hook the MLP instead; use coda.patch or "
            "Liger-Kernel, not both")
    x, gate, up, down = _autocast(x, *_gate_up(self), _weight(self, "down_proj"))
    return self._coda_op(x, _gain(norm), gate, up, down, _eps(norm))


def _olmo2_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return swiglu_mlp(*_autocast(x, *_gate_up(self), _weight(self, "down_proj")))


def _patch_olmo2_layer(i: int, layer: nn.Module) -> list[str]:
    """h = x + post_attention_layernorm(attn(x)), out = h + post_feedforward_layernorm(mlp(h)): no
    norm feeds the MLP, and each norm needs whole rows of a GEMM output (HF's o_proj, coda's down
    GEMM) before the residual add, so the norms run alone."""
    swapped = []
    for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
        norm = getattr(layer, name)
        norm._coda_unit_offset = False
        norm.forward = types.MethodType(_norm, norm)
        swapped.append(f"model.layers.{i}.{name} -> coda.ops.rmsnorm")
    swapped += _patch_qk_norms(i, layer, False)  # (whole-width: over all heads' q, and all k)
    layer.mlp._coda_name = f"model.layers.{i}.mlp."
    layer.mlp.forward = types.MethodType(_olmo2_mlp_forward, layer.mlp)
    return swapped + [f"model.layers.{i}.mlp -> coda.ops.swiglu_mlp"]


def _patch_qk_norms(i: int, layer: nn.Module, gemma: bool) -> list[str]:
    """The attention's q and k norms (Qwen3's and Gemma 3's per head, OLMo 2's whole-width), each one
    row pass forward and backward instead of HF's eager chain of elementwise kernels; the rest of
    HF's attention (projections, RoPE, the attention call) is unchanged. An attention without them
    (GLM-4.5's without use_qk_norm) computes none."""
    swapped = []
    for name in ("q_norm", "k_norm"):
        norm = getattr(layer.self_attn, name, None)
        if norm is None:
            continue
        norm._coda_unit_offset = gemma
        norm.forward = types.MethodType(_norm, norm)
        swapped.append(f"model.layers.{i}.self_attn.{name} -> coda.ops.rmsnorm")
    return swapped


@functools.cache
def _with_coda_rope(forward: Callable) -> Callable | None:
    """HF's attention `forward` with coda.ops.rope wherever it calls `apply_rotary_pos_emb`: the same
    code objects and closures, the innermost function's over a copy of its module's globals, and
    each decorator's wrapper (followed through `__wrapped__`, e.g. transformers' deprecate_kwarg)
    rebuilt around the new inner function. None where that does not fit (the name is not called,
    a wrapper does not hold its inner function in its closure). HF's own function still runs for
    inputs coda's op does not take (cos and sin with gradients or of another dtype, another
    unsqueeze_dim)."""
    inner = getattr(forward, "__wrapped__", None)
    if not isinstance(forward, types.FunctionType):
        return None
    if inner is not None:
        patched_inner = _with_coda_rope(inner)
        cells = forward.__closure__ or ()
        held = [i for i, c in enumerate(cells) if _holds(c, inner)]
        if patched_inner is None or len(held) != 1:
            return None
        cells = tuple(types.CellType(patched_inner) if i == held[0] else c for i, c in enumerate(cells))
        return _rebuilt(forward, forward.__globals__, cells, patched_inner)
    hf_rope = forward.__globals__.get("apply_rotary_pos_emb")
    if not callable(hf_rope) or "apply_rotary_pos_emb" not in forward.__code__.co_names \
            or not _rotates_halves(hf_rope):
        return None

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (unsqueeze_dim != 1 or cos.dim() != 3 or cos.shape[-1] % 2 or cos.requires_grad or sin.requires_grad
                or not q.dtype == k.dtype == cos.dtype == sin.dtype):
            return hf_rope(q, k, cos, sin, unsqueeze_dim)
        return rope(q, k, cos, sin)

    return _rebuilt(forward, {**forward.__globals__, "apply_rotary_pos_emb": apply_rotary_pos_emb},
                    forward.__closure__, None)


def _rotates_halves(hf_rope: Callable) -> bool:
    """Whether HF's `apply_rotary_pos_emb` computes what coda.ops.rope does (each head's two halves
    paired, cos and sin over the whole head), tried on a small fp64 probe: GLM's, which rotates
    interleaved pairs, does not, and keeps its own."""
    g = torch.Generator().manual_seed(0)
    # (on the CPU whatever the default device: the probe's generator is a CPU one)
    q, k = (torch.randn(1, heads, 3, 8, generator=g, dtype=torch.float64, device="cpu") for heads in (2, 1))
    angles = torch.randn(1, 3, 4, generator=g, dtype=torch.float64, device="cpu")
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rotated(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, -1)
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    try:
        got = hf_rope(q, k, cos, sin)
    except Exception:  # noqa: BLE001  (any signature or shape it does not take: not the rotation coda computes)
        return False
    return all(torch.allclose(a, rotated(x), rtol=1e-12, atol=1e-12) for a, x in zip(got, (q, k)))


def _holds(cell: types.CellType, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _rebuilt(fn: types.FunctionType, names: dict, closure: tuple | None, inner: Callable | None) -> Callable:
    """fn's code over new globals and closure; `inner` is the new function it wraps, if any."""
    new = functools.update_wrapper(types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, closure), fn)
    new.__kwdefaults__ = fn.__kwdefaults__
    if inner is not None:
        new.__wrapped__ = inner
    return new


def _patch_rope(i: int, layer: nn.Module) -> list[str]:
    attn = getattr(layer, "self_attn", None)
    forward = _with_coda_rope(type(attn).forward) if attn is not None else None
    if forward is None:
        log.info("coda.patch: model.layers.%d.self_attn keeps HF's RoPE (its forward calls no apply_rotary_pos_emb)", i)
        return []
    attn.forward = types.MethodType(forward, attn)
    return [f"model.layers.{i}.self_attn: apply_rotary_pos_emb -> coda.ops.rope"]


# Families whose decoder layer differs from Llama's, by model_type (the rest: the loop in patch()).
_LAYER_PATCHES: dict[str, Callable[[int, nn.Module], list[str]]] = {
    "olmo2": _patch_olmo2_layer,
    "olmo3": _patch_olmo2_layer,  # OLMo 2's layer; its windows and per-type RoPE are inside HF's attention
    "exaone4": _patch_olmo2_layer,  # OLMo 2's layer with per-head q/k norms (a row pass over each head as well)
}



def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                       logits_to_keep=0, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    moe = families.FAMILIES[self.config.model_type].moe
    if moe:  # HF's MoE causal LMs: the routers' logits recorded where asked (or the config says)
        router = kwargs.pop("output_router_logits", None)
        kwargs["output_router_logits"] = self.config.output_router_logits if router is None else router
    return_dict = kwargs.pop("return_dict", None)
    # transformers hands these to its loss only (ForCausalLMLoss; its model ignores them)
    loss_kwargs = {k: kwargs.pop(k) for k in LOSS_ARGUMENTS if k in kwargs}
    cap = getattr(self.config, "final_logit_softcapping", None)  # Gemma: c * tanh(logits / c)
    norm = self.model.norm
    scaling = getattr(norm, "_coda_logits_scaling", None)  # Granite: logits / logits_scaling
    # Returned hidden states end in the final norm's output, which must then be HF's: the LM head
    # reads it as it is (and divides by Granite's scaling after). Otherwise the head's op takes the norm.
    states = kwargs.get("output_hidden_states")
    # A replaced final norm or a hook on it sees it too (_still_patched): the head then reads its output.
    seen = bool(self.config.output_hidden_states if states is None else states) or not _still_patched(norm, _final_norm)
    norm._coda_head = None if seen else "logits" if labels is None else "loss"
    try:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, return_dict=True, **kwargs)
    finally:
        norm._coda_head = None
    hidden = outputs.last_hidden_state
    loss = logits = None
    if labels is None:
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        if seen:
            logits = F.linear(hidden, _weight(self, "lm_head"))
            logits = logits if scaling is None else logits / scaling
        else:
            hidden, head = _autocast(hidden, _weight(self, "lm_head"))
            logits = rmsnorm_linear(hidden, _gain(norm, head=True), head, _eps(norm))
        if cap is not None:  # as HF rounds it: in the logits' dtype
            logits = torch.tanh(logits / cap) * cap
    else:
        hidden = hidden / scaling if seen and scaling is not None else hidden
        loss = causal_lm_loss(*_autocast(hidden, _weight(self, "lm_head")), labels, softcap=cap, **loss_kwargs)
    rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    if moe:
        aux = None
        if kwargs["output_router_logits"]:  # HF's load-balancing loss (its own function, from the model's module)
            balance = sys.modules[type(self).__module__].load_balancing_loss_func
            aux = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
            if loss is not None:
                loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        out = MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=logits, **rest)
    elif hasattr(outputs, "router_logits"):  # (a field of the model's output class, None where not asked)
        # a router whose logits HF's causal LM passes on without a loss (DeepSeek-V3 in transformers 5.2x)
        out = MoeCausalLMOutputWithPast(loss=loss, logits=logits, **rest)
    else:
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **rest)
    return out if return_dict is not False else out.to_tuple()


def _rewritten(model: nn.Module, layers: nn.ModuleList) -> list[tuple[str, nn.Module]]:
    """The modules whose forward patch() rebinds or whose parameters coda's ops read (qualified
    names): each layer's norms, attention (its class's forward is reused), q and k norms and dense
    MLP, and the final norm. (The projections coda reads are checked as plain Linears: _linear_problem.)"""
    names = families.FAMILIES[model.config.model_type].norms
    found = []
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        own = [(name, getattr(layer, name)) for name in (names.attn_in, names.attn_out, names.mlp_in, names.mlp_out)
               if name is not None and hasattr(layer, name)]
        own += [(f"self_attn.{name}", getattr(attn, name)) for name in ("q_norm", "k_norm")
                if getattr(attn, name, None) is not None]
        own += [("self_attn", attn)] if attn is not None else []
        own += [("mlp", mlp)] if hasattr(mlp, "down_proj") else []
        found += [(f"model.layers.{i}.{name}", module) for name, module in own]
    return found + [("model.norm", model.model.norm)]


def _check(model: nn.Module) -> list[str]:
    problems = families.problems(getattr(model, "config", None), families.PATCH) + families.foreign_code(model)
    layers = getattr(getattr(model, "model", None), "layers", None)
    for what, ok in (("a .model.layers list", layers is not None),
                     ("a .model.norm", hasattr(getattr(model, "model", None), "norm")),
                     ("an .lm_head", isinstance(getattr(model, "lm_head", None), nn.Module))):
        if not ok:
            problems.append(f"it has no {what} (a *ForCausalLM model is expected)")
    if hasattr(model, "lm_head") and getattr(model.lm_head, "bias", None) is not None:
        problems.append("lm_head has a bias")
    read = [("lm_head", getattr(model, "lm_head", None))] + [
        (f"model.layers.{i}.mlp.{name}", getattr(layer.mlp, name)) for i, layer in enumerate(layers or [])
        if hasattr(getattr(layer, "mlp", None), "down_proj") for name in _MLP_PROJECTIONS
        if getattr(layer.mlp, name, None) is not None]
    unread = [f"{where} {problem}" for where, module in read if module is not None
              for problem in [_linear_problem(module)] if problem is not None]
    more = f" (and {len(unread) - 1} more projections)" if len(unread) > 1 else ""
    problems += [f"{unread[0]}{more}: {_READS_WEIGHTS}"] if unread else []
    if problems:  # (the family and the model's layout are known to fit from here on)
        return problems
    return families.foreign_modules(_rewritten(model, layers), families.PATCH)


def patch(model: nn.Module) -> nn.Module:
    """Patch a transformers *ForCausalLM model of a family families.supported(PATCH) lists in place
    to run coda's ops.

    Returns the model; `model.coda_patched` lists the swapped modules by name (also logged to the
    "coda" logger). Raises TypeError naming what does not fit for a model it cannot patch.
    Patching twice is a no-op."""
    problems = _check(model)
    if problems:
        raise TypeError(f"coda.patch: cannot patch {type(model).__name__}: " + "; ".join(problems))
    if getattr(model, "coda_patched", None):
        return model
    layer_patch = _LAYER_PATCHES.get(model.config.model_type)
    family = families.FAMILIES[model.config.model_type]
    gemma = family.gemma_norms  # (1 + w) norms, the GeGLU MLP
    # The loop's layers (families.Norms): the norm in front of the MLP runs inside coda's fused MLP op;
    # the others alone (the input norm, and the norms on the attention and MLP outputs, which need a
    # GEMM output's whole row before the residual add).
    names = family.norms
    mlp_norm, alone = names.mlp_in, [n for n in (names.attn_in, names.attn_out, names.mlp_out) if n is not None]
    mlp_op = rmsnorm_geglu_mlp if gemma else rmsnorm_swiglu_mlp
    swapped = []
    for i, layer in enumerate(model.model.layers):
        swapped += _patch_rope(i, layer)
        if layer_patch is not None:
            swapped += layer_patch(i, layer)
            continue
        for name in alone:
            norm = getattr(layer, name)
            norm._coda_unit_offset = gemma
            norm.forward = types.MethodType(_norm, norm)
            swapped += [f"model.layers.{i}.{name} -> coda.ops.rmsnorm"]
        if family.qk_norm:
            swapped += _patch_qk_norms(i, layer, gemma)
        # a sparse MoE block (its router and experts stay HF's; GraniteMoE's block_sparse_moe): the norm alone
        norm, mlp = getattr(layer, mlp_norm), getattr(layer, "mlp", None)
        if not hasattr(mlp, "down_proj"):
            norm._coda_unit_offset = gemma
            norm.forward = types.MethodType(_norm, norm)
            swapped += [f"model.layers.{i}.{mlp_norm} -> coda.ops.rmsnorm"]
            continue
        norm._coda_unit_offset = gemma
        norm.forward = types.MethodType(_passthrough, norm)
        norm._coda_name = f"model.layers.{i}.{mlp_norm}"
        object.__setattr__(mlp, "_coda_norm", norm)  # a plain attribute, not a submodule: names stay
        mlp._coda_op, mlp._coda_name = mlp_op, f"model.layers.{i}.mlp."
        mlp.forward = types.MethodType(_mlp_forward, mlp)
        swapped += [f"model.layers.{i}.{mlp_norm}+mlp -> coda.ops.{mlp_op.__name__}"]
    norm = model.model.norm
    norm._coda_unit_offset = gemma
    scaling = float(getattr(model.config, "logits_scaling", 1.0))  # Granite: logits / logits_scaling
    if scaling != 1.0:
        norm._coda_logits_scaling = scaling
    # Run as a module (the base model's output, returned hidden states): HF's norm, or coda's for
    # Gemma, which rounds as HF's Gemma norm does (_final_norm).
    norm._coda_forward = types.MethodType(_norm, norm) if gemma else norm.forward
    norm._coda_head = None
    norm.forward = types.MethodType(_final_norm, norm)
    model._coda_name = ""
    model.forward = types.MethodType(_causal_lm_forward, model)
    swapped += ["model.norm+lm_head -> coda.ops.rmsnorm_linear (logits)",
                "lm_head+loss -> coda.ops.linear_cross_entropy (labels)"]
    model.coda_patched = swapped
    log.info("coda.patch %s: %s", type(model).__name__, "; ".join(swapped))
    return model
