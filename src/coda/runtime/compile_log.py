"""An opt-in record of what first launches cost, for measuring first use (bench/first_call.py).

With `CODA_COMPILE_LOG` set to a file path, the first launch of every launch plan appends one
JSON line to it: {"kernel": its name, "backend", "config": the tile config in a few words,
"seconds": host wall-clock of that launch}. On a GPU that launch is where Triton compiles the
kernel for its specialization, or loads the binary from its own cache, or finds it compiled
already by an earlier plan (then it costs milliseconds); the kernel's run is asynchronous and
not in it. Under the interpreter the launch runs the kernel. Unset, nothing is timed or written.
"""

from __future__ import annotations

import json
import os

from .autotune import label
from .config import Config

VARIABLE = "CODA_COMPILE_LOG"


def record(kernel: object, backend: str, config: Config, seconds: float) -> None:
    """Append one line for a plan's first launch (one write, so concurrent processes do not interleave)."""
    path = os.environ.get(VARIABLE, "").strip()
    if not path:
        return
    line = json.dumps({"kernel": getattr(kernel, "__name__", type(kernel).__name__), "backend": backend,
                       "config": label(config), "seconds": seconds})
    with open(os.path.expanduser(path), "a") as f:
        f.write(line + "\n")
