"""The JIT kernel cache: on disk across processes, in memory within one, keyed by what
the kernel is specialized on, and robust to damaged entries.

Cross-process behaviour runs a small script in fresh Python processes that share one
CODA_CACHE_DIR (passed explicitly in their environment). Autotuning is off
(CODA_AUTOTUNE=0) so that each call needs exactly one kernel on a GPU too.
"""

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest
import torch

import coda
from coda.ir import Graph
from coda.runtime import interpreting, stats
from coda.runtime.cache import kernel_key
from coda.runtime.launch import specialize
from coda.runtime.validate import validate
from conftest import DEVICE, randn

# Runs `acc * s + c` for each constant c given on the command line (one graph each) on
# small integer inputs, so results compare exactly, and prints per-call stats deltas.
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import coda
    from coda.runtime import interpreting, stats

    device = "cpu" if interpreting() else "cuda"
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-3, 4, (20, 24), generator=gen).float().to(device)
    b = torch.randint(-3, 4, (24, 18), generator=gen).float().to(device)
    s = torch.randint(-4, 5, (20,), generator=gen).float().to(device) / 4
    calls = []
    for c in map(float, sys.argv[1:]):
        def scaled(acc, s: coda.VecM):
            return acc * s + c
        ep = coda.epilogue(scaled)
        before = dict(stats)
        out = coda.gemm(a, b, ep, s=s)
        delta = {key: n - before.get(key, 0) for key, n in stats.items() if n != before.get(key, 0)}
        calls.append({"hash": ep.graph.hash, "stats": delta, "out": out.cpu().tolist(),
                      "ref": ep.reference(a, b, s=s).cpu().tolist()})
    print(json.dumps({"stats": dict(stats), "calls": calls}))
""")


def run_script(tmp_path: Path, cache: Path, *consts: float, hash_seed: int = 0) -> dict:
    """Run SCRIPT in a fresh interpreter with CODA_CACHE_DIR=cache; its parsed JSON output."""
    script = tmp_path / "cache_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "CODA_CACHE_DIR": str(cache), "CODA_AUTOTUNE": "0", "PYTHONHASHSEED": str(hash_seed)}
    proc = subprocess.run([sys.executable, str(script), *map(str, consts)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kernel_files(cache: Path, graph_hash: str) -> list[Path]:
    """Cached kernel sources for the graph with this hash."""
    return [p for p in cache.rglob("*.py") if graph_hash in p.read_text(errors="replace")]


@pytest.mark.slow
def test_fresh_process_reuses_disk_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = run_script(tmp_path, cache, 0.5, hash_seed=1)
    second = run_script(tmp_path, cache, 0.5, hash_seed=2)
    assert first["stats"].get("generated") == 1 and first["stats"].get("disk_hits", 0) == 0
    assert second["stats"].get("disk_hits") == 1 and second["stats"].get("generated", 0) == 0
    (call1,), (call2,) = first["calls"], second["calls"]
    assert call1["hash"] == call2["hash"]  # canonical across processes (their hash seeds differ)
    assert call1["out"] == call2["out"] == call1["ref"]
    assert len(kernel_files(cache, call1["hash"])) == 1


def _garbage(text: str) -> str | bytes:
    """Bytes that are not even UTF-8."""
    return bytes(range(256)) * 8


def _half(text: str) -> str | bytes:
    """The first half of the characters (still naming the graph hash in its header)."""
    return text[: len(text) // 2]


def _without_tail(text: str) -> str | bytes:
    """Whole lines, cut before the first store: still valid Python, but a kernel that writes nothing."""
    lines = text.splitlines(keepends=True)
    return "".join(lines[: next(i for i, line in enumerate(lines) if "store(" in line)])


def _empty(text: str) -> str | bytes:
    """A zero-length file."""
    return ""


def _syntax_error(text: str) -> str | bytes:
    """The whole file with a line that does not parse appended."""
    return text + "\n)(\n"


CORRUPTIONS: dict[str, Callable[[str], str | bytes]] = {
    "garbage": _garbage, "half": _half, "cut_at_line": _without_tail, "empty": _empty, "syntax_error": _syntax_error,
}
CONSTS = {name: 1.0 + i for i, name in enumerate(CORRUPTIONS)}  # the epilogue constant of each one's graph


@pytest.fixture(scope="module")
def filled_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """A cache dir filled by one process with a kernel per corruption kind (one graph each)."""
    tmp = tmp_path_factory.mktemp("corrupt")
    cache = tmp / "cache"
    first = run_script(tmp, cache, *CONSTS.values())
    return cache, dict(zip(CORRUPTIONS, first["calls"]))


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_corrupt_cache_file_is_regenerated(filled_cache: tuple[Path, dict[str, dict]], tmp_path: Path,
                                           damage: str) -> None:
    cache, calls = filled_cache
    first = calls[damage]
    assert first["stats"] == {"generated": 1}
    (path,) = kernel_files(cache, first["hash"])
    bad = CORRUPTIONS[damage](path.read_text())
    path.write_bytes(bad if isinstance(bad, bytes) else bad.encode())
    (second,) = run_script(tmp_path, cache, CONSTS[damage])["calls"]
    assert second["out"] == first["out"] == first["ref"], f"wrong result after a {damage} cache file"
    assert second["stats"] == {"generated": 1}, f"a {damage} cache file was used instead of being regenerated"
    (path,) = kernel_files(cache, first["hash"])
    compile(path.read_text(), str(path), "exec")  # the rewritten file is whole again


def _unique_epilogue(tag: float) -> coda.Epilogue:
    """An epilogue no other test uses (so the in-memory cache has not seen it)."""

    def tagged(acc, s: coda.VecM):
        return coda.relu(acc * s) + tag

    return coda.epilogue(tagged)


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache dir for this test, and no autotuning (one kernel per call)."""
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CODA_AUTOTUNE", "0")
    return tmp_path


def test_second_call_in_process_is_a_memory_hit(own_cache: Path) -> None:
    ep = _unique_epilogue(0.8125)
    a, b, s = randn(20, 24), randn(24, 18), randn(20)
    before = Counter(stats)
    first = coda.gemm(a, b, ep, s=s)
    middle = Counter(stats)
    second = coda.gemm(a, b, ep, s=s)
    assert middle - before == Counter(generated=1)
    assert Counter(stats) - middle == Counter(memory_hits=1)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def key_of(graph: Graph, a: torch.Tensor, b: torch.Tensor, operands: dict, out: object = None) -> str:
    """The kernel cache key gemm() uses for this call."""
    interpret = interpreting()
    return kernel_key(graph, specialize(validate(graph, a, b, operands, out, interpret), interpret))


def call_variants() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]]:
    """gemm() calls that must each get their own kernel: (a, b, operands, out) from a base call."""
    m, n, k = 32, 32, 32
    return {
        "base": lambda a, b, s: (a, b, {"s": s}, None),
        "bf16": lambda a, b, s: (a.bfloat16(), b.bfloat16(), {"s": s}, None),
        "fp16": lambda a, b, s: (a.half(), b.half(), {"s": s}, None),
        "b_col_major": lambda a, b, s: (a, b.T.contiguous().T, {"s": s}, None),
        "b_strided": lambda a, b, s: (a, randn(k, 2 * n)[:, ::2], {"s": s}, None),
        "a_col_major": lambda a, b, s: (a.T.contiguous().T, b, {"s": s}, None),
        "operand_bf16": lambda a, b, s: (a, b, {"s": s.bfloat16()}, None),
        "operand_int": lambda a, b, s: (a, b, {"s": torch.arange(m, device=DEVICE)}, None),
        "out_bf16": lambda a, b, s: (a, b, {"s": s}, torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)),
    }


def test_cache_key_distinguishes_specializations() -> None:
    ep = _unique_epilogue(0.3125)
    a, b, s = randn(32, 32), randn(32, 32), randn(32)
    keys = {name: key_of(ep.graph, *make(a, b, s)) for name, make in call_variants().items()}
    assert len(set(keys.values())) == len(keys), keys
    assert key_of(ep.graph, a.clone(), b.clone(), {"s": s.clone()}) == keys["base"]  # same call, same key
    assert key_of(_unique_epilogue(0.3125).graph, a, b, {"s": s}) == keys["base"]  # a retrace, same key
    assert key_of(_unique_epilogue(0.375).graph, a, b, {"s": s}) != keys["base"]  # another graph


def test_each_specialization_writes_its_own_kernel(own_cache: Path) -> None:
    ep = _unique_epilogue(0.4375)
    a, b, s = randn(32, 32), randn(32, 32), randn(32)
    variants = call_variants()
    for count, make in enumerate(variants.values(), start=1):
        x, y, operands, out = make(a, b, s)
        coda.gemm(x, y, ep, out=out, **operands)
        assert len(list(own_cache.rglob("*.py"))) == count
    x, y, operands, out = variants["bf16"](a, b, s)
    coda.gemm(x, y, ep, out=out, **operands)  # seen before: no new file
    assert len(list(own_cache.rglob("*.py"))) == len(variants)
