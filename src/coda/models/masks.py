"""Which keys each query attends to, as transformers (5.x masking_utils) decides it for a causal LM
in training (no cache): causal, within the query's document, on unpadded keys, within the layer's
sliding window. Built once per forward, one mask per distinct window, shared by the layers.

* Padding (`attention_mask`, 0 = pad): padded keys are never attended. A query that has no key left
  (a left-padded position) is marked not `live`: coda lets such a row attend to itself and replaces
  its output afterwards (zeros, or eager attention's mean: attention.py), which keeps every
  backend's gradient finite.
* Packed documents (`position_ids`, only without `attention_mask`, as transformers): a new document
  starts wherever the position does not step by +1 from the previous token; attention never
  crosses one.
* Sliding window w: key j is attended from query i only if i - w < j (and j <= i).

A mask takes one of two forms (attention.py picks the kernel): a boolean [S, S] mask per row, or,
for flash attention's variable-length kernel, where each document starts in the flattened tokens
and the window. Padding takes the sequence form when each row's unpadded tokens are one run (left
or right padding, outside compilation): the run is a sequence, a padded run before it outputs zeros,
and the padded queries after it, which attend every unpadded key of their row in transformers, take
a second, full (non-causal) call over those keys (without a window reaching: else the boolean form).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Tail:
    """The right-padded queries of the sequence form: `queries` [P] their token indices, `keys` [K]
    the unpadded tokens of their rows, and flash's cumulative starts (`cu_q`, `cu_k`, int32) and
    longest lengths of both, one sequence per such row."""

    queries: torch.Tensor
    keys: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


@dataclass(frozen=True)
class AttentionMask:
    """Boolean form: `allowed` [B, 1, S, S], True where query (row) may attend key (column);
    `live` [B, 1, S, 1], False for the queries that have no key (their output is zeroed), None
    when every query has one. Sequence form: `starts` [N + 1] int32, where each of the N documents
    (rows, padded or unpadded runs) starts among the B * S tokens, then B * S, and `longest` the
    longest; `window` the sliding window (None: none); `live` [B * S, 1, 1] as above; `tail` the
    right-padded queries' second call (None: none)."""

    allowed: torch.Tensor | None = None
    live: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    longest: int = 0
    window: int | None = None
    tail: Tail | None = None


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
    the sequence form where `sequences` asks for it and the padding allows (module docstring)."""
    return build_all(batch, seq, device, padding=padding, docs=docs, windows={window}, sequences=sequences)[window]


def build_all(batch: int, seq: int, device: torch.device, *, padding: torch.Tensor | None,
              docs: torch.Tensor | None, windows: set[int | None], sequences: bool = False
              ) -> dict[int | None, AttentionMask | None]:
    """`build`'s mask for each window. The sequence form reads the batch (the document starts or the
    padded runs: a host sync), so it is made once, without a window, and each window takes a copy."""
    shared: list[AttentionMask | None] = []  # the sequence form, once made (None: the padding refuses it)

    def one(window: int | None) -> AttentionMask | None:
        if window is not None and window >= seq:
            window = None
        if padding is None and docs is None and window is None:
            return None
        if sequences and (padding is None or docs is None):
            if not shared:
                shared.append(_sequence_form(batch, seq, device, padding, docs))
            form = shared[0]
            if form is not None and (window is None or form.tail is None):  # the tail call takes no window
                return replace(form, window=window)
        return _boolean(batch, seq, device, padding, docs, window)

    return {w: one(w) for w in windows}


def _boolean(batch: int, seq: int, device: torch.device, padding: torch.Tensor | None,
             docs: torch.Tensor | None, window: int | None) -> AttentionMask:
    """The boolean form: the [B, 1, S, S] mask, and which queries have no key (module docstring)."""
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


def _sequence_form(batch: int, seq: int, device: torch.device, padding: torch.Tensor | None,
                   docs: torch.Tensor | None) -> AttentionMask | None:
    """The sequence form without a window: where each document (or row) starts, or, for padding,
    each row's padded and unpadded runs (None where a row's unpadded tokens are not one run)."""
    if padding is None:
        return AttentionMask(starts=_starts(batch, seq, device, docs), longest=seq)
    runs = _unpadded_runs(padding)
    return None if runs is None else _padded_sequences(batch, seq, device, runs)


def _starts(batch: int, seq: int, device: torch.device, docs: torch.Tensor | None) -> torch.Tensor:
    """Where each document (each row, without documents) starts among the batch's tokens, then
    their count: [N + 1] int32. With documents this reads their number (a device sync)."""
    if docs is None:
        return torch.arange(0, (batch + 1) * seq, seq, device=device, dtype=torch.int32)
    first = torch.ones(batch, seq, dtype=torch.bool, device=device)
    first[:, 1:] = docs[:, 1:] != docs[:, :-1]
    end = torch.full((1,), batch * seq, device=device, dtype=torch.int32)
    return torch.cat([first.flatten().nonzero().flatten().to(torch.int32), end])


def _unpadded_runs(padding: torch.Tensor) -> list[tuple[int, int]] | None:
    """Each row's unpadded tokens as one run [first, end) (an empty row: (S, S)); None where a row's
    are not one run, or under compilation (which cannot read the data). Reads the mask (a sync)."""
    if torch.compiler.is_compiling():
        return None
    live = padding.bool()
    seq = live.shape[1]
    idx = torch.arange(seq, device=live.device)
    count = live.sum(1)
    first = torch.where(live, idx, seq).amin(1)
    end = torch.where(live, idx + 1, 0).amax(1)
    rows = torch.stack([count, first, end], 1).tolist()
    if any(n and e - f != n for n, f, e in rows):
        return None
    return [(f, e) if n else (seq, seq) for n, f, e in rows]


def _padded_sequences(batch: int, seq: int, device: torch.device, runs: list[tuple[int, int]]) -> AttentionMask:
    """The sequence form of left and right padding (module docstring): per row the padded run before
    its unpadded run, the unpadded run, the padded run after it, each a sequence; the first zeroed,
    the last recomputed by the tail call."""
    starts, live, queries, keys, cu_q, cu_k = [], torch.ones(batch * seq, dtype=torch.bool), [], [], [0], [0]
    for row, (first, end) in enumerate(runs):
        base = row * seq
        starts += [base + i for i in sorted({0, first, end}) if i < seq]
        live[base:base + first] = False
        if first < end < seq:
            queries.append(torch.arange(base + end, base + seq))
            keys.append(torch.arange(base + first, base + end))
            cu_q.append(cu_q[-1] + seq - end)
            cu_k.append(cu_k[-1] + end - first)
    bounds = starts + [batch * seq]
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    tail = None
    if queries:
        tail = Tail(torch.cat(queries).to(device), torch.cat(keys).to(device),
                    torch.tensor(cu_q, dtype=torch.int32, device=device),
                    torch.tensor(cu_k, dtype=torch.int32, device=device),
                    max(b - a for a, b in zip(cu_q, cu_q[1:])), max(b - a for a, b in zip(cu_k, cu_k[1:])))
    return AttentionMask(live=None if bool(live.all()) else live.to(device)[:, None, None],
                         starts=torch.tensor(bounds, dtype=torch.int32, device=device), longest=longest,
                         tail=tail)
