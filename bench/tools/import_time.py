"""Seconds that `import coda` takes in a fresh process, optionally as if torch were an older version
(`--as-torch 2.11.0`: torch.__version__ is set before coda is imported, which is all coda reads to
decide whether it must register explicit Inductor fallbacks; see coda/runtime/inductor.py), and
whether that import loaded Inductor's lowering module. Runs anywhere.

    python bench/tools/import_time.py [--as-torch 2.11.0] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, sys, time
import torch
if {version!r}:
    torch.__version__ = torch.torch_version.TorchVersion({version!r})
t = time.perf_counter()
import coda
print(json.dumps({{"s": time.perf_counter() - t, "inductor_loaded": "torch._inductor.lowering" in sys.modules}}))
"""


def measure(version: str | None, runs: int) -> list[dict]:
    """One fresh process per run: each run's import time and whether Inductor's lowering got loaded."""
    out = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-c", CHILD.format(version=version or "")], capture_output=True,
                              text=True, check=True)
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--as-torch", help="the torch version coda sees (default: the installed one)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for r in measure(args.as_torch, args.runs):
        print(f"import coda: {r['s']:.2f} s (Inductor's lowering module {'loaded' if r['inductor_loaded'] else 'not loaded'})")


if __name__ == "__main__":
    main()
