"""Threads: Triton's interpreter is process-global state, coda's caches are not.

Triton's interpreter runs a kernel by patching `triton.language` in place and stepping a
module-level builder through the grid, so two kernels interpreted at once in two threads
corrupt each other ("Did you forget to add @triton.jit?"). `install()` serializes every
interpreted launch in the process (coda's GEMMs, its row kernels and any other Triton kernel)
behind one lock; on a GPU nothing is serialized there.

`build_lock` serializes what a call does the first time (validation, config choice and
tuning, code generation, the first launch that compiles): two threads that miss the same plan
then build it once, and tuning never runs concurrently with itself. Repeated calls take no lock.
The caches themselves are dicts read and written whole under the GIL.
"""

from __future__ import annotations

import functools
import threading

interpreter_lock = threading.RLock()
build_lock = threading.RLock()


def install() -> None:
    """Serialize Triton interpreter launches (idempotent; a no-op outside the interpreter)."""
    from .device import interpreting

    if not interpreting():
        return
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    if getattr(run, "_coda_serialized", False):
        return

    @functools.wraps(run)
    def serialized(self, *args, **kwargs):
        with interpreter_lock:
            return run(self, *args, **kwargs)

    serialized._coda_serialized = True  # type: ignore[attr-defined]
    InterpretedFunction.run = serialized
