"""coda's custom ops under Inductor on torch older than 2.13.

Inductor runs an op it has no lowering for (every custom op) through an implicit fallback, and
torch 2.11 builds that fallback's log message ("Creating implicit fallback for") by printing the
op's argument IR eagerly, at any log level; for the coda Llama the print never finished on the
H200 (torch.compile of the 1B model spent minutes in IR `__str__`, then crashed). torch 2.13
builds the message lazily. Registering coda's ops as explicit fallbacks when they are defined
skips the message: Inductor then calls them as the implicit fallback would have, with the
layout constraint their tags (or the custom-op default) ask for.
"""

from __future__ import annotations

import torch


def needs_explicit_fallbacks(version: str) -> bool:
    """Whether this torch version's Inductor prints a fallback's argument IR eagerly."""
    return torch.torch_version.TorchVersion(version) < "2.13"


def register_fallback(op: torch._ops.OpOverload) -> None:
    """Make `op` an explicit Inductor fallback (once)."""
    from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    if op not in lowerings:
        constraint = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        make_fallback(op, layout_constraint=constraint, warn=False)


def explicit_fallback(op: torch._ops.OpOverload) -> None:
    """Register `op` as an explicit fallback where the running torch needs it."""
    if needs_explicit_fallbacks(torch.__version__):
        register_fallback(op)
