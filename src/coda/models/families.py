"""Which transformers decoder families coda runs, through which entry point, and what each config
field must be for coda to compute what transformers computes: the one place that decides.

Two entry points read these rules: `coda.models.from_hf` (FROM_HF: coda's own model, every layer
rewritten, attention included) and `coda.patch` (PATCH: HF's modules kept, coda runs the norms, the
MLP and the LM head; HF's attention, RoPE and q/k/v projections stay). Every field of a config
(`config.to_dict()`) is either irrelevant to the math (token ids, cache and output flags, ...),
handled (a predicate on its value, per entry point: an attention-only field cannot change what
PATCH rewrites), or refused. A field no rule names, such as one a later transformers adds, is
refused: never a silently different model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

FROM_HF, PATCH = "from_hf", "patch"
BOTH = frozenset({FROM_HF, PATCH})

# Config fields no supported family's math reads (PreTrainedConfig's own and the usual extras).
IRRELEVANT = frozenset({
    "_name_or_path", "transformers_version", "model_type", "architectures", "dtype", "torch_dtype",
    "output_attentions", "output_hidden_states", "return_dict", "use_cache", "is_encoder_decoder",
    "chunk_size_feed_forward", "problem_type", "id2label", "label2id", "tokenizer_class",
    "bos_token_id", "eos_token_id", "max_position_embeddings", "initializer_range",
    # Where remote code for the family lives: read only with trust_remote_code, and a model built from
    # it is refused by `foreign_code` (checkpoints on the Hub carry it beside transformers' own code).
    "auto_map",
})


@dataclass(frozen=True)
class Rule:
    """A handled field: `ok(value)` says whether coda computes this value as HF does; `handles`
    says which values it does (for the error message); `entries` are the entry points whose math
    the field changes (for the others it is irrelevant)."""

    ok: Callable[[Any], bool]
    handles: str
    entries: frozenset[str] = BOTH


def _any(_: Any) -> bool:
    return True


LAYER_TYPES_NAMES = ("full_attention", "sliding_attention")


def _rope_ok(rope: Any, partial: bool = False) -> bool:
    """The RoPE coda's epilogues compute (llama_block.inv_freq): theta^(-2i/d), plain or with
    transformers' "linear", "llama3" or "yarn" frequency rule, and nothing else; one such per layer type where
    the config gives one per type (Gemma 3). Over the whole head, or (`partial`: the families whose
    attention reads it) over its first partial_rotary_factor of each head's dims."""
    if rope is None:
        return True
    if not isinstance(rope, Mapping):
        return False
    if rope and set(rope) <= set(LAYER_TYPES_NAMES):
        return all(isinstance(r, Mapping) and _rope_ok(r, partial) for r in rope.values())
    kind = rope.get("rope_type", rope.get("type", "default"))
    keys = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if kind == "llama3":
        keys |= {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    elif kind == "linear":
        keys |= {"factor"}
    elif kind == "yarn":  # over the whole head: its attention factor scales the rotated dims alone
        keys |= YARN_KEYS
        partial = False
    elif kind != "default":
        return False
    return set(rope) <= keys and _fraction_ok(rope.get("partial_rotary_factor"), partial)


# A "yarn" RoPE dict's keys (max_position_embeddings: Ministral 3's copy of the config's, unread).
YARN_KEYS = frozenset({"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                       "mscale_all_dim", "attention_factor", "truncate", "max_position_embeddings"})


def _fraction_ok(value: Any, partial: bool) -> bool:
    """A rotated fraction of each head: 1 (None) always; a fraction in (0, 1) where `partial`."""
    if value in (None, 1):
        return True
    return partial and isinstance(value, (int, float)) and 0 < value < 1


ANY = Rule(_any, "any value")
# Fields any value of which coda computes as HF does: sizes, the norms' eps, a tied LM head, the
# embedding's padding_idx (the row lookups never update: coda's own model reads pad_token_id too).
SHAPE = {name: ANY for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "rms_norm_eps", "tie_word_embeddings", "pad_token_id")}
SILU = Rule(lambda v: v == "silu", "'silu' (SwiGLU)")
NO_BIAS = Rule(lambda v: not v, "False")
ROPE = Rule(_rope_ok, "rope_type 'default', 'linear', 'llama3' or 'yarn' over the whole head", frozenset({FROM_HF}))
# The same over part of each head, for the families whose RoPE reads partial_rotary_factor (Phi-3's
# halves, GLM's interleaved pairs): LlamaConfig.rotary_dim, and the row order of conversion (Family.rope_pairs).
PARTIAL_ROPE = Rule(lambda v: _rope_ok(v, partial=True),
                    "rope_type 'default', 'linear' or 'llama3' over the whole head or a fraction of it, or 'yarn' "
                    "over the whole head", frozenset({FROM_HF}))
# transformers 5.17 keeps the fraction at the config's top level (5.2x moves it into rope_parameters).
PARTIAL_FRACTION = Rule(lambda v: _fraction_ok(v, partial=True), "a fraction in (0, 1]", frozenset({FROM_HF}))
# Dropout changes training math: coda's own model has none; coda.patch keeps HF's modules that apply it.
NO_DROPOUT = Rule(lambda v: not v, "0 (no dropout)", frozenset({FROM_HF}))
# Attention-only fields: coda.patch keeps HF's attention, so only coda's own model must handle them.
ATTENTION = {
    "num_key_value_heads": ANY, "head_dim": ANY,
    "rope_parameters": ROPE, "rope_scaling": ROPE, "rope_theta": ANY,
    "attention_dropout": NO_DROPOUT,  # on the attention weights
}
# Read by the config class when it is built (to set other fields), never by the model.
DERIVED = Rule(_any, "any value", frozenset())


def _attention_only(rule: Rule) -> Rule:
    return Rule(rule.ok, rule.handles, frozenset({FROM_HF}))


@dataclass(frozen=True)
class Norms:
    """A decoder layer's RMSNorms by transformers' module names, None where the layer has none: in
    front of attention, on its output (before the residual add), in front of the MLP, on its output."""

    attn_in: str | None = "input_layernorm"
    attn_out: str | None = None
    mlp_in: str | None = "post_attention_layernorm"
    mlp_out: str | None = None


LLAMA_NORMS = Norms()
# Gemma 2/3: "sandwich" norms, on the attention and MLP outputs too, and the MLP's own norm in front of it.
SANDWICH_NORMS = Norms(attn_out="post_attention_layernorm", mlp_in="pre_feedforward_layernorm",
                       mlp_out="post_feedforward_layernorm")
# GLM-4: the same layout under its own names.
GLM4_NORMS = Norms(attn_out="post_self_attn_layernorm", mlp_out="post_mlp_layernorm")
# OLMo 2: norms only on the attention and MLP outputs.
POST_NORMS = Norms(attn_in=None, attn_out="post_attention_layernorm", mlp_in=None,
                   mlp_out="post_feedforward_layernorm")


@dataclass(frozen=True)
class Family:
    """A transformers `model_type`, the entry points that support it, its fields' rules, and what
    its layer computes beyond Llama's (and under which names and layouts transformers holds it)."""

    model_type: str
    entries: frozenset[str]
    fields: Mapping[str, Rule]
    # q/k/v projections with biases: True always (Qwen2, whatever the config says); a config field's
    # name: where that field is set (GLM's attention_bias, which leaves o_proj without one).
    qkv_bias: bool | str = False
    qk_norm: bool = False  # its attention RMS-normalizes each q and k head before RoPE (Qwen3; GLM-4.5 where use_qk_norm)
    gemma_norms: bool = False  # every Gemma: (1 + w) norms, a GeGLU MLP, the embedding scaled by sqrt(hidden_size)
    norms: Norms = LLAMA_NORMS
    fused_qkv: bool = False  # one qkv_proj per layer ([q; k; v] rows: Phi-3)
    fused_gate_up: bool = False  # one gate_up_proj per layer ([gate; up] rows: Phi-3, GLM)
    # Which dims of a head its RoPE rotates together: "halves" (i, i + r/2), or "interleaved" (2i, 2i + 1: GLM)
    rope_pairs: str = "halves"
    # Which layers rotate q and k (a flag per layer), for families with layers without RoPE; None: all.
    rotary_layers: Callable[[Any], tuple[bool, ...] | None] | None = None
    # Sparse MoE layers (a router over experts where the config says; dense MLPs elsewhere): coda.patch
    # keeps HF's MoE block, runs the norm in front of it alone, and adds the router's load-balancing
    # loss in the causal LM's forward as HF's does.
    moe: bool = False
    # A condition across fields that coda's own model needs (a problem sentence, or None), for what
    # one field's rule cannot see; coda.patch runs the family's own attention whatever it says.
    consistent: Callable[[Any], str | None] | None = None

    @property
    def sandwich(self) -> bool:
        """Norms on the attention and MLP outputs as well as in front of each (Gemma 2/3, GLM-4)."""
        return self.norms.attn_out is not None and self.norms.attn_in is not None

    @property
    def post_norm(self) -> bool:
        """Norms only on the attention and MLP outputs (OLMo 2: whole-width q/k norms; EXAONE 4: per head)."""
        return self.norms.attn_in is None

    def has_qkv_bias(self, config: Any) -> bool:
        if isinstance(self.qkv_bias, str):
            return bool(getattr(config, self.qkv_bias, False))
        return self.qkv_bias


# transformers 4.x splits the projections into `pretraining_tp` slices; coda handles none.
ONE_TP_SLICE = Rule(lambda v: v in (None, 1), "1")
_LLAMA = {**SHAPE, **ATTENTION, "hidden_act": SILU, "mlp_bias": NO_BIAS,
          "attention_bias": _attention_only(NO_BIAS),
          "pretraining_tp": ONE_TP_SLICE}
_MISTRAL = {**SHAPE, **ATTENTION, "hidden_act": SILU, "sliding_window": ANY}
# Sliding windows, per layer: masks.py; Qwen2's q/k/v biases: Family.qkv_bias; Qwen3's QK-norm:
# Family.qk_norm (coda.patch keeps HF's attention, which computes it).
LAYER_TYPES = Rule(lambda v: v is None or set(v) <= set(LAYER_TYPES_NAMES),
                   "'full_attention' and 'sliding_attention' layers")
_WINDOWS = {"sliding_window": ANY,
            # Qwen2/3: these set sliding_window and layer_types, which the model reads.
            "use_sliding_window": DERIVED, "max_window_layers": DERIVED,
            "layer_types": _attention_only(LAYER_TYPES)}

# Gemma 2 and 3. coda.patch runs their norms ((1 + w), with the sandwich norms), the GeGLU MLP and the
# LM head, and keeps HF's attention (QK-norm, query_pre_attn_scalar, per-layer-type RoPE, windows,
# score softcapping), so those fields are coda's own model's alone (LlamaConfig.from_hf reads them).
POSITIVE_OR_NONE = Rule(lambda v: v is None or (isinstance(v, (int, float)) and 0 < v < float("inf")),
                        "None or a positive number")
GELU_TANH = Rule(lambda v: v == "gelu_pytorch_tanh", "'gelu_pytorch_tanh' (GeGLU)")
_GEMMA = {**SHAPE, **ATTENTION, "attention_bias": _attention_only(NO_BIAS), "sliding_window": ANY,
          "layer_types": _attention_only(LAYER_TYPES),
          "hidden_activation": GELU_TANH,
          # c * tanh(logits / c) before the loss: linear_cross_entropy's softcap, and on the logits.
          "final_logit_softcapping": POSITIVE_OR_NONE,
          "query_pre_attn_scalar": _attention_only(Rule(lambda v: isinstance(v, (int, float)) and v > 0,
                                                        "a positive number")),
          "attn_logit_softcapping": _attention_only(POSITIVE_OR_NONE),
          # Gemma 3 as an encoder (EmbeddingGemma): attention is not causal.
          "use_bidirectional_attention": _attention_only(Rule(lambda v: not v, "False (causal attention)")),
          "rope_local_base_freq": _attention_only(ANY),  # older transformers' sliding-layer RoPE base
          # Read when the config is built (older transformers spell the window pattern without the
          # underscore and name generate()'s cache class): no model math reads them.
          "_sliding_window_pattern": DERIVED, "sliding_window_pattern": DERIVED, "cache_implementation": DERIVED}
# Gemma (1): Llama's decoder layer with Gemma's (1 + w) norms, GeGLU MLP and embedding scale (in coda's
# model the fused block segments with the gains as tensors and the GeGLU epilogues).
_GEMMA1 = {**SHAPE, **ATTENTION, "attention_bias": _attention_only(NO_BIAS),
           "hidden_act": GELU_TANH,
           "use_bidirectional_attention": _GEMMA["use_bidirectional_attention"]}
# Phi-3: fused qkv_proj (inside HF's attention) and gate_up_proj ([gate; up] rows: coda.patch passes
# the two halves as views). Its dropout stays HF's under coda.patch: the decoder layer, which patch
# keeps, applies resid_pdrop around coda's MLP output, and HF's Phi3Model reads embd_pdrop nowhere.
_PHI3 = {**SHAPE, **ATTENTION, "hidden_act": SILU, "sliding_window": ANY,
         "resid_pdrop": NO_DROPOUT, "embd_pdrop": NO_DROPOUT,
         # RoPE, inside HF's attention: longrope's switch length, the rotated fraction of each head.
         "rope_parameters": PARTIAL_ROPE, "rope_scaling": PARTIAL_ROPE,
         "original_max_position_embeddings": ANY, "partial_rotary_factor": PARTIAL_FRACTION}
# OLMo 2: norms on the attention and MLP outputs (no input norms), whole-width q/k norms (inside HF's
# attention under coda.patch; row passes in coda's model: Family.post_norm).
_OLMO2 = {**SHAPE, **ATTENTION, "hidden_act": SILU, "attention_bias": _attention_only(NO_BIAS)}
# OLMo 3: OLMo 2's layer with windows per layer (`layer_types`) and a RoPE per layer type (as Gemma 3's).
_OLMO3 = {**_OLMO2, "sliding_window": ANY, "layer_types": _attention_only(LAYER_TYPES)}

# SmolLM3: Llama's layer; `no_rope_layers` marks the layers whose q and k rotate (LlamaConfig.rope:
# the others' rotation is the identity), and windows apply where layer_types says, if use_sliding_window.
_SMOLLM3 = {**_LLAMA, "sliding_window": ANY, "use_sliding_window": ANY, "layer_types": _attention_only(LAYER_TYPES),
            "no_rope_layers": _attention_only(Rule(lambda v: isinstance(v, (list, tuple)) and set(v) <= {0, 1},
                                                   "a list of 0 and 1 (1: the layer rotates)")),
            "no_rope_layer_interval": DERIVED}


def _smollm3_rotary_layers(config: Any) -> tuple[bool, ...] | None:
    """SmolLM3's `no_rope_layers` (despite the name, 1 marks a layer that rotates), one per layer."""
    flags = getattr(config, "no_rope_layers", None)
    return None if flags is None else tuple(bool(f) for f in flags[:config.num_hidden_layers])


def _smollm3_windows(config: Any) -> str | None:
    """transformers' SmolLM3 windows a layer in its masks wherever layer_types says
    "sliding_attention", but in flash attention only if use_sliding_window is set too: refused
    where the two disagree."""
    types_ = getattr(config, "layer_types", None) or ()
    if "sliding_attention" in types_ and not getattr(config, "use_sliding_window", False):
        return ("smollm3: layer_types has sliding_attention layers while use_sliding_window=False (transformers "
                "windows them in its masks but not in flash attention)")
    return None


FINITE = Rule(lambda v: isinstance(v, (int, float)) and math.isfinite(v), "a finite number")
NONZERO = Rule(lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v != 0, "a finite, nonzero number")
# Granite: Llama's layer with four numbers (LlamaConfig): the attention scale itself, the embedding's
# multiplier, the residual multiplier (HF's decoder layer and embedding, kept by coda.patch, apply
# those), and the logits' divisor (coda.patch's LM head applies it).
_GRANITE = {**_LLAMA, "attention_multiplier": _attention_only(FINITE),
            "embedding_multiplier": _attention_only(FINITE), "residual_multiplier": _attention_only(FINITE),
            "logits_scaling": NONZERO}

# GLM and GLM-4: Llama's layer names with Phi-3's fused gate_up_proj (GLM-4: with norms on the attention
# and MLP outputs too, GLM4_NORMS), q/k/v biases where attention_bias says (o_proj has none), and a RoPE
# that rotates interleaved pairs over part of each head (Family.rope_pairs; LlamaConfig.rotary_dim).
_GLM = {**SHAPE, **ATTENTION, "hidden_act": SILU, "attention_bias": _attention_only(ANY),
        "rope_parameters": PARTIAL_ROPE, "rope_scaling": PARTIAL_ROPE, "partial_rotary_factor": PARTIAL_FRACTION}

# Llama's layer with q/k/v biases where attention_bias says, under other names and RoPE pairings:
# Helium (interleaved pairs; o_proj without bias), Ernie 4.5 (interleaved pairs; use_bias would bias every
# projection), Seed-OSS (o_proj's bias is attention_out_bias; its dropouts on the attention and MLP
# outputs: the MLP's is inside the MLP coda.patch replaces, so both entry points need it 0).
_HELIUM = {**SHAPE, **ATTENTION, "hidden_act": SILU, "mlp_bias": NO_BIAS, "attention_bias": _attention_only(ANY)}
_ERNIE4_5 = {**SHAPE, **ATTENTION, "hidden_act": SILU, "use_bias": NO_BIAS}
_SEED_OSS = {**_LLAMA, "attention_bias": _attention_only(ANY), "attention_out_bias": _attention_only(NO_BIAS),
             "residual_dropout": Rule(lambda v: not v, "0 (no dropout)")}

# EXAONE 4: OLMo 2's layer (norms on the attention and MLP outputs) with per-head q/k norms (Family.qk_norm),
# windowed layers, and where a window is set, global layers without RoPE.
_EXAONE4 = {**SHAPE, **ATTENTION, "hidden_act": SILU, "sliding_window": ANY, "sliding_window_pattern": DERIVED,
            "layer_types": _attention_only(LAYER_TYPES)}


def _exaone4_rotary_layers(config: Any) -> tuple[bool, ...] | None:
    """EXAONE 4 rotates q and k on its windowed layers only, or on every layer where no window is set."""
    types_ = getattr(config, "layer_types", None)
    if types_ is None or getattr(config, "sliding_window", None) is None:
        return None
    return tuple(t == "sliding_attention" for t in types_)

# Sparse MoE families, through coda.patch only: Llama's layer (Qwen3-MoE's with QK-norm) whose MLP is,
# where the config says, a router over experts (Qwen2-MoE's with a gated shared expert), all HF's. Which
# layers route (decoder_sparse_step, mlp_only_layers) patch reads from the modules; the router's loss
# (output_router_logits, router_aux_loss_coef) its causal LM forward computes as HF's; the rest is
# inside HF's MoE block and attention.
_MOE = {name: ANY for name in ("num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                               "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                               "num_local_experts", "router_jitter_noise", "output_router_logits",
                               "router_aux_loss_coef")}
_MOE_ATTENTION = {"attention_bias": _attention_only(ANY), "qkv_bias": _attention_only(ANY), **_WINDOWS}


def _ministral3_rope_ok(rope: Any) -> bool:
    """Ministral 3's RoPE dict: one coda computes, with Llama 4's query scale by position in it
    (llama_4_scaling_beta over original_max_position_embeddings: LlamaConfig.query_scale)."""
    if not isinstance(rope, Mapping) or not isinstance(rope.get("llama_4_scaling_beta"), (int, float)) \
            or not isinstance(rope.get("original_max_position_embeddings"), (int, float)):
        return False
    return _rope_ok({k: v for k, v in rope.items() if k != "llama_4_scaling_beta"})


# Ministral 3: Mistral's layer; after RoPE its attention scales q by position, as Llama 4's
_MINISTRAL3_ROPE = Rule(_ministral3_rope_ok, "a RoPE of ROPE's with llama_4_scaling_beta and "
                        "original_max_position_embeddings (Llama 4's query scale)", frozenset({FROM_HF}))

# gpt-oss, through coda.patch only: every layer a router over experts whose clamped SwiGLU
# (swiglu_alpha, swiglu_limit) is HF's, as are the attention (sinks, q/k/v/o biases, windows) and its RoPE
# (cos and sin over half a head: patch's probe leaves it HF's); hidden_act names no MLP the model runs.
_GPT_OSS = {**SHAPE, **ATTENTION, **_MOE, **_MOE_ATTENTION, "hidden_act": ANY,
            "swiglu_alpha": ANY, "swiglu_limit": ANY}

# ERNIE 4.5 MoE, through coda.patch only: Ernie 4.5's layer (its interleaved RoPE HF's) whose MLP is, on the
# layers moe_layer_start_index..end_index every moe_layer_interval, HF's router (with its score
# correction) over experts plus shared experts; the routers' loss as Mixtral's (Family.moe).
_ERNIE4_5_MOE = {**_ERNIE4_5, **_MOE, **{name: ANY for name in (
    "moe_k", "moe_num_experts", "moe_num_shared_experts", "moe_layer_start_index", "moe_layer_end_index",
    "moe_layer_interval", "moe_norm_min")}}
# DeepSeek-V3's MoE block (HF's under coda.patch): sigmoid routing over groups of experts, shared experts,
# dense layers before first_k_dense_replace; the multi-token-prediction layers are not built (nor loaded).
_GROUPED_MOE = {**_MOE, **{name: ANY for name in ("n_shared_experts", "n_routed_experts", "routed_scaling_factor",
                                                  "n_group", "topk_group", "first_k_dense_replace",
                                                  "num_nextn_predict_layers")}}
_DEEPSEEK_V3 = {**SHAPE, **ATTENTION, **_GROUPED_MOE, "hidden_act": SILU, "attention_bias": _attention_only(ANY),
                "pretraining_tp": ONE_TP_SLICE,
                **{name: ANY for name in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                                          "qk_nope_head_dim", "qk_head_dim", "rope_interleave")}}
# GLM-4.5 (glm4_moe): Llama's pre-norm layer around HF's attention (q/k/v biases, per-head q/k norms where
# use_qk_norm, RoPE over the first partial_rotary_factor of each head's halves) and DeepSeek-V3's MoE block.
_GLM4_MOE = {**SHAPE, **ATTENTION, **_GROUPED_MOE, "hidden_act": SILU, "attention_bias": _attention_only(ANY),
             "use_qk_norm": ANY, "rope_parameters": PARTIAL_ROPE, "rope_scaling": PARTIAL_ROPE,
             "partial_rotary_factor": PARTIAL_FRACTION}

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", BOTH, _LLAMA),
    Family("mistral", BOTH, _MISTRAL),
    # Ministral: Mistral's layer, its window on the layers `layer_types` names
    Family("ministral", BOTH, {**_MISTRAL, "layer_types": _attention_only(LAYER_TYPES)}),
    Family("ministral3", BOTH, {**_MISTRAL, "rope_parameters": _MINISTRAL3_ROPE, "rope_scaling": _MINISTRAL3_ROPE}),
    Family("qwen2", BOTH, {**SHAPE, **ATTENTION, "hidden_act": SILU, **_WINDOWS}, qkv_bias=True),
    # Qwen3's attention_bias adds biases to q/k/v and to o_proj, which coda's block does not compute.
    Family("qwen3", BOTH, {**SHAPE, **ATTENTION, "hidden_act": SILU, "attention_bias": _attention_only(NO_BIAS),
                           **_WINDOWS}, qk_norm=True),
    Family("gemma", BOTH, _GEMMA1, gemma_norms=True),  # Llama's layer with Gemma's norms and MLP
    Family("gemma2", BOTH, _GEMMA, gemma_norms=True, norms=SANDWICH_NORMS),  # Gemma 3's layer without QK-norm
    Family("gemma3_text", BOTH, _GEMMA, gemma_norms=True, norms=SANDWICH_NORMS, qk_norm=True),
    Family("phi3", BOTH, _PHI3, fused_qkv=True, fused_gate_up=True),
    Family("olmo2", BOTH, _OLMO2, norms=POST_NORMS),
    Family("olmo3", BOTH, _OLMO3, norms=POST_NORMS),
    Family("smollm3", BOTH, _SMOLLM3, consistent=_smollm3_windows, rotary_layers=_smollm3_rotary_layers),
    Family("granite", BOTH, _GRANITE),
    Family("glm", BOTH, _GLM, qkv_bias="attention_bias", fused_gate_up=True, rope_pairs="interleaved"),
    Family("glm4", BOTH, _GLM, qkv_bias="attention_bias", fused_gate_up=True, rope_pairs="interleaved",
           norms=GLM4_NORMS),
    Family("helium", BOTH, _HELIUM, qkv_bias="attention_bias", rope_pairs="interleaved"),
    Family("ernie4_5", BOTH, _ERNIE4_5, rope_pairs="interleaved"),
    Family("seed_oss", BOTH, _SEED_OSS, qkv_bias="attention_bias"),
    Family("exaone4", BOTH, _EXAONE4, norms=POST_NORMS, qk_norm=True, rotary_layers=_exaone4_rotary_layers),
    Family("mixtral", frozenset({PATCH}), {**_MISTRAL, **_MOE}, moe=True),
    Family("qwen2_moe", frozenset({PATCH}), {**SHAPE, **ATTENTION, "hidden_act": SILU, **_MOE_ATTENTION, **_MOE}, moe=True),
    Family("gpt_oss", frozenset({PATCH}), _GPT_OSS, moe=True),
    # GraniteMoE: Granite's layer (its multipliers in HF's embedding, residual adds and attention; the
    # logits' in coda's LM head), every layer sparse (block_sparse_moe: router and experts HF's)
    Family("granitemoe", frozenset({PATCH}), {**_GRANITE, **_MOE, "hidden_act": ANY}, moe=True),
    # DeepSeek-V3: Llama's pre-norm layer names around HF's multi-head latent attention (its own latent
    # norms, RoPE over part of each head) and, from first_k_dense_replace on, HF's MoE block (grouped
    # routing, shared experts); the dense layers' MLP is coda's. Its causal LM adds no router loss.
    Family("deepseek_v3", frozenset({PATCH}), _DEEPSEEK_V3),
    Family("glm4_moe", frozenset({PATCH}), _GLM4_MOE, qk_norm=True),
    Family("ernie4_5_moe", frozenset({PATCH}), _ERNIE4_5_MOE, moe=True),
    # OLMoE: Llama's pre-norm layer with OLMo 2's whole-width q/k norms, every layer sparse (experts HF's)
    Family("olmoe", frozenset({PATCH}), {**SHAPE, **ATTENTION, **_MOE, "hidden_act": ANY,
                                         "attention_bias": _attention_only(ANY), "clip_qkv": _attention_only(ANY)},
           qk_norm=True, moe=True),
    Family("qwen3_moe", frozenset({PATCH}), {**SHAPE, **ATTENTION, "hidden_act": SILU, **_MOE_ATTENTION, **_MOE},
           qk_norm=True, moe=True),
)}


def supported(entry: str) -> tuple[str, ...]:
    """The model_types `entry` (FROM_HF or PATCH) supports."""
    return tuple(name for name, f in FAMILIES.items() if entry in f.entries)


# What to do about adapters (peft's LoRA) where coda reads weights: said by every refusal that meets them.
MERGE_ADAPTERS = "merge the adapters into the weights first (peft: merge_and_unload())"


def foreign_code(model: Any) -> list[str]:
    """A model whose class is not transformers' (remote code, `trust_remote_code=True`) computes what
    its own files say, which the rules here do not know; a subclass of a transformers class is taken."""
    if any(cls.__module__.startswith("transformers.models.") for cls in type(model).__mro__):
        return []
    what = f"{type(model).__name__} (module {type(model).__module__}) is not a transformers model class"
    if hasattr(model, "_orig_mod"):  # torch.compile's wrapper
        return [f"{what}: it is torch.compile's wrapper; pass the model itself, and compile what coda returns"]
    if type(model).__module__.startswith("peft."):
        return [f"{what}: it is a peft model; merge its adapters (merge_and_unload()) and pass the merged model"]
    if type(model).__module__.startswith("torch.") and hasattr(model, "module"):  # DistributedDataParallel, ...
        return [f"{what}: it wraps its .module; pass that, and wrap what coda returns"]
    return [f"{what}: coda checks transformers' own families only (remote code may compute anything)"]


def foreign_modules(modules: Iterable[tuple[str, Any]], entry: str) -> list[str]:
    """The modules (qualified name, module) coda reads or rewrites whose class is not transformers' or
    torch's own, as one problem: another library's replacement (Liger-Kernel's class patches, an
    adapter, a quantized layer) computes what its own code says, which coda would not compute."""
    foreign = [(name, type(module)) for name, module in modules
               if not type(module).__module__.startswith(("transformers.", "torch."))]
    if not foreign:
        return []
    (name, cls), more = foreign[0], f" (and {len(foreign) - 1} more modules)" if len(foreign) > 1 else ""
    where = cls.__module__.split(".")[0]
    fix = {"liger_kernel": "Liger-Kernel's apply_liger_kernel_to_* replaced transformers' classes before this model "
                           "was built, or patched it; coda replaces the same modules, so use one of the two",
           "peft": MERGE_ADAPTERS}.get(
        where, "build the model from transformers' classes alone")
    what = "reads these modules' weights" if entry == FROM_HF else "rewrites these modules"
    return [f"{name} is a {cls.__module__}.{cls.__qualname__}{more}, not transformers' or torch's own class: coda "
            f"{what} as transformers computes them; {fix}"]


def hf_attention(config: Any) -> str:
    """The attention transformers runs this config's model with: the one the config names (set when a
    model is built, or by the user), else its causal-LM class's default, SDPA where the class has it
    and eager otherwise (transformers' rule; Gemma 2 has no SDPA path in transformers >= 5.2x)."""
    name = getattr(config, "_attn_implementation", None)
    if name:
        return name
    import transformers  # only a transformers config of a supported family reaches here
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type])
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def problems(config: Any, entry: str) -> list[str]:
    """Why `entry` cannot compute this transformers config as HF does (empty: it can). Each problem
    names the model_type and the field."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None or entry not in family.entries:
        # (a family the other entry point takes: only coda.patch, which keeps HF's attention and MoE blocks)
        other = "; coda.patch takes it" if family is not None else ""
        return [f"model_type {model_type!r} is not supported (supported: {', '.join(supported(entry))}){other}"]
    found = []
    for name, value in config.to_dict().items():
        if name in IRRELEVANT:
            continue
        rule = family.fields.get(name)
        if rule is None:
            found.append(f"{model_type}: config field {name}={value!r} is not one coda knows (refused: it may "
                         "change the math)")
        elif entry in rule.entries and not rule.ok(value):
            found.append(f"{model_type}: {name}={value!r} (coda handles {rule.handles})")
    if entry == FROM_HF and family.consistent is not None and (problem := family.consistent(config)):
        found.append(problem)
    if entry == FROM_HF and not found and (problem := _odd_rotation(config)):  # (its fields pass their rules)
        found.append(problem)
    return found


def _rotary_fraction(config: Any) -> float | None:
    """partial_rotary_factor as transformers reads it: in the RoPE dict (the full-attention layers'
    where the config gives one per layer type; transformers 5.2x), else at the config's top level
    (5.17); None: the whole head."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        rope = rope.get("full_attention", {})
    return rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))


def rotary_dim(config: Any) -> int | None:
    """The dims of each head that rotate: transformers' int(head_dim * partial_rotary_factor); None: all."""
    fraction = _rotary_fraction(config)
    if fraction is None or fraction == 1:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * fraction)


def _odd_rotation(config: Any) -> str | None:
    """A partial rotary fraction that rotates an odd count of each head's dims: transformers then
    rotates one dim more (its tables hold whole pairs) with frequencies over the odd count, a RoPE
    coda's epilogues do not compute."""
    dims = rotary_dim(config)
    if dims is None or dims % 2 == 0:
        return None
    return (f"{config.model_type}: partial_rotary_factor={_rotary_fraction(config)} rotates {dims} dims of each "
            "head, an odd count (coda rotates whole pairs)")
