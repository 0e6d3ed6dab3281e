"""transformers' causal-LM loss (`ForCausalLMLoss`) on the final hidden states, through the fused LM
head + cross-entropy: one reading of its arguments for coda's models and for `coda.patch`.

The targets are `shift_labels` when given (sequence-parallel trainers shift the labels themselves),
else `labels` shifted left by one (token t predicts t + 1) and padded with `ignore_index`. With
`num_items_in_batch` (transformers' Trainer under gradient accumulation) the loss is the sum over the
targets divided by it, else their mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.cross_entropy import linear_cross_entropy

LOSS_ARGUMENTS = ("shift_labels", "ignore_index", "num_items_in_batch")  # causal_lm_loss's keywords, HF's names


def causal_lm_loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, *,
                   shift_labels: torch.Tensor | None = None, ignore_index: int = -100,
                   num_items_in_batch: torch.Tensor | int | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    """The fp32 loss of the logits hidden @ head.T (capped as softcap * tanh(z / softcap) when given)
    against labels [B, S] as transformers computes it (module docstring); hidden: [B, S, D] or
    [B * S, D], head: [V, D]."""
    if shift_labels is None:
        target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    else:
        if shift_labels.shape != labels.shape:
            raise ValueError(f"shift_labels {list(shift_labels.shape)} must have labels' shape {list(labels.shape)}")
        target = shift_labels
    target = target.to(hidden.device).reshape(-1)
    hidden = hidden.reshape(target.numel(), hidden.shape[-1])
    if num_items_in_batch is None:
        return linear_cross_entropy(hidden, head, target, ignore_index=ignore_index, softcap=softcap)
    total = linear_cross_entropy(hidden, head, target, ignore_index=ignore_index, reduction="sum", softcap=softcap)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
