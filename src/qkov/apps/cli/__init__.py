"""The ``qkov`` command line: parse, call the public API, print. Nothing else lives here.

User mistakes (:class:`qkov.QkovError`, bad options) print one line and exit 2; a library
error's hint becomes the command line's advice (:data:`common.HINT_ADVICE`); a
:class:`qkov.errors.QkovWarning` prints as one line ``qkov: warning: ...`` and the command goes on. An allocation that
fails anyway (the analyses plan their memory first; this is the backstop) is one line too. Commands live in
``train_cmds`` (train), ``info_cmds`` (info), ``weights_cmds`` (circuits, trigrams), ``behaviour_cmds`` (paths,
heads), ``report_cmds`` (report, tour), ``architecture_cmds``
(architectures), ``dynamics_cmds`` (dynamics), ``ablate_cmds`` (ablate), ``patch_cmds`` (patch),
``circuit_cmds`` (circuit), ``interop_cmds`` (import, export) and ``explore_cmds`` (explore: the web server,
whose libraries it alone imports).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Sequence

from ...device import set_memory_budget
from ...errors import QkovError, QkovWarning
from ...version import __version__
from .behaviour_cmds import add_heads, add_paths
from .ablate_cmds import add_ablate
from .architecture_cmds import add_architectures
from .dynamics_cmds import add_dynamics
from .circuit_cmds import add_circuit
from .explore_cmds import add_explore
from .common import EXIT_USAGE, Parser, error_line, out_of_memory_line, show_warning
from .interop_cmds import add_export, add_import
from .patch_cmds import add_patch
from .report_cmds import add_report, add_tour
from .info_cmds import add_info
from .train_cmds import add_train
from .weights_cmds import add_circuits, add_trigrams

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="qkov",
        description="Transformer circuits as software: train small transformers and take them apart "
        "into QK/OV circuits, paths and induction heads.",
    )
    parser.add_argument("--version", action="version", version=f"qkov {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for add in (add_train, add_info, add_circuits, add_paths, add_heads, add_trigrams, add_report, add_tour, add_architectures):
        add(sub)
    for add in (add_dynamics, add_ablate, add_patch, add_circuit):
        add(sub)
    add_import(sub)
    add_export(sub)
    add_explore(sub)
    return parser


EXIT_BROKEN_PIPE = 141
"""The status of a command whose output's reader closed it: what a shell reports for a process ended by SIGPIPE."""


def _silence_stdout() -> None:
    """Point stdout at the null device, so the interpreter's last flush at exit does not fail on the
    closed pipe again (and print a traceback)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): nothing to flush
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        with warnings.catch_warnings():  # qkov's warnings print as one line each (restored on return)
            warnings.simplefilter("always", QkovWarning)
            warnings.showwarning = show_warning
            rc = int(args.func(args) or 0)
            sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
            return rc
    except QkovError as exc:
        sys.stderr.write(error_line(exc))
        return EXIT_USAGE
    except (MemoryError, RuntimeError) as exc:  # the backstop: work is planned to fit before it starts
        line = out_of_memory_line(exc, args.command)
        if line is None:
            raise  # any other RuntimeError is a bug: it keeps its traceback
        sys.stderr.write(line)
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("qkov: interrupted (a run continues from its last checkpoint with --resume)\n")
        return 130
    except BrokenPipeError:  # the reader of the output went away (`qkov heads --json | head -1`): end quietly
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    finally:
        set_memory_budget(None)  # --max-memory is one command's: it never outlives it in this process


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
