"""Runs of a trace directory: the traced processes grouped by program launch.

A directory may hold the traces of several launches (``copytrace run train.py`` twice, or
a training and an evaluation script). Processes of one launch (ranks, DataLoader workers,
``multiprocessing`` children) run at the same time; separate launches do not overlap. So
processes are grouped, by start time, into runs whose time spans do not overlap.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunGroup", "program_args", "resource_command", "run_groups"]

_PY = re.compile(r"python[0-9.]*(\.exe)?")
#: the interpreter's options that take the next argument as their value
_PY_VALUE_OPTIONS = ("-W", "-X")
#: ``copytrace run`` options that take a value (the rest are flags).
_RUN_VALUE_OPTIONS = ("-o", "--output", "--py-spy-format", "--py-spy-rate")


def program_args(argv: Sequence[Any]) -> list[str]:
    """The program's own command from a process's recorded ``argv``: ``["train.py",
    "--epochs", "1"]`` of ``python -m copytrace run -o out -- train.py --epochs 1`` (or of
    the ``copytrace`` console script, ``python /venv/bin/copytrace run ...``). The resource's
    ``process.command_args`` is the process's whole command (``sys.orig_argv``), which under
    ``copytrace run`` is copytrace's; the run span's is the program's, but a trace cut short
    (the process killed) has no run span. Any other ``argv`` is returned as it is (as
    strings), the interpreter included."""
    args = [str(a) for a in argv]
    i = 0
    if args and _PY.fullmatch(os.path.basename(args[0])):
        i = 1
        while i < len(args) and args[i].startswith("-") and args[i] != "-m":
            i += 2 if args[i] in _PY_VALUE_OPTIONS else 1
    if args[i : i + 2] == ["-m", "copytrace"]:
        i += 2
    elif i < len(args) and os.path.basename(args[i]) == "copytrace":
        i += 1
    else:
        return args
    if args[i : i + 1] != ["run"]:
        return args
    rest = args[i + 1 :]
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        opt = rest.pop(0)
        if opt == "--":
            break
        if opt in _RUN_VALUE_OPTIONS and rest:
            rest.pop(0)
    return rest


@dataclass
class RunGroup:
    """One launch: the processes (OTLP trace ids) that ran together.

    Attributes:
        number: 1-based, in start order (what ``--run`` takes).
        command: The command line of its first process ('' if unknown).
        start_ns: Earliest span start, ns since the epoch.
        end_ns: Latest span end, ns since the epoch.
        trace_ids: Its processes.
    """

    number: int
    command: str = ""
    start_ns: int = 0
    end_ns: int = 0
    trace_ids: list[str] = field(default_factory=list)

    @property
    def program(self) -> str:
        """The program: the first argument of the command that is not an interpreter or
        an option (``train.py`` of ``python -u train.py --epochs 1``)."""
        words = self.command.split()
        for i, word in enumerate(words):
            base = word.rsplit("/", 1)[-1]
            if word.startswith("-") or base.startswith(("python", "copytrace")) or base == "run":
                if word in ("-m", "-c") and i + 1 < len(words):
                    return words[i + 1]
                continue
            return word
        return self.command


def _command(attrs: dict[str, Any]) -> str:
    """A run span's ``process.command_args`` (the program's argv) joined; '' if absent."""
    argv = attrs.get("process.command_args")
    if isinstance(argv, list):
        return " ".join(str(a) for a in argv)
    return str(argv or "")


def resource_command(res: dict[str, Any]) -> str:
    """The program's command from a resource's ``process.command_args`` (or an SDK
    detector's ``process.command_line``), through :func:`program_args`; '' if unknown."""
    argv = res.get("process.command_args")
    if isinstance(argv, list):
        return " ".join(program_args(argv))
    line = argv or res.get("process.command_line")
    return " ".join(program_args(str(line).split(" "))) if line else ""


def run_groups(table: Any) -> list[RunGroup]:
    """Group the processes of an :class:`~copytrace.tracefile.EventTable` into launches."""
    import pyarrow.compute as pc

    bounds: dict[str, list[int]] = {}
    commands: dict[str, str] = {}
    for run, res in table.resources.items():
        commands[run] = resource_command(res)
    for part in table.parts:
        if part.rows == 0:
            continue
        if len(part.runs) == 1:  # one process per file, as the tracer writes: times only
            tab = part.read(["start_ns", "end_ns"])
            found = [(part.runs[0], pc.min(tab.column("start_ns")).as_py(),
                      pc.max(tab.column("end_ns")).as_py())]  # fmt: skip
        else:
            tab = part.read(["run", "start_ns", "end_ns"])
            agg = tab.group_by("run").aggregate([("start_ns", "min"), ("end_ns", "max")])
            found = list(zip(*(agg.column(c).to_pylist() for c in
                               ("run", "start_ns_min", "end_ns_max")), strict=True))  # fmt: skip
        for run, lo, hi in found:
            b = bounds.setdefault(run, [lo, hi])
            b[0], b[1] = min(b[0], lo), max(b[1], hi)
        spans = part.read(["run", "attrs_json"],
                          filters=pc.equal(pc.field("name"), "copytrace.run")).to_pylist()
        for row in spans:
            cmd = _command(json.loads(row["attrs_json"] or "{}"))
            if cmd:
                commands[row["run"]] = cmd
    groups: list[RunGroup] = []
    for run in sorted(bounds, key=lambda r: (bounds[r][0], r)):
        lo, hi = bounds[run]
        if groups and lo < groups[-1].end_ns:  # overlaps the current launch
            g = groups[-1]
            g.end_ns = max(g.end_ns, hi)
        else:
            g = RunGroup(len(groups) + 1, commands.get(run, ""), lo, hi)
            groups.append(g)
        g.trace_ids.append(run)
    return groups
