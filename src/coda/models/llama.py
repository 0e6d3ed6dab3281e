"""coda.models.LlamaForCausalLM: a Llama-family decoder whose blocks run as coda's fused GEMMs.

The residual stream is cut at shifted boundaries (docs/ALGEBRA.md 7): `first_segment` runs from the
embedding to layer 0's QKV projection, `block_segment` from layer l's attention output to layer
l+1's QKV projection, `last_segment` from the last attention output to the final norm, and
`coda.ops.linear_cross_entropy` does the LM head and the loss without materializing logits.
Attention runs between them (attention.py: SDPA, or flash attention over each document and
window; the masks for padding, packed documents and sliding windows built once per forward:
masks.py). Gemma's (1 + w) gains enter every segment as tensors (`LlamaConfig.gain`) and its GeGLU
as the segments' activation; Gemma 2/3's layers end in their sandwich norms' row passes
(sandwich.py), so the next layer's qkv comes as layer 0's does (`qkv_segment`). The parameters are held
in coda's layouts (gate/up interleaved, q/k pair-permuted and fused with v) by the module whose
forward reads them, one LlamaLayer per segment (what FSDP2's per-layer sharding needs: MODEL.md);
`from_hf` / `to_hf_state_dict` convert from and to transformers' names, grouping and layouts.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..ops.layout import interleave_gate_up, reorder_head_rows, rope_row_order, split_gate_up
from ..ops.rmsnorm import rmsnorm
from .attention import attend, varlen_applies
from .autocast import autocast_dtype, cast
from .families import (FAMILIES, FROM_HF, Family, foreign_code, foreign_modules, hf_attention, problems, rotary_dim,
                       supported)
from .hf_interface import CausalLMOutput, TrainerInterface, trainer_config
from .llama_block import YARN, NativeBlockWeights, block_segment, inv_freq, is_yarn, rope_freq_table
from .llama_ends import first_segment, last_segment
from .lm_loss import LOSS_ARGUMENTS, causal_lm_loss
from .masks import AttentionMask, build_all, documents, padding
from .qkv_projection import qk_norm_qkv, whole_qk_norm_qkv
from .sandwich import post_norm_residual, sandwich_residual


@trainer_config  # (use_cache, to_dict: what transformers' Trainer reads, hf_interface.py)
@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-family decoder (the fields of transformers' LlamaConfig that matter)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # inv_freq's: linear (factor,), Llama 3's (factor, low, high, old len), or YaRN's six (llama_block.YARN)
    rope_scaling: tuple[float, ...] | None = None
    # Partial rotary (Phi-3's, GLM's partial_rotary_factor): the first rotary_dim dims of each head
    # rotate, the rest pass through (frequency 0); None: the whole head.
    rotary_dim: int | None = None
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None  # the embedding row that lookups never update (HF's padding_idx)
    sliding_window: int | None = None  # keys within this distance (the query included), on windowed layers
    layer_types: tuple[str, ...] | None = None  # per layer "full_attention" / "sliding_attention"; None: all windowed
    qkv_bias: bool = False  # q/k/v projections with biases (Qwen2)
    qk_norm: bool = False  # each q and k head RMS-normalized (own [head_dim] weights, rms_norm_eps) before RoPE (Qwen3)
    # Every Gemma: norms scale by (1 + w) (`gain`); GeGLU (tanh GELU) for SwiGLU (`activation`); the
    # embedding scaled by sqrt(hidden_size) in the model dtype.
    gemma: bool = False
    # Gemma 2/3 (with gemma): sandwich norms on the attention and MLP outputs, a norm in front of the
    # MLP too (sandwich.py); without it, Llama's layer (Gemma 1).
    sandwich: bool = False
    # OLMo 2: no norm in front of attention or the MLP; norms on the attention and MLP outputs
    # (sandwich.post_norm_residual); q and k each RMS-normalized over its whole width ([H*hd] and
    # [KV*hd] weights, rms_norm_eps) before RoPE (qkv_projection.whole_qk_norm_qkv), or with qk_norm
    # per head (EXAONE 4: qkv_projection.qk_norm_qkv).
    post_norm: bool = False
    local_rope: tuple[float, tuple[float, ...] | None] | None = None  # (theta, scaling) of sliding layers (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar ** -0.5; None: head_dim's
    attn_softcap: float | None = None  # attention scores c * tanh(s / c) before the softmax (Gemma 2)
    final_softcap: float | None = None  # logits c * tanh(l / c) before the loss (Gemma 2)
    # The transformers family whose parameter names and layouts from_hf reads and to_hf_state_dict
    # writes (families.Family: fused projections, norm names, RoPE pair order); None: Llama's, Gemma's,
    # Gemma 2's (sandwich) or OLMo 2's (post_norm), as the flags say.
    hf_family: str | None = None
    rotary_layers: tuple[bool, ...] | None = None  # per layer whether q and k rotate (SmolLM3's NoPE layers: not)
    # Granite's four numbers: the attention scale itself (None: from query_pre_attn_scalar or head_dim),
    # the embedding times embedding_multiplier (None: no scale, or Gemma's), each attention and MLP
    # output times residual_multiplier before its residual add, the logits divided by logits_scaling.
    attention_multiplier: float | None = None
    embedding_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Ministral 3's (Llama 4's) query scale by position, (beta, context): after RoPE, q times
    # 1 + beta ln(1 + floor(pos / context)), rounded to q's dtype as transformers does; None: none.
    query_scale: tuple[float, float] | None = None
    # What a query that sees no key (a left pad) outputs: "zeros" (transformers' SDPA, flash and flex
    # attention) or "mean", every value of its row averaged (transformers' eager attention: attention.py)
    keyless_queries: str = "zeros"

    def __post_init__(self) -> None:
        if self.keyless_queries not in ("zeros", "mean"):
            raise ValueError(f"LlamaConfig: keyless_queries={self.keyless_queries!r} (takes 'zeros' or 'mean')")
        if self.post_norm and (self.gemma or self.sandwich or self.qkv_bias):
            raise ValueError("LlamaConfig: post_norm (OLMo 2's layer) with gemma, sandwich or qkv_bias "
                             "describes no family coda computes")
        if self.residual_multiplier != 1.0 and (self.sandwich or self.post_norm):
            raise ValueError("LlamaConfig: residual_multiplier (Granite's) with sandwich or post_norm describes no "
                             "family coda computes (a norm on the output would undo the scaled weights)")
        layout = self.layout
        if (layout.gemma_norms, layout.sandwich, layout.post_norm) != (self.gemma, self.sandwich, self.post_norm):
            raise ValueError(f"LlamaConfig: the layer of gemma={self.gemma}, sandwich={self.sandwich}, post_norm="
                             f"{self.post_norm} is not {layout.model_type}'s, whose names and layouts the conversions "
                             f"would use (hf_family={self.hf_family!r}): it describes no family coda computes")
        for name in ("layer_types", "rotary_layers"):
            per_layer = getattr(self, name)
            if per_layer is not None and len(per_layer) != self.num_hidden_layers:
                raise ValueError(f"LlamaConfig: {name} has {len(per_layer)} entries for {self.num_hidden_layers} layers")
        hd = self.dim_per_head
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= hd and self.rotary_dim % 2 == 0):
            raise ValueError(f"LlamaConfig: rotary_dim={self.rotary_dim} must be even, in (0, head_dim={hd}]")
        yarn = is_yarn(self.rope_scaling) or (self.local_rope is not None and is_yarn(self.local_rope[1]))
        if yarn and self.rotary_dim not in (None, hd):
            raise ValueError("LlamaConfig: YaRN with a partial rotary_dim: its attention factor would scale the "
                             "rotated dims alone, which no softmax scale computes")
        if (self.qk_norm or self.post_norm) and (self.rotary_dim not in (None, hd) or layout.rope_pairs != "halves"):
            raise ValueError("LlamaConfig: q/k norms (qk_norm, post_norm) with a partial or interleaved RoPE describe "
                             "no family coda computes (their weights are read in a whole-head halves order)")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def layout(self) -> Family:
        """The family whose names and layouts the conversions use (hf_family)."""
        if self.hf_family is not None:
            family = FAMILIES.get(self.hf_family)
            if family is None or FROM_HF not in family.entries:
                raise ValueError(f"LlamaConfig: hf_family={self.hf_family!r} is not one from_hf supports "
                                 f"({', '.join(supported(FROM_HF))})")
            return family
        return FAMILIES["olmo2" if self.post_norm else "gemma2" if self.sandwich else "gemma" if self.gemma else "llama"]

    @property
    def activation(self) -> str:
        """The MLP's gate activation (ops.rmsnorm_gated_mlp)."""
        return "gelu_tanh" if self.gemma else "silu"

    def attention_scale(self, layer: int) -> float:
        """Layer `layer`'s softmax scale: Granite's attention_multiplier, else query_pre_attn_scalar's or
        head_dim's inverse square root; times YaRN's attention factor squared on a layer that
        rotates by YaRN (transformers scales cos and sin by it, so the rotated q and k each carry it
        into the scores: the same scores, one multiply instead of two)."""
        scale = self.attention_multiplier
        if scale is None:
            scale = (self.query_pre_attn_scalar or self.dim_per_head) ** -0.5
        _, scaling = self.rope(layer)
        return scale * scaling[-1] ** 2 if is_yarn(scaling) else scale

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: full causal attention)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def rope(self, layer: int) -> tuple[float, tuple[float, ...] | None]:
        """Layer `layer`'s RoPE (theta, scaling): Gemma 3's sliding layers have their own. A layer
        that does not rotate (SmolLM3's NoPE) gets a linear factor of infinity: every frequency is
        0, so cos is 1 and sin 0 at every position and the rotation is the identity, exactly (the
        same kernels run, for the price of a few multiplies)."""
        if self.rotary_layers is not None and not self.rotary_layers[layer]:
            return self.rope_theta, (math.inf,)
        if self.local_rope is not None and self.layer_types is not None \
                and self.layer_types[layer] == "sliding_attention":
            return self.local_rope
        return self.rope_theta, self.rope_scaling

    def gain(self, w: torch.Tensor) -> torch.Tensor:
        """The scale a norm weight stands for: w, or Gemma's 1 + w in fp32 (HF's Gemma norm scales in
        fp32 and rounds once, as coda's ops do; the gradient maps back to w unchanged)."""
        return 1.0 + w.float() if self.gemma else w

    def gains(self, *ws: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """`gain` of each weight (None stays None). Gemma's in one concatenation, cast and add, split
        into views: a layer's five or six norms take three launches, not two each, and backward one
        concatenation and one cast, not a cast each (the same values: 1 + w in fp32)."""
        given = [w for w in ws if w is not None]
        if not self.gemma or len(given) < 2:
            return tuple(None if w is None else self.gain(w) for w in ws)
        parts = iter((1.0 + torch.cat([w.reshape(-1) for w in given]).float()).split([w.numel() for w in given]))
        return tuple(None if w is None else next(parts).view(w.shape) for w in ws)

    def residual_weights(self, wo: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output and down projections as the fused segments use them: Granite's
        residual_multiplier m scales the GEMM output before the residual add, x + m (a W^T) =
        x + a (m W)^T, so the weights are scaled (one pass over each weight a step, autograd
        carrying m into their gradients) and the segments' epilogues stay those of every family."""
        if self.residual_multiplier == 1.0:
            return wo, w_down
        return wo * self.residual_multiplier, w_down * self.residual_multiplier

    def final_gain(self, g: torch.Tensor) -> torch.Tensor:
        """The final norm's scale with Granite's 1 / logits_scaling folded in (in fp32): logits =
        (norm(x) g / s) W^T, both with labels (the fused loss) and without (returned logits)."""
        return g if self.logits_scaling == 1.0 else g.float() / self.logits_scaling

    @classmethod
    def from_hf(cls, config) -> LlamaConfig:
        """From a transformers config of a family `coda.models.from_hf` supports (families.py: every
        field either handled or refused; v4.56 `rope_theta`/`rope_scaling` or v5 `rope_parameters`)."""
        found = problems(config, FROM_HF)
        if found:
            raise ValueError("coda.models.from_hf cannot compute this model as transformers does: " + "; ".join(found))
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        default_theta = getattr(config, "rope_theta", 10000.0)
        local = None
        # transformers reads YaRN's `truncate` from the config's RoPE dict itself, never a layer type's
        truncate = bool(rope.get("truncate", True))
        if "full_attention" in rope or "sliding_attention" in rope:  # one RoPE per layer type (Gemma 3)
            if "sliding_attention" in rope:
                local = _rope(rope["sliding_attention"], default_theta, config, truncate)
            rope = rope.get("full_attention", {})
        elif getattr(config, "rope_local_base_freq", None) is not None:  # older transformers' Gemma 3
            local = (float(config.rope_local_base_freq), None)
        theta, scaling = _rope(rope, default_theta, config, truncate)
        heads, family = config.num_attention_heads, FAMILIES[config.model_type]
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                   num_attention_heads=heads, num_key_value_heads=config.num_key_value_heads or heads,
                   head_dim=getattr(config, "head_dim", None), rms_norm_eps=float(config.rms_norm_eps),
                   rope_theta=theta, rope_scaling=scaling,
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   pad_token_id=getattr(config, "pad_token_id", None),
                   sliding_window=getattr(config, "sliding_window", None),
                   layer_types=None if getattr(config, "layer_types", None) is None else tuple(config.layer_types),
                   rotary_dim=rotary_dim(config),
                   qkv_bias=family.has_qkv_bias(config), qk_norm=family.qk_norm, gemma=family.gemma_norms,
                   sandwich=family.sandwich, post_norm=family.post_norm,
                   local_rope=local, hf_family=config.model_type,
                   query_pre_attn_scalar=_number(config, "query_pre_attn_scalar"),
                   attn_softcap=_number(config, "attn_logit_softcapping"),
                   final_softcap=_number(config, "final_logit_softcapping"),
                   keyless_queries="mean" if hf_attention(config) == "eager" else "zeros",
                   rotary_layers=None if family.rotary_layers is None else family.rotary_layers(config),
                   attention_multiplier=_number(config, "attention_multiplier"),
                   embedding_multiplier=_number(config, "embedding_multiplier"),
                   residual_multiplier=_number(config, "residual_multiplier", 1.0),
                   logits_scaling=_number(config, "logits_scaling", 1.0),
                   query_scale=None if rope.get("llama_4_scaling_beta") is None else (
                       float(rope["llama_4_scaling_beta"]), float(rope["original_max_position_embeddings"])))


def _rope(params: dict, default_theta: float, config, truncate: bool) -> tuple[float, tuple[float, ...] | None]:
    """(theta, scaling) from one transformers RoPE dict (families._rope_ok has vetted its type)."""
    theta = float(params.get("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "llama3":
        return theta, tuple(float(params[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_position_embeddings"))
    if kind == "linear":
        return theta, (float(params["factor"]),)
    if kind == "yarn":
        return theta, _yarn_numbers(params, config, truncate)
    return theta, None


def _yarn_numbers(params: dict, config, truncate: bool) -> tuple[float, ...]:
    """llama_block.YARN's numbers as transformers derives them from a "yarn" RoPE dict: the original
    context defaults to max_position_embeddings, the factor to their ratio, and the attention
    factor to 0.1 ln(factor) + 1, or DeepSeek's ratio of two such terms where mscale and
    mscale_all_dim are both given."""
    old = float(params.get("original_max_position_embeddings") or config.max_position_embeddings)
    factor = params.get("factor")
    factor = config.max_position_embeddings / old if factor is None else float(factor)

    def mscale(weight: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale()
    numbers = dict(factor=factor, beta_fast=params.get("beta_fast") or 32, beta_slow=params.get("beta_slow") or 1,
                   original_max_position_embeddings=old, truncate=float(truncate), attention_factor=attention)
    return tuple(float(numbers[name]) for name in YARN)


def _number(config, name: str, default: float | None = None) -> float | None:
    value = getattr(config, name, None)
    return default if value is None else float(value)


class AttnParams(NamedTuple):
    """One HF layer's parameters that its QKV projection reads (None where the config has none)."""

    norm: nn.Parameter
    w_qkv: nn.Parameter
    b_qkv: nn.Parameter | None
    q_norm: nn.Parameter | None
    k_norm: nn.Parameter | None


class LlamaLayer(nn.Module):
    """Decoder layer i as the fused kernels cut it (MODEL.md): attention on layer i's qkv, then the
    segment to layer i+1's qkv (layer i's output projection and MLP, layer i+1's input norm and QKV
    projection), or for the last layer the segment to the final norm.

    It owns exactly the parameters its forward reads, so that `fully_shard(layer)` (FSDP2) gathers
    all of them in the layer's forward and backward and reduce-scatters each gradient after that
    layer's backward. With HF's grouping a segment would read two layers' parameters and layer
    i+1's QKV gradient would only appear after layer i+1 had been resharded and reduced. Layer 0's
    input norm and QKV projection (the first segment) live on the model."""

    def __init__(self, c: LlamaConfig, *, index: int, **factory: object) -> None:
        super().__init__()
        d, f, hd = c.hidden_size, c.intermediate_size, c.dim_per_head
        last = index == c.num_hidden_layers - 1
        self.config, self.index = c, index
        self.wo = nn.Parameter(torch.empty(d, c.num_attention_heads * hd, **factory))
        # Gemma 2/3's sandwich norms and OLMo 2's post-norms on the attention and MLP outputs (None elsewhere).
        outputs_normed = c.sandwich or c.post_norm
        self.post_attn_norm = nn.Parameter(torch.ones(d, **factory)) if outputs_normed else None
        self.ffn_norm = None if c.post_norm else nn.Parameter(torch.ones(d, **factory))  # the norm in front of the MLP
        self.w_gate_up = nn.Parameter(torch.empty(2 * f, d, **factory))
        self.w_down = nn.Parameter(torch.empty(d, f, **factory))
        self.post_ffn_norm = nn.Parameter(torch.ones(d, **factory)) if outputs_normed else None
        # Layer i+1's input norm and fused, pair-permuted QKV projection (none after the last layer).
        self.next_attn_norm = None if last or c.post_norm else nn.Parameter(torch.ones(d, **factory))
        self.next_w_qkv = None if last else nn.Parameter(torch.empty(_qkv_rows(c), d, **factory))
        self.next_b_qkv = None if last or not c.qkv_bias else nn.Parameter(torch.zeros(_qkv_rows(c), **factory))
        self.next_q_norm, self.next_k_norm = (None, None) if last else _qk_norms(c, **factory)

    def _attention(self, qkv: torch.Tensor, batch: int, seq: int, mask: AttentionMask | None,
                   q_scale: torch.Tensor | None) -> torch.Tensor:
        c, hd = self.config, self.config.dim_per_head
        h, kv = c.num_attention_heads, c.num_key_value_heads
        q, k, v = qkv.view(batch * seq, h + 2 * kv, hd).split([h, kv, kv], dim=1)
        if q_scale is not None:
            q = q * q_scale[:, None, None]
        return attend(q, k, v, batch, seq, mask, c.attention_scale(self.index), c.attn_softcap, c.keyless_queries)

    def forward(self, x: torch.Tensor, qkv: torch.Tensor, pos: torch.Tensor, batch: int, seq: int,
                final_norm: torch.Tensor | None = None, mask: AttentionMask | None = None,
                q_scale: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x_{i+1}, qkv_{i+1}); for the last layer (final norm output, None), `final_norm` being
        the model's norm weight (a root parameter, gathered for the whole step under FSDP2).
        `mask`: this layer's attention mask (masks.py; None: causal); `q_scale`: each token's query
        scale (LlamaConfig.query_scale; None: 1); `dtype`: torch.autocast's, to which the layer casts
        its parameters for the call (inside a checkpoint's recomputation too: autocast.py)."""
        # The parameters in `dtype`, read here rather than through a re-entered module call
        # (torch.func.functional_call would run FSDP2's hooks again, which put the gathered fp32 ones back).
        p = {name: cast(t, dtype) for name, t in self.named_parameters(recurse=False, remove_duplicate=False)}
        post_attn_norm, ffn_norm, post_ffn_norm = p.get("post_attn_norm"), p.get("ffn_norm"), p.get("post_ffn_norm")
        w_gate_up, next_w_qkv, next_b_qkv = p["w_gate_up"], p.get("next_w_qkv"), p.get("next_b_qkv")
        c = self.config
        attn = self._attention(qkv, batch, seq, mask, q_scale)
        if next_w_qkv is None and final_norm is None:
            raise ValueError("the last LlamaLayer needs the model's final norm weight")
        # This layer's norm scales (Gemma's 1 + w made together: LlamaConfig.gains); the next layer's
        # input norm and q/k norms, or the final norm after the last layer.
        g_post_attn, g_ffn, g_post_ffn, g_final, g_attn, g_q, g_k = c.gains(
            post_attn_norm, ffn_norm, post_ffn_norm, final_norm if next_w_qkv is None else None,
            p.get("next_attn_norm"), p.get("next_q_norm"), p.get("next_k_norm"))
        g_final = None if g_final is None else c.final_gain(g_final)
        wo, w_down = c.residual_weights(p["wo"], p["w_down"])
        if c.sandwich or c.post_norm:  # norms on the outputs: row passes, then the next qkv as layer 0's
            if c.post_norm:
                x2 = post_norm_residual(attn, x, wo, g_post_attn, w_gate_up, w_down, g_post_ffn, c.rms_norm_eps)
            else:
                x2 = sandwich_residual(attn, x, wo, g_post_attn, g_ffn, w_gate_up, w_down, g_post_ffn,
                                       c.rms_norm_eps, c.activation)
            if next_w_qkv is None:
                return rmsnorm(x2, g_final, c.rms_norm_eps), None
            return x2, qkv_segment(c, self.index + 1, x2, pos, g_attn, next_w_qkv, next_b_qkv, g_q, g_k)
        if next_w_qkv is None:
            return last_segment(attn, x, wo, g_ffn, w_gate_up, w_down, g_final, c.rms_norm_eps, c.activation), None
        theta, scaling = c.rope(self.index + 1)
        w = NativeBlockWeights(wo=wo, g_ffn=g_ffn, w_gate_up=w_gate_up, w_down=w_down,
                               g_attn=g_attn, w_qkv=next_w_qkv,
                               n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads, eps=c.rms_norm_eps,
                               rope_base=theta, rope_scaling=None if scaling is None else list(scaling),
                               rotary_dim=c.rotary_dim, activation=c.activation,
                               b_qkv=[] if next_b_qkv is None else [next_b_qkv],
                               qk_norm=[] if g_q is None else [g_q, g_k])
        return block_segment(attn, x, pos, w)


def qkv_segment(c: LlamaConfig, layer: int, x: torch.Tensor, pos: torch.Tensor, g_attn: torch.Tensor | None,
                w_qkv: torch.Tensor, b_qkv: torch.Tensor | None, g_q: torch.Tensor | None,
                g_k: torch.Tensor | None) -> torch.Tensor:
    """Layer `layer`'s qkv from the residual stream x as `first_segment` (its input norm's row pass,
    then the QKV GEMM with RoPE, the biases or QK-norm in its epilogue): layer 0's, and every
    layer's after a Gemma 2/3 layer (whose sandwich norm ends in a row pass). OLMo 2 (no input norm,
    whole-width q/k norms): the GEMM, then row passes (whole_qk_norm_qkv); EXAONE 4 (no input norm,
    per-head q/k norms): the GEMM with Qwen3's QK-norm epilogue (qk_norm_qkv)."""
    theta, scaling = c.rope(layer)
    if c.post_norm and c.qk_norm:
        freq = rope_freq_table(c.dim_per_head, c.num_attention_heads, c.num_key_value_heads, theta,
                               None if scaling is None else list(scaling), x.device)
        return qk_norm_qkv(x, pos, freq, w_qkv, g_q, g_k, c.num_attention_heads, c.num_key_value_heads,
                           c.rms_norm_eps)
    if c.post_norm:
        return whole_qk_norm_qkv(x, pos, inv_freq(c.dim_per_head, theta, scaling, x.device), w_qkv, g_q, g_k,
                                 c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps)
    return first_segment(x, pos, g_attn, w_qkv, n_heads=c.num_attention_heads,
                         n_kv_heads=c.num_key_value_heads, eps=c.rms_norm_eps, rope_base=theta, rope_scaling=scaling,
                         rotary_dim=c.rotary_dim, b_qkv=b_qkv, qk_norm=None if g_q is None else (g_q, g_k))


# The order in which transformers' layers register their norms (state_dict order), by name.
_HF_ORDER = ("post_attention_layernorm", "post_self_attn_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm", "post_mlp_layernorm")


def _rope_order(c: LlamaConfig) -> torch.Tensor:
    """For each row of a q or k head in coda's order (each RoPE pair in adjacent rows), the row of
    transformers' order it holds (layout.rope_row_order for the family's pairs and rotary_dim)."""
    return rope_row_order(c.dim_per_head, c.rotary_dim, interleaved=c.layout.rope_pairs == "interleaved")


def _qkv_rows(c: LlamaConfig) -> int:
    return (c.num_attention_heads + 2 * c.num_key_value_heads) * c.dim_per_head


def _qk_norms(c: LlamaConfig, **factory: object) -> tuple[nn.Parameter | None, nn.Parameter | None]:
    """The q and k norm weights (HF order) where the config has them: per head ([head_dim] each), or
    OLMo 2's over the whole width ([H*hd] and [KV*hd])."""
    if c.post_norm and not c.qk_norm:
        return tuple(nn.Parameter(torch.ones(n * c.dim_per_head, **factory))
                     for n in (c.num_attention_heads, c.num_key_value_heads))
    if not c.qk_norm:
        return None, None
    return tuple(nn.Parameter(torch.ones(c.dim_per_head, **factory)) for _ in range(2))


def _full(t: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) parameter or gradient gathered whole; a plain tensor as it is.
    Gathering is a collective: every rank must make the same calls."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return t.full_tensor()
    return t


class LlamaForCausalLM(TrainerInterface, nn.Module):
    """A Llama decoder + LM head + loss on coda's fused ops. `model(input_ids, labels=None,
    position_ids=None, attention_mask=None)` -> CausalLMOutput. `checkpoint=True` recomputes each layer in backward
    (transformers' `gradient_checkpointing_enable()` sets it too: hf_interface.py).

    The parameters are nn.Parameters of the module that reads them: the embedding, layer 0's input
    norm and QKV projection (the first segment), the final norm and the LM head on the model, the rest
    on `layers[i]` (LlamaLayer: a segment's weights), and the forward reads them afresh on every call.
    That is what FSDP2 needs (`fully_shard` per layer, then on the model: docs/MODEL.md): each
    module's parameters are gathered in its own forward and backward, the root's for the whole step,
    and the custom ops only ever see those gathered tensors."""

    # The unit of sharding: accelerate's FSDP2 (Trainer's `fsdp`, transformer-based wrapping) shards each
    # LlamaLayer as its own group, then the root, as MODEL.md's recipe does.
    _no_split_modules = ["LlamaLayer"]

    def __init__(self, config: LlamaConfig, *, checkpoint: bool = False, initializer_range: float = 0.02,
                 **factory: object) -> None:
        super().__init__()
        self.config, self.checkpoint = config, checkpoint
        self.hf_config = None  # transformers' config, kept by from_hf for save_pretrained
        c, n = config, config.num_hidden_layers
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, **factory))
        # layer 0's input norm (OLMo 2 has none)
        self.first_attn_norm = None if c.post_norm else nn.Parameter(torch.ones(c.hidden_size, **factory))
        self.first_w_qkv = nn.Parameter(torch.empty(_qkv_rows(c), c.hidden_size, **factory))  # and QKV projection
        self.first_b_qkv = nn.Parameter(torch.zeros(_qkv_rows(c), **factory)) if c.qkv_bias else None
        self.first_q_norm, self.first_k_norm = _qk_norms(c, **factory)
        self.layers = nn.ModuleList(LlamaLayer(c, index=i, **factory) for i in range(n))
        self.norm = nn.Parameter(torch.ones(c.hidden_size, **factory))
        self.lm_head = None if c.tie_word_embeddings else nn.Parameter(torch.empty(c.vocab_size, c.hidden_size,
                                                                                   **factory))
        self.init_weights(initializer_range)

    def init_weights(self, initializer_range: float = 0.02) -> None:
        """Matrices ~ N(0, initializer_range), biases 0, norms the identity: weights 1, or 0 for
        Gemma's (1 + w) (for a model built on the meta device and materialized with to_empty)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, initializer_range)
                else:
                    p.fill_(0.0 if name.endswith("b_qkv") or self.config.gemma else 1.0)

    def _attn_params(self, i: int) -> AttnParams:
        """HF layer i's input norm, fused QKV weight and bias, q and k norms (held by the model for
        i = 0, else by layers[i - 1], whose segment ends with them)."""
        if i == 0:
            return AttnParams(self.first_attn_norm, self.first_w_qkv, self.first_b_qkv, self.first_q_norm,
                              self.first_k_norm)
        prev = self.layers[i - 1]
        return AttnParams(prev.next_attn_norm, prev.next_w_qkv, prev.next_b_qkv, prev.next_q_norm, prev.next_k_norm)

    # -- conversion ----------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf_model: nn.Module, *, checkpoint: bool = False) -> LlamaForCausalLM:
        """The same weights as a transformers causal LM of a supported family (families.py), copied
        into coda's layouts (same dtype and device). ValueError naming the model_type or the field
        for anything coda would compute differently."""
        config = LlamaConfig.from_hf(getattr(hf_model, "config", None))
        foreign = foreign_code(hf_model) or foreign_modules(
            ((name, module) for name, module in hf_model.named_modules() if name), FROM_HF)
        if foreign:
            raise ValueError("coda.models.from_hf: " + "; ".join(foreign))
        if not isinstance(getattr(hf_model, "lm_head", None), nn.Linear) or hf_model.lm_head.bias is not None:
            raise ValueError(f"coda.models.from_hf: {type(hf_model).__name__} is not a causal LM with a bias-free "
                             f"lm_head (model_type {hf_model.config.model_type!r}: pass its *ForCausalLM model)")
        attention = getattr(hf_model.config, "_attn_implementation", None)
        if config.attn_softcap is not None and attention not in (None, "eager"):
            warnings.warn(f"coda.models.from_hf: transformers runs this {type(hf_model).__name__} with attn_implementation="
                          f"{attention!r}, which ignores attn_logit_softcapping={config.attn_softcap}; coda caps the "
                          "attention scores as the config says (as transformers' eager attention does), so the two "
                          "models differ", stacklevel=2)
        sd = hf_model.state_dict()
        ref = sd["model.embed_tokens.weight"]
        with torch.device("meta"):
            model = cls(config, checkpoint=checkpoint, dtype=ref.dtype)
        model.to_empty(device=ref.device)
        model.load_hf_state_dict(sd)
        model.hf_config = copy.deepcopy(hf_model.config)
        return model

    def _layer_norms(self, i: int) -> dict[str, nn.Parameter]:
        """HF layer i's norms after its input norm by HF name, in HF's order (the family's names:
        families.Norms). Llama's norm in front of the MLP is its post-attention norm."""
        layer, names = self.layers[i], self.config.layout.norms
        found = {names.attn_out: layer.post_attn_norm, names.mlp_in: layer.ffn_norm, names.mlp_out: layer.post_ffn_norm}
        return {name: found[name] for name in _HF_ORDER if name in found}

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy HF-named, HF-layout weights into this model's parameters (unsharded parameters:
        load before fully_shard). Every weight is read: ValueError for one missing or one left
        over (a bias, an extra norm: something this model would not compute)."""
        c, hd = self.config, self.config.dim_per_head
        nq, nk = c.num_attention_heads * hd, c.num_key_value_heads * hd
        layout = c.layout
        order = _rope_order(c)
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ValueError(f"coda.models.from_hf: the state dict has no {name!r}")
            used.add(name)
            return sd[name]

        def qkv_rows(p: str, what: str) -> list[torch.Tensor]:
            """q, k, v rows of the projection (`what`: weight or bias), q and k in coda's RoPE order."""
            if layout.fused_qkv:
                q, k, v = take(p + f"self_attn.qkv_proj.{what}").split([nq, nk, nk])
            else:
                q, k, v = (take(p + f"self_attn.{x}_proj.{what}") for x in "qkv")
            return torch.cat([reorder_head_rows(q, order), reorder_head_rows(k, order), v])

        with torch.no_grad():
            self.embed_tokens.copy_(take("model.embed_tokens.weight"))
            self.norm.copy_(take("model.norm.weight"))
            if self.lm_head is not None:
                self.lm_head.copy_(take("lm_head.weight"))
            elif "lm_head.weight" in sd:  # tied: HF lists the shared weight under both names
                used.add("lm_head.weight")
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                attn_norm, w_qkv, b_qkv, q_norm, k_norm = self._attn_params(i)
                if attn_norm is not None:  # (OLMo 2 has none)
                    attn_norm.copy_(take(f"{p}{layout.norms.attn_in}.weight"))
                w_qkv.copy_(qkv_rows(p, "weight"))
                if b_qkv is not None:  # permuted like the rows they add to
                    b_qkv.copy_(qkv_rows(p, "bias"))
                if q_norm is not None:  # HF order (the QKV epilogue permutes them: ops.qknorm_columns)
                    q_norm.copy_(take(p + "self_attn.q_norm.weight"))
                    k_norm.copy_(take(p + "self_attn.k_norm.weight"))
                for name, norm in self._layer_norms(i).items():
                    norm.copy_(take(f"{p}{name}.weight"))
                layer.wo.copy_(take(p + "self_attn.o_proj.weight"))
                gate, up = take(p + "mlp.gate_up_proj.weight").chunk(2) if layout.fused_gate_up else \
                    (take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight"))
                layer.w_gate_up.copy_(interleave_gate_up(gate, up))
                layer.w_down.copy_(take(p + "mlp.down_proj.weight"))
        unused = sorted(set(sd) - used)
        if unused:
            raise ValueError(f"coda.models.from_hf: weights this model would not use: {', '.join(unused[:8])}"
                             + (f" and {len(unused) - 8} more" if len(unused) > 8 else ""))

    def save_pretrained(self, path: str | os.PathLike, **kwargs: object) -> None:
        """The model as a transformers checkpoint that `AutoModelForCausalLM.from_pretrained` loads:
        the config from_hf read and the weights as to_hf_state_dict gives them, written by transformers'
        own save_pretrained (`kwargs` go to it). Under FSDP2 call it on every rank (the weights are
        gathered), with is_main_process=(rank == 0)."""
        if self.hf_config is None:
            raise ValueError("save_pretrained needs the transformers config that coda.models.from_hf keeps: this "
                             "model was built from a coda LlamaConfig; load to_hf_state_dict() into a transformers "
                             "model of the family and save that")
        import transformers  # (an optional dependency: the models from_hf converts are its)

        sd = self.to_hf_state_dict()
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(self.hf_config)
        hf.load_state_dict(sd, strict=True, assign=True)
        if self.config.tie_word_embeddings:
            hf.tie_weights()  # (assign=True gave the head a tensor of its own)
        hf.save_pretrained(path, **kwargs)

    def to_hf_state_dict(self, *, grads: bool = False) -> dict[str, torch.Tensor]:
        """transformers' names and layouts (new contiguous tensors; the exact inverse of from_hf).
        grads=True: the parameters' gradients instead (zeros where None), e.g. to compare with an
        HF model's; a tied embedding's gradient includes the LM head's, as HF's tied weight's does.
        Under FSDP2 the shards are gathered whole (a collective: call it on every rank)."""
        c, hd = self.config, self.config.dim_per_head
        nq, nk = c.num_attention_heads * hd, c.num_key_value_heads * hd
        layout = c.layout
        back = torch.argsort(_rope_order(c))

        def split_qkv(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """Rows of the fused [P q; P k; v] layout as HF's q, k, v (rows in HF's order)."""
            return reorder_head_rows(t[:nq], back), reorder_head_rows(t[nq:nq + nk], back), t[nq + nk:]

        def get(p: torch.Tensor) -> torch.Tensor:
            if not grads:
                return _full(p.detach())
            return torch.zeros(p.shape, dtype=p.dtype, device=p.device) if p.grad is None else _full(p.grad)

        sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": get(self.embed_tokens)}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn_norm, w_qkv, b_qkv, q_norm, k_norm = (None if t is None else get(t) for t in self._attn_params(i))
            gate, up = split_gate_up(get(layer.w_gate_up))
            if layout.fused_qkv:  # Phi-3's order: o_proj, then the fused projection
                sd[p + "self_attn.o_proj.weight"] = get(layer.wo)
                sd[p + "self_attn.qkv_proj.weight"] = torch.cat(split_qkv(w_qkv))
            else:
                biases = [None] * 3 if b_qkv is None else split_qkv(b_qkv)
                for proj, w, b in zip("qkv", split_qkv(w_qkv), biases):  # HF's order: a weight, then its bias
                    sd[f"{p}self_attn.{proj}_proj.weight"] = w
                    if b is not None:
                        sd[f"{p}self_attn.{proj}_proj.bias"] = b
                sd[p + "self_attn.o_proj.weight"] = get(layer.wo)
                if q_norm is not None:
                    sd.update({p + "self_attn.q_norm.weight": q_norm, p + "self_attn.k_norm.weight": k_norm})
            if layout.fused_gate_up:
                sd[p + "mlp.gate_up_proj.weight"] = torch.cat([gate, up])
            else:
                sd.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up})
            sd[p + "mlp.down_proj.weight"] = get(layer.w_down)
            if attn_norm is not None:
                sd[f"{p}{layout.norms.attn_in}.weight"] = attn_norm
            sd.update({f"{p}{name}.weight": get(norm) for name, norm in self._layer_norms(i).items()})
        sd["model.norm.weight"] = get(self.norm)
        sd["lm_head.weight"] = get(self.embed_tokens if self.lm_head is None else self.lm_head)
        return {k: v.detach().clone().contiguous() for k, v in sd.items()}

    # -- forward -------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, **loss_kwargs: object) -> CausalLMOutput:
        """`attention_mask` [B, S]: 0 marks padding (never attended); `position_ids` [B, S] or [1, S]:
        RoPE positions, and without `attention_mask` the documents packed in a row (a new one where
        the position does not step by +1; attention stays inside it), as transformers (masks.py).
        With `labels`, transformers' loss and its keyword arguments `shift_labels`, `ignore_index`,
        `num_items_in_batch` (lm_loss.py), taken as keywords as transformers' models take them, so that
        its Trainer finds `labels` alone as the label and passes `num_items_in_batch` (hf_interface.py)."""
        unknown = sorted(set(loss_kwargs) - set(LOSS_ARGUMENTS) - {"skip_logits"})
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward() got unexpected keyword arguments {unknown}: it takes "
                            f"input_ids, labels, position_ids, attention_mask, skip_logits and the loss's "
                            f"{', '.join(LOSS_ARGUMENTS)}")
        if labels is None and loss_kwargs.get("shift_labels") is not None:
            raise ValueError("shift_labels needs labels: as in transformers, the loss is computed only when "
                             "labels are given (pass both)")
        skip = loss_kwargs.pop("skip_logits", None)  # Liger-Kernel's (Trainer passes it: hf_interface.py)
        if skip is not None and bool(skip) != (labels is not None):
            raise ValueError(f"skip_logits={skip} {'with' if labels is not None else 'without'} labels: coda's model "
                             "returns the loss and no logits given labels (they are never materialized), and the "
                             "logits without labels")
        dtype = autocast_dtype(input_ids.device)
        if dtype is None:
            return self._forward(input_ids, labels, position_ids, attention_mask, loss_kwargs, None)
        with torch.autocast(input_ids.device.type, enabled=False):  # (autocast.py)
            return self._forward(input_ids, labels, position_ids, attention_mask, loss_kwargs, dtype)

    def _forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None, position_ids: torch.Tensor | None,
                 attention_mask: torch.Tensor | None, loss_args: dict, dtype: torch.dtype | None) -> CausalLMOutput:
        """forward's body; `dtype`: torch.autocast's, to which the model's own parameters are cast here
        and each layer's by the layer (None: as they are)."""
        c = self.config
        batch, seq = input_ids.shape
        docs = None
        if position_ids is None:
            pos = torch.arange(seq, device=input_ids.device).repeat(batch)
        else:
            position_ids = position_ids.expand(batch, seq)
            pos = position_ids.reshape(-1)
            if attention_mask is None:
                docs = documents(position_ids)
        pad = padding(attention_mask)
        # Flash's variable-length kernel where it applies: not under capped scores, and with documents
        # only outside compilation (their starts have a data-dependent count).
        sequences = (c.attn_softcap is None and (docs is None or not torch.compiler.is_compiling())
                     and varlen_applies(input_ids.device, dtype or self.embed_tokens.dtype, c.dim_per_head))
        masks = build_all(batch, seq, input_ids.device, padding=pad, docs=docs, sequences=sequences,
                          windows={c.window(i) for i in range(c.num_hidden_layers)})
        embed = cast(self.embed_tokens, dtype)
        x = F.embedding(input_ids.reshape(-1), embed, padding_idx=c.pad_token_id)
        if c.gemma:  # HF's scale: sqrt(D) as an fp32 number, rounded to the embedding's dtype
            x = x * torch.tensor(c.hidden_size ** 0.5, dtype=torch.float32).to(x.dtype)
        elif c.embedding_multiplier is not None:  # Granite's, as HF: a Python number (products in fp32, one rounding)
            x = x * c.embedding_multiplier
        attn_norm, w_qkv, b_qkv, q_norm, k_norm = (None if t is None else cast(t, dtype) for t in self._attn_params(0))
        g_attn, g_q, g_k = c.gains(attn_norm, q_norm, k_norm)
        qkv = qkv_segment(c, 0, x, pos, g_attn, w_qkv, b_qkv, g_q, g_k)
        q_scale = None
        # Past the scale's context only: default positions reach seq - 1, where every scale is 1
        if c.query_scale is not None and (position_ids is not None or seq > c.query_scale[1]):
            beta, context = c.query_scale
            q_scale = (1 + beta * torch.log(1 + torch.floor(pos / context))).to(x.dtype)
        norm = cast(self.norm, dtype)
        for i, layer in enumerate(self.layers):
            mask = masks[c.window(i)]
            # The layer is called as a module (inside the checkpoint too), so FSDP2's hooks gather its
            # parameters for the forward and again for the recomputation in backward.
            if self.checkpoint and self.training and torch.is_grad_enabled():
                x, qkv = checkpoint(layer, x, qkv, pos, batch, seq, norm, mask, q_scale, dtype, use_reentrant=False)
            else:
                x, qkv = layer(x, qkv, pos, batch, seq, norm, mask, q_scale, dtype)
        head = embed if self.lm_head is None else cast(self.lm_head, dtype)
        if labels is None:
            logits = F.linear(x, head).view(batch, seq, -1)
            if c.final_softcap is not None:  # as HF rounds it: in the logits' dtype
                logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
            return CausalLMOutput(logits=logits)
        return CausalLMOutput(loss=causal_lm_loss(x, head, labels, softcap=c.final_softcap, **loss_args))


def from_hf(hf_model: nn.Module, *, checkpoint: bool = False) -> LlamaForCausalLM:
    """A coda causal LM with the weights of a transformers *ForCausalLM of any family from_hf
    supports (families.supported(FROM_HF)): a LlamaForCausalLM, whose config describes the family's
    differences from Llama (biases, QK-norm, Gemma's norms and MLP, windows, caps); ValueError
    naming the model_type or the config field otherwise."""
    return LlamaForCausalLM.from_hf(hf_model, checkpoint=checkpoint)
