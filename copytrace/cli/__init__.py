"""The ``copytrace`` command line: ``run``, ``report``, ``summary``, ``check``, ``diff``,
``fix``, ``export`` and ``trigger``.

Each subcommand lives in its own module (``copytrace/cli/<name>.py``) that defines
``register(subparsers)``; the parser it adds sets ``handler`` to a function
``(argparse.Namespace) -> int``. Errors a user can fix are raised as
:class:`copytrace.CopytraceError` and become one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from copytrace._errors import CopytraceError

__all__ = ["main", "console_main"]

#: Subcommands whose arguments after ``--`` are a program to run (``args.program``).
_PROGRAM_AFTER_DASHES = ("fix",)


#: reStructuredText roles in the docstrings the help reuses: ``:class:`~a.B``` -> ``B``
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def plain(text: str) -> str:
    """``text`` with the reStructuredText markup of docstrings taken out: roles
    (``:class:`copytrace.Trace``` -> ``copytrace.Trace``; with ``~``, the last name),
    double backquotes around literals, and the ``::`` that opens a literal block."""
    text = _ROLE.sub(lambda m: m[2].rsplit(".", 1)[-1] if m[1] else m[2], text)
    text = re.sub(r"``(.+?)``", r"\1", text, flags=re.S)
    return re.sub(r"(\w)::$", r"\1:", text, flags=re.M)


class _Paragraphs(argparse.HelpFormatter):
    """argparse's formatter with a description's paragraphs kept apart (argparse's own fills
    the whole description as one paragraph) and an indented block's lines kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in re.split(r"\n\s*\n", text.strip("\n")):
            lines = para.splitlines()
            if lines and all(line.startswith("    ") for line in lines):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(super()._fill_text(para, width, indent))
        return "\n\n".join(out)


class _Parser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: ``copytrace run: error: unrecognized arguments:
    --bogus (see copytrace run --help)`` on stderr and exit status 2, without the usage
    block, and help in plain text (:func:`plain`: the descriptions are the subcommands'
    docstrings). Subcommand parsers are of this class too (``add_subparsers`` passes it on)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Paragraphs)
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        return plain(super().format_help())

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """As argparse's, except that arguments no parser knows are blamed on the
        subcommand they were given to (``copytrace run``), not on ``copytrace``."""
        args = list(sys.argv[1:] if args is None else args)
        first = args[0].split("=", 1)[0] if args else ""
        if first not in ("-", "--") and first.startswith("-"):
            if not any(opt.startswith(first) for opt in self._option_string_actions):
                # argparse would only say that COMMAND is missing
                self.error(f"unrecognized arguments: {args[0]}")
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            where = self._subparser(args, args.index(extras[0]) if extras[0] in args else 0)
            where.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _subparser(self, args: list[str], at: int) -> argparse.ArgumentParser:
        """The parser of the subcommand named in ``args`` before index ``at``, or this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                named = [a for a in args[:at] if a in action.choices]
                if named:
                    return action.choices[named[0]]  # type: ignore[no-any-return]
        return self


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every subcommand registered."""
    from copytrace._version import __version__
    from copytrace.cli import check, diff, doctor, export, fix, report, run, summary, trigger

    parser = _Parser(
        prog="copytrace",
        description="Trace PyTorch tensor copies and aliases; write OpenTelemetry traces and HTML reports.",
    )
    parser.add_argument("--version", action="version", version=f"copytrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in (run, report, summary, check, diff, fix, export, doctor, trigger):
        module.register(sub)
    return parser


_SIGNED_OPTIONS = frozenset({"--max-increase"})


def _signed_values(argv: list[str]) -> list[str]:
    """``--max-increase -10%`` joined into ``--max-increase=-10%``.

    argparse reads a token that starts with ``-`` and is not a plain number as an option, so
    the space form ended in "expected one argument"; joined, the value reaches the option's own
    check, which names what is wrong with it.
    """
    out: list[str] = []
    for token in argv:
        if out and out[-1] in _SIGNED_OPTIONS and token[:1] == "-" and token[1:2].isdigit():
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    Returns:
        0 on success, 2 for a usage or input error (one line on stderr), 141
        (:data:`BROKEN_PIPE_STATUS`) when stdout's reader went away (``| head``), or the
        traced script's own exit status for ``copytrace run``.
    """
    BROKEN_PIPE[0] = False
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    program = None
    if argv[:1] and argv[0] in _PROGRAM_AFTER_DASHES and "--" in argv:
        # ``copytrace fix TRACE --verify -- python train.py --lr 1``: the program's own
        # arguments are never read as copytrace options
        cut = argv.index("--")
        argv, program = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(_signed_values(argv))
    if program is not None:
        args.program = program
    try:
        from copytrace.cli._common import check_outputs

        check_outputs(args)
        status = int(args.handler(args))
        if args.command != "run":
            sys.stdout.flush()  # a reader gone is met here, not in the interpreter's exit
        return status
    except CopytraceError as err:
        print(f"copytrace: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("copytrace: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # ``copytrace diff --json | head``: the reader left; say nothing more (as ``cat``,
        # killed by SIGPIPE, does). ``run``'s program meets its own broken pipe as untraced.
        if args.command == "run":
            raise
        BROKEN_PIPE[0] = True
        return BROKEN_PIPE_STATUS


#: Exit status after the reader of stdout went away: 128 + SIGPIPE (13), the status a shell
#: reports for a C tool killed by SIGPIPE in the same pipe.
BROKEN_PIPE_STATUS = 141
#: Set when the last :func:`main` stopped on a broken stdout pipe.
BROKEN_PIPE = [False]


#: Commands that only read traces: their process runs no program of the user's.
_READ_COMMANDS = frozenset(("report", "summary", "check", "diff", "export"))


class _NoPandas:
    """A meta-path finder that reports pandas absent. pyarrow imports pandas, when it is
    installed, the first time an array is built or turned into numpy (its pandas shim), which
    costs 0.4-0.5 s of CPU per command; the read-side commands never use pandas."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def skip_pandas(argv: Sequence[str]) -> None:
    """Make pandas unimportable in this process when ``argv`` is a read-side command on the
    embedded engine (Spark's client needs pandas; ``run`` and ``fix`` run the user's
    program, which may), and take Arrow's memory from the C library's allocator there."""
    if argv[:1] and argv[0] in _READ_COMMANDS and not any("spark" in a for a in argv):
        if "pandas" not in sys.modules and _NoPandas not in sys.meta_path:
            sys.meta_path.insert(0, _NoPandas)  # type: ignore[arg-type]
        _system_pool()


def _system_pool() -> None:
    """Arrow's buffers from the C library's allocator, whose freed memory the report gives
    back (``malloc_trim``) before DuckDB builds its tables: with mimalloc, Arrow's default,
    what the hazard analysis freed stayed in the process, in the peak with DuckDB's tables
    (``docs/scale.md``; the same user CPU, less system time)."""
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())


def console_main() -> None:
    """Entry point of the ``copytrace`` console script.

    When ``copytrace run``'s program ended with an unhandled KeyboardInterrupt, the process
    ends the way python's own does: killed by SIGINT (status 130 in a shell).
    """
    from copytrace.cli import run

    skip_pandas(sys.argv[1:])
    status = main()
    if BROKEN_PIPE[0]:
        # stdout's buffer would be flushed into the closed pipe at exit: a second
        # BrokenPipeError, printed by the interpreter ("Exception ignored ...")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    if run.INTERRUPTED[0] and status == 130 and hasattr(signal, "SIGINT"):
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(status)
