"""A process that compiles for sm_90 without a GPU, for the AOT tests (test_aot_gluon.py, test_compile_time.py,
test_older_gpus.py, test_resources.py): one JSON request a line in, one JSON reply a line out; it
imports the tests' own modules (cpu_calls). A test module gives the
body of the worker's script, a `handle(req) -> result` and its imports; `script` wraps it so that
only replies reach the reply stream."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest

PREAMBLE = '''\
import json, os, sys, traceback

out = os.fdopen(os.dup(1), "w")  # replies; everything else printed goes to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr
'''

LOOP = '''

for line in sys.stdin:
    try:
        reply = {"ok": True, "result": handle(json.loads(line))}
    except Exception:
        reply = {"ok": False, "error": traceback.format_exc()}
    out.write(json.dumps(reply) + "\\n")
    out.flush()
'''


def script(body: str) -> str:
    """The worker's source: stdout kept for replies, then `body` (imports and `handle`), then the loop."""
    return PREAMBLE + textwrap.dedent(body) + LOOP


class AotWorker:
    """The compiling process (TRITON_INTERPRET=0; coda's and Triton's caches under `tmp`; `env`
    added, a None value removing the variable). A context manager: leaving it closes the process."""

    def __init__(self, tmp: Path, source: str, timeout_s: float, env: Mapping[str, str | None] | None = None) -> None:
        path = tmp / "aot_worker.py"
        path.write_text(source)
        tests = str(Path(__file__).resolve().parent)  # the worker imports cpu_calls from here
        path_now = os.environ.get("PYTHONPATH")
        full = {**os.environ, "TRITON_INTERPRET": "0", "CODA_CACHE_DIR": str(tmp / "coda"),
                "TRITON_CACHE_DIR": str(tmp / "triton"),
                "PYTHONPATH": tests if not path_now else tests + os.pathsep + path_now}
        for name, value in (env or {}).items():
            if value is None:
                full.pop(name, None)
            else:
                full[name] = value
        self.timeout_s = timeout_s
        self.log = tmp / "worker.stderr"
        self._stderr = self.log.open("w")
        self.proc = subprocess.Popen([sys.executable, str(path)], env=full, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True)

    def request(self, req: dict, what: str = "") -> dict:
        """The worker's result for `req`; a failure saying `what` and why when it has none."""
        assert self.proc.poll() is None, f"the worker exited: {self.log.read_text()[-4000:]}"
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], self.timeout_s)[0]:
            self.proc.kill()
            pytest.fail(f"{what}no reply within {self.timeout_s} s: {self.log.read_text()[-4000:]}")
        line = self.proc.stdout.readline()
        assert line, f"{what}the worker died: {self.log.read_text()[-4000:]}"
        reply = json.loads(line)
        assert reply["ok"], f"{what}{reply['error']}"
        return reply["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()

    def __enter__(self) -> AotWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
