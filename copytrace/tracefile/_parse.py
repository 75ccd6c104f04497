"""Parsing OTLP/JSON trace lines into rows of the event table (see :mod:`._table`).

pyarrow's native JSON reader reads a block of lines at a time against the request's schema;
the attribute lists are pivoted into one column per ``CopyEvent`` field with numpy index
arithmetic. A block with a bad line is read line by line; a line pyarrow cannot type goes
through the Python reader (:mod:`._reader`); only what neither can read is skipped and
counted.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from copytrace.schema import (
    ATTRIBUTE_OF,
    META_SPANS,
    PREFIX,
    TABLE_VERSION,
    event_schema,
)
from copytrace.tracefile import _reader

__all__ = ["EVENT_SCHEMA", "META_SPANS", "TABLE_VERSION", "Builder", "iter_blocks", "row_of_raw"]

_BLOCK_BYTES = 32 << 20

_STR, _INT, _BOOL = pa.string(), pa.int64(), pa.bool_()
#: The table's schema (:data:`copytrace.schema.TABLE_COLUMNS`).
EVENT_SCHEMA = event_schema()
_TYPE_OF = {name: EVENT_SCHEMA.field(name).type for name in ATTRIBUTE_OF}


def _field_type(name: str) -> pa.DataType:
    return _TYPE_OF[name]


# The OTLP/JSON request as pyarrow's JSON reader types it.
_SCALAR_VALUE = [("stringValue", _STR), ("intValue", _STR), ("boolValue", _BOOL),
                 ("doubleValue", pa.float64())]  # fmt: skip
_VALUE = pa.struct(
    [*_SCALAR_VALUE, ("arrayValue", pa.struct([("values", pa.list_(pa.struct(_SCALAR_VALUE)))]))]
)
_ATTRS = pa.list_(pa.struct([("key", _STR), ("value", _VALUE)]))
_SPAN = pa.struct([
    ("traceId", _STR), ("spanId", _STR), ("parentSpanId", _STR), ("name", _STR),
    ("startTimeUnixNano", _STR), ("endTimeUnixNano", _STR), ("attributes", _ATTRS),
    ("events", pa.list_(pa.struct([("timeUnixNano", _STR), ("name", _STR),
                                   ("attributes", _ATTRS)]))),
])  # fmt: skip
_REQUEST = pa.schema([
    ("resourceSpans", pa.list_(pa.struct([
        ("resource", pa.struct([("attributes", _ATTRS)])),
        ("scopeSpans", pa.list_(pa.struct([("spans", pa.list_(_SPAN))]))),
    ]))),
])  # fmt: skip
_PARSE = pj.ParseOptions(explicit_schema=_REQUEST, unexpected_field_behavior="ignore")
_KEY_OF = {key: name for name, key in ATTRIBUTE_OF.items()}




def iter_blocks(path: Path, start: int = 0) -> Iterator[tuple[bytes | None, int]]:
    """Yield ``(block of whole lines, bytes read)``; None for an unreadable gzip tail.

    Args:
        path: A trace file, plain or gzip.
        start: Read from this byte on (the start of a line, or of a gzip member).
    """
    with path.open("rb") as raw:
        raw.seek(start)
        magic = raw.read(2)
        raw.seek(start)
        fh: Any = gzip.GzipFile(fileobj=raw, mode="rb") if magic == b"\x1f\x8b" else raw
        buf: list[bytes] = []
        size, pos = 0, start
        try:
            for line in fh:
                buf.append(line)
                size += len(line)
                if size >= _BLOCK_BYTES:
                    now = raw.tell()
                    yield b"".join(buf), now - pos
                    pos, buf, size = now, [], 0
        except (EOFError, OSError, gzip.BadGzipFile):
            if buf:
                yield b"".join(buf), raw.tell() - pos
            yield None, 0
            return
        if buf:
            yield b"".join(buf), raw.tell() - pos


def _split_lines(block: bytes) -> list[bytes]:
    return [ln for ln in block.split(b"\n") if ln.strip()]


def _check_line(line: bytes) -> bool:
    """Whether a line is one JSON object (pyarrow would read a bad line as nulls)."""
    return line.lstrip()[:1] == b"{" and line.rstrip()[-1:] == b"}"


class Builder:
    """Accumulates the rows of one file from blocks of lines."""

    def __init__(self) -> None:
        self.resources: dict[str, dict[str, Any]] = {}
        self.bad_lines = 0
        self.batches: list[pa.Table] = []

    def add_block(self, block: bytes) -> None:
        lines = _split_lines(block)
        if all(_check_line(ln) for ln in lines):
            longest = max((len(ln) for ln in lines), default=0)
            opts = pj.ReadOptions(block_size=max(1 << 20, 2 * longest + 2))
            try:
                self._add_arrow(pj.read_json(io.BytesIO(block), read_options=opts,
                                             parse_options=_PARSE))  # fmt: skip
                return
            except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError):
                pass
        for ln in lines:  # one line at a time: skip only what cannot be read
            self.add_line(ln)

    def add_line(self, line: bytes) -> None:
        if _check_line(line):
            opts = pj.ReadOptions(block_size=max(1 << 20, len(line) + 2))
            try:
                self._add_arrow(pj.read_json(io.BytesIO(line), read_options=opts,
                                             parse_options=_PARSE))  # fmt: skip
                return
            except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError):
                pass
        try:  # a line pyarrow cannot type: the Python reader reads it if it is valid at all
            spans = _reader._parse_line(line.decode("utf-8"))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            self.bad_lines += 1
            return
        self._add_python(spans)

    def _add_arrow(self, req: pa.Table) -> None:
        rs = pc.list_flatten(req.column("resourceSpans").combine_chunks())
        if len(rs) == 0:
            return
        ss_list = rs.field("scopeSpans")
        ss = pc.list_flatten(ss_list)
        sp_list = ss.field("spans")
        spans = pc.list_flatten(sp_list)
        if len(spans) == 0:
            return
        span_rs = pc.list_parent_indices(ss_list).to_numpy()[
            pc.list_parent_indices(sp_list).to_numpy()
        ]
        if spans.field("traceId").null_count or spans.field("spanId").null_count:
            # OTLP requires both; the Python reader refuses such a line (or skips a foreign
            # span), and a null run id would break the table's run list
            raise ValueError("a span without traceId or spanId")
        trace = pc.utf8_lower(spans.field("traceId"))
        pairs = pa.table({"rs": span_rs, "run": trace}).group_by(["rs", "run"]).aggregate([])
        res_attrs = rs.field("resource").field("attributes")
        for i, run in zip(pairs.column("rs").to_pylist(), pairs.column("run").to_pylist(),
                          strict=True):  # fmt: skip
            if run is not None:
                res = _decode_kv(res_attrs[i].as_py())
                self.resources.setdefault(run, {}).update(res)
        self.batches.append(_spans_to_rows(spans, trace))

    def _add_python(self, spans: list[Any]) -> None:
        rows = []
        for sp in spans:
            self.resources.setdefault(sp.trace_id, {}).update(sp.resource)
            rows.append(row_of_raw(sp))
        if rows:
            self.batches.append(pa.Table.from_pylist(rows, schema=EVENT_SCHEMA))

    def finish(self) -> pa.Table:
        tab = pa.concat_tables(self.batches) if self.batches else EVENT_SCHEMA.empty_table()
        self.batches = []
        return _dedup(tab)


def _decode_kv(items: Any) -> dict[str, Any]:
    """Attributes as pyarrow gives them (list of {key, value struct}) to plain values."""
    out: dict[str, Any] = {}
    for item in items or ():
        out[item["key"]] = _decode_value(item["value"])
    return out


def _decode_value(v: Any) -> Any:
    if v is None:
        return None
    if v.get("stringValue") is not None:
        return v["stringValue"]
    if v.get("intValue") is not None:
        return int(v["intValue"])
    if v.get("boolValue") is not None:
        return bool(v["boolValue"])
    if v.get("doubleValue") is not None:
        return float(v["doubleValue"])
    arr = v.get("arrayValue")
    if arr is not None:
        return [_decode_value(x) for x in arr.get("values") or ()]
    return None


def _spans_to_rows(spans: pa.StructArray, trace: pa.Array) -> pa.Table:
    """One row per copytrace span: pivot the attribute lists into one column per field."""
    names = spans.field("name")
    attrs = spans.field("attributes")
    n = len(spans)
    flat = pc.list_flatten(attrs)
    owner = pc.list_parent_indices(attrs).to_numpy()
    keys = flat.field("key").dictionary_encode()
    codes = keys.indices.to_numpy(zero_copy_only=False)
    values = flat.field("value")
    order = np.argsort(codes, kind="stable")
    bounds = np.searchsorted(codes[order], np.arange(len(keys.dictionary) + 1))
    where: dict[str, np.ndarray] = {}
    for code, key in enumerate(keys.dictionary.to_pylist()):
        name = _KEY_OF.get(key)
        if name is not None:
            where[name] = order[bounds[code] : bounds[code + 1]]
    cols: dict[str, pa.Array] = {
        "run": trace,
        "span_id": pc.utf8_lower(spans.field("spanId")),
        "parent_id": _null_empty(pc.utf8_lower(spans.field("parentSpanId"))),
        "name": names,
        "start_ns": _to_int(spans.field("startTimeUnixNano")),
        "end_ns": _to_int(spans.field("endTimeUnixNano")),
    }
    for name in ATTRIBUTE_OF:
        cols[name] = _column(name, where.get(name), owner, values, n)
    op = cols["op"]
    from_name = pc.utf8_slice_codeunits(names, len(PREFIX))
    from_name = pc.if_else(pc.starts_with(names, PREFIX), from_name, names)
    cols["op"] = pc.if_else(pc.fill_null(pc.greater(pc.utf8_length(op), 0), False), op,
                            from_name)  # fmt: skip
    is_meta = pc.is_in(names, pa.array(sorted(META_SPANS)))
    meta_idx = np.nonzero(is_meta.to_numpy(zero_copy_only=False))[0]
    attrs_json = [None] * n
    events_json = [None] * n
    if len(meta_idx):
        sub_attrs = attrs.take(pa.array(meta_idx)).to_pylist()
        sub_events = spans.field("events").take(pa.array(meta_idx)).to_pylist()
        for j, i in enumerate(meta_idx):
            attrs_json[i] = json.dumps(_decode_kv(sub_attrs[j]))
            evs = [[e["name"] or "", int(e["timeUnixNano"] or 0), _decode_kv(e["attributes"])]
                   for e in sub_events[j] or ()]  # fmt: skip
            events_json[i] = json.dumps(evs) if evs else None
    cols["attrs_json"] = pa.array(attrs_json, _STR)
    cols["events_json"] = pa.array(events_json, _STR)
    table = pa.table(cols, schema=EVENT_SCHEMA)
    # only copytrace spans (another library's spans in the same file are skipped)
    return table.filter(pc.or_(pc.starts_with(names, PREFIX), pc.is_valid(op)))


def _null_empty(arr: pa.Array) -> pa.Array:
    return pc.if_else(pc.equal(arr, ""), pa.scalar(None, _STR), arr)


def _to_int(arr: pa.Array) -> pa.Array:
    return pc.fill_null(pc.cast(_null_empty(arr), _INT), 0)


def _column(
    name: str, idx: np.ndarray | None, owner: np.ndarray, values: pa.StructArray, n: int
) -> pa.Array:
    """The column of field ``name``: the value of its attribute on each span, else null."""
    typ = _field_type(name)
    if idx is None or len(idx) == 0:
        return pa.nulls(n, typ)
    take = np.full(n, -1, dtype=np.int64)
    take[owner[idx]] = idx
    indices = pa.array(take, mask=take < 0)
    if typ == _STR:
        return values.field("stringValue").take(indices)
    if typ == _INT:
        return pc.cast(values.field("intValue").take(indices), _INT)
    if typ == _BOOL:
        return values.field("boolValue").take(indices)
    arr = values.field("arrayValue").take(indices)
    lists = arr.field("values")
    inner = pc.list_flatten(lists)
    item = inner.field("intValue" if typ == pa.list_(_INT) else "stringValue")
    if typ == pa.list_(_INT):
        item = pc.cast(item, _INT)
    offsets = lists.offsets
    return pa.ListArray.from_arrays(offsets, item, mask=lists.is_null())


def row_of_raw(sp: Any) -> dict[str, Any]:
    """One table row from a span read by the Python reader."""
    a = sp.attrs
    row: dict[str, Any] = {
        "run": sp.trace_id,
        "span_id": sp.span_id,
        "parent_id": sp.parent_id,
        "name": sp.name,
        "start_ns": sp.start_ns,
        "end_ns": sp.end_ns,
    }
    for name, key in ATTRIBUTE_OF.items():
        row[name] = _typed(name, a.get(key))
    op = row["op"]
    if not op:
        row["op"] = sp.name[len(PREFIX) :] if sp.name.startswith(PREFIX) else sp.name
    if sp.name in META_SPANS:
        row["attrs_json"] = json.dumps(a, default=str)
        evs = [[n, t, e] for n, t, e in sp.span_events]
        row["events_json"] = json.dumps(evs, default=str) if evs else None
    return row


def _typed(name: str, value: Any) -> Any:
    typ = _field_type(name)
    if value is None:
        return None
    if typ == _INT:
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if typ == _BOOL:
        return value if isinstance(value, bool) else None
    if typ == _STR:
        return value if isinstance(value, str) else str(value)
    if not isinstance(value, list):
        return None
    if typ == pa.list_(_INT):
        return [v if isinstance(v, int) and not isinstance(v, bool) else None for v in value]
    return [None if v is None else str(v) for v in value]


def _dedup(tab: pa.Table) -> pa.Table:
    """Keep the first row of each (run, span id)."""
    if tab.num_rows == 0:
        return tab
    key = pc.binary_join_element_wise(tab.column("run"), tab.column("span_id"), "/")
    if pc.count_distinct(key).as_py() == tab.num_rows:
        return tab
    tab = tab.append_column("__i", pa.array(np.arange(tab.num_rows)))
    firsts = tab.group_by(["run", "span_id"], use_threads=False).aggregate([("__i", "min")])
    keep = np.sort(firsts.column("__i_min").to_numpy())
    return tab.drop_columns(["__i"]).take(pa.array(keep))
