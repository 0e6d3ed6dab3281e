"""coda's reading of transformers' causal-LM loss arguments (models/lm_loss.py) against transformers'
own `ForCausalLMLoss` on the same logits, in fp32: labels shifted or given shifted, another ignore
value, a token count from outside the batch (gradient accumulation), capped logits."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

from coda.models.lm_loss import causal_lm_loss  # noqa: E402
from conftest import DEVICE, rel  # noqa: E402

V, D = 40, 16


def _inputs(ignore: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 7, D, generator=g).to(DEVICE)
    head = torch.randn(V, D, generator=g).to(DEVICE)
    labels = torch.randint(0, V, (2, 7), generator=g).to(DEVICE)
    labels[0, :2] = ignore
    shifted = torch.randint(0, V, (2, 7), generator=g).to(DEVICE)
    shifted[1, 3:5] = ignore
    return hidden, head, labels, shifted


@pytest.mark.parametrize("ignore_index", [-100, -7])
@pytest.mark.parametrize("given_shifted", [False, True])
@pytest.mark.parametrize("num_items", [None, 9, "tensor"])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_loss_and_gradients_are_transformers(ignore_index: int, given_shifted: bool, num_items: object,
                                             softcap: float | None) -> None:
    hidden, head, labels, shifted = _inputs(ignore_index)
    count = torch.tensor(9, device=DEVICE) if num_items == "tensor" else num_items
    kw = dict(ignore_index=ignore_index, num_items_in_batch=count, shift_labels=shifted if given_shifted else None)
    hidden.requires_grad_(True)
    head.requires_grad_(True)
    ours = causal_lm_loss(hidden, head, labels, softcap=softcap, **kw)
    dh, dw = torch.autograd.grad(ours, (hidden, head))
    logits = hidden @ head.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ref = ForCausalLMLoss(logits, labels, V, **kw)
    rh, rw = torch.autograd.grad(ref, (hidden, head))
    assert abs(ours.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert rel(dh, rh) < 1e-5 and rel(dw, rw) < 1e-5


def test_shift_labels_of_another_shape_are_refused() -> None:
    hidden, head, labels, shifted = _inputs(-100)
    with pytest.raises(ValueError, match=r"shift_labels \[2, 6\] must have labels' shape \[2, 7\]"):
        causal_lm_loss(hidden, head, labels, shift_labels=shifted[:, 1:])
