"""coda's model attends as transformers does (masks.py) against the unmodified HF models in fp32:
padding (left and right) and documents packed in a row (also against HF run on each document
alone) for each family from_hf takes, sliding windows shorter than the sequence, for every layer
(Mistral) or per layer (Qwen2's layer_types, with its q/k/v biases); loss and every parameter
gradient. Then the two forms of a mask (attention.py): flash's sequences against the boolean mask."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

import coda  # noqa: E402
from coda.models import LlamaForCausalLM  # noqa: E402
from conftest import DEVICE, attention, rel  # noqa: E402
from hf_reference import (assert_step_like_hf, assert_within_hf_low_precision_error, grads_of,  # noqa: E402
                          redraw_per_layer)

VOCAB, SEQ = 96, 12
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
# Per family what changes its attention: QK-norm (qwen3, gemma3_text), head_dim apart from
# hidden_size / heads (qwen3, gemma), a window shorter than the sequence on layer 0 (Gemma 2/3's),
# capped scores under HF's eager attention (gemma2), Phi-3's fused projections and a window on every
# layer, OLMo 2's whole-width q/k norms (OLMo 3's with a window), Ministral's window on layer 1,
# SmolLM3's windowed layer without RoPE, Granite's attention scale, GLM-4's q/k/v biases and interleaved
# RoPE over half of each head, EXAONE 4's per-head q/k norms without input norms and its global layer
# without RoPE; pad_token_id 0 (Gemma's default;
# HF's default pad id is past VOCAB for Phi-3, OLMo 2, SmolLM3 and GLM-4).
FAMILIES = {
    "llama": dict(pad_token_id=0),
    "qwen3": dict(head_dim=16),
    "gemma": dict(head_dim=16),
    "gemma3_text": dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=6,
                        layer_types=["sliding_attention", "full_attention"]),
    "gemma2": dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=6, attn_logit_softcapping=2.0,
                   final_logit_softcapping=0.5, layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(sliding_window=6, pad_token_id=0),
    "olmo2": dict(pad_token_id=0),
    "olmo3": dict(pad_token_id=0, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "ministral": dict(pad_token_id=0, sliding_window=6, layer_types=["full_attention", "sliding_attention"],
                      head_dim=8),
    "smollm3": dict(no_rope_layers=[0, 1], use_sliding_window=True, sliding_window=6, pad_token_id=0),
    # q scaled by position past 4 (Llama 4's scale): a packed document's positions restart it
    "ministral3": dict(head_dim=8, pad_token_id=0, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0, "original_max_position_embeddings": 4,
        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}),
    "granite": dict(attention_multiplier=0.3, embedding_multiplier=6.0, residual_multiplier=0.4, logits_scaling=3.0),
    "glm4": dict(head_dim=8, pad_token_id=0),
    "exaone4": dict(head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "helium": dict(head_dim=8, attention_bias=True, pad_token_id=0),
}


# The quick subset runs llama; every family runs in the full suite.
FAMILY_CASES = [f if f == "llama" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILIES)]


def hf_model(model_type: str, attn: str | None = None, shape: dict | None = None, **kw: object) -> torch.nn.Module:
    """The tiny HF model, norms and biases perturbed; `attn` its attention (None: conftest.attention's)."""
    torch.manual_seed(0)
    config = transformers.CONFIG_MAPPING[model_type](**(shape or SHAPE), **kw)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn or attention(config))
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



def assert_same_step(hf: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, **kw: torch.Tensor) -> None:
    """Loss and every gradient of one step, coda's model of `hf` against HF, on the same inputs, within
    the bounds of hf_reference.assert_step_like_hf."""
    def step(m: torch.nn.Module) -> tuple:
        out = m(ids, labels=labels, **kw) if isinstance(m, LlamaForCausalLM) else m(input_ids=ids, labels=labels, **kw)
        out.loss.backward()
        return out.loss.detach().double(), {n: g.double() for n, g in grads_of(m).items()}

    assert_step_like_hf(hf, coda.models.from_hf, step)


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
    # Every row, the left pads' too (no key: zeros under HF's SDPA, every value averaged under its
    # eager attention, Gemma 2's): the shifted loss reads the last pad's, which predicts the first token.
    assert rel(ours, theirs) < 1e-5
    assert_same_step(hf, ids, labels, attention_mask=mask)


@pytest.mark.slow  # whole models against HF (the quick subset keeps test_keyless_mean_is_eager_attention_of_its_rows)
@pytest.mark.parametrize("family,kw", [
    ("llama", dict(FAMILIES["llama"], attn="eager")),
    # uncapped Gemma 2: eager attention under transformers' default (no SDPA path; SDPA before 5.2x)
    ("gemma2", dict(FAMILIES["gemma2"], attn_logit_softcapping=None))])
@pytest.mark.parametrize("holes", [False, True])
def test_keyless_queries_follow_hf_eager_attention(family: str, kw: dict, holes: bool) -> None:
    """A model transformers runs with eager attention: its queries that see no key (left pads; a pad
    under a window with holes before it) average every value of their row, and the loss and gradients
    read them through the last pad's logits (LlamaConfig.keyless_queries "mean")."""
    hf = hf_model(family, **kw)
    model = coda.models.from_hf(hf)
    assert model.config.keyless_queries == ("mean" if hf.config._attn_implementation == "eager" else "zeros")
    ids, labels = ids_and_labels()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    if holes:
        mask[0, 3:9] = 0  # under gemma2's window of 4, query 8 sees no key either
    labels[mask == 0] = -100
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
    assert rel(ours, theirs) < 1e-5
    assert_same_step(hf, ids, labels, attention_mask=mask)


def test_keyless_mean_is_eager_attention_of_its_rows() -> None:
    """fp64: `attend(..., keyless="mean")` against eager attention written out (the mask added as the
    dtype's lowest value, the softmax, autograd through both), output and q/k/v gradients, for rows
    that see no key (left pads, and one under a window past a hole) among rows that do."""
    from coda.models import attention, masks

    pad = _pads(["00011111", "11000011", "11111111"])
    batch, seq, heads, kv, hd, window = 3, 8, 4, 2, 8, 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch * seq, n, hd, generator=g, dtype=torch.float64) for n in (heads, kv, kv))
    grad = torch.randn(batch * seq, heads * hd, generator=g, dtype=torch.float64)
    scale = hd ** -0.5
    mask = masks.build(batch, seq, q.device, padding=pad, docs=None, window=window)
    assert int((~mask.live).sum()) == 3 + 2  # row 0's left pads; row 1's queries 4 and 5 (window 3)

    def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        bq, bk, bv = (t.view(batch, seq, -1, hd).transpose(1, 2) for t in (q, k, v))
        bk, bv = (t.repeat_interleave(heads // kv, dim=1) for t in (bk, bv))
        idx = torch.arange(seq)
        allowed = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - window) & pad.bool()[:, None, None]
        scores = bq @ bk.transpose(2, 3) * scale
        scores = scores + torch.zeros((), dtype=scores.dtype).masked_fill(~allowed, torch.finfo(scores.dtype).min)
        return (torch.softmax(scores, -1) @ bv).transpose(1, 2).reshape(batch * seq, heads * hd)

    def run(f) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = f(*leaves)
        out.backward(grad)
        return [out] + [t.grad for t in leaves]

    ours = run(lambda *t: attention.attend(*t, batch, seq, mask, scale, keyless="mean"))
    for name, got, ref in zip(("out", "dq", "dk", "dv"), ours, run(eager)):
        assert rel(got, ref) < 1e-12, f"{name}: {rel(got, ref):.3g}"
    zeros = run(lambda *t: attention.attend(*t, batch, seq, mask, scale))
    assert rel(zeros[0], ours[0]) > 0.1  # the keyless rows are what differs


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
    assert_same_step(hf, ids, labels, position_ids=pos)


def test_sliding_window_matches_mistral() -> None:
    hf = hf_model("mistral", sliding_window=5, use_cache=False)  # use_cache: as for packed documents above
    model = coda.models.from_hf(hf)
    assert [model.config.window(i) for i in range(2)] == [5, 5]
    ids, labels = ids_and_labels()
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None].to(DEVICE)  # windows inside packed documents
    assert_same_step(hf, ids, labels)
    assert_same_step(hf, ids, labels, position_ids=pos)


def test_per_layer_windows_match_qwen2_layer_types() -> None:
    hf = hf_model("qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=1, use_cache=False)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    model = coda.models.from_hf(hf)
    assert [model.config.window(i) for i in range(2)] == [None, 3]
    ids, labels = ids_and_labels()
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None].to(DEVICE)
    assert_same_step(hf, ids, labels, position_ids=pos)


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


# -- the two mask forms (attention.py) ------------------------------------------------------------

def test_sequence_form_starts_where_documents_do() -> None:
    from coda.models import masks

    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    docs = masks.documents(pos)
    got = masks.build(2, 6, pos.device, padding=None, docs=docs, window=4, sequences=True)
    assert got.allowed is None and got.window == 4
    assert got.starts.tolist() == [0, 3, 5, 6, 12]
    rows = masks.build(2, 6, pos.device, padding=None, docs=None, window=3, sequences=True)
    assert rows.starts.tolist() == [0, 6, 12] and rows.window == 3
    assert masks.build(2, 6, pos.device, padding=None, docs=None, window=6, sequences=True) is None


def test_masks_of_several_windows_read_the_batch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with several windows (Gemma 3's local and global layers) builds a mask for each; the
    document starts and the padded runs, each a host sync, are read once for all of them, and each
    mask is the one `build` gives for its window alone."""
    from coda.models import masks

    reads = []
    for name in ("_starts", "_unpadded_runs"):
        fn = getattr(masks, name)
        monkeypatch.setattr(masks, name, lambda *a, _fn=fn, _name=name: reads.append(_name) or _fn(*a))
    docs = masks.documents(torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]))
    pad = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    for kw in (dict(padding=None, docs=docs), dict(padding=pad, docs=None)):
        reads.clear()
        both = masks.build_all(2, 6, pad.device, windows={None, 4}, sequences=True, **kw)
        assert len(reads) == 1, reads
        for w, got in both.items():
            alone = masks.build(2, 6, pad.device, window=w, sequences=True, **kw)
            assert got.window == alone.window == w and torch.equal(got.starts, alone.starts)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="flash attention's variable-length kernel runs on a GPU")
@pytest.mark.parametrize("heads,kv,head_dim", [(4, 1, 256), (8, 2, 64)])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("layout", ["documents", "padding", "padding, keyless mean"])
def test_flash_sequences_match_the_boolean_mask(heads: int, kv: int, head_dim: int, window: int | None,
                                                layout: str) -> None:
    """bf16 on the GPU: the sequence form (flash, variable length) against the fp32 boolean form, output
    and q/k/v gradients, within twice the error of bf16 SDPA with the boolean mask. Packed documents,
    or padding: a right-padded and a left-padded row (with a window, which right padding's tail call
    does not take, an unpadded and a left-padded row); the left pads' output zeros or, as under HF's
    eager attention, their row's mean value."""
    from coda.models import attention, masks

    if not attention.varlen_applies(DEVICE, torch.bfloat16, head_dim):
        pytest.skip("this torch has no variable-length flash attention with windows")
    batch, seq = 2, 96
    g = torch.Generator().manual_seed(0)
    lengths = [[30, 17, 49], [96]]
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths]).to(DEVICE)
    docs = masks.documents(pos) if layout == "documents" else None
    pad = None
    if layout.startswith("padding"):
        pad = torch.ones(batch, seq, dtype=torch.long, device=DEVICE)
        pad[1, :30] = 0
        if window is None:
            pad[0, 76:] = 0
    tokens = batch * seq
    q, k, v = (torch.randn(tokens, n, head_dim, generator=g).to(DEVICE) for n in (heads, kv, kv))
    grad = torch.randn(tokens, heads * head_dim, generator=g).to(DEVICE)
    scale = head_dim ** -0.5

    def run(dtype: torch.dtype, sequences: bool) -> list[torch.Tensor]:
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        mask = masks.build(batch, seq, DEVICE, padding=pad, docs=docs, window=window, sequences=sequences)
        assert (mask.starts is not None) == sequences
        out = attention.attend(*leaves, batch, seq, mask, scale, keyless="mean" if "mean" in layout else "zeros")
        out.backward(grad.to(dtype))
        return [out] + [t.grad for t in leaves]

    ref = run(torch.float32, False)
    dense = run(torch.bfloat16, False)
    flash = run(torch.bfloat16, True)
    for name, r, d, f in zip(("out", "dq", "dk", "dv"), ref, dense, flash):
        assert rel(d, r) <= BF16_ATTENTION, f"{name}: bf16 SDPA {rel(d, r):.3g}"
        assert rel(f, r) <= 2 * rel(d, r) + 1e-4, f"{name}: flash {rel(f, r):.3g}, bf16 SDPA {rel(d, r):.3g}"


def test_sdpa_backward_gets_its_output_gradient_in_its_output_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the GPU test below guards, on the CPU: SDPA stands in as cuDNN lays its output out (token-major
    under a [B, H, S, hd] view), and the gradient its backward receives has that output's strides, with
    and without padded queries to zero (a contiguous one made torch 2.11's cuDNN backward wrong)."""
    from coda.models import attention, masks

    seen = []

    class CudnnLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out: torch.Tensor) -> torch.Tensor:
            return out.transpose(1, 2).contiguous().transpose(1, 2)

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            seen.append(grad.stride())
            return grad

    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **kw: CudnnLike.apply(sdpa(*a, **kw)))
    batch, seq, heads, head_dim = 2, 8, 4, 8
    pad = torch.ones(batch, seq, dtype=torch.long)
    pad[1, :3] = 0
    for padding in (None, pad):
        q, k, v = (torch.randn(batch * seq, heads, head_dim, requires_grad=True) for _ in range(3))
        mask = masks.build(batch, seq, q.device, padding=padding, docs=None, window=4)
        assert (mask.live is not None) == (padding is not None)
        seen.clear()
        attention.attend(q, k, v, batch, seq, mask, 0.5).backward(torch.randn(batch * seq, heads * head_dim))
        assert seen == [CudnnLike.apply(torch.empty(batch, heads, seq, head_dim)).stride()], padding


# bf16 attention against fp32: a few bf16 ulps (2^-8) over outputs and q/k/v gradients (2e-3 to 5e-3 seen).
BF16_ATTENTION = 2 ** -6


@pytest.mark.skipif(DEVICE.type != "cuda", reason="SDPA's GPU kernels")
def test_boolean_masks_of_one_shape_in_turn_keep_their_gradients() -> None:
    """bf16 SDPA under boolean masks of one shape, one after the other in a process, as a training loop
    meets them: documents, padding with queries that have no key (their output zeroed), documents,
    padding. Each output and q/k/v gradient within a few bf16 ulps of fp32. With the padded output zeroed
    on the [B, H, S, hd] view, torch 2.11's cuDNN backward (H200) returned gradients 1.4 off (relative)
    for the padding after the documents, and right ones when padding came first."""
    from coda.models import attention, masks

    batch, seq, heads, kv, head_dim = 2, 1024, 8, 2, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch * seq, n, head_dim, generator=g).to(DEVICE) for n in (heads, kv, kv))
    grad = torch.randn(batch * seq, heads * head_dim, generator=g).to(DEVICE)
    pos = torch.cat([torch.arange(n) for n in (300, 500, 224, 1024)])[None].view(batch, seq).to(DEVICE)
    pad = torch.ones(batch, seq, dtype=torch.long, device=DEVICE)
    pad[0, 700:] = 0
    pad[1, :200] = 0
    forms = {"documents": dict(padding=None, docs=masks.documents(pos)), "padding": dict(padding=pad, docs=None)}

    def run(dtype: torch.dtype, form: str) -> list[torch.Tensor]:
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        mask = masks.build(batch, seq, DEVICE, window=None, **forms[form])
        assert mask.allowed is not None and (mask.live is not None) == (form == "padding")
        out = attention.attend(*leaves, batch, seq, mask, head_dim ** -0.5)
        return [out, *torch.autograd.grad(out, leaves, grad.to(dtype))]

    refs = {form: run(torch.float32, form) for form in forms}
    for turn, form in enumerate(["documents", "padding", "documents", "padding"]):
        for name, got, ref in zip(("out", "dq", "dk", "dv"), run(torch.bfloat16, form), refs[form]):
            assert rel(got, ref) <= BF16_ATTENTION, f"turn {turn} ({form}) {name}: {rel(got, ref):.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma", "gemma3_text"])
def test_packed_bf16_error_is_within_hf_bf16_error(family: str) -> None:
    """bf16 over packed documents (and Gemma 3's window): on a GPU the sequence form (flash over each
    document), on the CPU the boolean form. Against HF fp32 on the same bf16-rounded weights, coda's
    bf16 loss and gradients are no further off than HF's own bf16 run (twice its error plus a bf16 ulp:
    the bound of the other bf16 tests)."""
    hf32 = hf_model(family, use_cache=False, **FAMILIES[family])
    hf32.to(torch.bfloat16).float()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    model = coda.models.from_hf(hf16)
    ids, labels = ids_and_labels()
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None].to(DEVICE)

    def step(m: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
        if isinstance(m, LlamaForCausalLM):
            out = m(ids, labels=labels, position_ids=pos)
            out.loss.backward()
            return out.loss.item(), {n: g.float() for n, g in m.to_hf_state_dict(grads=True).items()}
        out = m(input_ids=ids, labels=labels, position_ids=pos)
        out.loss.backward()
        grads = {n: p.grad.float() for n, p in m.named_parameters()}
        grads.setdefault("lm_head.weight", grads["model.embed_tokens.weight"])
        return out.loss.item(), grads

    assert_within_hf_low_precision_error(step(hf32), step(hf16), step(model))


# -- padding in the sequence form, on the CPU through a reference of flash's variable-length call ---------

def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, *, scale: float, window_size: tuple[int, int]) -> torch.Tensor:
    """torch.nn.attention.varlen.varlen_attn's function, one sequence at a time: query i of a sequence
    with Lq queries and Lk keys sits at key position i + Lk - Lq (flash aligns the ends) and attends
    keys j with pos - left <= j <= pos + right (-1: unbounded); grouped kv heads serve H / KV q heads."""
    out = torch.zeros_like(q)
    left, right = window_size
    for a, b, c, d in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()):
        assert b - a <= max_q and d - c <= max_k
        qs, ks, vs = q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)
        ks, vs = (t.repeat_interleave(qs.shape[0] // t.shape[0], 0) for t in (ks, vs))
        pos = torch.arange(b - a, device=q.device)[:, None] + (d - c) - (b - a)
        j = torch.arange(d - c, device=q.device)[None, :]
        allowed = torch.ones(b - a, d - c, dtype=torch.bool, device=q.device)
        if right >= 0:
            allowed &= j <= pos + right
        if left >= 0:
            allowed &= j >= pos - left
        scores = (qs @ ks.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
        out[a:b] = (torch.softmax(scores, -1) @ vs).transpose(0, 1)
    return out


def _pads(rows: list[str]) -> torch.Tensor:
    """A [B, S] attention_mask from strings of 1 (token) and 0 (pad)."""
    return torch.tensor([[int(c) for c in r] for r in rows])


def test_padding_takes_the_sequence_form_where_each_rows_tokens_are_one_run() -> None:
    from coda.models import masks

    pad = _pads(["111111", "001111", "111100", "011110", "000000"])
    got = masks.build(5, 6, pad.device, padding=pad, docs=None, window=None, sequences=True)
    # rows: whole; left pad run + tokens; tokens + right pad run; pad, tokens, pad; one (empty) run
    assert got.allowed is None and got.starts.tolist() == [0, 6, 8, 12, 16, 18, 19, 23, 24, 30]
    assert got.longest == 6
    assert got.live[:, 0, 0].nonzero().flatten().tolist() == [
        i for i in range(30) if i not in (6, 7, 18, 24, 25, 26, 27, 28, 29)]
    assert got.tail.queries.tolist() == [16, 17, 23] and got.tail.keys.tolist() == [12, 13, 14, 15, 19, 20, 21, 22]
    assert got.tail.cu_q.tolist() == [0, 2, 3] and got.tail.cu_k.tolist() == [0, 4, 8]
    assert (got.tail.max_q, got.tail.max_k) == (2, 4)
    left = masks.build(5, 6, pad.device, padding=pad[:2], docs=None, window=3, sequences=True)
    assert left.starts is not None and left.window == 3 and left.tail is None  # left padding keeps windows
    # the boolean form: a hole in a row, or a window with right padding (the tail call has no window)
    for rows, window in ((["110111", "111111"], None), (["111100", "111111"], 3)):
        boolean = masks.build(2, 6, pad.device, padding=_pads(rows), docs=None, window=window, sequences=True)
        assert boolean.starts is None and boolean.allowed is not None, rows


@pytest.mark.parametrize("window", [None, 3])
def test_padded_sequences_compute_the_boolean_mask(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """fp32 on the CPU, flash replaced by its reference: the sequence form of padding (runs, zeroed
    queries, the tail call) gives the boolean form's output and q/k/v gradients."""
    from coda.models import attention, masks

    monkeypatch.setattr(attention, "_varlen", lambda: varlen_reference)
    pad = _pads(["11111111", "00011111", "11110000", "01111100", "00000000"])
    if window is not None:
        pad = pad[:2]
    batch, seq, heads, kv, hd = pad.shape[0], 8, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch * seq, n, hd, generator=g, dtype=torch.float64) for n in (heads, kv, kv))
    grad = torch.randn(batch * seq, heads * hd, generator=g, dtype=torch.float64)

    def run(sequences: bool) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = masks.build(batch, seq, q.device, padding=pad, docs=None, window=window, sequences=sequences)
        assert (mask.starts is not None) == sequences
        out = attention.attend(*leaves, batch, seq, mask, hd ** -0.5)
        out.backward(grad)
        return [out] + [t.grad for t in leaves]

    for name, got, ref in zip(("out", "dq", "dk", "dv"), run(True), run(False)):
        assert rel(got, ref) < 1e-12, f"{name}: {rel(got, ref):.3g}"


@pytest.mark.parametrize("side", ["left", *(pytest.param(s, marks=pytest.mark.slow) for s in ("right", "both"))])
def test_model_over_padded_sequences_matches_hf(monkeypatch: pytest.MonkeyPatch, side: str) -> None:
    """The whole model taking the sequence form (as on a GPU in bf16; here fp32 through flash's
    reference) against HF with the same attention_mask: logits of every token, loss, gradients."""
    from coda.models import attention, llama

    monkeypatch.setattr(attention, "_varlen", lambda: varlen_reference)
    monkeypatch.setattr(llama, "varlen_applies", lambda *args: True)
    hf = hf_model("llama", **FAMILIES["llama"])
    model = coda.models.from_hf(hf)
    ids, labels = ids_and_labels(3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, SEQ - 3:] = 0
    if side == "both":
        mask[2, :2] = 0
    elif side == "left":
        mask[2] = 1
    else:
        mask[1] = 1
    labels[mask == 0] = -100
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
    assert rel(ours, theirs) < 1e-5
    assert_same_step(hf, ids, labels, attention_mask=mask)


@st.composite
def drawn_masks(draw: st.DrawFn) -> tuple[str, dict, dict, int, dict]:
    """(family, shape, fields, seq, step inputs): a FAMILIES case at drawn head counts, width, depth,
    per-layer lists and window, over a drawn sequence length, with a drawn mask: left or right padding
    of any length per row (a whole row's but one token included), holes inside rows, or packed
    documents of drawn lengths."""
    family = draw(st.sampled_from(sorted(FAMILIES)))
    heads, layers = draw(st.sampled_from([2, 4])), draw(st.integers(1, 2))
    shape = dict(SHAPE, hidden_size=draw(st.sampled_from([32, 48])), num_attention_heads=heads,
                 num_key_value_heads=draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0])),
                 num_hidden_layers=layers)
    kw = redraw_per_layer(draw, dict(FAMILIES[family], use_cache=False), layers)
    if "sliding_window" in kw:
        kw["sliding_window"] = draw(st.sampled_from([2, 3, 5, 6]))
    seq = draw(st.sampled_from([7, 10, 15]))
    form = draw(st.sampled_from(["left", "right", "holes", "packed"]))
    if form == "packed":
        rows = []
        for _ in range(2):
            cuts = sorted(draw(st.sets(st.integers(1, seq - 1), max_size=3)))
            rows.append(torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, seq])]))
        return family, shape, kw, seq, dict(position_ids=torch.stack(rows).to(DEVICE))
    mask = torch.ones(2, seq, dtype=torch.long)
    for row in range(2):
        n = draw(st.integers(0, seq - 1))
        if form == "left":
            mask[row, :n] = 0
        elif form == "right":
            mask[row, seq - n:] = 0
        elif n:
            start = draw(st.integers(1, seq - 1))
            mask[row, start:start + draw(st.integers(1, 3))] = 0
    return family, shape, kw, seq, dict(attention_mask=mask.to(DEVICE))


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=drawn_masks())
def test_masks_match_hf_at_drawn_shapes(case: tuple) -> None:
    """Padding, holes and packed documents at drawn shapes and layouts: coda's logits and its step
    against HF's (a drawn shape transformers itself cannot run, Helium's head_dim apart from the
    width, is skipped)."""
    family, shape, kw, seq, inputs = case
    hf = hf_model(family, shape=shape, **kw)
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g).to(DEVICE)
    labels = ids.clone()
    if "attention_mask" in inputs:
        labels[inputs["attention_mask"] == 0] = -100
    try:
        with torch.no_grad():
            theirs = hf(input_ids=ids, **inputs).logits
    except RuntimeError:
        assume(False)
    model = coda.models.from_hf(hf)
    with torch.no_grad():
        assert rel(model(ids, **inputs).logits, theirs) < 1e-5
    assert_same_step(hf, ids, labels, **inputs)
