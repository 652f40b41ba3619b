"""Docs that check themselves: every code reference in README.md and docs/*.md names something that
exists, so a rename or a deletion that leaves the docs behind fails here.

What counts as a reference (inside inline code spans; fenced blocks are commands, not references):

* ``path.py:Name`` / ``path.py:Class.member``: the module, then the name resolved with ``ast`` (a
  top-level def, class or assignment; a member is a def or assignment in the class body, or a
  ``self.member = ...`` assignment in one of its methods). Line numbers (``path.py:120-140``) are
  not checked.
* ``file.py::test`` / ``file.py::Class::test``: a test in ``tests/``; a span ``::test`` continues the
  file of the previous path reference in the same document.
* ``path.py`` alone: the file exists (a ``*`` is a glob that must match).
* ``Class.member`` alone, where ``Class`` is a class defined in tpuoffload/: the member exists
  there (a bare ``module.name`` is not checked: write ``path.py:name``).

A span that is a ``git`` command (``git log -- path``) may name files that are gone.

Paths resolve from the repository root, then under ``tpuoffload/``, then (``test_*.py``) under
``tests/``. A path found in none of them is looked up in the installed vLLM and tpu-inference
packages (the integration notes cite their files), and its name resolved there the same way.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tpuoffload"
EXTERNAL = ("vllm", "tpu_inference")  # packages whose files the docs cite by their own paths

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # an inline code span may wrap one line
_REF = re.compile(
    r"(?<![\w/.*-])(?P<path>[\w./*-]*[\w*]\.py)(?:(?P<sep>::?)(?P<name>[A-Za-z_][\w.]*(?:::[A-Za-z_]\w*)?))?"
    r"|(?<![\w.:])::(?P<cont>[A-Za-z_]\w*)"
    r"|(?<![\w./:-])(?P<owner>_?[A-Z]\w*)\.(?P<member>[A-Za-z_]\w*)(?![\w(/]|\.\w)")


@dataclass(frozen=True)
class Ref:
    doc: str
    line: int
    text: str


def _external_roots() -> list[Path]:
    roots = []
    for name in EXTERNAL:
        spec = importlib.util.find_spec(name)  # locates the package without importing it
        if spec is not None and spec.submodule_search_locations:
            roots.extend(Path(p) for p in spec.submodule_search_locations)
    return roots


@functools.lru_cache(maxsize=None)
def _external_files() -> tuple[Path, ...]:
    return tuple(p for root in _external_roots() for p in root.rglob("*.py"))


def resolve_path(path: str) -> list[Path]:
    """The files a doc's ``path`` names (a glob may name several); [] when none."""
    candidates = [ROOT / path, PACKAGE / path]
    if Path(path).name.startswith("test_") and "/" not in path:
        candidates.append(ROOT / "tests" / path)
    for cand in candidates:
        if "*" in path:
            found = sorted(cand.parent.glob(cand.name))
            if found:
                return found
        elif cand.is_file():
            return [cand]
    if "*" in path:
        return []
    suffix = "/" + path.lstrip("./")
    return [p for p in _external_files() if str(p).endswith(suffix)]


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _binds(stmt: ast.stmt, name: str) -> bool:
    """Whether a statement of a module or class body defines ``name``."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return stmt.name == name
    if isinstance(stmt, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    if isinstance(stmt, ast.AnnAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name
    if isinstance(stmt, (ast.If, ast.Try)):  # definitions under a version or import guard
        bodies = [stmt.body, stmt.orelse] + ([h.body for h in stmt.handlers] if isinstance(stmt, ast.Try) else [])
        return any(_binds(s, name) for body in bodies for s in body)
    return False


def _find(body: list[ast.stmt], name: str) -> ast.stmt | None:
    return next((s for s in body if _binds(s, name)), None)


def _self_assigns(cls: ast.ClassDef, name: str) -> bool:
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            if (isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                    and t.value.id == "self"):
                return True
    return False


def resolve_name(path: Path, dotted: str) -> bool:
    """Whether ``dotted`` (``name``, ``Class.member``, ``Class.Inner.member``) is defined in ``path``."""
    parts = dotted.split(".")
    node = _find(_tree(path).body, parts[0])
    for part in parts[1:]:
        if not isinstance(node, ast.ClassDef):
            return False
        found = _find(node.body, part)
        if found is None and part == parts[-1] and _self_assigns(node, part):
            return True
        node = found
    return node is not None


@functools.lru_cache(maxsize=None)
def _package_index() -> dict[str, list[Path]]:
    """Classes defined in tpuoffload/, each with the files that hold one of that name."""
    classes: dict[str, list[Path]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for stmt in _tree(path).body:
            if isinstance(stmt, ast.ClassDef):
                classes.setdefault(stmt.name, []).append(path)
    return classes


def references(text: str, doc: str = "<text>") -> list[Ref]:
    """Every reference in a markdown text, continuations (``::test``) completed with their file."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    refs, last_path = [], None
    for span in _SPAN.finditer(text):
        line = text.count("\n", 0, span.start()) + 1
        if span.group(1).startswith("git "):
            continue
        for m in _REF.finditer(span.group(1)):
            if m.group("path"):
                last_path = m.group("path")
                refs.append(Ref(doc, line, m.group(0)))
            elif m.group("cont"):
                refs.append(Ref(doc, line, f"{last_path}::{m.group('cont')}" if last_path
                                else f"<no file before>::{m.group('cont')}"))
            else:
                refs.append(Ref(doc, line, m.group(0)))
    return refs


def problem(ref: Ref) -> str | None:
    """Why ``ref`` does not resolve against the tree, or None when it does."""
    m = _REF.fullmatch(ref.text)
    if m is None:
        return "not a reference"
    if m.group("owner"):
        classes = _package_index()
        owner, member = m.group("owner"), m.group("member")
        files = classes.get(owner)
        if files:
            return None if any(resolve_name(f, f"{owner}.{member}") for f in files) else \
                f"{owner} has no {member}"
        return None  # not one of ours (a vLLM class, a config key...): nothing to check
    files = resolve_path(m.group("path"))
    if not files:
        return f"no file {m.group('path')}"
    name = m.group("name")
    if name is None:
        return None
    if m.group("sep") == "::":
        name = name.replace("::", ".")
    if name[0].isdigit():
        return None
    if not any(resolve_name(f, name) for f in files):
        return f"{m.group('path')} defines no {name}"
    return None


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def broken(text: str, doc: str = "<text>") -> list[str]:
    out = []
    for ref in references(text, doc):
        why = problem(ref)
        if why:
            out.append(f"{ref.doc}:{ref.line}: `{ref.text}`: {why}")
    return out


# ---- the checks ---------------------------------------------------------------------------------

def test_every_reference_in_the_docs_resolves():
    docs = doc_files()
    assert (ROOT / "docs" / "design.md") in docs and len(docs) >= 3
    refs = [r for d in docs for r in references(d.read_text(), str(d.relative_to(ROOT)))]
    assert len(refs) > 200, len(refs)  # the scan reads the docs at all
    assert any("::" in r.text for r in refs) and any(":" in r.text.replace("::", "") for r in refs)
    bad = [f"{r.doc}:{r.line}: `{r.text}`: {why}" for r in refs if (why := problem(r))]
    assert not bad, "references that do not resolve:\n" + "\n".join(bad)


def test_design_md_invariants_each_name_a_mechanism_and_a_test():
    text = (ROOT / "docs" / "design.md").read_text()
    sections = re.split(r"^### (\d+)\. ", text, flags=re.M)[1:]
    numbers = [int(n) for n in sections[0::2]]
    assert numbers == list(range(1, 12)), numbers
    for number, body in zip(sections[0::2], sections[1::2]):
        body = body.split("\n## ")[0]
        mech = re.search(r"^\* Mechanism: (.*?)(?=^\* |\Z)", body, re.S | re.M)
        assert mech, f"invariant {number} names no mechanism"
        assert re.search(r"`[\w/]+\.py:\w", mech.group(1)), f"invariant {number}: mechanism without a path"
        assert "::" in body, f"invariant {number} names no test"


# ---- the checker fails on wrong references (its negative controls) -------------------------------

BAD = """
* Mechanism: `worker/transfer_engine.py:TransferEngine._last_write` waits.
* Tests: `test_engine_ordering.py::test_write_after_write_newest_wins`, `::test_no_such_test`;
  `test_no_such_file.py::test_x`; `manager/index.py:NoSuchClass`; `TransferEngine._no_such_member`;
  `worker/no_such_module.py`; `::test_orphan` continues the last file.
"""


def test_a_wrong_reference_fails_the_check():
    found = broken(BAD)
    assert found == [
        "<text>:2: `worker/transfer_engine.py:TransferEngine._last_write`: "
        "worker/transfer_engine.py defines no TransferEngine._last_write",
        "<text>:3: `test_engine_ordering.py::test_no_such_test`: "
        "test_engine_ordering.py defines no test_no_such_test",
        "<text>:4: `test_no_such_file.py::test_x`: no file test_no_such_file.py",
        "<text>:4: `manager/index.py:NoSuchClass`: manager/index.py defines no NoSuchClass",
        "<text>:4: `TransferEngine._no_such_member`: TransferEngine has no _no_such_member",
        "<text>:5: `worker/no_such_module.py`: no file worker/no_such_module.py",
        "<text>:5: `worker/no_such_module.py::test_orphan`: no file worker/no_such_module.py",
    ], found


GOOD = """
`worker/transfer_engine.py:TransferEngine._earlier_writes`, `TransferEngine._earlier_writes`,
`backend/slot_table.py:SlotTable._lock` (set in `__init__`), `backend/slot_table.py:SHARD_SPARE_ROWS`,
`tests/test_engine_ordering.py::test_write_after_write_newest_wins`, `::test_read_after_write_waits_for_inflight_write`,
`tests/test_hybrid_*.py`, `config/vllm.py:1585-1644`, `v1/core/sched/scheduler.py`, `KVConnectorFactory.create_connector`,
`git log -- tools/probe_pinned.py`, `runner.kv_caches`, `docs/real-engine.md`,
```
tools/no_such_tool.py:not_checked   (a command block)
```
"""


def test_right_references_pass_and_code_blocks_are_not_references():
    refs = references(GOOD)
    assert len(refs) == 10, refs
    assert broken(GOOD) == []


@pytest.mark.parametrize("text", ["`test_engine_ordering.py::test_write_after_write_newest_wins`",
                                  "`worker/programs.py:GroupPrograms`"])
def test_a_reference_breaks_when_its_target_is_renamed(text, monkeypatch, tmp_path):
    """The same reference resolves against the tree and fails once the name it points at is gone."""
    assert broken(text) == []
    rel = ("tests/" if "::" in text else "tpuoffload/") + text.strip("`").split(":")[0]
    src = (ROOT / rel).read_text()
    name = re.split(r"::?", text.strip("`"))[-1]
    fake = tmp_path / rel
    fake.parent.mkdir(parents=True)
    fake.write_text(re.sub(rf"\b{name}\b", name + "_renamed", src))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "tpuoffload")
    assert len(broken(text)) == 1
