"""One run's events as normalised columns (pyarrow), for the vectorised hazard rules.

A :class:`RunColumns` gives a run's events in event order (start, end, span id), one column
per :class:`~copytrace.analysis._view.Ev` field, read as the views read them (absent booleans
false, absent step and byte counts 0, an empty ``error`` absent, ``transfer`` ``"none"``, the
call site as ``file:line function``, ``parent`` the position of the event's deepcopy group or
-1). A column is read from the table when first asked for, so a rule that reads three columns
costs three columns; predicates give numpy masks over the events, and values are decoded only
at the events asked for. ``seq`` is the event's position in the run (or ``CopyEvent.seq`` for
events from memory).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from copytrace.analysis._dense import dense, first_rows
from copytrace.analysis._view import Ev
from copytrace.tracefile._parse import EVENT_SCHEMA

__all__ = ["RunColumns", "columns_of"]

#: Column types of the event table (``copytrace.tracefile``).
EVENT_TYPES = {f.name: f.type for f in EVENT_SCHEMA}

_BOOLS = ("group", "alias", "noop", "non_blocking", "requires_grad", "src_requires_grad",
          "snapshot", "stale", "recompute", "autocast_nocache")  # fmt: skip
_INTS0 = ("step", "bytes_allocated", "bytes_logical")
_INTS = ("src_storage", "src_offset", "src_version", "dst_storage", "dst_version",
         "inplace_writes", "retained_bytes")  # fmt: skip
_LISTS = {"aten": pa.list_(pa.string()), "shape": pa.list_(pa.int64()),
          "src_stride": pa.list_(pa.int64()), "saved_by": pa.list_(pa.string())}  # fmt: skip


def _type_of(name: str) -> pa.DataType:
    if name in _BOOLS or name == "pinned":
        return pa.bool_()
    if name in _INTS0 or name in _INTS or name in ("seq", "run", "parent"):
        return pa.int64()
    return _LISTS.get(name, pa.string())


def _site_column(file: Any, line: Any, func: Any) -> Any:
    """``file:line function`` (``file:line`` without a function, ``file`` without a line;
    null without a file)."""
    line = pc.cast(line, "string")
    site = pc.if_else(pc.is_valid(line), pc.binary_join_element_wise(file, line, ":"), file)
    with_func = pc.binary_join_element_wise(site, func, " ")
    has_func = pc.fill_null(pc.greater(pc.utf8_length(func), 0), False)
    site = pc.if_else(has_func, with_func, site)
    empty = pc.fill_null(pc.equal(file, ""), True)
    return pc.if_else(empty, pa.scalar(None, pa.string()), site)


class RunColumns:
    """The events of one run, column by column (see the module docstring).

    Columns stay as read (over the source rows, strings dictionary-encoded where the source
    allows): predicates run over them (a string predicate over each dictionary's distinct
    values only) and come back as numpy masks in event order; values are taken, decoded and
    normalised only at the rows asked for.

    Args:
        n: number of events.
        run: the run's index.
        raw: ``raw(name)`` -> column ``name`` over the source rows (pyarrow array or chunked
            array).
        order: the source row of each event, in event order (None: the source rows are the
            events, in order).
        evs: the :class:`Ev` objects themselves when the run came from memory.
    """

    def __init__(
        self,
        n: int,
        run: int,
        raw: Any,
        order: np.ndarray | None = None,
        evs: Sequence[Ev] | None = None,
    ) -> None:
        self.n = n
        self.run = run
        self._read = raw
        self.order = order
        self._evs = evs
        self._cache: dict[str, Any] = {}

    def prefetch(self, names: Sequence[str]) -> None:
        """Read the columns ``names`` not yet read in one pass over the source (one read of
        each Parquet part for all of them, against one per column and part: on a 1M-event
        sidecar of 16 parts, 40 columns read so take about a third less CPU)."""
        many = getattr(self._read, "many", None)
        todo = [n for n in dict.fromkeys(names) if n not in self._cache]
        if many is not None and todo:
            self._cache.update(many(todo))

    def raw(self, name: str) -> Any:
        """Column ``name`` over the source rows, as read (cached)."""
        out = self._cache.get(name)
        if out is None:
            out = self._cache[name] = self._read(name)
        return out

    def _events(self, values: np.ndarray) -> np.ndarray:
        """Source-row values in event order."""
        return values if self.order is None else values[self.order]

    def _mask(self, test: Any) -> np.ndarray:
        """A boolean pyarrow column over the source rows as a numpy mask in event order
        (null: false)."""
        arr = np.asarray(pc.fill_null(test, False).to_numpy(zero_copy_only=False), dtype=bool)
        return self._events(arr)

    def _strings(self, name: str, test: Any) -> Any:
        """``test(strings)`` over a string column, once per distinct value where the column
        is dictionary-encoded."""
        col = self.raw(name)
        chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
        out = [pc.take(test(c.dictionary), c.indices) if pa.types.is_dictionary(c.type)
               else test(c) for c in chunks]  # fmt: skip
        return pa.chunked_array(out, pa.bool_())

    # -- predicates (numpy boolean masks in event order, Python truthiness) ----------------------
    def flag(self, name: str) -> np.ndarray:
        """``bool(e.name)`` of a boolean column."""
        key = "flag:" + name
        out = self._cache.get(key)
        if out is None:
            out = self._cache[key] = self._mask(self.raw(name))
        return out

    def null(self, name: str) -> np.ndarray:
        """``e.name is None`` (an empty ``error`` is none)."""
        test = pc.is_null(self.raw(name))
        if name == "error":
            test = pc.or_(test, pc.fill_null(self._strings(name, lambda c: pc.equal(c, "")),
                                             False))  # fmt: skip
        return self._mask(test)

    def truthy(self, name: str) -> np.ndarray:
        """``bool(e.name)`` of a string, integer or list column (null, empty, 0: false)."""
        col = self.raw(name)
        if pa.types.is_list(col.type):
            return self._mask(pc.greater(pc.list_value_length(col), 0))
        if pa.types.is_integer(col.type):
            return self._mask(pc.not_equal(col, 0))
        return self._mask(self._strings(name, lambda c: pc.greater(pc.utf8_length(c), 0)))

    def isin(self, name: str, values: Any) -> np.ndarray:
        """``e.name in values`` of a string column (a null is in no set)."""
        value_set = pa.array(sorted(values), pa.string())
        return self._mask(self._strings(name, lambda c: pc.is_in(c, value_set=value_set)))

    def eq(self, name: str, value: Any) -> np.ndarray:
        """``e.name == value`` (a string, or a boolean's ``is value``)."""
        if isinstance(value, bool):
            return self._mask(pc.equal(self.raw(name), value))
        return self._mask(self._strings(name, lambda c: pc.equal(c, value)))

    def np(self, name: str) -> np.ndarray:
        """``seq``, or an integer column with absent values 0, as numpy int64 in event
        order."""
        key = "np:" + name
        out = self._cache.get(key)
        if out is None:
            if name == "seq" and self._evs is None:
                out = np.arange(self.n, dtype=np.int64)
            else:
                col = pc.fill_null(self.raw(name), 0)
                out = self._events(np.asarray(col.to_numpy(zero_copy_only=False), np.int64))
            self._cache[key] = out
        return out

    filled = np

    # -- values at rows -----------------------------------------------------------------------------
    def _at(self, rows: np.ndarray) -> Any:
        src = rows if self.order is None else self.order[rows]
        return pa.array(src, pa.int64())

    def take(self, name: str, rows: np.ndarray) -> Any:
        """Column ``name`` at ``rows`` (event positions), decoded and normalised as the
        :class:`Ev` fields are; ``site`` is ``file:line function``; ``NAME_key`` is list
        column ``NAME`` as text (equal lists, equal keys)."""
        if name in ("site", "lib_site"):  # the user's / the library's call site
            p = "lib_" if name == "lib_site" else ""
            return _site_column(self.take(p + "file", rows), self.take(p + "line", rows),
                                self.take(p + "function", rows))  # fmt: skip
        if name.endswith("_key"):
            col = self.take(name.removesuffix("_key"), rows)
            if pa.types.is_integer(col.type.value_type):
                col = pc.cast(col, pa.list_(pa.string()))
            return pc.fill_null(pc.binary_join(col, "\x1f"), "")
        if name in ("seq", "run", "parent"):
            values = (self.np("seq")[rows] if name == "seq" else self.parents(rows)
                      if name == "parent" else np.full(len(rows), self.run))  # fmt: skip
            return pa.array(values, pa.int64())
        col = pc.take(self.raw(name), self._at(rows))
        if pa.types.is_dictionary(col.type):
            col = pc.cast(col, col.type.value_type)
        if name in _BOOLS:
            return pc.fill_null(col, False)
        if name in _INTS0:
            return pc.fill_null(col, 0)
        if name == "error":
            return pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col)
        if name == "transfer":
            return pc.fill_null(col, "none")
        return col

    def values(self, name: str, rows: np.ndarray) -> list[Any]:
        """The Python values of ``name`` at ``rows``."""
        if self._evs is not None:
            return [getattr(self._evs[i], name) for i in rows.tolist()]
        return self.take(name, rows).to_pylist()  # type: ignore[no-any-return]

    def span_ids(self, rows: np.ndarray) -> Any:
        """The span ids of the events at ``rows`` that have one (not empty), as a pyarrow
        string array."""
        ids = pa.array(self.values("span_id", rows), pa.string()) if self._evs is not None \
            else self.take("span_id", rows)  # fmt: skip
        if isinstance(ids, pa.ChunkedArray):
            ids = ids.combine_chunks()
        keep = pc.fill_null(pc.greater(pc.utf8_length(ids), 0), False)
        return ids if pc.all(keep).as_py() is not False else ids.filter(keep)

    def ints(self, name: str, rows: np.ndarray) -> np.ndarray:
        """``e.name or 0`` of an integer column at ``rows``."""
        return self.np(name)[rows]

    def parents(self, rows: np.ndarray) -> np.ndarray:
        """Event position of the deepcopy group each event at ``rows`` belongs to, or -1."""
        if self._evs is not None:
            return np.array([self._evs[i].parent for i in rows.tolist()], dtype=np.int64)
        groups = np.flatnonzero(self.flag("group"))
        if not len(groups) or not len(rows):
            return np.full(len(rows), -1, dtype=np.int64)
        ids = self.take("span_id", groups)
        where = pc.fill_null(pc.index_in(self.take("parent_id", rows), value_set=ids), -1)
        where = np.asarray(where.to_numpy(zero_copy_only=False), dtype=np.int64)
        return np.where(where >= 0, groups[np.maximum(where, 0)], -1)

    def evs(self, rows: np.ndarray) -> list[Ev]:
        """The :class:`Ev` of each event at ``rows`` (in that order)."""
        if self._evs is not None:
            evs = self._evs
            return [evs[i] for i in rows.tolist()]
        cols = {name: self.take(name, rows).to_pylist() for name in Ev.__slots__}
        out = []
        for i in range(len(rows)):
            fields = {name: values[i] for name, values in cols.items()}
            for name in _LISTS:
                fields[name] = tuple(fields[name]) if fields[name] else ()
            out.append(Ev(**fields))
        return out

    def codes(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Integer codes of column ``name`` at ``rows``: equal values, equal codes (as Python
        compares them: a null is only equal to a null; a string's null code is -1). A column's
        codes are made once over all events (:meth:`all_codes`), strings through their
        dictionaries and ``site`` through the ``(file, line, function)`` triples, so no text
        is built per row."""
        if self._evs is not None:
            return _dense(pc.dictionary_encode(_ev_column(self._evs, name, rows)))
        if name.endswith("_key"):
            col = self.take(name.removesuffix("_key"), rows)
            codes = _list_codes(col)
            if codes is not None:
                return codes
            return _dense(pc.dictionary_encode(self.take(name, rows)))
        if name in ("seq", "run", "parent"):
            return np.asarray(self.take(name, rows).to_numpy(), dtype=np.int64)
        return self.all_codes(name)[rows]  # type: ignore[no-any-return]

    def all_codes(self, name: str) -> np.ndarray:
        """:meth:`codes` of column ``name`` over all events, in event order (cached)."""
        key = "codes:" + name
        out = self._cache.get(key)
        if out is None:
            if name == "site":
                out = self._site_codes()
            else:
                col = self.raw(name)
                if pa.types.is_string(col.type) or pa.types.is_dictionary(col.type):
                    out = self._events(_string_codes(col))
                else:
                    out = self.ids(name)
            self._cache[key] = out
        return out  # type: ignore[no-any-return]

    def _site_codes(self) -> np.ndarray:
        """:meth:`all_codes` of ``site`` (``file:line function``; no file: no site, -1).

        The text is built only when a file or function name holds ``:`` or a space: without
        them it is ``FILE[:LINE][ FUNCTION]``, read back into one triple, so equal triples
        (no function and an empty one alike) are equal texts and the triples' codes are the
        texts' codes."""
        no_file = self.null("file") | self.eq("file", "")
        no_func = self.null("function") | self.eq("function", "")
        if _has_separator(self.raw("file")) or _has_separator(self.raw("function")):
            triple = _combine([self.all_codes(k) for k in ("file", "line", "function")])
            firsts = first_rows(triple)  # a row of each triple
            text = pc.dictionary_encode(self.take("site", firsts))
            return _dense(text)[triple]  # type: ignore[no-any-return]
        key = _combine([np.where(no_file, -1, self.all_codes("file")),
                        np.where(no_file, 0, self.ids("line")),
                        np.where(no_file | no_func, -1, self.all_codes("function"))])  # fmt: skip
        return np.where(no_file, -1, key)  # type: ignore[no-any-return]

    def ids(self, name: str) -> np.ndarray:
        """An integer column over all events, in event order, with an absent value as
        ``INT64_MIN`` (so that equality is Python's: an absent value equals only an absent
        one)."""
        key = "ids:" + name
        out = self._cache.get(key)
        if out is None:
            if self._evs is not None:
                col = _ev_column(self._evs, name)
                null = np.asarray(pc.is_null(col).to_numpy(zero_copy_only=False), dtype=bool)
                ints = np.asarray(pc.fill_null(col, 0).to_numpy(zero_copy_only=False), np.int64)
            else:
                col = self.raw(name)
                null = self._mask(pc.is_null(col))
                ints = self._events(np.asarray(pc.fill_null(col, 0).to_numpy(
                    zero_copy_only=False), np.int64))  # fmt: skip
            out = self._cache[key] = np.where(null, np.iinfo(np.int64).min, ints)
        return out  # type: ignore[no-any-return]

    def labels(self, mask: np.ndarray, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The events where ``mask`` holds (ascending) and, for each, its group by equal values
        of ``keys``: ``0 .. k-1``, groups numbered in order of their first event."""
        rows = np.flatnonzero(mask)
        if not len(rows):
            return rows, rows
        inverse = _combine([self.codes(k, rows) for k in keys])
        first = first_rows(inverse)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first))
        return rows, rank[inverse]

    def groups(self, mask: np.ndarray, keys: Sequence[str]) -> list[np.ndarray]:
        """The events where ``mask`` holds, grouped by equal values of ``keys``: one array of
        event positions (ascending) per group, groups in order of their first event."""
        rows, group = self.labels(mask, keys)
        if not len(rows):
            return []
        order = np.argsort(group, kind="stable")
        bounds = np.flatnonzero(np.diff(group[order])) + 1
        return np.split(rows[order], bounds)


def _combine(columns: list[np.ndarray]) -> np.ndarray:
    """One code per row for the tuple of its codes in ``columns``: ``0 .. k-1`` for the
    ``k`` distinct tuples, in sorted order."""
    key: np.ndarray | None = None
    for col in columns:
        _, codes = dense(col)
        if key is not None and len(codes):  # (no row: nothing to combine)
            _, codes = dense(key * (int(codes.max()) + 1) + codes)
        key = codes
    assert key is not None
    return key


def _dense(encoded: Any) -> np.ndarray:
    """Codes of a dictionary-encoded column whose dictionary has distinct values (nulls:
    -1)."""
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    idx = pc.fill_null(encoded.indices, -1)
    return np.asarray(idx.to_numpy(zero_copy_only=False), dtype=np.int64)


def _string_codes(col: Any) -> np.ndarray:
    """Codes of a string column, dictionary-encoded or not, whose chunks may have different
    dictionaries (or repeat a value): the same string, the same code (nulls: -1). The
    chunks' dictionaries are unified by one ``dictionary_encode``: no Python object per
    value."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    if not chunks:
        return np.zeros(0, dtype=np.int64)
    if not pa.types.is_dictionary(chunks[0].type):
        return _dense(pc.dictionary_encode(pa.chunked_array(chunks, chunks[0].type)))
    values = pa.chunked_array([c.dictionary for c in chunks], chunks[0].type.value_type)
    unified = _dense(pc.dictionary_encode(values))  # each chunk's dictionary, in turn
    starts = np.cumsum([0] + [len(c.dictionary) for c in chunks])
    lut = np.append(unified, -1)  # the last: a null
    out = []
    for c, start in zip(chunks, starts.tolist(), strict=False):
        idx = np.asarray(pc.fill_null(c.indices, -1).to_numpy(zero_copy_only=False), np.int64)
        out.append(lut[np.where(idx >= 0, idx + start, len(unified))])
    return np.concatenate(out)



#: Lists longer than this are coded through their text.
_LIST_WIDTH = 16


def _list_codes(col: Any) -> np.ndarray | None:
    """Codes of an integer list column (an absent list as an empty one: equal codes, equal
    lists, as their ``NAME_key`` text), one column of codes per position; None for a list
    with a null item or longer than :data:`_LIST_WIDTH` (then the text decides)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if not pa.types.is_integer(col.type.value_type):
        return None
    flat = pc.list_flatten(col)
    lengths = np.asarray(pc.fill_null(pc.list_value_length(col), 0).to_numpy(
        zero_copy_only=False), np.int64)  # fmt: skip
    if flat.null_count or int(lengths.max(initial=0)) > _LIST_WIDTH:
        return None
    parent = np.asarray(pc.list_parent_indices(col).to_numpy(), np.int64)
    values = np.asarray(flat.to_numpy(zero_copy_only=False), np.int64)
    start = np.cumsum(lengths) - lengths  # each list's first item in ``flat``
    pos = np.arange(len(flat)) - start[parent]
    columns = [lengths]
    for j in range(int(lengths.max(initial=0))):
        at = pos == j
        item = np.zeros(len(lengths), dtype=np.int64)
        item[parent[at]] = values[at]
        columns.append(item)
    return _combine(columns)


def _has_separator(col: Any) -> bool:
    """Whether a value of string column ``col`` (its dictionaries only, where encoded) holds
    ``:`` or a space."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    for c in chunks:
        values = c.dictionary if pa.types.is_dictionary(c.type) else c
        if len(values) and pc.any(pc.match_substring_regex(values, "[: ]")).as_py():
            return True
    return False


# --- building: from the event table ------------------------------------------------------------
#: String columns read dictionary-encoded (few distinct values; span ids are all distinct).
_PLAIN_STRINGS = frozenset(("span_id", "parent_id"))


def _read_column(parts: list[Any], name: str) -> Any:
    """Column ``name`` of every part, as one chunked array (strings dictionary-encoded when
    read from Parquet)."""
    typ = EVENT_TYPES[name]
    as_dict = [name] if pa.types.is_string(typ) and name not in _PLAIN_STRINGS else None
    chunks = []
    for part in parts:
        chunks.extend(part.read([name], dictionary=as_dict).column(0).chunks)
    if not chunks:
        return pa.chunked_array([], typ)
    return pa.chunked_array(chunks)


def _read_columns(parts: list[Any], names: list[str]) -> dict[str, Any]:
    """:func:`_read_column` of each of ``names``, each part read once for all of them."""
    names = [n for n in names if n in EVENT_TYPES]
    as_dict = [n for n in names if pa.types.is_string(EVENT_TYPES[n]) and n not in _PLAIN_STRINGS]
    chunks: dict[str, list[Any]] = {n: [] for n in names}
    for part in parts:
        tab = part.read(names, dictionary=as_dict or None)
        for n in names:
            chunks[n].extend(tab.column(n).chunks)
    return {n: pa.chunked_array(c) if c else pa.chunked_array([], EVENT_TYPES[n])
            for n, c in chunks.items()}  # fmt: skip


class _Reader:
    """``reader(name)``: one column of ``parts``; ``reader.many(names)``: several."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def __call__(self, name: str) -> Any:
        return _read_column(self.parts, name)

    def many(self, names: list[str]) -> dict[str, Any]:
        return _read_columns(self.parts, names)


def _event_order(parts: list[Any], run: str) -> np.ndarray:
    """The source rows (the parts' rows, concatenated) of ``run``'s events (not run, step or
    hazards spans), in event order (start, end, span id). Span ids are read only when two
    events have the same start and end."""
    from copytrace.tracefile import META_SPANS

    several = any(len(p.runs) > 1 for p in parts)
    name = _read_column(parts, "name")
    meta = pa.chunked_array(
        [pc.take(pc.is_in(c.dictionary, value_set=pa.array(sorted(META_SPANS))), c.indices)
         if pa.types.is_dictionary(c.type)
         else pc.is_in(c, value_set=pa.array(sorted(META_SPANS))) for c in name.chunks],
        pa.bool_(),
    )  # fmt: skip
    keep = pc.invert(pc.fill_null(meta, False))
    if several:
        runs = pc.cast(_read_column(parts, "run"), pa.string())
        keep = pc.and_(keep, pc.fill_null(pc.equal(runs, run), False))
    kept = np.asarray(pc.indices_nonzero(keep).to_numpy(), dtype=np.int64)
    start = np.asarray(_read_column(parts, "start_ns").to_numpy(), dtype=np.int64)[kept]
    end = np.asarray(_read_column(parts, "end_ns").to_numpy(), dtype=np.int64)[kept]
    order = np.lexsort((end, start))
    start, end = start[order], end[order]
    if not bool(np.any((start[1:] == start[:-1]) & (end[1:] == end[:-1]))):
        return kept[order]  # type: ignore[no-any-return]
    keys = pa.table({"start": start, "end": end,
                     "span_id": pc.take(_read_column(parts, "span_id"), kept[order])})
    again = pc.sort_indices(keys, [("start", "ascending"), ("end", "ascending"),
                                   ("span_id", "ascending")])  # fmt: skip
    return kept[order][np.asarray(again.to_numpy(), dtype=np.int64)]  # type: ignore[no-any-return]


def _run_order(table: Any) -> list[str]:
    """Runs (trace ids) by start (the run span's, else the earliest span's), then trace id."""
    from copytrace.schema import SPAN_RUN

    if any(len(p.runs) != 1 for p in table.parts):  # a file of several processes: rare
        from copytrace.analysis._table_view import _run_order as by_rows

        return by_rows(table)  # type: ignore[no-any-return]
    starts: dict[str, int] = {}
    run_starts: dict[str, int] = {}
    for part in table.parts:
        (run,) = part.runs
        start = pc.min(_read_column([part], "start_ns")).as_py()
        if start is None:
            continue
        starts[run] = min(starts.get(run, start), start)
        name = _read_column([part], "name")
        is_run = pa.chunked_array(
            [pc.take(pc.equal(c.dictionary, SPAN_RUN), c.indices)
             if pa.types.is_dictionary(c.type) else pc.equal(c, SPAN_RUN) for c in name.chunks],
            pa.bool_(),
        )  # fmt: skip
        where = pc.indices_nonzero(pc.fill_null(is_run, False))
        if len(where):
            run_starts[run] = pc.take(_read_column([part], "start_ns"), where)[0].as_py()
    return sorted(starts, key=lambda r: (run_starts.get(r, starts[r]), r))


def _table_runs(table: Any) -> Iterator[RunColumns]:
    for i, run in enumerate(_run_order(table)):
        parts = [p for p in table.parts if run in p.runs]
        order = _event_order(parts, run)
        yield RunColumns(len(order), i, _Reader(parts), order)


# --- building: from views in memory ------------------------------------------------------------
def _ev_column(evs: Sequence[Ev], name: str, rows: np.ndarray | None = None) -> Any:
    """Field ``name`` of ``evs`` (at ``rows``) as a pyarrow array."""
    picked = evs if rows is None else [evs[i] for i in rows.tolist()]
    if name.endswith("_key"):
        return pa.array(["\x1f".join(map(str, getattr(e, name[:-4]) or ())) for e in picked],
                        pa.string())  # fmt: skip
    values = [getattr(e, name) for e in picked]
    if name in _LISTS:
        values = [list(v) if v else [] for v in values]
    return pa.array(values, _type_of(name))


def columns_of(source: Any) -> Iterator[RunColumns]:
    """One :class:`RunColumns` per run of ``source`` (what :func:`copytrace.analysis.analyze`
    takes), in run order; a table's runs are read one at a time."""
    import os

    if isinstance(source, (str, os.PathLike)):
        from copytrace.tracefile import event_table

        source = event_table(source)
    if hasattr(source, "parts") and hasattr(source, "files"):  # an EventTable
        yield from _table_runs(source)
        return
    from copytrace.analysis._view import runs_of

    for i, evs in enumerate(runs_of(source)):
        run = evs[0].run if evs and evs[0].run is not None else i
        yield RunColumns(len(evs), run, lambda name, evs=evs: _ev_column(evs, name), None, evs)
