"""Compare two runs: the call sites, modules and ops that copy more or less per step.

BASE and NEW are trace files or directories (``--base-run N`` / ``--new-run N`` pick a run
of a directory holding several). With one directory only, its last two runs are compared;
with ``--ranks``, the ranks (processes) of its run.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

__all__ = ["register", "handle", "load_side"]


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _run_arg(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError("runs are numbered from 1")
    return value


def load_side(path: str, run: int | None, err: TextIO, *, second_last: bool = False) -> Any:
    """The profile (:class:`copytrace.analysis.diff.RunProfile`) of run ``run`` of ``path``.

    Without ``run``, a path holding several runs gives its latest (its second latest with
    ``second_last``), with a warning naming them on ``err``.

    Raises:
        TraceFileError: If ``path`` holds no readable trace.
        CopytraceError: If ``run`` is not a run of ``path``.
    """
    from copytrace.analysis.diff import load_run
    from copytrace.cli._common import select_runs, warn_unreadable
    from copytrace.tracefile import event_table, run_groups

    table = event_table(path)
    groups = run_groups(table)
    label = path
    if run is None and second_last and len(groups) >= 2:
        run = len(groups) - 1
    if run is not None or len(groups) > 1:
        table = select_runs(table, argparse.Namespace(run=run, all=False), path, err)
        label = f"{path} run {run if run is not None else len(groups)}"
    warn_unreadable(table, path, err)
    return load_run(table, label)


def _write(args: argparse.Namespace, d: Any, out: TextIO) -> None:
    from copytrace.analysis.diff import format_markdown, format_terminal, to_json

    if args.output:
        _write_page(args, d, out)
    elif args.json:
        json.dump(to_json(d), out, indent=2)
        out.write("\n")
    elif args.markdown:
        out.write(format_markdown(d))
    else:
        out.write(format_terminal(d))


def _write_page(args: argparse.Namespace, d: Any, out: TextIO) -> None:
    from copytrace._errors import CopytraceError
    from copytrace.dashboards._diff_page import write_diff_page

    try:
        written = write_diff_page(d, args.output, offline=not args.cdn)
    except OSError as err:
        raise CopytraceError(f"cannot write {args.output}: {err.strerror or err}") from err
    from copytrace.analysis.diff import site_counts

    out.write(f"copytrace: diff written to {written} (call sites: {site_counts(d)})\n")


def _rank_name(res: dict[str, Any], index: int) -> tuple[int, str]:
    for key in ("copytrace.rank", "rank", "process.rank"):
        value = res.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value, str(value)
    pid = res.get("process.pid")
    return 1 << 30 | index, f"pid {pid}" if pid else f"process {index + 1}"


def _ranks(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``--ranks``: the processes of one run of BASE side by side."""
    from copytrace.analysis.diff import compare_ranks, format_ranks, load_run, ranks_json
    from copytrace.cli._common import select_runs, warn_unreadable
    from copytrace.tracefile import event_table

    table = event_table(args.base)
    table = select_runs(table, argparse.Namespace(run=args.base_run, all=False), args.base, err)
    warn_unreadable(table, args.base, err)
    resources = table.resources
    named = sorted((_rank_name(resources.get(t, {}), i), t)
                   for i, t in enumerate(sorted({r for p in table.parts for r in p.runs})))  # fmt: skip
    ranks = [(name, tid, load_run(table, f"rank {name}", [tid], hazards=False))
             for (_, name), tid in named]  # fmt: skip
    rd = compare_ranks(args.base, ranks, warmup=args.warmup_steps)
    if args.json:
        json.dump(ranks_json(rd), out, indent=2)
        out.write("\n")
    else:
        out.write(format_ranks(rd))
    return 0


def handle(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Compare the runs and print the comparison.

    Returns:
        0 (a difference is not an error; ``copytrace check --baseline`` gates).

    Raises:
        TraceFileError: If a path is missing or holds no readable trace.
        CopytraceError: For a run number that is not in its path.
    """
    from copytrace.analysis.diff import compare

    out = out or sys.stdout
    err = err or sys.stderr
    if args.ranks:
        from copytrace._errors import CopytraceError

        for bad, what in ((args.new, "NEW"), (args.output, "-o"), (args.markdown, "--markdown"),
                          (args.new_run, "--new-run")):  # fmt: skip
            if bad:
                raise CopytraceError(f"--ranks compares the ranks of one run: no {what}")
        return _ranks(args, out, err)
    if args.new is None:
        base = load_side(args.base, args.base_run, err, second_last=True)
        new = load_side(args.base, args.new_run, err)
        if base.label == new.label:
            from copytrace._errors import CopytraceError

            raise CopytraceError(f"{args.base} holds one run; give NEW, a second trace")
    else:
        base = load_side(args.base, args.base_run, err)
        new = load_side(args.new, args.new_run, err)
    _write(args, compare(base, new, warmup=args.warmup_steps), out)
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``diff`` subcommand to ``subparsers``."""
    doc = (__doc__ or "").strip()
    parser = subparsers.add_parser(
        "diff", help="compare two runs: call sites that copy more or less per step",
        description=doc + " The JSON form is documented in docs/diff.md.",
    )  # fmt: skip
    parser.add_argument("base", metavar="BASE", help="trace file or directory of the base run")
    parser.add_argument("new", metavar="NEW", nargs="?", default=None,
                        help="trace file or directory of the new run (default: the last run "
                        "of BASE against the one before it)")  # fmt: skip
    parser.add_argument(
        "--base-run",
        type=_run_arg,
        metavar="N",
        default=None,
        help="run N of BASE (default: the latest)",
    )
    parser.add_argument(
        "--new-run",
        type=_run_arg,
        metavar="N",
        default=None,
        help="run N of NEW (default: the latest)",
    )
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="print one JSON object")
    form.add_argument(
        "--markdown", action="store_true", help="print Markdown (for a pull-request comment)"
    )
    form.add_argument("-o", "--output", metavar="OUT.html", default=None,
                      help="write the two runs side by side as an HTML page")  # fmt: skip
    parser.add_argument("--cdn", action="store_true",
                        help="with -o: load plotly.js from the plotly CDN instead of inlining "
                        "it")  # fmt: skip
    parser.add_argument("--ranks", action="store_true",
                        help="the ranks (processes) of one run of BASE side by side: per-step "
                        "copies, bytes and copy time per rank, the slowest rank and the "
                        "imbalance (max/median)")  # fmt: skip
    parser.add_argument(
        "--warmup-steps",
        type=_count,
        metavar="N",
        default=1,
        help="steps left out of the copy-time test (default 1)",
    )
    parser.set_defaults(handler=handle)
    return parser
