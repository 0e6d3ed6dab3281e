"""Generate a kernel's source for (graph, specialization): the specialization names the backend."""

from __future__ import annotations

from ..ir.graph import Graph
from ..ir.primitives import PRIMITIVES
from . import gluon_kernel, triton_kernel
from .spec import Specialization

_BACKENDS = {"triton": triton_kernel, "gluon-hopper": gluon_kernel}


def generate(graph: Graph, spec: Specialization) -> str:
    """Source of a kernel computing graph(a @ b) with `spec.backend`; the module binds `coda_kernel`."""
    return _BACKENDS[spec.backend].generate(graph, spec)


def unsupported(graph: Graph, spec: Specialization) -> str | None:
    """Why `spec.backend` cannot run this program (None: it can): a primitive with no text in
    its dialect, or the backend's own limits. Triton runs every program."""
    for node in graph.nodes:
        fn = getattr(node, "fn", None)
        if fn is not None and spec.backend not in PRIMITIVES[fn].text:
            return f"primitive {fn!r} has no {spec.backend} text"
    check = getattr(_BACKENDS[spec.backend], "unsupported", None)
    return check(graph, spec) if check else None
