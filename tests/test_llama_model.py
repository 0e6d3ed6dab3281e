"""coda.models.LlamaForCausalLM against the unmodified transformers Llama (tiny configs built from
LlamaConfig, nothing downloaded): loss and every parameter gradient in fp32, the state-dict round
trip, logits, torch.compile(fullgraph=True), activation checkpointing, bf16 error against HF's own."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from coda.models import LlamaForCausalLM  # noqa: E402
from conftest import DEVICE, rel  # noqa: E402
from hf_reference import assert_within_hf_low_precision_error, hf_grads  # noqa: E402

VOCAB, SEQ = 96, 8
# With head_dim 8 the four RoPE wavelengths (6, 63, 628, 6283) fall one below high_wavelen (kept), one
# between (blended), two above low_wavelen (slowed by factor): every branch of the llama3 rule.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 8.0, "original_max_position_embeddings": 256}


def hf_llama(tied: bool, rope: dict | None = None, dtype: torch.dtype = torch.float32, seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=tied, rope_parameters=rope, **kw)
    model = transformers.LlamaForCausalLM(cfg).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():  # HF initializes norms to ones: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored tokens
    labels[1, 5] = -100
    return ids, labels



@pytest.mark.slow
@pytest.mark.parametrize("tied,rope,offset", [(False, LLAMA3_ROPE, 300), (True, None, None)],
                         ids=["untied-llama3_rope-position_ids", "tied"])
def test_loss_and_every_gradient_match_hf_in_fp32(tied: bool, rope: dict | None, offset: int | None) -> None:
    hf = hf_llama(tied, rope)
    model = LlamaForCausalLM.from_hf(hf)
    assert model.config.tie_word_embeddings == tied and (model.lm_head is None) == tied
    ids, labels = batch()
    pos = None if offset is None else (torch.arange(SEQ, device=DEVICE) + offset)[None].expand(2, SEQ)
    ours = model(ids, labels=labels, position_ids=pos)
    theirs = hf(input_ids=ids, labels=labels, position_ids=pos)
    assert ours.logits is None
    assert abs(ours.loss.item() - theirs.loss.item()) < 1e-5 * abs(theirs.loss.item())
    ours.loss.backward()
    theirs.loss.backward()
    mine, ref = model.to_hf_state_dict(grads=True), hf_grads(hf)
    assert set(mine) == set(ref)
    for name, g in ref.items():
        assert rel(mine[name], g) < 1e-5, f"{name}: relative error {rel(mine[name], g):.3g}"


@pytest.mark.slow
def test_training_steps_track_hf_in_fp32() -> None:
    """Several AdamW steps at a large learning rate: every loss, and each weight's update, match HF's.
    A single step's gradients can be right while something carried between steps (a cached
    derived weight, a layout set up once) is not."""
    hf = hf_llama(tied=True)
    model = LlamaForCausalLM.from_hf(hf)
    before = {name: p.clone() for name, p in hf.state_dict().items()}
    losses = {}
    for name, net in (("coda", model), ("hf", hf)):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        losses[name] = []
        for step in range(5):
            ids, labels = batch(seed=step % 2)
            loss = net(ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    assert losses["hf"][-1] < losses["hf"][0] - 0.1  # the steps do move the model
    for ours, theirs in zip(losses["coda"], losses["hf"]):
        assert abs(ours - theirs) < 1e-5 * abs(theirs), (losses["coda"], losses["hf"])
    # The updates, compared as a whole: AdamW's step m / sqrt(v) keeps a gradient's relative
    # rounding error, except where the gradient is itself at rounding level (there any sign is
    # as good): those entries are few, so the update's norm agrees far better than its max.
    mine = model.to_hf_state_dict()
    for name, p in hf.state_dict().items():
        if name in mine:
            err = rel(mine[name] - before[name], p - before[name])
            assert err < 1e-4, f"{name}: the 5 steps' update differs from HF's by {err:.3g} (relative)"


@pytest.mark.parametrize("tied", [False, True])
def test_state_dict_round_trip_is_exact(tied: bool) -> None:
    hf = hf_llama(tied, LLAMA3_ROPE)
    model = LlamaForCausalLM.from_hf(hf)
    sd, ref = model.to_hf_state_dict(), hf.state_dict()
    assert list(sd) == list(ref)
    assert all(torch.equal(sd[k], ref[k]) and sd[k].dtype == ref[k].dtype for k in ref)
    other = hf_llama(tied, LLAMA3_ROPE, seed=7)
    other.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), ref.values()))
    again = LlamaForCausalLM.from_hf(other)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_logits_without_labels_match_hf() -> None:
    hf = hf_llama(False)
    model = LlamaForCausalLM.from_hf(hf)
    ids, _ = batch()
    with torch.no_grad():
        out, ref = model(ids), hf(input_ids=ids)
    assert out.loss is None and out.logits.shape == ref.logits.shape == (2, SEQ, VOCAB)
    assert rel(out.logits, ref.logits) < 1e-5


@pytest.mark.slow
def test_compiled_fullgraph_and_checkpointed_give_the_eager_results() -> None:
    torch._dynamo.reset()
    hf = hf_llama(True)
    ids, labels = batch()
    results = []
    for mode in ("eager", "compiled", "checkpointed"):
        model = LlamaForCausalLM.from_hf(hf, checkpoint=mode == "checkpointed")
        fn = torch.compile(model, fullgraph=True, backend="eager") if mode == "compiled" else model
        loss = fn(ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), model.to_hf_state_dict(grads=True)))
    (loss0, g0), *others = results
    for loss, g in others:
        torch.testing.assert_close(loss, loss0)
        for name in g0:
            torch.testing.assert_close(g[name], g0[name], msg=name)


@pytest.mark.slow
def test_bf16_error_is_within_hf_bf16_error() -> None:
    """Against HF in fp32 (same weights, rounded to bf16 first): coda's bf16 loss and gradients are
    no further off than HF's own bf16 run (with a factor for the different rounding points)."""
    hf32 = hf_llama(False, LLAMA3_ROPE)
    hf32.to(torch.bfloat16).float()  # the weights both bf16 runs see, exactly
    hf16 = hf_llama(False, LLAMA3_ROPE, dtype=torch.bfloat16)
    hf16.load_state_dict(hf32.state_dict())
    model = LlamaForCausalLM.from_hf(hf16)
    ids, labels = batch()
    runs = {}
    for name, m in (("ref", hf32), ("hf", hf16)):
        out = m(input_ids=ids, labels=labels)
        out.loss.backward()
        runs[name] = (out.loss.detach().float(), {k: v.float() for k, v in hf_grads(m).items()})
    out = model(ids, labels=labels)
    out.loss.backward()
    runs["coda"] = (out.loss.detach().float(), {k: v.float() for k, v in model.to_hf_state_dict(grads=True).items()})
    assert_within_hf_low_precision_error(runs["ref"], runs["hf"], runs["coda"])


def test_unsupported_configs_are_refused_clearly() -> None:
    hf = hf_llama(False, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ValueError, match="rope_parameters=.*dynamic"):
        LlamaForCausalLM.from_hf(hf)


def test_gemma_gains_made_together_equal_each_made_alone() -> None:
    """LlamaConfig.gains (Gemma's 1 + w of several norms in one concatenation) gives gain()'s
    values and gradients exactly, None where a weight is None, and leaves non-Gemma weights as given."""
    from coda.models.llama import LlamaConfig

    shape = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    gemma = LlamaConfig(**shape, gemma=True)
    ws = [torch.randn(n, dtype=torch.bfloat16, device=DEVICE, requires_grad=True) for n in (8, 8, 4)]
    args = (ws[0], None, ws[1], ws[2])
    together, alone = gemma.gains(*args), tuple(None if w is None else gemma.gain(w) for w in args)
    assert together[1] is None
    ups = [torch.randn(n, device=DEVICE) for n in (8, 8, 4)]
    grads = []
    for gains in (together, alone):
        got = [g for g in gains if g is not None]
        grads.append(torch.autograd.grad([(g * u).sum() for g, u in zip(got, ups)], ws))
        assert all(g.dtype == torch.float32 for g in got)
    for a, b in zip((g for g in together if g is not None), (g for g in alone if g is not None)):
        assert torch.equal(a, b)
    for a, b in zip(*grads):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    plain = LlamaConfig(**shape)
    assert all(a is b for a, b in zip(plain.gains(*args), args))
