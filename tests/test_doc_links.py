"""Every path and section a document or a comment cites exists.

Checked, in README.md, CHANGELOG.md, docs/*.md, examples/* and bench/**/README*:
* each relative markdown link `[text](target#anchor)`: the target exists, and so does the anchor
  (a heading of the target, as GitHub slugs it);
* each repository path (`bench/...`, `src/coda/...`, `coda/...`, `tests/...`, `docs/...`,
  `examples/...`, `scripts/...`), backticked or not, with or without a trailing slash, `:line` or
  `::name`: the file or folder exists, the line is in the file, the name is in the file;
* each backticked short path with a file suffix (`runtime/cache.py`, `epilogue_cost/x.md`): it
  exists under the repository root, src/coda, bench, bench/results or the document's folder;
* each section a document is cited by (`DESIGN.md#slug`, `HISTORY.md, "Title"`, `MODEL.md's
  section "Title"`, `ALGEBRA.md 3a`): that heading exists;
* no name that went away (`pip install coda` without `-gemm`, `train_llama.py`).
The same path and section checks run over the comments and docstrings of every Python file under
src/, bench/, tests/ and scripts/, and over every shell script there. No imports, no subprocess.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = {"README": "README.md", "CHANGELOG": "CHANGELOG.md",
        **{p.stem: f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))}}
CODE_DIRS = ("src", "bench", "tests", "scripts")

# a repository path: starts at a top-level folder (or coda's package), not inside a longer path
REPO_PATH = re.compile(r"(?<![\w/.$~-])((?:bench|src/coda|coda(?=/[a-z_])|tests|docs|examples|scripts)/"
                       r"[\w./<>*{}-]*(?:::\w+|:\d+)?)")
# a path as of a commit: `c566a3e:bench/host_step.py`, or a command after `git checkout c566a3e`
OLD_TREE = re.compile(r"(?:\b[0-9a-f]{7,40}:|git checkout [0-9a-f]{7,40}\b.*)$")
# the steps a gpu_session.sh citation names, and the steps the script has
SESSION = re.compile(r"\bbash (?:\S*/)?gpu_session\.sh((?: [a-z_0-9]+\b(?![=/.]))+)")
# a short path in backticks: has a folder and ends in a file suffix
SHORT_PATH = re.compile(r"`(?!(?:bench|src|coda|tests|docs|examples|scripts)/)"
                        r"([\w.-]+/[\w./-]*\.(?:py|md|sh|json|txt|log|toml|csv|png))(?:::\w+|:\d+)?`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# a section named by its title: `DESIGN "Title"`, `MODEL.md, "Title"`, `HISTORY.md's section "Title"`
DOC_NAMES = "|".join(DOCS)
SECTION = re.compile(rf"\b({DOC_NAMES})(?:\.md)?(?:'s)?,?\s+(?:section\s+)?\"([^\"]+)\"")
NUMBERED = re.compile(r"\bALGEBRA(?:\.md)?,?\s+(?:section\s+)?(\d+[a-z]?)\b")
ANCHOR = re.compile(rf"\b({DOC_NAMES})\.md#([\w-]+)")
# names that went away, however they are written
GONE = ((re.compile(r"pip install coda(?![-\w])"), "the distribution is coda-gemm"),
        (re.compile(r"\btrain_llama\.py\b"), "bench/train.py replaced it"))


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted(p for p in (ROOT / "examples").iterdir() if p.is_file())
    files += sorted(p for p in (ROOT / "bench").rglob("README*") if p.is_file())
    return files


def code_files() -> list[Path]:
    """Python and shell files under CODE_DIRS, but this one (its examples are not citations)."""
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*")
                  if p.suffix in (".py", ".sh") and p.is_file() and "__pycache__" not in p.parts
                  and p != Path(__file__).resolve())


def prose_of_python(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each comment and docstring of a Python source."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.append((first.lineno, first.value.value))
    return out


def prose(path: Path, text: str) -> list[tuple[int, str]]:
    """(first line, text) pieces of a file that may cite paths: all of a document or a shell script,
    the comments and docstrings of Python."""
    return prose_of_python(text) if path.suffix == ".py" else [(1, text)]


@cache
def headings(doc: str) -> tuple[str, ...]:
    """The headings of a markdown file, as written (backticks and emphasis dropped)."""
    text = re.sub(r"^```.*?^```", "", (ROOT / doc).read_text(encoding="utf-8"), flags=re.S | re.M)
    return tuple(re.sub(r"[`*]", "", m.group(1)).strip() for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.M))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def check_repo_path(cited: str) -> str | None:
    """None if a cited repository path exists, else what is wrong."""
    if any(c in cited for c in "<>*{}"):  # a pattern or a placeholder (`block_kernels_<commit>`)
        return None
    path, line, name = cited.rstrip(".,;:"), None, None
    if "::" in path:
        path, name = path.split("::")
    elif re.search(r":\d+$", path):
        path, line = path.rsplit(":", 1)
    path = path.rstrip(".")
    target = ROOT / ("src/" + path if path.startswith("coda/") else path)
    if not target.exists():
        return f"{cited}: no such file or folder"
    if line is not None and (not target.is_file() or int(line) > len(target.read_text().splitlines())):
        return f"{cited}: no line {line}"
    if name is not None and not re.search(rf"\b{name}\b", target.read_text()):
        return f"{cited}: {name} is not in {path}"
    return None


@cache
def session_steps() -> frozenset[str]:
    """The steps bench/gpu_session.sh runs: the labels of its `case`."""
    text = (ROOT / "bench" / "gpu_session.sh").read_text()
    return frozenset(re.findall(r"^\s+([a-z_0-9]+)\)", text, re.M))


def check_short_path(cited: str, where: Path) -> str | None:
    bases = (ROOT, ROOT / "src" / "coda", ROOT / "src", ROOT / "bench", ROOT / "bench" / "results", where.parent)
    return None if any((b / cited).exists() for b in bases) else f"{cited}: not under any of {len(bases)} folders"


def check_link(target: str, where: Path) -> str | None:
    if re.match(r"[a-z]+:", target):  # http:, mailto:
        return None
    file, _, anchor = target.partition("#")
    dest = (where.parent / file).resolve() if file else where
    if not dest.exists():
        return f"link {target}: no such file or folder"
    if anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in headings(str(dest.relative_to(ROOT)))}:
        return f"link {target}: no heading with that anchor"
    return None


def check_section(doc: str, title: str) -> str | None:
    if any(h == title or h.startswith(title + " ") for h in headings(DOCS[doc])):
        return None
    return f'{doc} "{title}": no such section in {DOCS[doc]}'


def problems(path: Path, text: str | None = None) -> list[str]:
    """What `path` (or `text`, read as if it were `path`) cites that does not exist."""
    found: list[str] = []
    is_doc = path.suffix not in (".py", ".sh")
    for first_line, piece in prose(path, path.read_text(encoding="utf-8") if text is None else text):
        errs: list[tuple[int, str | None]] = []  # (offset in the piece, what is wrong)

        def old(m: re.Match) -> bool:  # a path in an older commit's tree
            return bool(OLD_TREE.search(piece, 0, m.start()))

        errs += [(m.start(), check_repo_path(m.group(1))) for m in REPO_PATH.finditer(piece) if not old(m)]
        errs += [(m.start(), f"gpu_session.sh {step}: no such step") for m in SESSION.finditer(piece) if not old(m)
                 for step in m.group(1).split() if step not in session_steps()]
        if is_doc:
            errs += [(m.start(), check_short_path(m.group(1), path)) for m in SHORT_PATH.finditer(piece)]
            errs += [(m.start(), check_link(m.group(1), path)) for m in LINK.finditer(piece)]
        errs += [(m.start(), check_section(m.group(1), " ".join(m.group(2).split()))) for m in SECTION.finditer(piece)]
        errs += [(m.start(), None if any(h.startswith(m.group(1) + ".") for h in headings(DOCS["ALGEBRA"]))
                  else f"ALGEBRA {m.group(1)}: no such numbered section") for m in NUMBERED.finditer(piece)]
        errs += [(m.start(), None if m.group(2) in {slug(h) for h in headings(DOCS[m.group(1)])}
                  else f"{m.group(0)}: no such anchor") for m in ANCHOR.finditer(piece)]
        errs += [(m.start(), f"{m.group(0)}: {why}") for rx, why in GONE for m in rx.finditer(piece)]
        found += [f"{path.relative_to(ROOT)}:{first_line + piece.count(chr(10), 0, at)}: {e}" for at, e in errs if e]
    return found


def test_documents_cite_only_what_exists() -> None:
    bad = [p for f in markdown_files() for p in problems(f)]
    assert not bad, "\n".join(bad)


def test_comments_and_docstrings_cite_only_what_exists() -> None:
    bad = [p for f in code_files() for p in problems(f)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("text, bad", [
    ("see `bench/harness.py` and bench/tools/", False),
    ("`c566a3e:bench/host_step.py`; `git checkout c566a3e && python3 bench/host_step.py`", False),
    ("python3 bench/host_step.py", True),
    ("`bash bench/gpu_session.sh tests ops` and gpu_session.sh's `$OUT`", False),
    ("`bash bench/gpu_session.sh stores l2`", True),
    ("see `bench/no_such_tool.py`", True),
    ("tests/conftest.py:1 and `tests/conftest.py::tolerances`", False),
    ("tests/conftest.py:999999", True),
    ('DESIGN "The contract" and MODEL.md, "RoPE"', False),
    ('DESIGN "Where the gluon-hopper work stands"', True),
    ("ALGEBRA.md 3a; ALGEBRA.md 9", True),
    ("[x](docs/DESIGN.md#the-contract) [y](docs/HISTORY.md#no-such-heading)", True),
    ("pip install coda-gemm", False),
    ("pip install coda", True),
    ("as train_llama.py does", True),
])
def test_the_checker_finds_what_it_should(text: str, bad: bool) -> None:
    assert bool(problems(ROOT / "README.md", text)) is bad
