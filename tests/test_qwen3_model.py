"""Qwen3 (QK-norm: a per-head RMSNorm of q and k before RoPE) through `coda.models.from_hf`,
against the unmodified transformers model on tiny configs, every norm weight (input,
post-attention, q_norm, k_norm, final) perturbed: padding and packed documents on a sliding-window
layer pattern in fp32, bf16 error against HF's own, torch.compile(fullgraph=True) and activation
checkpointing against eager. (No mask, tied, windowed, and the state-dict round trip: test_families.)"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import coda  # noqa: E402
from conftest import DEVICE, rel, token_batch  # noqa: E402
from hf_reference import assert_within_hf_low_precision_error, hf_grads  # noqa: E402

VOCAB, SEQ = 96, 12
# Layer 1 slides (window 4 < SEQ); head_dim 16 (q width 64, not hidden_size: Qwen3's o_proj maps it back).
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, use_sliding_window=True,
              sliding_window=4, max_window_layers=1, use_cache=False)


def hf_qwen3(**kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**CONFIG, **kw})
    model = transformers.Qwen3ForCausalLM(config).to(device=DEVICE, dtype=torch.float32)
    with torch.no_grad():  # HF starts every norm at ones: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def ids_and_labels() -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(VOCAB, SEQ)



def step(model: torch.nn.Module, **kw: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, every gradient under HF's names) of one step on ids_and_labels()."""
    ids, labels = ids_and_labels()
    if hasattr(model, "to_hf_state_dict"):  # coda's, compiled or not
        loss = model(ids, labels=labels, **kw).loss
        loss.backward()
        return loss.detach(), model.to_hf_state_dict(grads=True)
    loss = model(input_ids=ids, labels=labels, **kw).loss
    loss.backward()
    return loss.detach(), hf_grads(model)


def test_the_model_holds_qk_norms_where_its_segments_read_them() -> None:
    hf = hf_qwen3()
    model = coda.models.from_hf(hf)
    assert model.config.qk_norm and [model.config.window(i) for i in range(2)] == [None, 4]
    attn = [layer.self_attn for layer in hf.model.layers]
    # layer 0's on the model (the first segment), layer 1's on layers[0] (whose segment ends in its QKV)
    assert torch.equal(model.first_q_norm, attn[0].q_norm.weight) and torch.equal(model.first_k_norm,
                                                                                  attn[0].k_norm.weight)
    assert torch.equal(model.layers[0].next_q_norm, attn[1].q_norm.weight)
    assert torch.equal(model.layers[0].next_k_norm, attn[1].k_norm.weight)
    assert model.layers[1].next_q_norm is None and model.layers[1].next_k_norm is None


@pytest.mark.parametrize("inputs", ["padding", "packed"])
def test_masks_match_hf_in_fp32(inputs: str) -> None:
    """Loss and every gradient with a left-padded row, or with documents packed in a row, on a model
    whose second layer slides: HF's fp32 gradients within 1e-5 (relative)."""
    hf = hf_qwen3()
    model = coda.models.from_hf(hf)
    ids, _ = ids_and_labels()
    if inputs == "padding":
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        kw = dict(attention_mask=mask)
    else:
        kw = dict(position_ids=torch.cat([torch.arange(7), torch.arange(5)])[None].to(DEVICE))
    (loss, grads), (ref_loss, ref) = step(model, **kw), step(hf, **kw)
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    assert set(grads) == set(ref)
    for name, g in ref.items():
        assert rel(grads[name], g) < 1e-5, f"{name}: relative error {rel(grads[name], g):.3g}"


def test_bf16_error_is_within_hf_bf16_error() -> None:
    """Against HF in fp32 on the same bf16-rounded weights: coda's bf16 loss and gradients no
    further off than HF's own bf16 run (test_llama_model's bound: twice HF's error plus a bf16 ulp,
    for the different rounding points: coda normalizes q and k and rotates them in fp32, one
    rounding; HF rounds the projection, the normalized head, the weight's product and RoPE's)."""
    hf32 = hf_qwen3()
    hf32.to(torch.bfloat16).float()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    model = coda.models.from_hf(hf16)
    assert_within_hf_low_precision_error(step(hf32), step(hf16), step(model))


@pytest.mark.slow
def test_compiled_fullgraph_and_checkpointed_give_the_eager_results() -> None:
    torch._dynamo.reset()
    hf = hf_qwen3()
    ids, _ = ids_and_labels()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    results = []
    for mode in ("eager", "compiled", "checkpointed"):
        model = coda.models.from_hf(hf, checkpoint=mode == "checkpointed")
        model = torch.compile(model, fullgraph=True, backend="eager") if mode == "compiled" else model
        results.append(step(model, attention_mask=mask))
    (loss0, g0), *others = results
    for loss, g in others:
        torch.testing.assert_close(loss, loss0)
        for name in g0:
            torch.testing.assert_close(g[name], g0[name], msg=name)
