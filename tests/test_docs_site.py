"""The reference site: ``mkdocs build --strict`` (no broken link or anchor, no griffe warning about
a docstring, no page left out of the navigation), every name in ``qkov.__all__`` documented on the
API pages from a docstring, every module that declares ``__all__`` on an API page with each of its
names (the pages written by scripts/docs/api_pages.py, which must be up to date), the Sphinx roles of
the docstrings rendered (never shown raw), the home page and the example notebooks present. Builds
the site once, into a temporary directory (~10 s)."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import griffe
import nbformat
import pytest

import qkov

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "docs"))
import api_pages  # noqa: E402  (writes the API pages, a script)
from roles import exported, rewrite  # noqa: E402  (the site's griffe extension, a script)

API = ROOT / "docs" / "api"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert "No module named mkdocs" not in log, "mkdocs is not installed: pip install -e '.[docs]'"
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0 and not warnings, "mkdocs build --strict failed:\n" + "\n".join(warnings or [log])
    return out


def api_html(site: Path) -> dict[str, str]:
    return {p.parent.name: p.read_text(encoding="utf-8") for p in (site / "api").glob("*/index.html")}


def test_every_public_name_is_on_an_api_page(site: Path) -> None:
    pages = api_html(site)
    missing = [n for n in qkov.__all__ if not any(f'id="qkov.{n}"' in text for text in pages.values())]
    assert not missing, f"not documented: add '::: qkov.NAME' for {missing} to a page in docs/api/ (e.g. qkov.md)"


def test_the_api_pages_are_up_to_date(capsys: pytest.CaptureFixture[str]) -> None:
    """A module added, renamed or given an ``__all__`` since the pages were written fails here."""
    stale = api_pages.main(["--check"])
    assert stale == 0, f"rerun python3 scripts/docs/api_pages.py:\n{capsys.readouterr().out}"


def test_every_module_with_all_is_on_an_api_page_with_its_names(site: Path) -> None:
    """Each name of every module's ``__all__`` has its entry, under the module's path or where it is
    defined (a package documents a name once, at the module that defines it)."""
    ids = {i for text in api_html(site).values() for i in re.findall(r'id="(qkov[\w.]*)"', text)}
    package = griffe.load("qkov", search_paths=[str(ROOT / "src")])
    modules = [m for m in api_pages.public_modules() if m != "qkov"]  # qkov: the test above
    assert len(modules) >= 40, modules  # the walk found the package
    missing = []
    for module in modules:
        came_from = api_pages.origins(module) if api_pages.module_path(module).name == "__init__.py" else {}
        for name in api_pages.all_names(api_pages.module_path(module)) or []:
            where = {f"{module}.{name}", package[module.removeprefix("qkov.")][name].canonical_path}
            where.add(f"{came_from.get(name)}.{name}")
            if not where & ids:
                missing.append(f"{module}.{name}")
    assert not missing, f"not on an API page: {missing}"


def test_every_public_name_has_a_docstring() -> None:
    """What the site renders: griffe's view of the source (the names resolved to their definitions)."""
    package = griffe.load("qkov", search_paths=[str(ROOT / "src")])
    bare = [n for n in qkov.__all__ if not (package[n].docstring and package[n].docstring.value.strip())]
    assert not bare, f"public names without a docstring: {bare}"


def test_the_extension_reads_the_same_public_names_as_the_package() -> None:
    assert exported() == set(qkov.__all__)


def test_sphinx_roles_become_code_and_links() -> None:
    public = {"Weights", "load"}
    assert rewrite(":class:`Weights` view", public) == "[`Weights`][qkov.Weights] view"
    assert rewrite("see :func:`~qkov.load`", public) == "see [`load`][qkov.load]"
    # a path inside a subpackage is code only: its page may not document it, and a link nowhere fails --strict
    assert rewrite("see :func:`~qkov.io.checkpoint.load`", public) == "see `load`"
    assert rewrite(":mod:`qkov.analysis.paths`", public) == "`qkov.analysis.paths`"
    both = rewrite(":meth:`~Session.run` and :attr:`PathSummary.coverage`", public)
    assert both == "`run` and `PathSummary.coverage`"
    assert rewrite(":class:`the view <qkov.Weights>`", public) == "[`the view`][qkov.Weights]"
    assert rewrite("as below::\n\n    x = 1", public) == "as below:\n\n    x = 1"


def test_no_raw_role_on_the_site(site: Path) -> None:
    raw = re.compile(r":(class|func|meth|mod|attr|data|exc):<code>|:(class|func|meth|mod|attr|data|exc):`")
    shown = {name: raw.findall(text)[:3] for name, text in api_html(site).items() if raw.search(text)}
    assert not shown, f"Sphinx roles shown raw on the API pages: {shown}"


def test_home_page_is_the_readme(site: Path) -> None:
    page = (site / "index.html").read_text(encoding="utf-8")
    first_heading = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("## "))
    assert html.escape(first_heading[3:], quote=False) in page
    assert 'href="conventions/' in page, "README's docs/ links are not made relative to the site"


@pytest.mark.parametrize("notebook", sorted((ROOT / "examples").glob("*.ipynb")), ids=lambda p: p.name)
def test_every_example_notebook_is_a_page(site: Path, notebook: Path) -> None:
    page = site / "examples" / notebook.stem / "index.html"
    assert page.is_file(), f"no page for {notebook.name}"
    text = html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8")))
    cells = nbformat.read(notebook, as_version=4).cells
    for cell in [c for c in cells if c.cell_type == "code"][:3]:
        line = next(x for x in cell.source.splitlines() if x.strip())
        assert line.strip() in text, f"{notebook.name}: code line {line!r} not on its page"


def test_user_guide_pages_are_all_in_the_navigation() -> None:
    """mkdocs --strict warns of a page outside the nav (validation.omitted_files); this names them."""
    config = (ROOT / "mkdocs.yml").read_text()
    guide = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [g for g in guide if g not in config] == [], "add these docs/ pages to mkdocs.yml's nav"
    assert [p.name for p in API.glob("*.md") if f"api/{p.name}" not in config] == [], "add these API pages to the nav"
