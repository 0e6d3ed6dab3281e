"""Which keys each query attends to, as transformers (5.x masking_utils) decides it for a causal LM
in training (no cache): causal, within the query's document, on unpadded keys, within the layer's
sliding window. Built once per forward, one mask per distinct window, shared by the layers.

* Padding (`attention_mask`, 0 = pad): padded keys are never attended. A query that has no key left
  (a left-padded position) outputs zeros, as torch's SDPA gives transformers; coda lets such a row
  attend to itself and zeroes its output afterwards, which keeps every backend's gradient finite.
* Packed documents (`position_ids`, only without `attention_mask`, as transformers): a new document
  starts wherever the position does not step by +1 from the previous token; attention never
  crosses one.
* Sliding window w: key j is attended from query i only if i - w < j (and j <= i).

A mask takes one of two forms (attention.py picks the kernel): a boolean [S, S] mask per row, or,
for flash attention's variable-length kernel, where each document starts in the flattened tokens
and the window (padding always takes the boolean form).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMask:
    """Boolean form: `allowed` [B, 1, S, S], True where query (row) may attend key (column);
    `live` [B, 1, S, 1], False for the rows that have no key (their output is zeroed), None when
    every row has one. Sequence form: `starts` [N + 1] int32, where each of the N documents (or
    rows) starts among the B * S tokens, then B * S; `window` the sliding window (None: none)."""

    allowed: torch.Tensor | None = None
    live: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    window: int | None = None


def padding(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The [B, S] mask of unpadded tokens; None when nothing is padded (outside tracing, as
    `documents`), so that an all-ones mask keeps SDPA's causal path."""
    if attention_mask is None or (not torch.compiler.is_compiling() and bool(attention_mask.all())):
        return None
    return attention_mask


def documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[B, S] document index of each token (0, 1, ... per row): a new document wherever the
    position does not step by +1. None when every row is one document (outside tracing: the test
    reads the data, which compiled graphs cannot branch on, so they always get the index)."""
    start = position_ids[:, :1] - 1
    docs = (torch.diff(position_ids, prepend=start, dim=-1) != 1).cumsum(-1)
    if not torch.compiler.is_compiling() and not bool(docs[:, -1].any()):
        return None
    return docs


def build(batch: int, seq: int, device: torch.device, *, padding: torch.Tensor | None,
          docs: torch.Tensor | None, window: int | None, sequences: bool = False) -> AttentionMask | None:
    """The mask for one window size (None: plain causal attention, SDPA's `is_causal` path), in
    the sequence form where `sequences` asks for it and nothing is padded."""
    if window is not None and window >= seq:
        window = None
    if padding is None and docs is None and window is None:
        return None
    if sequences and padding is None:
        return AttentionMask(starts=_starts(batch, seq, device, docs), window=window)
    idx = torch.arange(seq, device=device)
    allowed = (idx[None, :] <= idx[:, None]).expand(batch, 1, seq, seq)
    if window is not None:
        allowed = allowed & (idx[None, :] > idx[:, None] - window)
    if docs is not None:
        allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])
    live = None
    if padding is not None:
        allowed = allowed & padding.bool()[:, None, None, :]
        live = allowed.any(-1, keepdim=True)
        allowed = allowed | (~live & (idx[None, :] == idx[:, None]))
    return AttentionMask(allowed, live)


def _starts(batch: int, seq: int, device: torch.device, docs: torch.Tensor | None) -> torch.Tensor:
    """Where each document (each row, without documents) starts among the batch's tokens, then
    their count: [N + 1] int32. With documents this reads their number (a device sync)."""
    if docs is None:
        return torch.arange(0, (batch + 1) * seq, seq, device=device, dtype=torch.int32)
    first = torch.ones(batch, seq, dtype=torch.bool, device=device)
    first[:, 1:] = docs[:, 1:] != docs[:, :-1]
    end = torch.full((1,), batch * seq, device=device, dtype=torch.int32)
    return torch.cat([first.flatten().nonzero().flatten().to(torch.int32), end])
