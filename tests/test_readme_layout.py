"""The "Layout" section of docs/dev/architecture.md (the contributors' page; the README links to it)
against the tree, both ways: every module under src/qkov and every page of docs/ is listed, and
everything listed exists.

The section's code block is one entry per line: a name (``x.py``, ``x.md``, ``folder/``) indented two
spaces per folder level, then its description; a description that wraps continues on lines indented
past ``NAME_COLUMN_MAX``. A package's ``__init__.py`` is listed by its folder, except the top one
(the public API), which is listed by name."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "src/qkov/"
NAME_COLUMN_MAX = 12  # names start at most this far in (four folder levels); continuations further
ENTRY = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")
ARCHITECTURE = ROOT / "docs" / "dev" / "architecture.md"


def layout_block(page: str) -> list[str]:
    section = page.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```\n(.*?)^```", section, re.S | re.M)
    assert match, "docs/dev/architecture.md's Layout section has no code block"
    return match.group(1).splitlines()


def listed(lines: list[str]) -> list[str]:
    """The paths the block names, relative to the repository root (folders end in '/')."""
    out: list[str] = []
    folders: list[tuple[int, str]] = []  # (indent, name) of the folders that enclose the next line
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent > NAME_COLUMN_MAX:
            continue  # blank, or a description's continuation
        name = line.split()[0]
        assert ENTRY.match(name) and indent % 2 == 0, f"layout: {line.strip()!r} is not 'name  description'"
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = "".join(f for _, f in folders) + name
        out.append(path)
        if name.endswith("/"):
            folders.append((indent, name))
    return out


def modules_in_tree() -> set[str]:
    """Every module, as the layout names it: a subpackage's __init__.py by its folder."""
    out = set()
    for path in (ROOT / PACKAGE).rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" and path.parent != ROOT / PACKAGE:
            rel = rel.removesuffix("__init__.py")
        out.add(rel)
    return out


def test_parser_reads_nesting_and_continuations() -> None:
    block = [
        "src/qkov/",
        "  a.py        one",
        "              more words.py",  # a continuation: not an entry, though it ends in .py
        "  m/          x",
        "    b.py      y",
        "docs/",
        "  c.md  z",
    ]
    want = ["src/qkov/", "src/qkov/a.py", "src/qkov/m/", "src/qkov/m/b.py", "docs/", "docs/c.md"]
    assert listed(block) == want


def test_every_module_is_listed_and_every_listed_path_exists() -> None:
    paths = listed(layout_block(ARCHITECTURE.read_text(encoding="utf-8")))
    in_package = {p for p in paths if p.startswith(PACKAGE) and (p.endswith(".py") or p.endswith("/"))}
    in_package = {p for p in in_package if p.endswith(".py") or (ROOT / p / "__init__.py").is_file()}
    add = sorted(modules_in_tree() - in_package - {PACKAGE})
    remove = sorted(p for p in paths if not (ROOT / p).exists())
    guide = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    add += sorted(guide - set(paths))
    assert not add and not remove, (
        "docs/dev/architecture.md's Layout section is out of date:"
        + (f"\n  add (in the tree, not listed): {', '.join(add)}" if add else "")
        + (f"\n  remove (listed, not in the tree): {', '.join(remove)}" if remove else "")
    )


def test_no_path_is_listed_twice() -> None:
    paths = listed(layout_block(ARCHITECTURE.read_text(encoding="utf-8")))
    assert sorted({p for p in paths if paths.count(p) > 1}) == []


def test_the_readme_links_to_the_layout() -> None:
    """The README keeps no copy of the layout (one list, checked above), only the way to it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/dev/architecture.md" in readme
    assert "\n## Layout\n" not in readme
