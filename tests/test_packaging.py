"""What `pip install coda-gemm` promises: the distribution's name, one version (coda.__version__),
the versions of torch, Triton and numpy coda runs with, the license; and that under the
interpreter a numpy that Triton 3.6's interpreter cannot run with is refused at import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coda import _platform

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")
specifiers = pytest.importorskip("packaging.specifiers")
requirements = pytest.importorskip("packaging.requirements")


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements(lines: list[str]) -> dict[str, object]:
    reqs = [requirements.Requirement(line) for line in lines]
    return {r.name: r.specifier for r in reqs}


def test_distribution_name_and_single_version_source(project: dict) -> None:
    assert project["name"] == "coda-gemm"
    assert project["dynamic"] == ["version"] and "version" not in project
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert build["dynamic"]["version"] == {"attr": "coda.__version__"}


def test_supported_versions(project: dict) -> None:
    deps = _requirements(project["dependencies"])
    assert set(deps) == {"torch", "triton", "numpy", "pydantic"}
    assert "2.11.0" in deps["torch"] and "2.10.0" not in deps["torch"]
    assert "3.6.0" in deps["triton"] and "3.7.0" not in deps["triton"] and "3.5.0" not in deps["triton"]
    assert "2.3.5" in deps["numpy"] and "2.4.0" not in deps["numpy"]
    assert "2.0" in deps["pydantic"] and "1.10" not in deps["pydantic"]
    extras = {name: _requirements(lines) for name, lines in project["optional-dependencies"].items()}
    assert "5.17.0" in extras["hf"]["transformers"] and "5.16.0" not in extras["hf"]["transformers"]
    assert {"pytest", "hypothesis", "transformers"} <= set(extras["test"])
    assert project["requires-python"] == ">=3.10"


def test_cpu_pins_satisfy_the_supported_versions(project: dict) -> None:
    """requirements-cpu.txt (the CPU development stack) lies inside what the package declares."""
    declared = _requirements(project["dependencies"] + project["optional-dependencies"]["hf"])
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements-cpu.txt").read_text().splitlines()]
    pinned = {r.name: r.specifier for r in map(requirements.Requirement, filter(None, lines))}
    for name, spec in pinned.items():
        exact = [s.version for s in spec if s.operator == "=="]
        if name in declared and exact:
            assert exact[0] in declared[name], (name, exact[0], str(declared[name]))
    assert str(pinned["numpy"]) == "<2.4"


def test_license(project: dict) -> None:
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("Copyright 2026 the coda authors\n")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


@pytest.mark.parametrize("version, refused", [("2.3.5", False), ("1.26.4", False), ("2.4.0", True),
                                              ("2.4.0rc1", True), ("2.10.1", True), ("3.0.0", True)])
def test_numpy_versions_the_interpreter_runs_with(version: str, refused: bool) -> None:
    if refused:
        with pytest.raises(ImportError, match=rf"numpy {version} breaks Triton 3.6's interpreter.*numpy<2.4"):
            _platform.check_numpy(version)
    else:
        _platform.check_numpy(version)


def test_import_refuses_numpy_2_4_under_the_interpreter() -> None:
    """`import coda` with the interpreter chosen and numpy reporting 2.4: one clear ImportError."""
    script = textwrap.dedent("""
        import numpy
        numpy.__version__ = "2.4.0"
        try:
            import coda
        except ImportError as exc:
            print(exc)
        else:
            print("imported")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == (
        "coda: numpy 2.4.0 breaks Triton 3.6's interpreter, which runs coda's kernels when there is no CUDA device; "
        "install numpy<2.4 (pip install 'numpy<2.4')")
