"""coda.patch on transformers Llama, Mistral and Gemma 3 models (tiny, built from configs): the same loss and
gradients as the unpatched model in fp32, unchanged parameter names and state_dict, the same greedy
.generate() tokens, clear refusals; and the fused norm + MLP op it uses against plain PyTorch."""

from __future__ import annotations

import copy
import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import coda  # noqa: E402
from conftest import DEVICE, EPS, rel  # noqa: E402

VOCAB, SEQ = 96, 8
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def hf_model(kind: str, **kw):
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True, **kw))
    elif kind == "gemma3_text":  # a window shorter than SEQ on layer 0, the local RoPE base there
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **SHAPE, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"], **kw))
    elif kind == "gemma2":  # the same, the final logits capped (at 0.5: these tiny logits are small)
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **SHAPE, head_dim=8, sliding_window=4, final_logit_softcapping=0.5,
            layer_types=["sliding_attention", "full_attention"], **kw))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPE, **kw))
    model = model.to(DEVICE).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's scale is 1 + w (w starts at 0): any w away from 0 tests it too
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model



# Swapped per layer: Llama's input norm, norm + MLP and RoPE; Gemma's also its two sandwich norms, Gemma 3's
# also its q and k norms.
SWAPPED_PER_LAYER = {"llama": 3, "mistral": 3, "gemma2": 5, "gemma3_text": 7}


# The quick subset runs Llama's layouts; Gemma's run in the full suite (test_families compares every
# family's patched model with HF in the quick subset too).
GEMMA_SLOW = {k: pytest.param(k, marks=pytest.mark.slow) for k in ("gemma2", "gemma3_text")}


@pytest.mark.parametrize("kind", [GEMMA_SLOW.get(k, k) for k in sorted(SWAPPED_PER_LAYER)])
def test_patched_model_trains_like_the_unpatched_one(kind: str) -> None:
    ref = hf_model(kind)
    model = copy.deepcopy(ref)
    names, sd = [n for n, _ in ref.named_parameters()], ref.state_dict()
    assert coda.patch(model) is model
    assert len(model.coda_patched) == SWAPPED_PER_LAYER[kind] * SHAPE["num_hidden_layers"] + 2
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == list(sd) and all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    ids = torch.randint(0, VOCAB, (2, SEQ), device=DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    ours, theirs = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert ours.logits is None and theirs.logits is not None
    assert abs(ours.loss.item() - theirs.loss.item()) < 1e-5 * theirs.loss.item()
    ours.loss.backward()
    theirs.loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel(p.grad, q.grad) < 1e-5, f"{name}: relative error {rel(p.grad, q.grad):.3g}"
    with torch.no_grad():  # logits without labels: the final norm + LM head through rmsnorm_linear
        assert rel(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5


@pytest.mark.parametrize("kind", ["llama", GEMMA_SLOW["gemma2"], GEMMA_SLOW["gemma3_text"]])
def test_patched_generate_gives_the_same_tokens(kind: str) -> None:
    ref = hf_model(kind)
    model = coda.patch(copy.deepcopy(ref))
    prompt = torch.randint(0, VOCAB, (2, 4), device=DEVICE)
    mask = torch.ones_like(prompt)
    args = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, **args), ref.generate(prompt, **args))


def test_patch_is_per_instance_and_idempotent() -> None:
    model, other = hf_model("llama"), hf_model("llama")
    coda.patch(model)
    report = list(model.coda_patched)
    assert coda.patch(model).coda_patched == report
    assert "forward" not in vars(other) and "forward" not in vars(other.model.layers[0].mlp)
    assert "forward" not in vars(other.model.layers[0].self_attn)
    hf_rope = transformers.models.llama.modeling_llama.apply_rotary_pos_emb  # the module function stays HF's
    assert hf_rope.__module__ == "transformers.models.llama.modeling_llama"
    assert inspect.unwrap(type(model.model.layers[0].self_attn).forward).__globals__["apply_rotary_pos_emb"] is hf_rope


def test_rope_is_swapped_only_where_hf_rotates_halves() -> None:
    """Every supported family's attention whose RoPE is the halves rotation gets coda's; GLM's and
    GLM-4's interleaved rotation is told apart by the probe and stays HF's; a function that is not a
    rotation at all (or takes other arguments) is never swapped."""
    from coda.models.hf_patch import _rotates_halves, _with_coda_rope

    for module, cls, swapped in (("llama", "LlamaAttention", True), ("phi3", "Phi3Attention", True),
                                 ("gemma3", "Gemma3Attention", True), ("glm", "GlmAttention", False),
                                 ("glm4", "Glm4Attention", False)):
        attn = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
        assert (_with_coda_rope(attn.forward) is not None) == swapped, cls
    assert not _rotates_halves(lambda q, k, cos, sin: (q, k))
    assert not _rotates_halves(lambda q, k, cos, sin, position_ids: (q, k))


@pytest.mark.parametrize("batch_cos,rotary", [(2, 8), (1, 8), (2, 4)])
def test_rope_matches_hf_apply_rotary_pos_emb(batch_cos: int, rotary: int) -> None:
    """coda.ops.rope against transformers' own functions (Llama's; Phi-3's partial rotary, where
    columns from R on pass through), outputs and q/k gradients, fp32; cos from a batch of 1 broadcasts."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

    hf_rope = llama_rope if rotary == 8 else phi3_rope
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 8, generator=g).to(DEVICE).transpose(1, 2).requires_grad_()  # HF's [B, H, S, D] view
    k = torch.randn(2, 2, 5, 8, generator=g).to(DEVICE).requires_grad_()
    cos, sin = (torch.randn(batch_cos, 5, rotary, generator=g).to(DEVICE) for _ in range(2))
    ours, theirs = coda.ops.rope(q, k, cos, sin), hf_rope(q, k, cos, sin)
    grads = [torch.randn(t.shape, generator=g).to(DEVICE) for t in theirs]
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and rel(a, b) < 1e-6
    for a, b in zip(torch.autograd.grad(ours, (q, k), grads), torch.autograd.grad(theirs, (q, k), grads)):
        assert rel(a, b) < 1e-6
    with pytest.raises(ValueError, match="must be"):
        coda.ops.rope(q, k, cos[..., :3], sin[..., :3])


def test_unpatchable_models_are_refused_clearly() -> None:
    with pytest.raises(TypeError, match=r"hidden_act='gelu'"):
        coda.patch(hf_model("llama", hidden_act="gelu"))
    with pytest.raises(TypeError, match=r"cannot patch Linear: model_type None is not supported \(supported: llama"):
        coda.patch(torch.nn.Linear(4, 4))


class Adapted(torch.nn.Linear):
    """A stand-in for an adapter layer such as peft's LoRA: the base weight, plus what its forward adds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.5 * super().forward(x.flip(-1))


def adapted(linear: torch.nn.Linear) -> Adapted:
    layer = Adapted(linear.in_features, linear.out_features, bias=linear.bias is not None, device=DEVICE)
    layer.load_state_dict(linear.state_dict())
    return layer


def test_adapted_projections_are_refused_not_skipped() -> None:
    """The fused MLP and LM head multiply by the projections' weights, so an adapter, a hook or a
    replaced forward on one of them would be skipped: refused when patching, and on every call
    (adapters are often added after patching), naming the module."""
    hf = hf_model("llama")
    hf.model.layers[1].mlp.up_proj = adapted(hf.model.layers[1].mlp.up_proj)
    with pytest.raises(TypeError, match=r"model\.layers\.1\.mlp\.up_proj is a test_patch\.Adapted, not a torch\.nn"
                                        r"\.Linear: .*merge_and_unload"):
        coda.patch(hf)
    ids = torch.randint(0, VOCAB, (2, SEQ), device=DEVICE)
    for change, name in ((lambda m: setattr(m.model.layers[0].mlp, "down_proj", adapted(m.model.layers[0].mlp.down_proj)),
                          r"model\.layers\.0\.mlp\.down_proj is a test_patch\.Adapted"),
                         (lambda m: m.lm_head.register_forward_hook(lambda *_: None),
                          r"lm_head has forward hooks or a replaced forward")):
        model = coda.patch(hf_model("llama"))
        change(model)
        with pytest.raises(TypeError, match=name):
            model(input_ids=ids, labels=ids)


def test_adapted_attention_projections_stay_hf() -> None:
    """HF's attention calls its projections as modules, so adapters there keep working when patched."""
    hf = hf_model("llama")
    for layer in hf.model.layers:
        layer.self_attn.q_proj = adapted(layer.self_attn.q_proj)
    ids = torch.randint(0, VOCAB, (2, SEQ), device=DEVICE)
    ours = coda.patch(copy.deepcopy(hf))
    assert rel(ours(input_ids=ids, labels=ids).loss, hf(input_ids=ids, labels=ids).loss) < 1e-5


@pytest.mark.parametrize("kind", ["llama", GEMMA_SLOW["gemma3_text"]])
@pytest.mark.parametrize("reentrant", [True, False])
def test_patched_model_trains_under_hf_gradient_checkpointing(kind: str, reentrant: bool) -> None:
    """transformers' own checkpointing (Trainer's gradient_checkpointing=True) recomputes each decoder
    layer, coda's ops inside it, in backward: the loss and every gradient stay the unpatched model's."""
    ref = hf_model(kind).train()
    model = coda.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, SEQ), device=DEVICE)
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and rel(p.grad, q.grad) < 1e-5, name


class ForeignNorm(torch.nn.Module):
    """A stand-in for another library's norm class holding the norm's weight (Liger-Kernel's
    LigerRMSNorm: its eps under another name, its own forward); refused before anything calls it."""

    __module__ = "liger_kernel.transformers.rms_norm"

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight


@pytest.mark.parametrize("where", ["model.layers.1.input_layernorm", "model.layers.0.post_attention_layernorm",
                                   "model.norm"])
def test_other_libraries_modules_are_refused(where: str) -> None:
    """A module coda rewrites (patch) or reads (from_hf) whose class is another library's computes what
    that library's code says: refused by name, saying what to do, never half rewritten."""
    hf = hf_model("llama")
    owner, name = where.rsplit(".", 1)
    hf.get_submodule(owner).register_module(name, ForeignNorm(hf.get_submodule(where)))
    message = rf"{where} is a liger_kernel\.transformers\.rms_norm\.ForeignNorm, not transformers' .*use one of the two"
    with pytest.raises(TypeError, match=message):
        coda.patch(hf)
    assert not getattr(hf, "coda_patched", None) and "forward" not in hf.model.layers[0].mlp.__dict__
    with pytest.raises(ValueError, match=message):
        coda.models.from_hf(hf)


def test_a_norm_hooked_or_replaced_after_patching_is_refused_or_left_to_hf() -> None:
    """The norm in front of the MLP passes its input through (the fused MLP applies it): a forward hook
    on it, or its forward replaced after patching (Liger-Kernel's instance patch), is refused on the
    call. The final norm is deferred to the LM head only while nothing else sees it: with a hook or a
    replaced forward the head reads the norm module's output, so loss and logits stay HF's."""
    ids = torch.randint(0, VOCAB, (2, SEQ), device=DEVICE)
    for change in (lambda norm: norm.register_forward_hook(lambda *_: None),
                   lambda norm: setattr(norm, "forward", type(norm).forward.__get__(norm))):
        model = coda.patch(hf_model("llama"))
        change(model.model.layers[1].post_attention_layernorm)
        with pytest.raises(RuntimeError, match=r"model\.layers\.1\.post_attention_layernorm has forward hooks, or "
                                               r"its forward was replaced .*not both"):
            model(input_ids=ids, labels=ids)
    hf = hf_model("llama")
    want = hf(input_ids=ids, labels=ids).loss, hf(input_ids=ids).logits
    for change in ("hook", "replaced"):
        model, seen = coda.patch(hf_model("llama")), []
        norm = model.model.norm
        if change == "hook":
            norm.register_forward_hook(lambda module, args, out: seen.append(out))
        else:
            norm.forward = type(norm).forward.__get__(norm)
        got = model(input_ids=ids, labels=ids).loss, model(input_ids=ids).logits
        assert rel(got[0], want[0]) < 1e-5 and rel(got[1], want[1]) < 1e-5, change
        if change == "hook":  # the final norm's output, as HF's hook sees it
            hidden = hf(input_ids=ids, output_hidden_states=True).hidden_states[-1]
            assert len(seen) == 2 and rel(seen[-1], hidden) < 1e-5


GATED = {"swiglu": (coda.ops.rmsnorm_swiglu_mlp, F.silu),
         "geglu": (coda.ops.rmsnorm_geglu_mlp, lambda t: F.gelu(t, approximate="tanh"))}


@pytest.mark.parametrize("mlp", sorted(GATED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_gated_mlp_matches_pytorch(dtype: torch.dtype, mlp: str) -> None:
    op, act = GATED[mlp]

    def leaf(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=DEVICE) * s).to(dtype).requires_grad_()

    d, f = 24, 40
    x, g = leaf(2, 9, d), leaf(d, s=0.3)
    wg, wu, wd = leaf(f, d, s=d**-0.5), leaf(f, d, s=d**-0.5), leaf(d, f, s=f**-0.5)
    out = op(x, g, wg, wu, wd, eps=1e-5)
    h = F.rms_norm(x.float(), (d,), g.float(), 1e-5)
    ref = F.linear(act(F.linear(h, wg.float())) * F.linear(h, wu.float()), wd.float())
    bound = 1e-5 if dtype == torch.float32 else 6 * EPS[dtype]
    assert out.shape == x.shape and rel(out, ref) < bound
    dout = torch.randn_like(ref)
    params = (x, g, wg, wu, wd)
    for name, a, b in zip("x g w_gate w_up w_down".split(), torch.autograd.grad(out, params, dout.to(dtype)),
                          torch.autograd.grad(ref, params, dout)):
        assert rel(a, b) < bound, f"d{name}: {rel(a, b):.3g}"
