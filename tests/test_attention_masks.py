"""coda's model attends as transformers does (masks.py) against the unmodified HF models in fp32:
padding (left and right) and documents packed in a row (also against HF run on each document
alone) for each family from_hf takes, sliding windows shorter than the sequence, for every layer
(Mistral) or per layer (Qwen2's layer_types, with its q/k/v biases); loss and every parameter
gradient."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import coda  # noqa: E402
from coda.models import LlamaForCausalLM  # noqa: E402
from conftest import DEVICE, attention, rel  # noqa: E402

VOCAB, SEQ = 96, 12
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
# Per family what changes its attention: QK-norm (qwen3, gemma3_text), a window shorter than the
# sequence on layer 0 (Gemma's), capped scores under HF's eager attention (gemma2), Phi-3's fused
# projections and a window on every layer, OLMo 2's whole-width q/k norms; pad_token_id 0 (HF's default
# pad id is past VOCAB for Phi-3 and OLMo 2).
FAMILIES = {
    "llama": dict(pad_token_id=0),
    "qwen3": dict(head_dim=16),
    "gemma3_text": dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=6,
                        layer_types=["sliding_attention", "full_attention"]),
    "gemma2": dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=6, attn_logit_softcapping=2.0,
                   final_logit_softcapping=0.5, layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(sliding_window=6, pad_token_id=0),
    "olmo2": dict(pad_token_id=0),
}


# The quick subset runs llama; every family runs in the full suite.
FAMILY_CASES = [f if f == "llama" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILIES)]


def hf_model(model_type: str, **kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.CONFIG_MAPPING[model_type](**SHAPE, **kw)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention(config))
    model = model.to(device=DEVICE, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def ids_and_labels(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g).to(DEVICE)
    return ids, ids.clone()



def assert_same_step(model: LlamaForCausalLM, hf: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                     **kw: torch.Tensor) -> None:
    """Loss and every gradient of one step, coda against HF, on the same inputs."""
    ours, theirs = model(ids, labels=labels, **kw), hf(input_ids=ids, labels=labels, **kw)
    assert abs(ours.loss.item() - theirs.loss.item()) < 1e-5 * abs(theirs.loss.item())
    ours.loss.backward()
    theirs.loss.backward()
    mine = model.to_hf_state_dict(grads=True)
    ref = {n: p.grad for n, p in hf.named_parameters()}
    ref.setdefault("lm_head.weight", ref["model.embed_tokens.weight"])
    assert set(mine) == set(ref)
    for name, g in ref.items():
        assert rel(mine[name], g) < 1e-5, f"{name}: relative error {rel(mine[name], g):.3g}"


@pytest.mark.parametrize("family", FAMILY_CASES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_matches_hf(side: str, family: str) -> None:
    hf = hf_model(family, **FAMILIES[family])
    model = coda.models.from_hf(hf)
    ids, labels = ids_and_labels()
    mask = torch.ones_like(ids)
    pads = slice(0, 5) if side == "left" else slice(SEQ - 5, SEQ)
    mask[1, pads] = 0  # row 1 padded, row 0 not
    labels[mask == 0] = -100
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
    assert rel(ours[mask == 1], theirs[mask == 1]) < 1e-5
    # A left-padded query has no key: it outputs zeros, as under HF's default SDPA attention (HF's eager
    # attention, Gemma 2's, averages every value there instead; no loss or gradient reads those rows).
    if hf.config._attn_implementation == "sdpa":
        assert rel(ours[1, pads], theirs[1, pads]) < 1e-5
    assert_same_step(model, hf, ids, labels, attention_mask=mask)


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_packed_documents_match_hf_and_each_document_alone(family: str) -> None:
    # transformers masks packed documents only without a cache (training): with `use_cache` on
    # (its config's default) it skips the detection and attends across documents.
    hf = hf_model(family, use_cache=False, **FAMILIES[family])
    model = coda.models.from_hf(hf)
    ids, labels = ids_and_labels()
    lengths = [[5, 4, 3], [SEQ]]  # row 0: three documents, row 1: one
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths]).to(DEVICE)
    with torch.no_grad():
        ours = model(ids, position_ids=pos).logits
        start = 0
        for n in lengths[0]:
            alone = hf(input_ids=ids[:1, start:start + n]).logits
            assert rel(ours[0, start:start + n], alone[0]) < 1e-5, f"document at {start}"
            start += n
        assert rel(ours[1], hf(input_ids=ids[1:]).logits[0]) < 1e-5
    assert_same_step(model, hf, ids, labels, position_ids=pos)


def test_sliding_window_matches_mistral() -> None:
    hf = hf_model("mistral", sliding_window=5, use_cache=False)  # use_cache: as for packed documents above
    model = coda.models.from_hf(hf)
    assert [model.config.window(i) for i in range(2)] == [5, 5]
    ids, labels = ids_and_labels()
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None].to(DEVICE)  # windows inside packed documents
    assert_same_step(model, hf, ids, labels)
    model.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    assert_same_step(model, hf, ids, labels, position_ids=pos)


def test_per_layer_windows_match_qwen2_layer_types() -> None:
    hf = hf_model("qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=1, use_cache=False)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    model = coda.models.from_hf(hf)
    assert [model.config.window(i) for i in range(2)] == [None, 3]
    ids, labels = ids_and_labels()
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None].to(DEVICE)
    assert_same_step(model, hf, ids, labels, position_ids=pos)


@pytest.mark.slow
def test_compiled_fullgraph_builds_the_same_masks() -> None:
    """Under compilation the masks are built without reading the data (an all-ones attention_mask
    and one-document rows too): the same losses as eager."""
    torch._dynamo.reset()
    hf = hf_model("qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=1)
    model = coda.models.from_hf(hf)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    ids, labels = ids_and_labels()
    padded = torch.ones_like(ids)
    padded[1, :4] = 0
    packed = torch.cat([torch.arange(7), torch.arange(5)])[None].to(DEVICE)
    for kw in (dict(attention_mask=padded), dict(attention_mask=torch.ones_like(ids)), dict(position_ids=packed),
               dict(position_ids=torch.arange(SEQ, device=DEVICE)[None])):
        with torch.no_grad():  # equal up to rounding: masked SDPA where eager may take the is_causal kernel
            ours, eager = compiled(ids, labels=labels, **kw).loss, model(ids, labels=labels, **kw).loss
        assert abs(ours.item() - eager.item()) < 1e-5 * abs(eager.item()), kw
