"""One Llama-style block with shifted boundaries (docs/ALGEBRA.md 7), forward and backward.

The segment runs from after layer l's attention to layer l+1's QKV projection:

    x1 = x0 + attn_out @ Wo.T;  h = rms_norm(x1, g_ffn)
    x2 = x1 + (act(h Wg.T) * (h Wu.T)) @ Wdown.T;  n = rms_norm(x2, g_attn)
    qkv = rope(n Wq.T), rope(n Wk.T), n Wv.T

as 4 fused GEMMs + 2 tiny finalizes forward, and RoPE backward (a row pass; with QK-norm the
recomputed QKV GEMM: qkv_projection.py) + 2 RMSNorm-backward GEMMs (each adding into the
residual gradient) + the gated-MLP-backward GEMM + plain GEMMs backward. Attention stays outside.
`act` is the weights' `activation`: silu (SwiGLU, Llama's) or gelu_tanh (GeGLU, Gemma 1's), an
epilogue choice (ops.epilogues.GATED); the norm gains are tensors as given (Gemma's 1 + w formed
by the caller, its gradient flowing back through that sum).
The qkv output keeps q and k in the pair-adjacent order of coda.ops.permute_rope_rows: attention
scores are invariant to a permutation of head dimensions applied to both q and k, and v is
unpermuted.

The kernels take the weights in coda's layouts (NativeBlockWeights: gate/up rows interleaved,
q and k rows pair-permuted and fused with v). Standard-layout weights (BlockWeights) are
converted inside the ops, forward and again backward (keeping the converted copies from
forward to backward would cost activation memory the size of the FFN weights per layer), and
their gradients are converted back; a model that stores NativeBlockWeights skips all of
these copies.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import typing
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..ops import epilogues as E
from ..ops.custom import FusedOp, fused_op
from ..ops.layout import interleave_gate_up, permute_rope_rows, split_gate_up, unpermute_rope_rows
from ..runtime import gemm
from .qkv_projection import qkv_backward, qkv_forward, saved_for_backward


@dataclass
class BlockWeights:
    """Standard-layout weights (nn.Linear [out, in]) of the segment."""

    wo: torch.Tensor  # [D, H*hd]
    g_ffn: torch.Tensor  # [D]
    w_gate: torch.Tensor  # [F, D]
    w_up: torch.Tensor  # [F, D]
    w_down: torch.Tensor  # [D, F]
    g_attn: torch.Tensor  # [D]
    wq: torch.Tensor  # [H*hd, D]
    wk: torch.Tensor  # [KV*hd, D]
    wv: torch.Tensor  # [KV*hd, D]
    n_heads: int
    n_kv_heads: int
    eps: float = 1e-6
    rope_base: float = 10000.0
    rope_scaling: list[float] | None = None  # inv_freq's: linear [factor], or Llama 3's 4 numbers
    activation: str = "silu"  # the MLP's gate activation: an ops.epilogues.GATED name

    @property
    def head_dim(self) -> int:
        return self.wq.shape[0] // self.n_heads

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.wo, self.g_ffn, self.w_gate, self.w_up, self.w_down, self.g_attn, self.wq, self.wk, self.wv)

    def inv_freq(self) -> torch.Tensor:
        return inv_freq(self.head_dim, self.rope_base, self.rope_scaling, self.wq.device)


@dataclass
class NativeBlockWeights:
    """The segment's weights in the layouts its kernels read: w_gate_up = interleave_gate_up(w_gate,
    w_up) [2F, D]; w_qkv = [permute_rope_rows(wq); permute_rope_rows(wk); wv]. Gradients of these
    tensors come back in the same layouts (to_standard converts either)."""

    wo: torch.Tensor  # [D, H*hd]
    g_ffn: torch.Tensor  # [D]
    w_gate_up: torch.Tensor  # [2F, D]
    w_down: torch.Tensor  # [D, F]
    g_attn: torch.Tensor  # [D]
    w_qkv: torch.Tensor  # [(H + 2 KV) hd, D]
    n_heads: int
    n_kv_heads: int
    eps: float = 1e-6
    rope_base: float = 10000.0
    rope_scaling: list[float] | None = None  # as in BlockWeights
    rotary_dim: int | None = None  # partial rotary: the first rotary_dim dims of each head rotate (inv_freq)
    activation: str = "silu"  # as in BlockWeights
    # The q/k/v biases (Qwen2), [(H + 2 KV) hd] permuted like w_qkv's rows: one tensor, or none.
    b_qkv: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # QK-norm (Qwen3): the q and k heads' RMSNorm weights, [hd] each in HF order: both, or none.
    qk_norm: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        rows, heads = self.w_qkv.shape[0], self.n_heads + 2 * self.n_kv_heads
        if self.w_qkv.dim() != 2 or rows % heads or (rows // heads) % 2:
            raise ValueError(f"NativeBlockWeights: w_qkv {list(self.w_qkv.shape)} is not [(n_heads + 2 n_kv_heads) * "
                             f"head_dim, D] with an even head_dim for n_heads={self.n_heads}, "
                             f"n_kv_heads={self.n_kv_heads}")
        if len(self.b_qkv) > 1 or any(b.shape != (rows,) for b in self.b_qkv):
            raise ValueError(f"NativeBlockWeights: b_qkv must be [] or one [{rows}] tensor, got "
                             f"{[list(b.shape) for b in self.b_qkv]}")
        if len(self.qk_norm) not in (0, 2) or any(t.shape != (rows // heads,) for t in self.qk_norm):
            raise ValueError(f"NativeBlockWeights: qk_norm must be [] or two [{rows // heads}] tensors (q, k), got "
                             f"{[list(t.shape) for t in self.qk_norm]}")
        if self.w_gate_up.dim() != 2 or self.w_gate_up.shape[0] != 2 * self.w_down.shape[1]:
            raise ValueError(f"NativeBlockWeights: w_gate_up {list(self.w_gate_up.shape)} must be [2F, D] for "
                             f"w_down {list(self.w_down.shape)} = [D, F]")
        E.gated(self.activation)  # a ValueError naming the activations there are

    @property
    def head_dim(self) -> int:
        return self.w_qkv.shape[0] // (self.n_heads + 2 * self.n_kv_heads)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.wo, self.g_ffn, self.w_gate_up, self.w_down, self.g_attn, self.w_qkv)

    @classmethod
    def from_standard(cls, w: BlockWeights) -> NativeBlockWeights:
        """New tensors in coda's layouts (copies; autograd tracks them like any torch op)."""
        hd = w.head_dim
        w_qkv = torch.cat([permute_rope_rows(w.wq, w.n_heads, hd), permute_rope_rows(w.wk, w.n_kv_heads, hd), w.wv])
        return cls(w.wo, w.g_ffn, interleave_gate_up(w.w_gate, w.w_up), w.w_down, w.g_attn, w_qkv,
                   n_heads=w.n_heads, n_kv_heads=w.n_kv_heads, eps=w.eps, rope_base=w.rope_base,
                   rope_scaling=w.rope_scaling, activation=w.activation)

    def leaves(self) -> NativeBlockWeights:
        """The same values as fresh autograd leaves: what a model storing this layout holds as parameters."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        leaves = {name: t.detach().requires_grad_() for name, t in values.items() if isinstance(t, torch.Tensor)}
        return dataclasses.replace(self, **leaves, b_qkv=[b.detach().requires_grad_() for b in self.b_qkv],
                                   qk_norm=[t.detach().requires_grad_() for t in self.qk_norm])

    def to_standard(self) -> BlockWeights:
        """The inverse layouts (also turns gradients of native weights into standard ones).
        BlockWeights has no biases or QK-norm: weights with either are refused rather than dropped."""
        if self.b_qkv or self.qk_norm or self.rotary_dim not in (None, self.head_dim):
            raise ValueError("NativeBlockWeights.to_standard: BlockWeights has no q/k/v biases, QK-norm weights or "
                             "partial rotary")
        hd, nq, nk = self.head_dim, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        w_gate, w_up = split_gate_up(self.w_gate_up)
        return BlockWeights(self.wo, self.g_ffn, w_gate.contiguous(), w_up.contiguous(), self.w_down, self.g_attn,
                            unpermute_rope_rows(self.w_qkv[:nq], self.n_heads, hd),
                            unpermute_rope_rows(self.w_qkv[nq:nq + nk], self.n_kv_heads, hd),
                            self.w_qkv[nq + nk:].contiguous(), n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                            eps=self.eps, rope_base=self.rope_base, rope_scaling=self.rope_scaling,
                            activation=self.activation)


def inv_freq(head_dim: int, base: float, scaling: list[float] | tuple[float, ...] | None = None,
             device: torch.device | str | None = None, rotary_dim: int | None = None) -> torch.Tensor:
    """RoPE's per-pair frequencies base^(-2i/r) over the first r = rotary_dim dims of a head (None: all
    of them), scaled as transformers' rope types say: `scaling` [factor] is "linear" (every frequency
    divided by factor: Gemma 3's global layers); [factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings] is "llama3" (long wavelengths slowed by factor, short ones kept,
    a smooth blend between); YARN numbers are "yarn" (`_yarn`; its attention factor is no frequency:
    LlamaConfig.attention_scale applies it). The pairs past r (partial rotary) get 0: cos 1, sin 0,
    not rotated."""
    r = head_dim if rotary_dim is None else rotary_dim
    inv = _scaled(base ** (-torch.arange(0, r, 2, device=device, dtype=torch.float32) / r), scaling, base)
    return inv if r == head_dim else torch.cat([inv, inv.new_zeros((head_dim - r) // 2)])


# YaRN's numbers, in this order, as a RoPE `scaling` (inv_freq); its attention factor scales cos and sin.
YARN = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate", "attention_factor")


def is_yarn(scaling: list[float] | tuple[float, ...] | None) -> bool:
    """Whether a RoPE `scaling` is YaRN's numbers (their count tells the rope types apart)."""
    return scaling is not None and len(scaling) == len(YARN)


def _yarn(inv: torch.Tensor, base: float, factor: float, beta_fast: float, beta_slow: float, old_len: float,
          truncate: float) -> torch.Tensor:
    """YaRN's frequencies (transformers' rope_type "yarn"): the pairs that turn more than beta_fast
    times over the original context old_len keep their frequency, those turning fewer than
    beta_slow times are divided by factor, and the pairs between blend linearly in the pair index
    (its bounds rounded outwards where `truncate`)."""
    dim = 2 * inv.numel()

    def pair(turns: float) -> float:  # the (fractional) pair index whose frequency turns `turns` times over old_len
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair(beta_fast), pair(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv.device) - low) / (high - low)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def _scaled(inv: torch.Tensor, scaling: list[float] | tuple[float, ...] | None, base: float) -> torch.Tensor:
    if scaling is None:
        return inv
    if len(scaling) == 1:
        return inv / scaling[0]
    if is_yarn(scaling):
        return _yarn(inv, base, *scaling[:-1])
    factor, low, high, old_len = scaling
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rope_freq(w: NativeBlockWeights) -> torch.Tensor:
    """Per column pair of the fused qkv output: the pair's frequency, 0 for v."""
    return rope_freq_table(w.head_dim, w.n_heads, w.n_kv_heads, w.rope_base, w.rope_scaling, w.w_qkv.device,
                           w.rotary_dim)


def rope_freq_table(head_dim: int, n_heads: int, n_kv_heads: int, base: float, scaling: list[float] | None,
                    device: torch.device, rotary_dim: int | None = None) -> torch.Tensor:
    """The rms_rope epilogue's freq operand for a fused [q; k; v] projection (inv_freq's per head)."""
    return _freq_table(head_dim, n_heads + n_kv_heads, n_kv_heads * head_dim // 2, base,
                       None if scaling is None else tuple(scaling), device, rotary_dim)


@functools.lru_cache(maxsize=64)
def _freq_table(head_dim: int, rotated_heads: int, v_pairs: int, base: float, scaling: tuple[float, ...] | None,
                device: torch.device, rotary_dim: int | None) -> torch.Tensor:
    # Built once per configuration: the table is a constant, and building it is a handful of
    # small launches per forward and backward (the block's host time bounds it at D=2048).
    inv = inv_freq(head_dim, base, scaling, device, rotary_dim)
    return torch.cat([inv.repeat(rotated_heads), inv.new_zeros(v_pairs)])


# -- the ops: one pair per weight layout, the weights as named arguments -----------------------

def _tensor_fields(cls: type) -> tuple[str, ...]:
    """The fields that get gradients: tensors and lists of tensors (b_qkv, qk_norm)."""
    hints = typing.get_type_hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls) if hints[f.name] in (torch.Tensor, list[torch.Tensor]))


def _prototype(name: str, cls: type, lead: tuple[str, ...], returns: object, body: Callable) -> Callable:
    """A function of (*lead tensors, *cls's fields by name): what torch.library reads the op
    schema from, so that each weight is a named op argument. It calls body(the lead tensors by
    name, the weights in coda's layouts, the weights as given)."""
    hints = typing.get_type_hints(cls)
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(n, kind, annotation=torch.Tensor) for n in lead]
    params += [inspect.Parameter(f.name, kind, annotation=hints[f.name]) for f in dataclasses.fields(cls)]
    signature = inspect.Signature(params, return_annotation=returns)

    def fn(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        given = cls(**{f.name: bound[f.name] for f in dataclasses.fields(cls)})
        native = given if isinstance(given, NativeBlockWeights) else NativeBlockWeights.from_standard(given)
        return body({n: bound[n] for n in lead}, native, given)

    fn.__name__ = fn.__qualname__ = name
    fn.__signature__ = signature
    return fn


# qkv_saved: what the QKV backward reads (qkv_projection.saved_for_backward: qkv, or h2 with QK-norm).
_SAVED = ("attn_out", "pos", "x1", "rstd1", "z1", "x2", "rstd2", "qkv_saved")
_FWD_LEAD, _BWD_LEAD = ("attn_out", "x0", "pos"), ("d_x2", "d_qkv") + _SAVED
_SEVEN = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _forward(t: dict, w: NativeBlockWeights, _given) -> tuple[torch.Tensor, ...]:
    """(x2, qkv) and what backward may keep: x1, rstd1, z1, rstd2, h2 (the QKV GEMM's input)."""
    x2, h2, rstd2, x1, rstd1, z1 = ffn_attn_forward(t["attn_out"], t["x0"], w.wo, w.g_ffn, w.w_gate_up, w.w_down,
                                                    w.g_attn, w.eps, w.activation)
    qkv = qkv_forward(h2, rstd2, t["pos"], _rope_freq(w), w.w_qkv, w.b_qkv, w.qk_norm, w.n_heads, w.n_kv_heads,
                      w.eps)
    return x2, qkv, x1, rstd1, z1, rstd2, h2


def ffn_attn_forward(attn_out: torch.Tensor, x0: torch.Tensor, wo: torch.Tensor, g_ffn: torch.Tensor,
                     w_gate_up: torch.Tensor, w_down: torch.Tensor, g_next: torch.Tensor, eps: float,
                     activation: str) -> tuple[torch.Tensor, ...]:
    """x1 = x0 + attn_out @ wo.T, x2 = x1 + mlp(rms_norm(x1, g_ffn)) and the next norm's h2 = x2 * g_next
    and rstd2, as 3 fused GEMMs: (x2, h2, rstd2, x1, rstd1, z1); the segments' shared upper half.
    `activation`: the MLP's gate activation (an ops.epilogues.GATED name)."""
    d = x0.shape[-1]
    p1 = gemm(attn_out, wo.T, E.residual_norm_stats, residual=x0, norm_weight=g_ffn)
    rstd1 = torch.rsqrt(p1["sumsq"] / d + eps)  # the tiny finalize
    c1 = gemm(p1["h"], w_gate_up.T, E.gated(activation).rms_save, rstd=rstd1)
    p2 = gemm(c1["y"], w_down.T, E.residual_norm_stats, residual=p1["x"], norm_weight=g_next)
    rstd2 = torch.rsqrt(p2["sumsq"] / d + eps)
    return p2["x"], p2["h"], rstd2, p1["x"], rstd1, c1["z"]


def _forward_fake(t: dict, w: NativeBlockWeights, _given) -> tuple[torch.Tensor, ...]:
    m, d = t["x0"].shape
    rows = t["x0"].new_empty(m, dtype=torch.float32)
    like = t["attn_out"]  # every GEMM output takes the dtype of the chain's first operand
    return (like.new_empty(m, d), like.new_empty(m, w.w_qkv.shape[0]), like.new_empty(m, d), rows,
            like.new_empty(m, w.w_gate_up.shape[0]), torch.empty_like(rows), like.new_empty(m, d))


def _backward(t: dict, w: NativeBlockWeights, given) -> list[torch.Tensor]:
    """Gradients for attn_out, x0 and the weights, in the order and layouts they came in."""
    d_x2, x2 = t["d_x2"], t["x2"]
    d = x2.shape[-1]
    w_qkv = w.w_qkv
    dz2, zdz2, d_attn_params = qkv_backward(t["d_qkv"], t["qkv_saved"], t["rstd2"], t["pos"], _rope_freq(w), w_qkv,
                                            w.b_qkv, w.qk_norm, w.n_heads, w.n_kv_heads, w.eps)
    # The residual gradient: each RMSNorm-backward GEMM adds its input gradient to it, into a
    # fresh tensor: on the H200 0.748 ms against 0.835 in place (a550342:bench/results/profile_ops.md).
    n2 = gemm(dz2, w_qkv, E.rmsnorm_backward_residual, out={"dx": torch.empty_like(d_x2)}, grad=d_x2, x=x2,
              norm_weight=w.g_attn, rstd=t["rstd2"], zdz_over_d=zdz2 / d)
    d_wqkv = gemm(dz2.T, n2["normed"])
    d_attn, grad, d_wo, dg_ffn, d_wgu, d_wdown = ffn_attn_backward(n2["dx"], t["attn_out"], t["x1"], t["rstd1"], t["z1"],
                                                                   w.wo, w.g_ffn, w.w_gate_up, w.w_down, w.activation)
    d_w = NativeBlockWeights(wo=d_wo, g_ffn=dg_ffn, w_gate_up=d_wgu, w_down=d_wdown,
                             g_attn=n2["dg"].to(w.g_attn.dtype), w_qkv=d_wqkv, n_heads=w.n_heads,
                             n_kv_heads=w.n_kv_heads)
    # b_qkv's or qk_norm's gradients last: the order of the fields (at most one of them is set)
    return [d_attn, grad, *(d_w if isinstance(given, NativeBlockWeights) else d_w.to_standard()).tensors(),
            *d_attn_params]


def ffn_attn_backward(grad: torch.Tensor, attn_out: torch.Tensor, x1: torch.Tensor, rstd1: torch.Tensor,
                      z1: torch.Tensor, wo: torch.Tensor, g_ffn: torch.Tensor, w_gate_up: torch.Tensor,
                      w_down: torch.Tensor, activation: str) -> tuple[torch.Tensor, ...]:
    """Backward of x2 = x1 + mlp(rms_norm(x1, g_ffn)), x1 = x0 + attn_out @ wo.T from grad = dL/dx2:
    (d_attn_out, d_x0, d_wo, d_g_ffn, d_w_gate_up, d_w_down); the segments' shared lower half."""
    d = x1.shape[-1]
    sb = gemm(grad, w_down, E.gated(activation).backward_zdz, z=z1)
    d_wdown = gemm(grad.T, sb["y"])
    n1 = gemm(sb["dz"], w_gate_up, E.rmsnorm_backward_residual, out={"dx": torch.empty_like(grad)}, grad=grad, x=x1,
              norm_weight=g_ffn, rstd=rstd1, zdz_over_d=sb["zdz"] / d)
    grad = n1["dx"]
    d_wgu = gemm(sb["dz"].T, n1["normed"])
    d_attn = gemm(grad, wo)
    d_wo = gemm(grad.T, attn_out)
    return d_attn, grad, d_wo, n1["dg"].to(g_ffn.dtype), d_wgu, d_wdown


def _backward_fake(t: dict, w: NativeBlockWeights, given) -> list[torch.Tensor]:
    return [torch.empty_like(t["attn_out"]), torch.empty_like(t["d_x2"]), *(torch.empty_like(x) for x in given.tensors()),
            *(torch.empty_like(b) for b in (*w.b_qkv, *w.qk_norm))]


def _saver(cls: type) -> Callable:
    """The op's save function: _SAVED, then the weights and config as given."""
    names = [f.name for f in dataclasses.fields(cls)]

    def save(attn_out, x0, pos, *weights_and_config, out):
        x2, qkv, x1, rstd1, z1, rstd2, h2 = out
        qk_norm = dict(zip(names, weights_and_config)).get("qk_norm", [])
        return (attn_out, pos, x1, rstd1, z1, x2, rstd2, saved_for_backward(h2, qkv, qk_norm), *weights_and_config)

    return save


def _segment_op(cls: type) -> FusedOp:
    """coda::block_segment_{fwd,bwd} for NativeBlockWeights, coda::block_segment_standard_* for BlockWeights."""
    name = "block_segment" if cls is NativeBlockWeights else "block_segment_standard"
    return fused_op(
        f"coda::{name}",
        forward=_prototype(f"{name}_fwd", cls, _FWD_LEAD, _SEVEN, _forward),
        fake=_prototype(f"{name}_fwd_fake", cls, _FWD_LEAD, _SEVEN, _forward_fake),
        save=_saver(cls),
        backward=_prototype(f"{name}_bwd", cls, _BWD_LEAD, list[torch.Tensor], _backward),
        backward_fake=_prototype(f"{name}_bwd_fake", cls, _BWD_LEAD, list[torch.Tensor], _backward_fake),
        grads=("attn_out", "x0", *_tensor_fields(cls)), outputs=2)


_OPS = {cls: _segment_op(cls) for cls in (NativeBlockWeights, BlockWeights)}


def block_segment(attn_out: torch.Tensor, x0: torch.Tensor, pos: torch.Tensor,
                  weights: BlockWeights | NativeBlockWeights):
    """(x2, qkv) of the segment, differentiable in attn_out, x0 and every weight.

    attn_out: [M, H*hd] attention output; x0: [M, D] residual stream; pos: [M] integer
    positions. qkv: [M, (H + 2 KV) hd] with q, k rotated in pair-adjacent order, v plain.
    Standard-layout weights are converted per call (see the module docstring).
    """
    if not isinstance(weights, (BlockWeights, NativeBlockWeights)):
        raise TypeError(f"block_segment: weights must be BlockWeights or NativeBlockWeights, got {type(weights).__name__}")
    values = [getattr(weights, f.name) for f in dataclasses.fields(weights)]
    return _OPS[type(weights)](attn_out, x0, pos, *values)


def reference_block_segment(attn_out: torch.Tensor, x0: torch.Tensor, pos: torch.Tensor, w: BlockWeights):
    """The same segment in plain PyTorch, standard layouts and half-split RoPE; qkv with q and
    k in the standard order (compare coda's through `qkv_to_standard`)."""
    x1 = x0 + F.linear(attn_out, w.wo)
    h = F.rms_norm(x1, (x1.shape[-1],), w.g_ffn, w.eps)
    x2 = x1 + F.linear(E.gated(w.activation).torch_act(F.linear(h, w.w_gate)) * F.linear(h, w.w_up), w.w_down)
    n = F.rms_norm(x2, (x2.shape[-1],), w.g_attn, w.eps)
    hd = w.head_dim
    theta = pos[:, None].float() * w.inv_freq()[None, :]
    cos, sin = torch.cat([theta.cos()] * 2, -1)[:, None], torch.cat([theta.sin()] * 2, -1)[:, None]

    def rope(t: torch.Tensor, heads: int) -> torch.Tensor:
        t = t.reshape(t.shape[0], heads, hd)
        rotated = torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1)
        return (t * cos + rotated * sin).reshape(t.shape[0], heads * hd)

    q, k, v = F.linear(n, w.wq), F.linear(n, w.wk), F.linear(n, w.wv)
    return x2, torch.cat([rope(q, w.n_heads), rope(k, w.n_kv_heads), v], -1)


def qkv_to_standard(qkv: torch.Tensor, w: BlockWeights | NativeBlockWeights) -> torch.Tensor:
    """coda's qkv (pair-adjacent q, k) in the standard half-split head order."""
    hd = w.head_dim
    nq, nk = w.n_heads * hd, w.n_kv_heads * hd
    q = unpermute_rope_rows(qkv[:, :nq].T, w.n_heads, hd).T
    k = unpermute_rope_rows(qkv[:, nq:nq + nk].T, w.n_kv_heads, hd).T
    return torch.cat([q, k, qkv[:, nq + nk:]], -1)
