"""coda's custom ops under Inductor on torch older than 2.13.

Inductor runs an op it has no lowering for (every custom op) through an implicit fallback, and
torch 2.11 builds that fallback's log message ("Creating implicit fallback for") by printing the
op's argument IR eagerly, at any log level; for the coda Llama the print never finished on the
H200 (torch.compile of the 1B model spent minutes in IR `__str__`, then crashed). torch 2.13
builds the message lazily. Registering coda's ops as explicit fallbacks before Inductor lowers
them skips the message: Inductor then calls them as the implicit fallback would have, with the
layout constraint their tags (or the custom-op default) ask for.

Registering imports Inductor's lowering module, which takes seconds: 3.0 s on the 2-core CPU
machine, where `import coda` as torch 2.11 (`bench/tools/import_time.py --as-torch 2.11.0`) took
4.4-5.3 s registering each op as it was defined and 0.4-0.9 s deferring, six runs each (on the
H200's torch 2.11, registering as defined, it took 1.9 s; deferring, 0.83-0.96 s). So an op
defined before that module is loaded waits in `_pending`, and the first call of any coda fake
kernel registers every waiting op (`before_tracing`): Dynamo and AOTAutograd run fake kernels
while they trace, before Inductor lowers the graph, and a program that never compiles never pays.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

import torch

_pending: list[torch._ops.OpOverload] = []


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
    """Register `op` as an explicit fallback where the running torch needs it: now if Inductor's
    lowering module is loaded, else when a fake kernel first runs (`register_pending`)."""
    if not needs_explicit_fallbacks(torch.__version__):
        return
    if "torch._inductor.lowering" in sys.modules:
        register_fallback(op)
    else:
        _pending.append(op)


def register_pending() -> None:
    """Register every op still waiting (a no-op once none is)."""
    while _pending:
        register_fallback(_pending.pop())


def before_tracing(fake: Callable) -> Callable:
    """`fake` (a custom op's fake kernel) that first registers the waiting fallbacks."""
    @functools.wraps(fake)
    def run(*args, **kwargs):
        if _pending:
            register_pending()
        return fake(*args, **kwargs)
    return run
