"""Every ```python block of README.md runs as written, each in a fresh Python process.

On the CPU the blocks run through Triton's interpreter at their tiny shapes. A block whose first
line is `# gpu-only` is skipped without a CUDA device; on a GPU every block runs with CUDA as
torch's default device. A block that imports transformers (the whole model) is marked slow and is
skipped where transformers is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import coda

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
GPU_ONLY = "# gpu-only"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each ```python block."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_has_its_examples() -> None:
    assert len(BLOCKS) >= 3, f"README.md has {len(BLOCKS)} python blocks"


def test_the_extractor_sees_fences_only_at_line_starts() -> None:
    text = "x\n```python\na = 1\n```\n```bash\nls\n```\n```python\n# gpu-only\nb = 2\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n"), (9, "# gpu-only\nb = 2\n")]


def _uses_transformers(code: str) -> bool:
    return re.search(r"^\s*import .*\btransformers\b", code, re.M) is not None


# The whole-model block takes 30-45 s through the interpreter: slow (pytest -m "not slow" leaves it out).
PARAMS = [pytest.param(line, code, id=f"line{line}", marks=[pytest.mark.slow] if _uses_transformers(code) else [])
          for line, code in BLOCKS]


@pytest.mark.parametrize("line,code", PARAMS)
def test_readme_block_runs(line: int, code: str, tmp_path: Path) -> None:
    gpu = torch.cuda.is_available()
    if code.lstrip().startswith(GPU_ONLY) and not gpu:
        pytest.skip("marked gpu-only")
    if _uses_transformers(code) and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers")
    prelude = "import torch\ntorch.set_default_device('cuda')\n" if gpu else ""
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(prelude + code, encoding="utf-8")
    env = dict(os.environ)
    src = str(Path(coda.__file__).resolve().parents[1])  # the coda under test, installed or not
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, f"README.md block at line {line} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
