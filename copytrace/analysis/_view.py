"""One read-only view of an event, whether it comes from memory or from a trace file.

The analyser works on :class:`Ev` objects, built either from :class:`copytrace.CopyEvent`
(``t.events`` of a live trace) or from the span attributes of a loaded trace
(:func:`copytrace.tracefile.load_trace`); ``docs/trace-format.md`` lists the attributes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Ev", "runs_of"]


class Ev:
    """The fields of one event the rules read (absent facts are ``None``)."""

    __slots__ = (
        "seq", "run", "span_id", "op", "aten", "step", "group", "parent", "alias", "noop",
        "error", "bytes_allocated", "bytes_logical", "shape", "dtype", "src_dtype",
        "src_device", "dst_device", "transfer", "non_blocking", "pinned", "graph", "grad_fn",
        "requires_grad", "src_requires_grad", "phase", "module", "site", "object_type", "via",
        "src_storage", "src_offset", "src_stride", "src_version", "dst_storage",
        "dst_version", "inplace_writes", "saved_by", "write_site", "src_name",
        "retained_bytes", "snapshot", "stale", "load_site", "origin",
        "recompute",  # tensor-kind facts
        "lib_site", "autocast_nocache",
    )  # fmt: skip

    def __init__(self, **fields: Any) -> None:
        for name in self.__slots__:
            setattr(self, name, fields.get(name))

    def __repr__(self) -> str:
        return f"Ev(#{self.seq} {self.op} step={self.step} {self.site})"


def _site(file: Any, line: Any, function: Any) -> str | None:
    if not file:
        return None
    site = f"{file}:{line}" if line is not None else str(file)
    return f"{site} {function}" if function else site


def _tuple(value: Any) -> tuple:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _from_copy_event(ev: Any) -> Ev:
    get = ev.__getattribute__
    fields = {name: getattr(ev, name, None) for name in Ev.__slots__ if hasattr(ev, name)}
    fields.update(
        run=0,
        span_id=None,
        site=_site(get("file"), get("line"), get("function")),
        lib_site=_site(getattr(ev, "lib_file", None), getattr(ev, "lib_line", None),
                       getattr(ev, "lib_function", None)),
        aten=_tuple(get("aten")),
        shape=_tuple(get("shape")),
        src_stride=_tuple(getattr(ev, "src_stride", ())),
        saved_by=_tuple(getattr(ev, "saved_by", ())),
        group=bool(get("group")),
        parent=get("parent") if get("parent") is not None else -1,
    )
    return Ev(**fields)


_ATTR = "copytrace."


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _from_span(span: Any, seq: int, run: int, parent: int) -> Ev:
    a = span.attrs

    def get(name: str) -> Any:
        return a.get(_ATTR + name)

    op = get("op")
    if not isinstance(op, str) or not op:
        op = span.op if hasattr(span, "op") else span.name.removeprefix(_ATTR)
    pinned = get("pinned")
    return Ev(
        seq=seq,
        run=run,
        span_id=span.span_id,
        op=op,
        aten=_tuple(get("aten")),
        step=_int(get("step")) or 0,
        group=get("group") is True,
        parent=parent,
        alias=get("alias") is True,
        noop=get("noop") is True,
        error=get("error") or None,
        bytes_allocated=_int(get("bytes_allocated")) or 0,
        bytes_logical=_int(get("bytes_logical")) or 0,
        shape=_tuple(get("shape")),
        dtype=get("dtype"),
        src_dtype=get("src_dtype"),
        src_device=get("src_device"),
        dst_device=get("dst_device"),
        transfer=get("transfer") or "none",
        non_blocking=get("non_blocking") is True,
        pinned=pinned if isinstance(pinned, bool) else None,
        graph=get("graph"),
        grad_fn=get("grad_fn"),
        requires_grad=get("requires_grad") is True,
        src_requires_grad=get("src_requires_grad") is True,
        phase=get("phase"),
        module=get("module"),
        site=_site(a.get("code.file.path"), a.get("code.line.number"), a.get("code.function.name")),
        object_type=get("object_type"),
        via=get("via"),
        src_storage=_int(get("src_storage")),
        src_offset=_int(get("src_offset")),
        src_stride=_tuple(get("src_stride")),
        src_version=_int(get("src_version")),
        dst_storage=_int(get("dst_storage")),
        dst_version=_int(get("dst_version")),
        inplace_writes=_int(get("inplace_writes")),
        saved_by=_tuple(get("saved_by")),
        write_site=get("write_site"),
        src_name=get("src_name"),
        retained_bytes=_int(get("retained_bytes")),
        snapshot=get("snapshot") is True,
        stale=get("stale") is True,
        recompute=get("recompute") is True,
        load_site=get("load_site"),
        origin=get("origin"),
        lib_site=_site(get("library.file.path"), get("library.line.number"),
                       get("library.function.name")),
        autocast_nocache=get("autocast_nocache") is True,
    )


def _run_views(run: Any, index: int) -> list[Ev]:
    events = list(run.events)
    position = {e.span_id: i for i, e in enumerate(events)}
    out = []
    for i, e in enumerate(events):
        parent = position.get(e.parent_id, -1) if e.parent_id else -1
        out.append(_from_span(e, i, index, parent))
    return out


def runs_of(source: Any) -> list[list[Ev]]:
    """Normalise ``source`` into one list of :class:`Ev` per run, in event order.

    Args:
        source: a sequence of :class:`copytrace.CopyEvent`; a :class:`copytrace.Trace` (its
            ``events``); a :class:`copytrace.tracefile.TraceData`; a
            :class:`copytrace.tracefile.EventTable`; or a trace file or directory path (read
            with :func:`copytrace.tracefile.event_table`).
    """
    if isinstance(source, (str, os.PathLike)):
        from copytrace.tracefile import event_table

        source = event_table(source)
    if hasattr(source, "parts") and hasattr(source, "files"):  # a copytrace.tracefile.EventTable
        from copytrace.analysis._table_view import TableRuns

        views = getattr(source, "analysis_views", None)  # one per table
        if views is None:
            views = source.analysis_views = TableRuns(source)
        return views  # type: ignore[no-any-return]
    runs = getattr(source, "runs", None)
    if runs is not None and not isinstance(source, Sequence):
        return [_run_views(run, i) for i, run in enumerate(runs)]
    if not isinstance(source, Iterable) and hasattr(source, "events"):
        source = source.events  # a copytrace.Trace
    events = list(source)
    return [[_from_copy_event(e) for e in events]]
