"""The columnar sidecar's reader: the event table the tracer wrote beside a trace file.

The tracer's file sink writes, at each flush, Parquet parts with exactly the columns of the
event table (:data:`copytrace.schema.TABLE_COLUMNS`) into
``.copytrace-cache/<trace file>.events/`` (the writer: ``copytrace.export.sidecar``). The
gzip trace file starts a new gzip member at each flush
(:class:`copytrace.export.trace_file.TraceFile`), so the bytes after a covered point can be
read on their own. A reader (:func:`open_sidecar`) takes the parts whose metadata is
consistent with the trace file and parses only the JSON beyond them (the
``copytrace.hazards`` span appended at stop, or what a killed process flushed to the JSON file
and not yet to a part).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from copytrace.schema import (
    SIDECAR_KEY_BYTES,
    SIDECAR_KEY_RESOURCES,
    SIDECAR_KEY_TAIL,
    SIDECAR_KEY_VERSION,
    TABLE_VERSION,
    event_schema,
    json_tail,
    sidecar_dir,
)

__all__ = ["Sidecar", "json_tail", "open_sidecar", "sidecar_dir"]


# --- reader ------------------------------------------------------------------------------------------
@dataclass
class Sidecar:
    """The usable part of a trace file's sidecar.

    Attributes:
        parts: Parquet parts, in order, consistent with the trace file.
        covered: Bytes of the trace file their rows hold (parse the file from here on).
        rows: Rows in ``parts``.
        resources: Resource attributes per run (trace id).
        note: One line saying what of the sidecar was not used and why, or None.
    """

    parts: list[Path] = field(default_factory=list)
    covered: int = 0
    rows: int = 0
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    note: str | None = None


def _same_columns(schema: pa.Schema) -> bool:
    return schema.remove_metadata().equals(event_schema())


def open_sidecar(trace: Path, size: int) -> Sidecar | None:
    """The sidecar of ``trace`` (``size`` bytes now), or None when it has none.

    Parts are used in order up to the first that is missing, unreadable, of another table
    version or not consistent with the trace file; :attr:`Sidecar.note` then says so in one
    line and the caller parses the trace file from :attr:`Sidecar.covered` on (from its start
    when no part is usable), so nothing readable is lost.
    """
    folder = sidecar_dir(trace)
    if not folder.is_dir():
        return None
    names = sorted(p.name for p in folder.glob("part-*.parquet"))
    if not names:
        return None
    out = Sidecar()
    expected = 0
    for name in names:
        problem = _check_part(trace, folder / name, size, expected, out)
        if problem is not None:
            out.note = (f"columnar sidecar {folder.name}/{name} {problem}; "
                        f"reading the rest of {trace.name} from its JSON")  # fmt: skip
            break
        expected += 1
    return out


def _check_part(trace: Path, part: Path, size: int, index: int, out: Sidecar) -> str | None:
    """Add ``part`` to ``out`` when it is usable, else say what is wrong with it."""
    if part.name != f"part-{index:06d}.parquet":
        return f"follows a missing part-{index:06d}.parquet"
    try:
        md = pq.read_metadata(part)
        schema = md.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as err:
        return f"is unreadable ({type(err).__name__})"
    meta = md.metadata or {}
    if meta.get(SIDECAR_KEY_VERSION) != TABLE_VERSION.encode() or not _same_columns(schema):
        return "has other columns (another copytrace version)"
    try:
        covered = int(meta[SIDECAR_KEY_BYTES])
        resources = json.loads(meta[SIDECAR_KEY_RESOURCES])
        tail = meta[SIDECAR_KEY_TAIL].decode()
    except (KeyError, ValueError):
        return "has no copytrace metadata"
    if covered > size or covered < out.covered:
        return "does not match the trace file (cut or replaced)"
    try:
        if json_tail(trace, covered) != tail:
            return "does not match the trace file (cut or replaced)"
    except OSError:
        return "does not match the trace file"
    out.parts.append(part)
    out.covered = covered
    out.rows += md.num_rows
    for run, res in resources.items():
        out.resources.setdefault(run, {}).update(res)
    return None
