"""A griffe extension for the reference site (mkdocs.yml loads it into mkdocstrings).

qkov's docstrings are Google style with Sphinx roles (:class:`Weights`, :func:`~qkov.load`,
:mod:`qkov.io`), which Markdown would show as ":class:" before the name. Each role becomes inline
code; a name that ``qkov.__all__`` exports (read from the source, so the site never imports the
package) also links to its entry in the API reference. A reST literal-block marker (a paragraph
ending in ``::``) becomes a colon.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

INIT = Path(__file__).resolve().parents[2] / "src" / "qkov" / "__init__.py"
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`<]*?)(?:\s*<([^>`]+)>)?`")
LITERAL = re.compile(r"(\S)::$", re.M)


def exported() -> set[str]:
    """The names in ``qkov.__all__``, read from src/qkov/__init__.py without importing it."""
    for node in ast.walk(ast.parse(INIT.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return set(ast.literal_eval(node.value))
    return set()


def rewrite(text: str, public: set[str]) -> str:
    """``text`` with every Sphinx role as Markdown: code, linked when qkov exports the name."""

    def one(m: re.Match[str]) -> str:
        tilde, label, target = m.group(1), m.group(2).strip(), (m.group(3) or m.group(2)).strip()
        shown = label.rsplit(".", 1)[-1] if tilde else label  # ~a.b.C shows C, as in Sphinx
        name = target.removeprefix("qkov.").removesuffix("()")
        if name in public:
            return f"[`{shown}`][qkov.{name}]"
        return f"`{shown}`"

    return LITERAL.sub(r"\1:", ROLE.sub(one, text))


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring griffe loads (modules, classes, functions, attributes)."""

    def __init__(self) -> None:
        super().__init__()
        self.public = exported()

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value, self.public)
