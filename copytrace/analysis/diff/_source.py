"""The source line of each call site of a run, and its snapshot beside the trace.

A call site is recorded as ``file:line function``; matching sites across an edit needs the
text of the line *as it was when the run was traced*. The file on disk holds that text only
while it has not been modified since the run started, so the text is read from it then, and
kept in a small snapshot beside each trace file
(``.copytrace-cache/<trace file>.sources.json``: ``{"version": 1, "sites": {file: {line:
text}}}``), which later reads use after the file was edited. ``copytrace run`` writes the
snapshot as soon as the program ends (:func:`snapshot_sources`).
"""

from __future__ import annotations

import io
import json
import linecache
import os
import re
import tokenize
from pathlib import Path
from typing import Any

from copytrace.schema import CACHE_DIR

__all__ = ["defined_functions", "normalize", "parse_site", "read_sources", "snapshot_sources"]

_VERSION = 1
_SITE = re.compile(r"^(.*):(\d+)(?: (\S+))?$")


def parse_site(site: str) -> tuple[str, int, str]:
    """``"file:line function"`` -> ``(file, line, function)``; ``("", 0, "")`` if not a site."""
    m = _SITE.match(site or "")
    if not m:
        return ("", 0, "")
    return (m.group(1), int(m.group(2)), m.group(3) or "")


def normalize(text: str) -> str:
    """A source line with its comment and its layout removed: the tokens joined by one space
    (``y = x.clone()  # why`` -> ``y = x . clone ( )``); the stripped text if it does not
    tokenize (a line inside a multi-line call)."""
    try:
        toks = [t.string for t in tokenize.generate_tokens(io.StringIO(text.strip()).readline)
                if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                                  tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)]  # fmt: skip
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return " ".join(text.split("#", 1)[0].split())
    return " ".join(toks)


_DEF = re.compile(r"^\s*(?:async\s+)?def\s+(\w+)", re.MULTILINE)


def defined_functions(files: list[str], not_after_ns: int) -> dict[str, set[str]]:
    """The names of the functions each of ``files`` defines (``def name``), for the files
    unmodified since ``not_after_ns`` (the others are left out: unknown)."""
    out = {}
    for file in set(files):
        try:
            if not file or os.stat(file).st_mtime_ns > not_after_ns:
                continue
            out[file] = set(_DEF.findall(Path(file).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    return out


def _snapshot_path(trace_file: Path) -> Path:
    return trace_file.parent / CACHE_DIR / (trace_file.name + ".sources.json")


def _read_snapshot(trace_file: Path) -> dict[tuple[str, int], str]:
    try:
        data = json.loads(_snapshot_path(trace_file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _VERSION:
        return {}
    out = {}
    for file, lines in (data.get("sites") or {}).items():
        for line, text in lines.items():
            out[(file, int(line))] = str(text)
    return out


def _from_disk(file: str, line: int, not_after_ns: int) -> str | None:
    """The stripped line if ``file`` is unmodified since ``not_after_ns`` (None otherwise)."""
    try:
        if not os.path.isfile(file) or (not_after_ns and os.stat(file).st_mtime_ns > not_after_ns):
            return None
        linecache.checkcache(file)
        return linecache.getline(file, line).strip()
    except (OSError, UnicodeDecodeError):
        return None


def read_sources(
    trace_files: list[Path], sites: list[tuple[str, int, str]], start_ns: int, save: bool = True
) -> dict[tuple[str, int, str], str]:
    """The source line of each of ``sites`` (those whose text is unknown are left out).

    Args:
        trace_files: The run's trace files (their snapshots are read, and written).
        sites: ``(file, line, function)`` call sites.
        start_ns: The run's start, ns since the epoch: a file modified after it is not read.
        save: Write what was read from disk into the snapshots (best effort).
    """
    known: dict[tuple[str, int], str] = {}
    for tf in trace_files:
        known.update(_read_snapshot(tf))
    out: dict[tuple[str, int, str], str] = {}
    fresh: dict[tuple[str, int], str] = {}
    for file, line, func in sites:
        if not file or not line:
            continue
        text = known.get((file, line))
        if text is None:
            text = _from_disk(file, line, start_ns)
            if text is not None:
                fresh[(file, line)] = text
        if text is not None:
            out[(file, line, func)] = text
    if save and fresh:
        for tf in trace_files:
            _write_snapshot(tf, {**known, **fresh})
    return out


def _write_snapshot(trace_file: Path, texts: dict[tuple[str, int], str]) -> None:
    sites: dict[str, dict[str, str]] = {}
    for (file, line), text in sorted(texts.items()):
        sites.setdefault(file, {})[str(line)] = text
    path = _snapshot_path(trace_file)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": _VERSION, "sites": sites}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:  # a read-only trace folder: the texts are read again next time
        tmp.unlink(missing_ok=True)


def snapshot_sources(path: str | Path) -> int:
    """Keep the source line of every call site of the trace(s) at ``path`` beside them.

    Called by ``copytrace run`` when its program ends, so that a later ``copytrace diff``
    matches call sites after the files are edited. Never raises for an unreadable trace.

    Returns:
        The number of call sites whose line was kept.
    """
    from copytrace._errors import CopytraceError
    from copytrace.analysis.diff._profile import profile_table
    from copytrace.tracefile import event_table

    try:
        table = event_table(path)
    except (CopytraceError, OSError):
        return 0
    prof: Any = profile_table(table, str(path))
    return len(read_sources(list(table.files), list(prof.sites), prof.start_ns))
