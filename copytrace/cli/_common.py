"""Pieces the trace-reading subcommands (``report``, ``summary``, ``check``) share."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

__all__ = ["add_trace_command", "warn_unreadable"]


def add_trace_command(
    subparsers: Any, name: str, doc: str | None, extra_description: str = ""
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` whose help is the first line of ``doc`` and whose first
    argument is the trace ``PATH`` (a file or a directory of trace files)."""
    doc = (doc or "").strip()
    short = doc[:1].lower() + doc[1:].rstrip(".")
    parser = subparsers.add_parser(name, help=short, description=doc + extra_description)
    parser.add_argument(
        "path", metavar="PATH", help="trace file (*.otlp.jsonl[.gz]) or a directory of them"
    )
    return parser


def warn_unreadable(trace: Any, path: Path | str, err: TextIO | None = None) -> None:
    """One stderr line when lines of the trace could not be read (a file cut mid-write)."""
    if trace.bad_lines:
        print(
            f"copytrace: warning: skipped {trace.bad_lines} unreadable line(s) in {path}",
            file=err or sys.stderr,
        )
