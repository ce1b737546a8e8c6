"""docs/architecture.md is the page a maintainer starts from: these tests keep it true.

Convention (the page says it too): a module is named by its path from the repository root
in backticks, `coordinator/placement/slot_map.py`; a package by its directory with a trailing
slash in a heading, `coordinator/placement/`; a method as `Class.method`.

- every module of coordinator/, worker/, shared/ and examples/ has its row in one of the
  page's tables, its path the row's first cell (``__init__.py`` and the generated ``*_pb2*``
  files excepted), and every package has a heading;
- every path the page names exists, and every dotted module name resolves;
- every `Class.method` the page names is defined in the three packages;
- every reference in the repository to a section of the page (the page's path, then the
  section's name in double quotes) names a heading that exists, and no file cites the team's
  old design notes.
"""

from __future__ import annotations

import ast
import os
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = ("coordinator", "worker", "shared", "examples")
# Top-level directories whose paths the page may name (checked to exist).
PATH_ROOTS = (*PACKAGES, "tests", "protos", "configs", "deploy", "docs")
# Where references to the page (and to the old notes) are looked for.
SCANNED_SUFFIXES = {".py", ".toml", ".yaml", ".yml", ".md", ".proto", ".cfg", ".txt", ".sh"}
SCANNED_NAMES = {"Makefile", "Dockerfile"}
SKIPPED_DIRS = {"__pycache__", "node_modules", "build", "dist"}  # and every hidden directory

_ROOTS = "|".join(PATH_ROOTS)
_PACKAGES = "|".join(PACKAGES)
PATH_RE = re.compile(rf"(?<![\w./-])(?:{_ROOTS})/[\w/.-]*")
DOTTED_RE = re.compile(rf"`((?:{_PACKAGES})(?:\.[A-Za-z_]\w*)+)`")
METHOD_RE = re.compile(r"`([A-Z]\w*)\.([A-Za-z_]\w*)`")
SECTION_REF_RE = re.compile(r'docs/architecture\.md\)?[,:]?\s*\(?"([^"]{1,80})"')


def page_text() -> str:
    """The page's markdown."""
    return PAGE.read_text(encoding="utf-8")


def is_generated(path: Path) -> bool:
    """Whether ``path`` is generated gRPC code (``*_pb2.py``, ``*_pb2_grpc.pyi``, ...)."""
    return "_pb2" in path.name


def package_modules() -> list[str]:
    """Every hand-written module of the three packages, as a path from the repository root."""
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "__pycache__" in path.parts or path.name == "__init__.py" or is_generated(path):
                continue
            found.append(path.relative_to(ROOT).as_posix())
    return sorted(found)


def package_dirs() -> list[str]:
    """Every package directory (one with an ``__init__.py``), as ``dir/``."""
    return sorted(
        p.parent.relative_to(ROOT).as_posix() + "/"
        for package in PACKAGES
        for p in (ROOT / package).rglob("__init__.py")
        if "__pycache__" not in p.parts
    )


def headings(text: str) -> list[str]:
    """The text of every markdown heading, without its ``#`` marks."""
    return [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]


def named_paths(text: str) -> set[str]:
    """Path-like words of the page under one of ``PATH_ROOTS``, a sentence's final dot cut."""
    return {m.group(0).rstrip(".") for m in PATH_RE.finditer(text)}


def module_rows(text: str) -> set[str]:
    """The modules of the page's tables: the first cell of each row, a path in backticks."""
    return set(re.findall(r"^\| `([\w/.-]+\.py)` \|", text, flags=re.MULTILINE))


def scanned_files() -> list[Path]:
    """The repository's code, config, tests and docs (what may cite the page).

    Hidden directories (``.git``, a ``.venv`` inside the checkout, caches) are not entered.
    """
    out = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".") and d not in SKIPPED_DIRS and not d.endswith(".egg-info")
        ]
        for name in files:
            path = Path(top, name)
            if is_generated(path):
                continue
            if path.suffix in SCANNED_SUFFIXES or name in SCANNED_NAMES:
                out.append(path)
    return sorted(out)


@cache
def class_members() -> dict[str, set[str]]:
    """Class name -> names defined on it (methods, class attributes, ``self.x`` assignments).

    A name defined as a class in several modules gets the union of their members.
    """
    members: dict[str, set[str]] = defaultdict(set)
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "__pycache__" in path.parts or is_generated(path):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    members[node.name].update(_defined_on(node))
    return members


def _defined_on(cls: ast.ClassDef) -> set[str]:
    """Names a class defines: in its body, and as ``self.x = ...`` in its methods."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for inner in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(inner, ast.Assign):
            targets = inner.targets
        elif isinstance(inner, (ast.AnnAssign, ast.AugAssign)):
            targets = [inner.target]
        for t in targets:
            for sub in ast.walk(t):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    names.add(sub.attr)
    return names


def resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` is a module or package, or names defined in one (``module.attr``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                source = candidate.read_text(encoding="utf-8")
                rest = parts[cut:]
                return all(re.search(rf"\b{re.escape(name)}\b", source) for name in rest)
    return False


def test_every_module_has_its_line_on_the_page() -> None:
    named = module_rows(page_text())

    missing = [m for m in package_modules() if m not in named]

    assert missing == [], (
        f"modules not on docs/architecture.md (add one line each to its package's table): {missing}"
    )


def test_every_package_has_a_heading() -> None:
    heads = " ".join(headings(page_text()))

    missing = [d for d in package_dirs() if f"`{d}`" not in heads]

    assert missing == [], f"packages without a heading on docs/architecture.md: {missing}"


def test_every_path_on_the_page_exists() -> None:
    named = named_paths(page_text())

    absent = sorted(p for p in named if not (ROOT / p).exists())

    assert named  # the pattern finds the page's paths at all
    assert absent == [], f"docs/architecture.md names paths that do not exist: {absent}"


def test_every_dotted_module_on_the_page_resolves() -> None:
    dotted = set(DOTTED_RE.findall(page_text()))

    unresolved = sorted(d for d in dotted if not resolves(d))

    assert dotted  # the page names the CLI's lazy imports this way
    assert unresolved == [], f"docs/architecture.md names unknown modules: {unresolved}"


def test_every_method_on_the_page_is_defined() -> None:
    named = set(METHOD_RE.findall(page_text()))
    members = class_members()

    undefined = sorted(
        f"{cls}.{attr}" for cls, attr in named if attr not in members.get(cls, set())
    )

    assert len(named) > 20  # the data paths name the methods they go through
    assert undefined == [], f"docs/architecture.md names undefined methods: {undefined}"


def test_references_to_the_page_name_its_sections() -> None:
    sections = set(headings(page_text()))
    wrong = []

    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)  # a name wrapped across lines
        for name in SECTION_REF_RE.findall(flat):
            if name not in sections:
                wrong.append(f"{path.relative_to(ROOT)}: {name!r}")

    assert wrong == [], f"references to sections docs/architecture.md does not have: {wrong}"


def test_no_file_cites_the_old_design_notes() -> None:
    old = "DESIGN" + ".md"  # spelled apart, so this file does not cite it

    citing = [
        str(p.relative_to(ROOT))
        for p in scanned_files()
        if old in p.read_text(encoding="utf-8", errors="replace")
    ]

    assert citing == [], f"cite docs/architecture.md (a section of it) instead of {old}: {citing}"
