"""A run of copy events as Arrow columns, and their OTLP/JSON spans built from the columns.

The file sink's bulk path: one pass per field over a flush's :class:`~copytrace.schema.CopyEvent`
records (``operator.attrgetter``, no dict per event) gives the columns of the event table
(:data:`copytrace.schema.TABLE_COLUMNS`: the sidecar's rows, as
:func:`copytrace.export.sidecar.event_batch` builds them from span attributes), and Arrow's
string kernels turn those columns into the spans' OTLP/JSON text, byte for byte what
:class:`~copytrace.export.otlp_json.Encoder` writes one event at a time (the same attributes
in the same order, the same omitted defaults; ``tests/test_export_columnar.py`` compares
both). String values are escaped once per distinct value (a dictionary of the column).

Only plain values take this path: a field holding a value of another type than its column
(a bool in an int field, an int beyond int64, a nested list...) makes :func:`event_columns`
return None, and the caller encodes that run one event at a time, as before.

Cost (CPU time, ``benchmarks/per_event.py``'s records, a loaded 2-core machine): the columns
7.7-9.4 µs per event, the JSON text 8.8 µs, the request lines 1.4 µs, against about 40 µs
for the per-event encoder and the sidecar's rows from attribute dicts
(``docs/performance.md``, "Finishing a run"). This module imports pyarrow and numpy (the
file sink imports it at its first flush).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from copytrace import schema as S

__all__ = ["event_columns", "span_line_parts", "span_lines", "span_texts"]

_NONE = type(None)
_TYPES = {"str": (str,), "int": (int,), "bool": (bool,)}
_ARROW = {"str": pa.string(), "int": pa.int64(), "bool": pa.bool_(),
          "int_list": pa.list_(pa.int64()), "str_list": pa.list_(pa.string())}  # fmt: skip
_FIELD = {f.name: f for f in S.FIELDS}
#: ``(field, attribute key, kind, group)`` in the order the encoder writes the attributes.
_ATTRS = tuple(
    (name, key, _FIELD[name].kind, group)
    for group, pairs in (
        ("str", S.STR_FIELDS),
        ("scalar", S.SCALAR_FIELDS),
        ("analysis", S.ANALYSIS_FIELDS),
        ("list", S.LIST_FIELDS),
        ("group", S.GROUP_FIELDS),
    )  # fmt: skip
    for name, key in pairs
)
_LISTS = ("int_list", "str_list")


class _Mixed(Exception):
    """A value that its column cannot hold as the file's reader would read it."""


def _types_ok(values: list[Any], kind: str) -> bool:
    allowed = {_NONE, *_TYPES[kind]}
    return set(map(type, values)) <= allowed


def _list_ok(values: list[Any], kind: str) -> bool:
    """Lists (or tuples) of ``kind`` elements, or None."""
    if not set(map(type, values)) <= {_NONE, list, tuple}:
        return False
    inner = _TYPES["int" if kind == "int_list" else "str"]
    return set(map(type, chain.from_iterable(v for v in values if v))) <= set(inner)


def _column(name: str, key: str, kind: str, group: str, values: list[Any]) -> pa.Array:
    """The field's column as the span attribute has it (null where it is left out), as
    ``otlp_json.event_attributes`` decides; raises :class:`_Mixed` for values the bulk path
    does not take."""
    listy = kind in _LISTS
    if not (_list_ok(values, kind) if listy else _types_ok(values, kind)):
        raise _Mixed(name)
    if group == "analysis" and listy and [] in values:  # an empty list is written, () is not
        return pa.array([None if v is None or v == () else v for v in values], _ARROW[kind])
    return _omit(pa.array(values, _ARROW[kind]), key, kind, group)


def _omit(col: pa.Array, key: str, kind: str, group: str) -> pa.Array:
    """``col`` with null where the encoder leaves the attribute out."""
    listy = kind in _LISTS
    default = S.OMITTED_DEFAULTS.get(key)
    if group == "str":  # written when truthy (and not the omitted default)
        drop = pc.equal(col, "")
        if default is not None:
            drop = pc.or_(drop, pc.equal(col, default))
    elif group == "scalar" and key in S.OMITTED_DEFAULTS:
        drop = pc.equal(col, default)
    elif group == "analysis" and kind == "bool":  # written when set: False is not
        drop = pc.invert(col)
    elif listy:  # a list attribute is written when non-empty
        drop = pc.equal(pc.list_value_length(col), 0)
    else:
        return col
    return _blank(col, drop)


def _blank(col: pa.Array, drop: pa.Array) -> pa.Array:
    """``col`` with null where ``drop`` is true."""
    drop = pc.fill_null(drop, False)
    if not pc.any(drop).as_py():
        return col
    return pc.if_else(drop, pa.scalar(None, col.type), col)


#: ``extract(events, specs)``: the records' fields as Arrow buffers in one C pass (the C++
#: observer's ``event_columns``, handed in by the tracer), None for a value that does not fit,
#: or NotImplemented where it cannot read them (then they are read in Python).
Extract = Callable[[list[Any], Sequence[tuple[str, int, bool]]], "list[tuple[Any, ...]] | None"]


def event_columns(
    events: Sequence[S.CopyEvent],
    trace: str,
    ids: list[str],
    parents: list[str],
    fallback_ns: int,
    offset_ns: int,
    extract: Extract | None = None,
) -> pa.RecordBatch | None:
    """The event table's rows of ``events`` (copy-event spans with span ids ``ids`` under
    ``parents``), as the file's reader reads their spans back; None when a value needs the
    per-event path (see the module docstring).

    Args:
        events: the records, in file order.
        trace: the run's trace id (hex).
        ids, parents: span id and parent span id of each event (hex).
        fallback_ns: ``perf_counter_ns`` for a missing start (``span_times``).
        offset_ns: ns to add to a ``perf_counter_ns`` value for ns since the epoch.
        extract: reads the fields in C (:data:`Extract`); None: one ``attrgetter`` pass per
            field in Python. Both give the same columns (``tests/test_export_columnar.py``).

    Returns:
        A batch with :func:`copytrace.schema.event_schema`'s columns.
    """
    try:
        fields = extract(list(events), _SPECS) if extract is not None else NotImplemented
        if fields is None:
            return None
        if fields is NotImplemented:
            cols = _python_columns(events)
        else:
            cols = _native_columns(dict(zip(_SPEC_NAMES, fields, strict=True)), len(events))
        return _batch(cols, trace, ids, parents, fallback_ns, offset_ns)
    except (_Mixed, pa.ArrowException, OverflowError, TypeError, ValueError):
        return None


_KIND_CODE = {"int": 0, "bool": 1, "str": 2, "int_list": 3, "str_list": 4}
#: What ``extract`` reads: each attribute's field, then the span's own fields.
_SPECS = (
    *[(name, _KIND_CODE[kind], group == "analysis") for name, _, kind, group in _ATTRS
      if group != "group"],
    ("start_ns", 0, False), ("end_ns", 0, False), ("group", 1, False), ("tensors", 0, False),
)  # fmt: skip
_SPEC_NAMES = tuple(spec[0] for spec in _SPECS)


def _array(kind: str, n: int, parts: tuple[Any, ...]) -> pa.Array:
    """An Arrow array from ``extract``'s buffers of one field (see :data:`Extract`)."""
    nulls, validity, *bufs = parts
    valid = pa.py_buffer(validity) if validity is not None else None
    if kind in ("int", "bool"):
        return pa.Array.from_buffers(_ARROW[kind], n, [valid, pa.py_buffer(bufs[0])], nulls)
    if kind == "str":
        return pa.Array.from_buffers(
            pa.string(), n, [valid, pa.py_buffer(bufs[0]), pa.py_buffer(bufs[1])], nulls
        )
    offsets = pa.py_buffer(bufs[0])
    if kind == "int_list":
        child = pa.Array.from_buffers(pa.int64(), len(bufs[1]) // 8, [None, pa.py_buffer(bufs[1])])
    else:
        child = pa.Array.from_buffers(pa.string(), len(bufs[1]) // 4 - 1,
                                      [None, pa.py_buffer(bufs[1]), pa.py_buffer(bufs[2])])  # fmt: skip
    return pa.Array.from_buffers(_ARROW[kind], n, [valid, offsets], nulls, children=[child])


def _native_columns(fields: dict[str, tuple[Any, ...]], n: int) -> dict[str, Any]:
    """The columns of :func:`_python_columns` from ``extract``'s buffers (empty lists are
    already null there, but for an analysis field's ``[]``, which is written)."""
    if fields["op"][0]:
        raise _Mixed("op")
    cols: dict[str, Any] = {}
    for name, key, kind, group in _ATTRS:
        if group != "group":
            col = _array(kind, n, fields[name])
            cols[name] = col if kind in _LISTS else _omit(col, key, kind, group)
    cols["op!"] = _array("str", n, fields["op"])
    for name in ("start_ns", "end_ns", "tensors"):
        cols[name + "!"] = _array("int", n, fields[name])
    cols["group!"] = _array("bool", n, fields["group"])
    return cols


def _python_columns(events: Sequence[S.CopyEvent]) -> dict[str, Any]:
    """Each field's column (:func:`_column`), and as ``<field>!`` the span's own fields
    (op, times, group, tensors) as they are, read with one ``attrgetter`` pass per field."""
    cols: dict[str, Any] = {}
    ops = list(map(attrgetter("op"), events))
    if not _types_ok(ops, "str") or None in ops:
        raise _Mixed("op")
    for name, key, kind, group in _ATTRS:
        if group != "group":
            values = ops if name == "op" else list(map(attrgetter(name), events))
            cols[name] = _column(name, key, kind, group, values)
    cols["op!"] = pa.array(ops, pa.string())
    for name in ("start_ns", "end_ns", "tensors"):
        values = list(map(attrgetter(name), events))
        if name == "tensors" and not _types_ok(values, "int"):
            raise _Mixed(name)
        cols[name + "!"] = pa.array(values, pa.int64())
    cols["group!"] = pa.array(list(map(attrgetter("group"), events)), pa.bool_())
    return cols


def _hex_ids(ids: list[str]) -> pa.Array:
    """Span ids (16 hex digits each) as a string array, from one joined buffer."""
    n = len(ids)
    data = "".join(ids).encode()
    if len(data) != 16 * n or set(map(len, ids)) != {16}:
        return pa.array(ids, pa.string())
    offsets = np.arange(0, 16 * n + 1, 16, dtype=np.int32)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _times(starts: pa.Array, ends: pa.Array, fallback: int, offset: int) -> tuple[Any, Any]:
    start = pc.fill_null(starts, fallback)
    end = pc.max_element_wise(pc.fill_null(ends, pc.max_element_wise(start, fallback)), start)
    return pc.add(start, offset), pc.add(end, offset)


def _batch(
    cols: dict[str, Any],
    trace: str,
    ids: list[str],
    parents: list[str],
    fallback: int,
    offset: int,
) -> pa.RecordBatch:
    n = len(ids)
    if not all(parents):
        raise _Mixed("parent")
    h2d = pc.equal(cols["transfer"], "h2d")  # pinned is written on h2d copies only
    cols["pinned"] = _blank(cols["pinned"], pc.invert(pc.fill_null(h2d, False)))
    grouped = pc.fill_null(cols.pop("group!"), False)
    none_bool = pa.nulls(n, pa.bool_())
    cols["group"] = pc.if_else(grouped, True, none_bool)
    cols["tensors"] = pc.if_else(grouped, cols.pop("tensors!"), pa.nulls(n, pa.int64()))
    start, end = _times(cols.pop("start_ns!"), cols.pop("end_ns!"), fallback, offset)
    names = pc.binary_join_element_wise(S.PREFIX, cols.pop("op!"), "")
    base = {"run": pa.nulls(n, pa.string()).fill_null(trace), "span_id": _hex_ids(ids),
            "parent_id": _hex_ids(parents), "name": names, "start_ns": start, "end_ns": end}  # fmt: skip
    op = cols["op"]
    if op.null_count:  # an empty op: the span name's (empty too)
        cols["op"] = pc.fill_null(op, "")
    cols["attrs_json"] = pa.nulls(n, pa.string())
    cols["events_json"] = pa.nulls(n, pa.string())
    schema = S.event_schema()
    arrays = [base[f.name] if f.name in base else cols[f.name] for f in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


# --- OTLP/JSON text from the columns -------------------------------------------------------------
def _json_of(values: pa.Array, wrap: str) -> pa.Array:
    """Each string's ``{"<wrap>":"<escaped>"}`` text, escaped once per distinct value."""
    dic = pc.dictionary_encode(values)
    texts = [json.dumps({wrap: v}, separators=(",", ":")) for v in dic.dictionary.to_pylist()]
    return pc.take(pa.array(texts, pa.string()), dic.indices)


def _value_json(col: pa.Array, kind: str) -> pa.Array:
    """The OTLP ``AnyValue`` text of each cell (null stays null)."""
    if kind == "str":
        return _json_of(col, "stringValue")
    if kind == "int":
        return pc.binary_join_element_wise('{"intValue":"', pc.cast(col, pa.string()), '"}', "")
    if kind == "bool":
        return pc.if_else(col, '{"boolValue":true}', '{"boolValue":false}')
    flat = pc.list_flatten(col)
    inner = _value_json(flat, "int" if kind == "int_list" else "str")
    offsets = pc.subtract(col.offsets, col.offsets[0])
    lists = pa.ListArray.from_arrays(offsets, inner, mask=col.is_null())
    return pc.binary_join_element_wise(
        '{"arrayValue":{"values":[', pc.binary_join(lists, ","), "]}}", ""
    )


def _fragment(col: pa.Array, key: str, kind: str) -> str | pa.Array | None:
    """One attribute's ``{"key":...,"value":...}`` text per row (null where it is left out):
    a plain string when every row has the same one, None when no row has it."""
    n, nulls = len(col), col.null_count
    if nulls == n:
        return None
    head = '{"key":' + json.dumps(key) + ',"value":'
    if not nulls and _constant(col, kind):
        return head + _value_json(col.slice(0, 1), kind)[0].as_py() + "}"
    return pc.binary_join_element_wise(head, _value_json(col, kind), "}", "")


def _constant(col: pa.Array, kind: str) -> bool:
    """Every cell of ``col`` (no nulls, at least one row) holds the same value."""
    if kind not in _LISTS:
        return bool(pc.count_distinct(col).as_py() == 1)
    first = col[0].as_py()
    if not pc.all(pc.equal(pc.list_value_length(col), len(first))).as_py():
        return False
    flat = pc.list_flatten(col)
    want = pa.array(first * len(col), flat.type)
    return bool(pc.all(pc.equal(flat, want)).as_py())


#: A column with at most this many distinct attribute texts is joined by its codes.
FEW = 256


def _coded(col: pa.Array, key: str, kind: str) -> tuple[np.ndarray, list[str]] | None:
    """``(code per row, -1 where left out; the attribute text of each code)`` for a column
    of at most :data:`FEW` distinct values, else None."""
    if kind in _LISTS:
        frag = _fragment(col, key, kind)
        if not isinstance(frag, pa.Array):
            return None
        dic = pc.dictionary_encode(frag)
        texts = dic.dictionary.to_pylist() if len(dic.dictionary) <= FEW else None
    else:
        dic = pc.dictionary_encode(col)
        if len(dic.dictionary) > FEW:
            return None
        head = '{"key":' + json.dumps(key) + ',"value":'
        texts = [head + t + "}" for t in _value_json(dic.dictionary, kind).to_pylist()]
    if texts is None:
        return None
    return pc.fill_null(dic.indices, -1).to_numpy(zero_copy_only=False), texts


def _joined(coded: list[tuple[np.ndarray, list[str]]]) -> tuple[Any, ...]:
    """Consecutive few-valued attributes as one fragment, ``("few", text of each distinct
    row of codes or None, the row's index per event)``: each distinct row is joined once."""
    acc = np.zeros(len(coded[0][0]), np.int64)
    size = 1  # acc < size
    for c, texts in coded:  # mixed radix, renumbered before it could overflow
        if size * (len(texts) + 1) >= 1 << 62:
            _, acc = np.unique(acc, return_inverse=True)
            size = int(acc.max()) + 1
        acc = acc * (len(texts) + 1) + (c + 1)
        size *= len(texts) + 1
    _, first, inverse = np.unique(acc, return_index=True, return_inverse=True)
    rows = np.stack([c[first] for c, _ in coded], axis=1)
    joined = [
        ",".join(texts[c] for (_, texts), c in zip(coded, row, strict=True) if c >= 0) or None
        for row in rows.tolist()
    ]
    return ("few", joined, inverse.ravel())


def _always(frag: tuple[Any, ...]) -> bool:
    """Every row has this fragment."""
    return None not in frag[1] if frag[0] == "few" else frag[2].null_count == 0


def _text(frag: tuple[Any, ...], lead: str) -> str | pa.Array | None:
    """A fragment's text per row, each starting with ``lead`` (null where left out; a plain
    string when every row has the same)."""
    if frag[0] == "few":
        texts = [None if t is None else lead + t for t in frag[1]]
        if len(texts) == 1:
            return texts[0]
        return pc.take(pa.array(texts, pa.string()), pa.array(frag[2]))
    _, head, values = frag
    return pc.binary_join_element_wise(lead + head, values, "}", "")


def _attributes(batch: pa.RecordBatch) -> list[Any]:
    """The pieces of each row's ``,"attributes":[...]`` text (none for a span without
    any): when the first attribute is on every row, each further one brings its comma, so
    the span's text is joined in one pass; else they are joined first."""
    frags: list[tuple[Any, ...]] = []
    coded: list[tuple[np.ndarray, list[str]]] = []
    for name, key, kind, _ in _ATTRS:
        col = batch.column(name)
        if name == "op":  # the table's op is "" where the span has none (an empty op)
            col = _blank(col, pc.equal(col, ""))
        if col.null_count == len(col):
            continue
        few = _coded(col, key, kind)
        if few is not None:
            coded.append(few)
            continue
        if coded:
            frags.append(_joined(coded))
            coded = []
        head = '{"key":' + json.dumps(key) + ',"value":'
        frags.append(("many", head, _value_json(col, kind)))
    if coded:
        frags.append(_joined(coded))
    if not frags:
        return []
    if _always(frags[0]):
        rest = [_text(f, ",") for f in frags[1:]]
        return [',"attributes":[', _text(frags[0], ""), *rest, "]"]
    texts = [_text(f, "") for f in frags]
    attrs = pc.binary_join_element_wise(*texts, ",", null_handling="skip")
    has = pc.greater(pc.binary_length(attrs), 0)
    return [pc.if_else(has, pc.binary_join_element_wise(',"attributes":[', attrs, "]", ""), "")]


#: ``encode(n, trace, ids, parents, names, starts, ends, attrs, error)``: the spans' text and
#: its int64 offsets, written in C from the columns' Arrow buffers (the C++ observer's
#: ``span_json``, handed in by the tracer; arrays as :func:`_buffers` gives them), or
#: NotImplemented where it cannot (then Arrow's string kernels build it).
Encode = Callable[..., tuple[bytes, bytes]]
_KIND_OF_TYPE = {pa.int64(): 0, pa.bool_(): 1, pa.string(): 2, pa.list_(pa.int64()): 3,
                 pa.list_(pa.string()): 4}  # fmt: skip


def _buffers(col: pa.Array) -> tuple[Any, ...]:
    """``(kind, length, offset, validity, buffer 1, buffer 2, child offset, child buffer 1,
    child buffer 2)`` of an array (Arrow's layout; kinds as :data:`_KIND_CODE`); KeyError
    for another type."""
    kind = _KIND_OF_TYPE[col.type]
    bufs = col.buffers()
    if kind < 3:
        return (kind, len(col), col.offset, bufs[0], bufs[1], bufs[2] if kind == 2 else None,
                0, None, None)  # fmt: skip
    child = col.values
    cb = child.buffers()
    return (kind, len(col), col.offset, bufs[0], bufs[1], None, child.offset, cb[1],
            cb[2] if kind == 4 else None)  # fmt: skip


def _native_texts(batch: pa.RecordBatch, trace: str, encode: Encode) -> pa.Array | None:
    """:func:`span_texts` written by ``encode`` (None for a column it does not take)."""
    if batch.column("parent_id").null_count:
        return None
    attrs = []
    try:
        for name, key, _, _ in _ATTRS:
            col = batch.column(name)
            if name == "op":  # the table's op is "" where the span has none (an empty op)
                col = _blank(col, pc.equal(col, ""))
            if col.null_count < len(col):
                attrs.append(('{"key":' + json.dumps(key) + ',"value":', _buffers(col)))
        err = batch.column("error")
        cols = [_buffers(batch.column(c)) for c in ("span_id", "parent_id", "name", "start_ns",
                                                    "end_ns")]  # fmt: skip
    except KeyError:
        return None
    error = _buffers(err) if err.null_count < len(err) else None
    out = encode(len(batch), trace, *cols, attrs, error)
    if out is NotImplemented:
        return None
    text, offsets = out
    return pa.Array.from_buffers(pa.large_string(), len(batch),
                                 [None, pa.py_buffer(offsets), pa.py_buffer(text)])  # fmt: skip


def span_texts(batch: pa.RecordBatch, trace: str, encode: Encode | None = None) -> pa.Array:
    """The OTLP/JSON text of each row's span (a batch of :func:`event_columns`), each
    followed by ``,``, as the encoder writes it (the ``error`` column is also the span's
    status message). ``encode``: written in C (:data:`Encode`, about 1 µs of CPU per span
    against 5.4 µs here); None: with Arrow's string kernels, where runs of attributes with
    few distinct values are joined once per distinct combination, not per row."""
    if encode is not None:
        texts = _native_texts(batch, trace, encode)
        if texts is not None:
            return texts
    attrs = _attributes(batch)
    pieces: list[Any] = [
        '{"traceId":"' + trace + '","spanId":"', batch.column("span_id"),
        '","parentSpanId":"', batch.column("parent_id"), '","name":',
        # the name's text is {"n":"..."}: keep the quoted string after the colon
        pc.utf8_slice_codeunits(_json_of(batch.column("name"), "n"), 5, -1),
        ',"kind":1,"startTimeUnixNano":"', pc.cast(batch.column("start_ns"), pa.string()),
        '","endTimeUnixNano":"', pc.cast(batch.column("end_ns"), pa.string()), '"', *attrs,
    ]  # fmt: skip
    err = batch.column("error")  # written when truthy, as the status
    if err.null_count < len(err):
        msg = pc.utf8_slice_codeunits(_json_of(err, "m"), 5, -1)
        status = pc.binary_join_element_wise(',"status":{"code":2,"message":', msg, "}", "")
        pieces.append(pc.fill_null(status, ""))
    pieces.append("},")
    return pc.binary_join_element_wise(*pieces, "", null_handling="skip")


def span_lines(head: str, tail: str, texts: pa.Array, max_bytes: int) -> Iterator[bytes]:
    """Request lines of at most ``max_bytes`` bytes (a span longer than that gets a line of
    its own) from :func:`span_texts`' texts, each line ``head + spans + tail + "\\n"``: the
    lines of :func:`span_line_parts`, joined."""
    for parts in span_line_parts(head, tail, texts, max_bytes):
        yield b"".join(parts)


def span_line_parts(
    head: str, tail: str, texts: pa.Array, max_bytes: int
) -> Iterator[tuple[bytes, memoryview, bytes]]:
    """The lines of :func:`span_lines` as ``(head, spans, tail + "\\n")``: the spans are a
    view of the texts' buffer (no copy; the view keeps the buffer alive)."""
    if not len(texts):
        return
    texts = texts.cast(pa.large_string())
    offsets = np.frombuffer(texts.buffers()[1], np.int64)[
        texts.offset : texts.offset + len(texts) + 1
    ]
    view = memoryview(texts.buffers()[2])
    room = max_bytes - len(head) - len(tail)
    start = 0
    n = len(texts)
    head_b, tail_b = head.encode(), (tail + "\n").encode()
    while start < n:
        limit = offsets[start] + room  # each text's comma stands for the separator
        stop = int(np.searchsorted(offsets, limit, side="right")) - 1
        stop = min(max(stop, start + 1), n)
        yield head_b, view[int(offsets[start]) : int(offsets[stop]) - 1], tail_b
        start = stop
