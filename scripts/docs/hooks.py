"""mkdocs hooks for the reference site (mkdocs.yml names this file).

* README.md is the home page (``index.md``): its links into ``docs/`` are made relative to the
  site, so the same file reads well on a repository host and on the site.
* CHANGELOG.md is a page of the same name (README links to it at the repository root).
* Each example notebook (``examples/*.ipynb``) becomes a page ``examples/NAME.md``, converted
  by nbconvert's Markdown exporter (nbconvert is already a test dependency; a notebook plugin
  would bring its own Jupyter stack and execute or re-render at every build). The notebooks are
  stored without outputs (the test suite executes them), so the pages show the code and the
  prose, with a line saying how to run them.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbconvert
import nbformat
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
# a Markdown link target that points into docs/ (README is written for the repository root)
DOCS_LINK = re.compile(r"\]\(docs/")


def home_page() -> str:
    """README.md with its ``docs/X.md`` links made relative to the site's root."""
    return DOCS_LINK.sub("](", (ROOT / "README.md").read_text(encoding="utf-8"))


def notebook_page(path: Path) -> str:
    """One notebook as a Markdown page: its cells, in order (markdown as is, code fenced)."""
    body, _ = nbconvert.MarkdownExporter().from_notebook_node(nbformat.read(path, as_version=4))
    run = (
        f"!!! note \"Run it\"\n    `pip install -e '.[notebook]' && jupyter lab examples/{path.name}`: "
        "the notebook as stored has no outputs; its cells run in the test suite.\n\n"
    )
    title, _, rest = body.partition("\n")
    if title.startswith("# "):
        return f"{title}\n\n{run}{rest}"
    return f"# {path.stem}\n\n{run}{body}"


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "index.md", content=home_page()))
    files.append(File.generated(config, "CHANGELOG.md", content=(ROOT / "CHANGELOG.md").read_text(encoding="utf-8")))
    for nb in sorted((ROOT / "examples").glob("*.ipynb")):
        files.append(File.generated(config, f"examples/{nb.stem}.md", content=notebook_page(nb)))
    return files
