"""Generate a kernel's source for (graph, specialization): the specialization names the backend."""

from __future__ import annotations

from ..ir.graph import Graph
from . import gluon_kernel, triton_kernel
from .spec import Specialization

_BACKENDS = {"triton": triton_kernel, "gluon-hopper": gluon_kernel}


def generate(graph: Graph, spec: Specialization) -> str:
    """Source of a kernel computing graph(a @ b) with `spec.backend`; the module binds `coda_kernel`."""
    return _BACKENDS[spec.backend].generate(graph, spec)


def unsupported(graph: Graph, spec: Specialization) -> str | None:
    """Why `spec.backend` cannot run this program (None: it can). Triton runs every program."""
    check = getattr(_BACKENDS[spec.backend], "unsupported", None)
    return check(graph, spec) if check else None
