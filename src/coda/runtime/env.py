"""coda's environment variables, read strictly: a malformed value raises naming the variable.

* `CODA_CACHE_DIR`: the cache root (default `~/.cache/coda`; `~` is expanded). When it cannot
  be written (read-only, or not a directory) coda warns once and uses a fresh temporary
  directory for the rest of the process instead of failing calls.
* `CODA_AUTOTUNE`: `0` (the default: never tune), `1` or `force` (coda.runtime.autotune.mode).
* `CODA_TUNE_QUIET`: a boolean (`0/1`, `true/false`, `yes/no`, `on/off`; empty is false).
* `CODA_INTERPRET_PROGRAMS`: an integer >= 1, the persistent grid under the interpreter.
* `CODA_COMPILE_LOG`: a file path; each launch plan's first launch appends a JSON line there
  (coda.runtime.compile_log).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def env_flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be a boolean (0/1, true/false, yes/no, on/off), got {raw!r}")


def env_int(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}")
    return value


# configured root -> the directory used (itself, or the temporary fallback)
_roots: dict[str, Path] = {}
_fallback: Path | None = None


def _writable(root: Path) -> OSError | None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".coda-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e
    return None


def cache_root() -> Path:
    """The cache directory to use now: CODA_CACHE_DIR (expanded) if writable, else a temporary one."""
    global _fallback
    raw = os.environ.get("CODA_CACHE_DIR", "")
    hit = _roots.get(raw)
    if hit is not None:
        return hit
    root = Path(os.path.expandvars(os.path.expanduser(raw))) if raw.strip() else Path.home() / ".cache" / "coda"
    error = _writable(root)
    if error is not None:
        if _fallback is None:
            _fallback = Path(tempfile.mkdtemp(prefix="coda-cache-"))
        warnings.warn(
            f"coda: cache directory {root} is not writable ({type(error).__name__}: {error}); generated kernels "
            f"and tuning results go to {_fallback} for this process (set CODA_CACHE_DIR to a writable directory)",
            RuntimeWarning, stacklevel=2,
        )
        root = _fallback
    _roots[raw] = root
    return root
