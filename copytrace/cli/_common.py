"""Pieces the trace-reading subcommands (``report``, ``summary``, ``check``) share."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "add_group_by", "add_trace_command", "check_outputs", "select_runs", "warn_unreadable",
]  # fmt: skip

#: Per subcommand, the options that name something it writes: ``(attribute, flag, folder)``;
#: ``folder`` is True when the value is itself the folder written into (else its parent is).
#: (``run -o`` is checked by ``run`` itself, with the settings.)
OUTPUTS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "report": (("output", "-o", False),),
    "diff": (("output", "-o", False),),
    "export": (
        ("parquet", "--parquet", False), ("chrome_trace", "--chrome-trace", False),
        ("dataset", "--dataset", True),
    ),
}  # fmt: skip


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, an output whose folder cannot be created or written to.

    Raises:
        CopytraceError: ``-o /sys/r.html: output directory /sys is not writable (...)``.
    """
    from copytrace._env import unwritable
    from copytrace._errors import CopytraceError

    # the subcommand, by its handler's module (``run``'s ``command`` is the program's argv)
    command = getattr(getattr(args, "handler", None), "__module__", "").rpartition(".")[2]
    for attr, flag, folder in OUTPUTS.get(command, ()):
        value = getattr(args, attr, None)
        if not value:
            continue
        path = Path(value)
        if folder and path.exists() and not path.is_dir():
            raise CopytraceError(f"{flag} must name a directory, not a file: {value}")
        problem = unwritable(path if folder else (path.parent if path.parent.parts else "."))
        if problem:
            raise CopytraceError(f"{flag} {value}: {problem}")


def add_trace_command(
    subparsers: Any, name: str, doc: str | None, extra_description: str = ""
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` whose help (its line in ``copytrace --help``) is the first
    paragraph of ``doc``, whose description is all of it, and whose first argument is the
    trace ``PATH`` (a file or a directory of trace files)."""
    doc = (doc or "").strip()
    first = " ".join(doc.split("\n\n", 1)[0].split())
    short = first[:1].lower() + first[1:].rstrip(".")
    parser = subparsers.add_parser(name, help=short, description=doc + extra_description)
    parser.add_argument(
        "path", metavar="PATH", help="trace file (*.otlp.jsonl[.gz]) or a directory of them"
    )
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument(
        "--run", type=int, metavar="N", default=None,
        help="when PATH holds several runs (launches, numbered from 1 by start time): "
        "only run N (default: the latest, with a warning naming the others)",
    )  # fmt: skip
    runs.add_argument(
        "--all", action="store_true",
        help="combine every run in PATH (a warning says which; needed to merge runs)",
    )  # fmt: skip
    return parser


def add_group_by(parser: argparse.ArgumentParser) -> None:
    """Add ``--group-by library|user``: what the call-site tables (and the report's treemap)
    group by."""
    parser.add_argument(
        "--group-by", choices=("library", "user"), default="library",
        help="group the call-site tables by the library's call site (the innermost frame of "
        "an installed package such as transformers or lightning, where a copy has one; the "
        "user's line beside it; the default) or by the user's line",
    )  # fmt: skip


def _when(ns: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def select_runs(table: Any, args: Any, path: Path | str, err: TextIO | None = None) -> Any:
    """The part of ``table`` that ``--run N`` / ``--all`` ask for.

    A directory with several runs (launches: processes that did not run at the same time)
    shows the latest unless ``--run N`` picks one or ``--all`` combines them; either way a
    warning on stderr names the runs (and, when combined, says so, and whether they are
    different programs).

    Raises:
        CopytraceError: If ``--run`` is not the number of a run in ``path``.
    """
    from copytrace._errors import CopytraceError
    from copytrace.tracefile import run_groups

    err = err or sys.stderr
    chosen = getattr(args, "run", None)
    if chosen is None and len({r for p in table.parts for r in p.runs}) <= 1:
        return table  # one process: one run at most (nothing to read)
    groups = run_groups(table)
    n = len(groups)
    if chosen is not None and not 1 <= chosen <= n:
        raise CopytraceError(f"--run {chosen}: {path} holds run{'s 1-' if n > 1 else ' '}{n}")
    if n <= 1:
        return table
    listing = "; ".join(f"run {g.number}: {g.command or '?'} (started {_when(g.start_ns)} UTC, "
                        f"{len(g.trace_ids)} process(es))" for g in groups)  # fmt: skip
    if getattr(args, "all", False):
        programs = sorted({g.program for g in groups})
        what = (f"different programs ({', '.join(programs)})" if len(programs) > 1
                else f"the same program ({programs[0]})")  # fmt: skip
        print(f"copytrace: warning: combining {n} runs of {what}: {listing}", file=err)
        return table
    if chosen is None:
        chosen = n
        print(f"copytrace: warning: {path} holds {n} runs; showing run {n} (--run N shows "
              f"another, --all combines them): {listing}", file=err)  # fmt: skip
    return table.only(groups[chosen - 1].trace_ids)


def warn_unreadable(trace: Any, path: Path | str, err: TextIO | None = None) -> None:
    """One stderr line when lines of the trace could not be read (a file cut mid-write),
    and one per columnar sidecar that could not be used whole (its trace file was read)."""
    for note in getattr(trace, "notes", ()):
        print(f"copytrace: warning: {note}", file=err or sys.stderr)
    if trace.bad_lines:
        print(
            f"copytrace: warning: skipped {trace.bad_lines} unreadable line(s) in {path}",
            file=err or sys.stderr,
        )
