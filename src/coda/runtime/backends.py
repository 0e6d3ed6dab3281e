"""The runtime's backends by name: the one place where shared code finds what is particular to
the backend a Config (or Specialization) names.

Each backend's module (`triton_backend`, `gluon_backend`) holds, in the order a call meets them:
the configs it runs (`check`, the Config model's rule), its default config (`default_config`),
how the code budget shrinks a config (`epilogue_code`, `budget_step`), its share of the resource
model (`MIN_STAGES` for the fit search, `shared_bytes`), its launch constants (`STRIDE_ARGS`,
`constexprs`, `launch_options`, `shared_layout`, `ast_source`) and its tuning space (`space`,
`options`, `LABEL`); gluon-hopper first says whether it can run the call (`unsupported`).

Those modules import the shared ones (config, resources, specialize, ...), never the reverse:
shared code reaches them only through `backend_of`, which imports them on first use, so that a
shared module can import this one at its top.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

_MODULES = {"triton": "triton_backend", "gluon-hopper": "gluon_backend"}


def backend_of(name: str) -> ModuleType:
    """The module of backend `name` ("triton" or "gluon-hopper")."""
    return import_module(f"{__package__}.{_MODULES[name]}")


__all__ = ["backend_of"]
