"""The package's shape, checked: dependencies point one way, files and functions stay small,
imports sit at the top, library errors name no command-line flags, comments point inside the
repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "qkov"
# each package may import only itself and the packages before it (docs/dev/architecture.md, "The packages, in their order")
ORDER = ["errors", "finite", "progress", "version", "device", "ranks", "model", "expect", "io", "weights", "analysis", "training", "apps", "show"]
# inside analysis/: the support modules at its top level, then one sub-package per concept; a
# sub-package imports only itself and those of a lower rank (paths and heads share one: neither
# imports the other)
ANALYSIS_RANK = {"": 0, "forward": 1, "circuits": 2, "paths": 3, "heads": 3, "causal": 4, "discovery": 5, "series": 6}
OPTIONAL = {"transformers", "transformer_lens", "huggingface_hub", "plotly"}  # imported only where used
# one idea per file: a concept is not split to meet a cap, and no file grows past this ceiling
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS: dict[str, str] = {}  # "module:function" -> why it may be longer (none today)


def modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py"))


def package_of(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def imported_qkov_modules(path: Path) -> set[tuple[str, ...]]:
    """The qkov modules a module imports, as paths inside the package (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                target = base + (node.module.split(".") if node.module else [])
                if not target:  # "from .. import x" at the top: x is a package
                    target = [node.names[0].name]
            elif node.module and node.module.startswith("qkov"):
                target = node.module.split(".")[1:] or [node.names[0].name]
            else:
                continue
            if target:
                out.add(tuple(target))
    return out


def imported_qkov_packages(path: Path) -> set[str]:
    """The top-level qkov packages a module imports."""
    return {target[0] for target in imported_qkov_modules(path)}


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_dependencies_point_one_way(path: Path) -> None:
    if path.parent == SRC and path.name in ("__init__.py", "__main__.py"):
        return  # the public API and the entry point gather everything
    mine = ORDER.index(package_of(path))
    for pkg in imported_qkov_packages(path):
        assert ORDER.index(pkg) <= mine, f"{path.relative_to(SRC)} imports qkov.{pkg}, which comes later"


def analysis_part(target: tuple[str, ...]) -> str:
    """The sub-package of ``analysis`` that a module path inside the package is in ("" for analysis/
    itself and the support modules at its top)."""
    return target[1] if len(target) > 1 and (SRC / "analysis" / target[1]).is_dir() else ""


@pytest.mark.parametrize("path", [p for p in modules() if package_of(p) == "analysis"], ids=lambda p: str(p.relative_to(SRC)))
def test_analysis_sub_packages_point_one_way(path: Path) -> None:
    rel = path.relative_to(SRC).with_suffix("").parts
    if rel == ("analysis", "__init__"):
        return  # the package's public names gather its sub-packages
    mine = analysis_part(rel)
    assert mine in ANALYSIS_RANK, f"{'/'.join(rel)}: analysis/{mine} is not in ANALYSIS_RANK"
    for target in imported_qkov_modules(path):
        if target[0] != "analysis" or len(target) < 2:
            continue
        theirs = analysis_part(target)
        if theirs == mine:
            continue
        assert ANALYSIS_RANK[theirs] < ANALYSIS_RANK[mine], f"{'/'.join(rel)} imports analysis/{theirs}, which is not below it"


def module_file(target: tuple[str, ...]) -> Path | None:
    """The file of a module path inside the package (a package: its ``__init__.py``), if there is one."""
    base = SRC.joinpath(*target)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def declared_all(path: Path) -> list[str] | None:
    """The module's ``__all__`` (a literal list at its top level), or ``None`` when it declares none."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            return list(ast.literal_eval(node.value))
    return None


def target_of(path: Path, node: ast.ImportFrom) -> tuple[str, ...] | None:
    """The qkov module an ``import from`` reads (relative imports resolved); ``None`` outside qkov."""
    if node.level:
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        return tuple(parts[: len(parts) - node.level] + (node.module.split(".") if node.module else []))
    if node.module and node.module.split(".")[0] == "qkov":
        return tuple(node.module.split(".")[1:])
    return None


def names_read_from_other_packages(path: Path) -> list[tuple[tuple[str, ...], str, int]]:
    """``(module, name, line)`` for every name this module reads from a module of another top-level
    package: imported by name (``from ..analysis.x import name``) or read as an attribute of a module
    it imported (``from ..analysis import x as X`` ... ``X.name``)."""
    tree = ast.parse(path.read_text())
    mine = package_of(path) if path.relative_to(SRC) != Path("__init__.py") else None
    out, aliases = [], {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        target = target_of(path, node)
        if not target or target[0] == mine:
            continue
        for alias in node.names:
            if module_file((*target, alias.name)) is not None:  # a module, not a name: its attributes are read below
                aliases[alias.asname or alias.name] = (*target, alias.name)
            else:
                out.append((target, alias.name, node.lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            target = aliases[node.value.id]
            if module_file((*target, node.attr)) is None:
                out.append((target, node.attr, node.lineno))
    return out


PUBLIC_FACING = [p for p in modules() if package_of(p) in ("apps", "show") or p == SRC / "__init__.py"]


@pytest.mark.parametrize("path", PUBLIC_FACING, ids=lambda p: str(p.relative_to(SRC)))
def test_apps_and_show_read_only_public_names_of_the_layers_below(path: Path) -> None:
    """Public is what a module's ``__all__`` lists: the apps, the notebook layer and ``import qkov`` read
    another package only through it (a name without an underscore is not public by that alone)."""
    private = []
    for target, name, line in names_read_from_other_packages(path):
        listed = declared_all(module_file(target))  # type: ignore[arg-type]
        if listed is None or name not in listed:
            private.append(f"line {line}: {'.'.join(target)}.{name}")
    assert not private, f"{path.relative_to(SRC)} reads names that are not in their module's __all__: {private}"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_every_module_declares_its_public_names(path: Path) -> None:
    listed = declared_all(path)
    assert listed is not None, f"{path.relative_to(SRC)} declares no __all__"
    tree = ast.parse(path.read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    lazy = {"dynamics", "show"} if path == SRC / "__init__.py" else set()  # loaded on first use
    missing = [name for name in listed if name not in defined | imported | lazy]
    assert not missing, f"{path.relative_to(SRC)}: __all__ lists names it does not have: {missing}"
    assert not [n for n in listed if n.startswith("_") and n != "__version__"], "__all__ lists a private name"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_files_and_functions_are_small(path: Path) -> None:
    text = path.read_text()
    assert text.count("\n") <= MAX_FILE_LINES, f"{path.name}: {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            key = f"{path.relative_to(SRC).with_suffix('')}:{node.name}"
            if key not in LONG_FUNCTIONS:
                assert length <= MAX_FUNCTION_LINES, f"{key} is {length} lines"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_at_the_top(path: Path) -> None:
    """Only optional heavy libraries (and ctypes-free stdlib) are imported inside functions."""
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {"qkov" if node.level else (node.module or "").split(".")[0]}
            else:
                continue
            assert names <= OPTIONAL, f"{path.relative_to(SRC)}:{fn.name} imports {names} inside a function"


def test_the_library_never_imports_the_command_line_nor_names_its_flags() -> None:
    flag = re.compile(r"QkovError\([^)]*?--[a-z]", re.S)
    for path in modules():
        rel = path.relative_to(SRC)
        if rel.parts[:2] == ("apps", "cli") or path.name == "__main__.py":
            continue
        assert not [m for m in imported_qkov_modules(path) if m[:2] == ("apps", "cli")], f"{rel} imports the CLI"
        assert not flag.search(path.read_text()), f"{rel}: a library error names a command-line flag"


def test_comments_point_inside_the_repository() -> None:
    root = SRC.parents[1]
    outside = "SPEC" + ".md"  # the project's notes outside the repository
    for path in [*modules(), *root.joinpath("tests").glob("*.py"), *root.joinpath("benchmarks").glob("*.py")]:
        assert outside not in path.read_text(), path
    for ref in sorted({m for p in modules() for m in re.findall(r"docs/[\w.-]+\.md", p.read_text())}):
        assert (root / ref).is_file(), f"{ref} is referred to but missing"
