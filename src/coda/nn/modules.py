"""Modules whose parameters have the shapes and names of their unfused PyTorch
counterparts, so checkpoints load either way; the forward is coda's fused version."""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import ops


def _linear_weight(out_features: int, in_features: int, **factory: object) -> nn.Parameter:
    w = nn.Parameter(torch.empty(out_features, in_features, **factory))
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # nn.Linear's default
    return w


class RMSNormLinear(nn.Module):
    """nn.RMSNorm(in_features) followed by nn.Linear(in_features, out_features, bias=False)."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-6, **factory: object) -> None:
        super().__init__()
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(in_features, **factory))
        self.weight = _linear_weight(out_features, in_features, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm_linear(x, self.norm_weight, self.weight, self.eps)


class SwiGLUMLP(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)), three bias-free linears."""

    def __init__(self, dim: int, hidden: int, **factory: object) -> None:
        super().__init__()
        self.w_gate = _linear_weight(hidden, dim, **factory)
        self.w_up = _linear_weight(hidden, dim, **factory)
        self.w_down = _linear_weight(dim, hidden, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.swiglu_mlp(x, self.w_gate, self.w_up, self.w_down)


class LinearCrossEntropy(nn.Module):
    """An LM head (bias-free linear to the vocabulary) and cross-entropy, logits never stored."""

    def __init__(self, dim: int, vocab: int, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                 **factory: object) -> None:
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.lse_square_scale, self.softcap = label_smoothing, lse_square_scale, softcap
        self.weight = _linear_weight(vocab, dim, **factory)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ops.linear_cross_entropy(x, self.weight, target, ignore_index=self.ignore_index, reduction=self.reduction,
                                        label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale,
                                        softcap=self.softcap)
