"""The Triton helpers of `jit_helpers`, re-wrapped for Gluon kernels: one source for both.

They are elementwise or scalar code with no layouts, which Gluon compiles as it is (Gluon's
own standard library imports Triton's the same way).
"""

from triton.experimental import gluon

from . import jit_helpers


def _as_gluon(fn):
    return gluon.jit(fn.fn)


_sigmoid = _as_gluon(jit_helpers._sigmoid)
_tanh = _as_gluon(jit_helpers._tanh)
_tile_coords = _as_gluon(jit_helpers._tile_coords)
_trig = _as_gluon(jit_helpers._trig)
