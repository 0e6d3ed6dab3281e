"""How whole models are compared with transformers: in fp32 (test_families, test_attention_masks), one
training step of coda's model or patched model against HF's own fp32 step, both measured from HF's
fp64 step, with the bounds fp32 rounding allows; in bf16 or under autocast, against HF's own error in
that precision; and what the tests that draw their cases share."""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable

import torch
from hypothesis import strategies as st

import coda
from conftest import rel

# One training step of a model: (loss, {HF parameter name: gradient}), in fp64.
Step = Callable[[torch.nn.Module], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def hf_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trained parameter's gradient (not ERNIE 4.5 MoE's frozen router score correction)."""
    sd = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])  # tied: one parameter
    return sd


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A stepped model's gradients under HF's names: coda's own model's or an HF (or patched) one's."""
    if isinstance(model, coda.models.LlamaForCausalLM):
        return model.to_hf_state_dict(grads=True)
    return hf_grads(model)


def redraw_per_layer(draw: st.DrawFn, fields: dict, layers: int) -> dict:
    """`fields` with its per-layer lists redrawn to `layers` entries: layer_types from the types the
    case names, no_rope_layers from 0 and 1."""
    out = dict(fields)
    for name, values in (("layer_types", sorted(set(fields.get("layer_types", [])))), ("no_rope_layers", [0, 1])):
        if name in fields:
            out[name] = draw(st.lists(st.sampled_from(values), min_size=layers, max_size=layers))
    return out


def assert_step_like_hf(hf: torch.nn.Module, convert: Callable[[torch.nn.Module], torch.nn.Module],
                        step: Step) -> None:
    """`step` of coda's model of `hf` (`convert(hf)`: coda's own model or a patched copy) against
    `step` of transformers' fp32 model, both measured from its fp64 step: within 1e-5 (relative),
    or where HF's own fp32 gradient is further than 0.5e-5 from fp64 (attention gradients through
    large q/k biases are that ill-conditioned), within twice HF's own error. Each error is one
    sample of fp32 rounding, which for such a gradient spreads several-fold: one over both bounds
    is compared as a distribution, the median of both sides' errors over the weights and four
    copies with every weight nudged by one ulp (`nudged_errors`; coda's median within 1e-5 or twice
    HF's). A bias's gradient is a sum over tokens that can cancel to near nothing (a k bias's whole
    part outside RoPE cancels exactly in softmax): one still over is measured, as a sum's rounding
    error is, against the sum of its terms' magnitudes (`bias_terms`)."""
    hf.zero_grad(set_to_none=True)  # its steps' gradients alone (not a step before this one)
    ours = step(convert(hf))
    hf32 = step(hf)
    hf64 = step(copy.deepcopy(hf).double())
    assert abs(ours[0] - hf32[0]) < 1e-5 * abs(hf32[0]), f"loss {ours[0].item()} against HF's {hf32[0].item()}"
    assert set(ours[1]) == set(hf64[1])
    errors = {name: (rel(ours[1][name], g), rel(hf32[1][name], g)) for name, g in hf64[1].items()}
    over = [name for name, (err, hf_err) in errors.items() if err >= max(1e-5, 2 * hf_err)]
    if over:
        nudged = nudged_errors(hf, convert, hf64[1], over, step)
        errors = {name: (statistics.median([errors[name][0], *nudged[name][0]]),
                         statistics.median([errors[name][1], *nudged[name][1]])) for name in over}
        over = [name for name, (err, hf_err) in errors.items() if err >= max(1e-5, 2 * hf_err)]
    off = {name: f"{name}: relative error {errors[name][0]:.3g} (HF fp32's own: {errors[name][1]:.3g})"
           for name in over}
    assert all(name.endswith(".bias") for name in off), "; ".join(off.values())
    if off:
        terms = bias_terms(copy.deepcopy(hf).double(), list(off), step)
        for name in off:
            err = (ours[1][name] - hf64[1][name]).norm().item()
            assert err < 1e-5 * terms[name], f"{off[name]}; {err:.3g} against its terms' {terms[name]:.3g}"


def assert_within_hf_low_precision_error(ref: tuple, hf: tuple, ours: tuple, what: str = "bf16") -> None:
    """coda's step in low precision (bf16 weights, or autocast) no further off transformers' fp32 step
    on the same rounded weights than transformers' own run in that precision: twice HF's error plus a
    bf16 ulp (the two round at different points), for the loss and every gradient. Each argument:
    (loss, {HF name: gradient}) of one step; `what` names the precision in the message."""
    (ref_loss, ref_grads), (hf_loss, hf_grads_), (loss, grads) = ref, hf, ours
    ref_loss, hf_loss, loss = float(ref_loss), float(hf_loss), float(loss)
    assert abs(loss - ref_loss) <= 2 * abs(hf_loss - ref_loss) + 2**-8 * abs(ref_loss), \
        f"loss: coda {what} {loss} vs HF {what} {hf_loss} (fp32: {ref_loss})"
    for name, g in ref_grads.items():
        hf_err, err = rel(hf_grads_[name], g), rel(grads[name], g)
        assert err <= 2 * hf_err + 2**-8, f"{name}: coda {what} {err:.3g} vs HF {what} {hf_err:.3g}"


def nudged_errors(hf: torch.nn.Module, convert: Callable[[torch.nn.Module], torch.nn.Module],
                  exact: dict[str, torch.Tensor], names: list[str], step: Step,
                  runs: int = 4) -> dict[str, tuple[list[float], list[float]]]:
    """For each named gradient, (coda's, HF's) relative errors from `exact` (the fp64 step's) over
    `runs` copies of HF's fp32 model with every weight moved one ulp up or down at random: how far
    fp32 rounding alone, of the weights and then of the step, takes each."""
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
    g = torch.Generator().manual_seed(0)
    for _ in range(runs):
        model = copy.deepcopy(hf)
        with torch.no_grad():
            for p in model.parameters():
                up = torch.rand(p.shape, generator=g).to(p.device) < 0.5
                p.copy_(torch.nextafter(p, torch.where(up, torch.inf, -torch.inf).to(p.dtype)))
        theirs, ours = step(model)[1], step(convert(model))[1]
        for name in names:
            out[name][0].append(rel(ours[name], exact[name]))
            out[name][1].append(rel(theirs[name], exact[name]))
    return out


def bias_terms(model: torch.nn.Module, names: list[str], step: Step) -> dict[str, float]:
    """For each named bias of an nn.Linear, the norm of the sum over tokens of |the output gradient|:
    the terms its gradient sums (in the model's step, fp64)."""
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name in names:
        module = model.get_submodule(name.removesuffix(".bias"))
        assert isinstance(module, torch.nn.Linear), f"{name} is not an nn.Linear's bias"

        def keep(_m, _i, out, name=name):
            out.retain_grad()
            outputs[name] = out
        hooks.append(module.register_forward_hook(keep))
    try:
        step(model)
    finally:
        for h in hooks:
            h.remove()
    return {name: out.grad.abs().reshape(-1, out.shape[-1]).sum(0).norm().item() for name, out in outputs.items()}
