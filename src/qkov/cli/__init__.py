"""The ``qkov`` command line: parse, call the public API, print. Nothing else lives here.

User mistakes (:class:`qkov.QkovError`, bad options) print one line and exit 2.
Commands live in ``train_cmds`` (train, info), ``analysis_cmds`` (circuits, paths,
heads, trigrams), ``report_cmds`` (report, tour) and ``interop_cmds`` (import, export).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..errors import QkovError
from .analysis_cmds import _add_circuits, _add_heads, _add_paths, _add_trigrams
from .common import EXIT_USAGE, _Parser
from .interop_cmds import _add_export, _add_import
from .report_cmds import _add_report, _add_tour
from .train_cmds import _add_info, _add_train, checkpoint_info

__all__ = ["build_parser", "checkpoint_info", "main"]


# ---------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(
        prog="qkov",
        description="Transformer circuits as software: train small transformers and take them apart "
        "into QK/OV circuits, paths and induction heads.",
    )
    parser.add_argument("--version", action="version", version=f"qkov {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_train(sub)
    _add_info(sub)
    _add_circuits(sub)
    _add_paths(sub)
    _add_heads(sub)
    _add_trigrams(sub)
    _add_report(sub)
    _add_tour(sub)
    _add_import(sub)
    _add_export(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except QkovError as exc:
        sys.stderr.write(f"qkov: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("qkov: interrupted (a run continues from its last checkpoint with --resume)\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
