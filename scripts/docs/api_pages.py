"""Writes the API reference pages: one page per package of src/qkov, listing every module of it that
declares ``__all__`` (``::: qkov.pkg.module``), the index of those pages, and the API section of
mkdocs.yml's navigation. Rerun it after a module is added, renamed or given an ``__all__``:

    python3 scripts/docs/api_pages.py          # rewrite docs/api/ and the nav
    python3 scripts/docs/api_pages.py --check  # exit 1, naming the files, if they are out of date

``qkov`` itself (``import qkov``: the names a user reaches for) has a page written by hand,
docs/api/qkov.md, which this script leaves alone. Pages follow the packages' order, the one
tests/test_layout.py enforces (``ORDER``, and ``ANALYSIS_RANK`` inside ``analysis``); the script
reads the source and that test with ``ast`` and imports neither.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roles import exported, rewrite  # noqa: E402  (the site's griffe extension: roles as Markdown)

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
API = ROOT / "docs" / "api"
MKDOCS = ROOT / "mkdocs.yml"
LAYOUT_TEST = ROOT / "tests" / "test_layout.py"
HAND_WRITTEN = {"qkov.md"}
MARK = "<!-- written by scripts/docs/api_pages.py from the docstrings: edit those, then rerun it -->"
NAV_HEAD = "  - API reference:"
PUBLIC = exported()


@dataclass
class Page:
    """One page: a package (``qkov.analysis.circuits``) and its modules that declare ``__all__``."""

    package: str
    file: str
    modules: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # the package's own names no module below documents


def all_names(path: Path) -> list[str] | None:
    """The module's ``__all__`` (None when it declares none)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and value is not None:
            return list(ast.literal_eval(value))
    return None


def declares_all(path: Path) -> bool:
    """Whether the module assigns ``__all__`` at its top level."""
    return all_names(path) is not None


def origins(package: str) -> dict[str, str]:
    """Where each name a package imports into its ``__init__`` comes from (a dotted module)."""
    out = {}
    for node in ast.parse(module_path(package).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                out[alias.asname or alias.name] = source
    return out


def summary(path: Path) -> str:
    """The first sentence of a module's docstring, on one line ("" when it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    first = re.split(r"(?<=[^.][^.]\.)\s+(?=[A-Z])", first, maxsplit=1)[0].rstrip(".")
    return rewrite(first, PUBLIC).replace("``", "`").replace("|", "\\|")


def public_modules() -> list[str]:
    """Every module under src/qkov that declares ``__all__``, dotted (a package by its own name)."""
    out = []
    for path in sorted((SRC / "qkov").rglob("*.py")):
        if declares_all(path):
            parts = path.relative_to(SRC).with_suffix("").parts
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def layout_order() -> tuple[list[str], dict[str, int]]:
    """``ORDER`` and ``ANALYSIS_RANK`` from tests/test_layout.py (the packages' tested order)."""
    found: dict[str, object] = {}
    for node in ast.parse(LAYOUT_TEST.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("ORDER", "ANALYSIS_RANK"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    return list(found.get("ORDER", [])), dict(found.get("ANALYSIS_RANK", {}))  # type: ignore[call-overload]


def package_of(module: str) -> str:
    """The package whose page lists ``module``: its own for a package, ``qkov`` for a top-level file."""
    path = SRC.joinpath(*module.split("."))
    return module if path.is_dir() else module.rsplit(".", 1)[0]


def page_key(package: str, order: list[str], rank: dict[str, int]) -> tuple:
    parts = package.split(".")[1:]
    top = order.index(parts[0]) if parts and parts[0] in order else (-1 if not parts else len(order))
    sub = (-1, 0)
    if parts[:1] == ["analysis"] and len(parts) > 1 and parts[1] in rank:
        sub = (rank[parts[1]], list(rank).index(parts[1]))  # ties as the test lists them
    return (top, sub, package)


def pages() -> list[Page]:
    """The generated pages, in the packages' order; modules in each by file name."""
    order, rank = layout_order()
    by_package: dict[str, Page] = {}
    for module in public_modules():
        if module == "qkov":
            continue  # docs/api/qkov.md, written by hand
        package = package_of(module)
        name = "core" if package == "qkov" else package.removeprefix("qkov.").replace(".", "-")
        page = by_package.setdefault(package, Page(package, f"{name}.md"))
        if module != package:
            page.modules.append(module)
    documented = set(public_modules())
    for page in by_package.values():
        if page.package != "qkov":
            came_from = origins(page.package)
            names = all_names(module_path(page.package)) or []
            page.names = [n for n in names if came_from.get(n) not in documented]
    return [by_package[p] for p in sorted(by_package, key=lambda p: page_key(p, order, rank))]


def module_path(module: str) -> Path:
    path = SRC.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def directive(path: str) -> list[str]:
    """``::: path`` with the options of an entry of its own (undocumented names shown too; a module that
    lists a dunder name such as ``__version__`` in its ``__all__`` shows its dunder names)."""
    lines = [f"::: {path}", "    options:", "      heading_level: 2", "      show_if_no_docstring: true"]
    file = module_path(path)
    if file.is_file() and any(n.startswith("__") for n in all_names(file) or []):
        lines.append('      filters: ["!^_[^_]"]')
    return lines + [""]


def page_text(page: Page) -> str:
    title = "`qkov`: the top-level modules" if page.package == "qkov" else f"`{page.package}`"
    lines = [f"# {title}", "", MARK, ""]
    if page.package != "qkov":
        # the package's docstring as the page's introduction, then the names it gives that no module
        # below documents (defined in it, or imported from a module without an ``__all__`` of its own);
        # the others are documented once, where they are defined
        lines += [f"::: {page.package}", "    options:", "      show_root_heading: false", "      heading_level: 2"]
        lines += ["      show_if_no_docstring: true"]
        # a name that is also a submodule's (``report.collect``) would render as the module: it gets
        # its own entry, under the path it is defined at
        came_from = origins(page.package)
        shadowed = [n for n in page.names if module_path(f"{page.package}.{n}").is_file()]
        plain = [n for n in page.names if n not in shadowed]
        lines += ["      members:"] + [f"        - {n}" for n in plain] if plain else ["      members: false"]
        lines.append("")
        for n in shadowed:
            lines += directive(f"{came_from[n]}.{n}")
    if page.modules:
        lines += ["| module | what it holds |", "|---|---|"]
        lines += [f"| [{m.rsplit('.', 1)[1]}](#{m}) | {summary(module_path(m))} |" for m in page.modules]
        lines.append("")
    for module in page.modules:
        lines += directive(module)
    return "\n".join(lines).rstrip() + "\n"


def index_text(all_pages: list[Page]) -> str:
    lines = [
        "# API reference",
        "",
        MARK,
        "",
        "Every entry is rendered from the docstring in the source. Shapes are written in brackets,",
        "`[batch, seq, d_vocab]`, in the row convention of [Conventions](../conventions.md). Most work",
        "needs only [`qkov`](qkov.md), the names `import qkov` gives; the pages after it document every",
        "module that declares `__all__`, package by package, in the order the packages import each other",
        "([Architecture](../dev/architecture.md)).",
        "",
        "| page | what it holds |",
        "|---|---|",
        "| [qkov](qkov.md) | the names a user reaches for: models, checkpoints, the weights views, the analysis "
        "forward, probes, interventions, training |",
    ]
    for page in all_pages:
        what = summary(module_path(page.package)) if page.package != "qkov" else "the modules at the package's top"
        name = "qkov (top-level modules)" if page.package == "qkov" else page.package
        lines.append(f"| [{name}]({page.file}) | {what} |")
    return "\n".join(lines) + "\n"


def nav_text(all_pages: list[Page]) -> list[str]:
    lines = [NAV_HEAD, "      - Overview: api/index.md", "      - qkov: api/qkov.md"]
    for page in all_pages:
        label = "qkov (top-level modules)" if page.package == "qkov" else page.package
        lines.append(f"      - {label}: api/{page.file}")
    return lines


def mkdocs_with_nav(text: str, all_pages: list[Page]) -> str:
    """mkdocs.yml with the lines of its API section replaced (up to the next top-level nav entry)."""
    lines = text.split("\n")
    start = lines.index(NAV_HEAD)
    end = start + 1
    while end < len(lines) and lines[end].startswith("      "):
        end += 1
    return "\n".join(lines[:start] + nav_text(all_pages) + lines[end:])


def wanted() -> dict[Path, str]:
    """Every file this script owns, with the text it should have."""
    all_pages = pages()
    out = {API / p.file: page_text(p) for p in all_pages}
    out[API / "index.md"] = index_text(all_pages)
    out[MKDOCS] = mkdocs_with_nav(MKDOCS.read_text(encoding="utf-8"), all_pages)
    return out


def stale_pages() -> list[Path]:
    """Generated pages on disk that no package produces any more (a package renamed or removed)."""
    keep = set(wanted()) | {API / name for name in HAND_WRITTEN}
    return sorted(p for p in API.glob("*.md") if p not in keep and MARK in p.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say whether the files are up to date")
    args = parser.parse_args(argv)
    changed = [p for p, text in wanted().items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
    stale = stale_pages()
    if args.check:
        for p in changed + stale:
            print(f"out of date: {p.relative_to(ROOT)}")
        return 1 if changed or stale else 0
    for p, text in wanted().items():
        if p in changed:
            p.write_text(text, encoding="utf-8")
            print(f"wrote {p.relative_to(ROOT)}")
    for p in stale:
        p.unlink()
        print(f"removed {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
