"""One run's events as normalised columns (pyarrow), for the vectorised hazard rules.

A :class:`RunColumns` holds a run's events in event order (start, end, span id), one column
per :class:`~copytrace.analysis._view.Ev` field, normalised as the views were (absent booleans
false, absent step and byte counts 0, an empty ``error`` absent, ``transfer`` ``"none"``, the
call site as ``file:line function``, ``parent`` the position of the event's deepcopy group or
-1). Columns are computed when first asked for, so a rule that reads three columns costs three
columns. Rows are events; ``seq`` is the event's position in the run (or ``CopyEvent.seq`` for
events from memory).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from copytrace.analysis._view import Ev
from copytrace.tracefile._parse import EVENT_SCHEMA

__all__ = ["RunColumns", "columns_of"]

#: Column types of the event table (``copytrace.tracefile``).
EVENT_TYPES = {f.name: f.type for f in EVENT_SCHEMA}

_BOOLS = ("group", "alias", "noop", "non_blocking", "requires_grad", "src_requires_grad",
          "snapshot", "stale")  # fmt: skip
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

    Args:
        n: number of events.
        run: the run's index.
        get: ``get(name)`` -> the normalised column ``name`` (pyarrow array, one value per
            event, in event order).
        evs: the :class:`Ev` objects themselves when the run came from memory.
    """

    def __init__(self, n: int, run: int, get: Any, evs: Sequence[Ev] | None = None) -> None:
        self.n = n
        self.run = run
        self._get = get
        self._evs = evs
        self._cache: dict[str, Any] = {}

    def col(self, name: str) -> Any:
        """The normalised column ``name`` (a pyarrow array or chunked array)."""
        out = self._cache.get(name)
        if out is None:
            if name.endswith("_key"):  # a list column as text: equal lists, equal keys
                col = self.col(name.removesuffix("_key"))
                if pa.types.is_integer(col.type.value_type):
                    col = pc.cast(col, pa.list_(pa.string()))
                out = pc.fill_null(pc.binary_join(col, "\x1f"), "")
            else:
                out = self._get(name)
            self._cache[name] = out
        return out

    def np(self, name: str) -> np.ndarray:
        """A boolean or integer column with no nulls as a numpy array."""
        key = "np:" + name
        out = self._cache.get(key)
        if out is None:
            out = self._cache[key] = np.asarray(self.col(name).to_numpy(zero_copy_only=False))
        return out

    # -- predicates (numpy boolean masks, Python truthiness) -------------------------------------
    def flag(self, name: str) -> np.ndarray:
        """``bool(e.name)`` of a boolean column."""
        key = "flag:" + name
        out = self._cache.get(key)
        if out is None:
            col = pc.fill_null(self.col(name), False)
            out = self._cache[key] = np.asarray(col.to_numpy(zero_copy_only=False), dtype=bool)
        return out

    def null(self, name: str) -> np.ndarray:
        """``e.name is None``."""
        return np.asarray(pc.is_null(self.col(name)).to_numpy(zero_copy_only=False))

    def truthy(self, name: str) -> np.ndarray:
        """``bool(e.name)`` of a string, integer or list column (null, empty, 0: false)."""
        col = self.col(name)
        if pa.types.is_string(col.type):
            test = pc.greater(pc.utf8_length(col), 0)
        elif pa.types.is_list(col.type):
            test = pc.greater(pc.list_value_length(col), 0)
        else:
            test = pc.not_equal(col, 0)
        return np.asarray(pc.fill_null(test, False).to_numpy(zero_copy_only=False))

    def isin(self, name: str, values: Any) -> np.ndarray:
        """``e.name in values`` (a null is in no set of strings)."""
        test = pc.is_in(self.col(name), value_set=pa.array(sorted(values), _type_of(name)))
        return np.asarray(pc.fill_null(test, False).to_numpy(zero_copy_only=False))

    def eq(self, name: str, value: Any) -> np.ndarray:
        """``e.name == value``."""
        test = pc.equal(self.col(name), pa.scalar(value, _type_of(name)))
        return np.asarray(pc.fill_null(test, False).to_numpy(zero_copy_only=False))

    def filled(self, name: str) -> np.ndarray:
        """``e.name or 0`` of an integer column, as numpy int64."""
        col = pc.fill_null(self.col(name), 0)
        return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.int64)

    def ints(self, name: str, rows: np.ndarray) -> np.ndarray:
        """``e.name or 0`` of an integer column at ``rows``."""
        col = pc.take(self.col(name), pa.array(rows, pa.int64()))
        return np.asarray(pc.fill_null(col, 0).to_numpy(zero_copy_only=False), dtype=np.int64)

    def values(self, name: str, rows: np.ndarray) -> list[Any]:
        """The Python values of column ``name`` at ``rows``."""
        if self._evs is not None:
            return [getattr(self._evs[i], name) for i in rows.tolist()]
        return pc.take(self.col(name), pa.array(rows, pa.int64())).to_pylist()  # type: ignore[no-any-return]

    # -- rows ---------------------------------------------------------------------------------------
    def evs(self, rows: np.ndarray) -> list[Ev]:
        """The :class:`Ev` of each row in ``rows`` (in that order)."""
        if self._evs is not None:
            evs = self._evs
            return [evs[i] for i in rows.tolist()]
        idx = pa.array(rows, pa.int64())
        cols = {name: pc.take(self.col(name), idx).to_pylist() for name in Ev.__slots__}
        out = []
        for i in range(len(rows)):
            fields = {name: values[i] for name, values in cols.items()}
            for name in _LISTS:
                fields[name] = tuple(fields[name]) if fields[name] else ()
            out.append(Ev(**fields))
        return out

    def groups(self, mask: np.ndarray, keys: Sequence[str]) -> list[np.ndarray]:
        """The rows where ``mask`` holds, grouped by equal values of ``keys``: one array of
        rows (ascending) per group, groups in order of their first row."""
        rows = np.flatnonzero(mask)
        if not len(rows):
            return []
        idx = pa.array(rows, pa.int64())
        tab = pa.table({**{f"k{i}": pc.take(self.col(k), idx) for i, k in enumerate(keys)},
                        "row": idx})  # fmt: skip
        grouped = tab.group_by([f"k{i}" for i in range(len(keys))], use_threads=False)
        lists = grouped.aggregate([("row", "list")]).column("row_list")
        flat = np.asarray(pc.list_flatten(lists).to_numpy(zero_copy_only=False))
        bounds = np.cumsum(np.asarray(pc.list_value_length(lists).to_numpy(zero_copy_only=False)))
        return np.split(flat, bounds[:-1])


# --- building: from the event table ------------------------------------------------------------
#: Columns read at once (the keys that order a run's rows, and what the rules' selections
#: read); the others are read one by one when asked for (a pair rule's candidates).
FIRST_COLUMNS = sorted({
    "run", "name", "start_ns", "end_ns", "span_id", "parent_id", "group", "error", "op",
    "noop", "alias", "via", "saved_by", "snapshot", "stale", "write_site", "retained_bytes",
    "transfer", "non_blocking", "pinned", "src_storage", "src_version", "dst_storage",
    "bytes_allocated", "bytes_logical", "inplace_writes", "graph", "step", "file", "line",
    "function",
})  # fmt: skip


def _run_rows(keys: pa.Table, run: str) -> Any:
    """The positions in ``keys`` (rows of the parts that hold ``run``) of ``run``'s events
    (not run, step or hazards spans), in event order (start, end, span id)."""
    from copytrace.tracefile import META_SPANS

    keep = pc.and_(pc.equal(keys.column("run"), run),
                   pc.invert(pc.is_in(keys.column("name"), pa.array(sorted(META_SPANS)))))
    kept = pc.indices_nonzero(pc.fill_null(keep, False))
    rows = keys.select(["start_ns", "end_ns", "span_id"]).take(kept)
    order = pc.sort_indices(rows, [("start_ns", "ascending"), ("end_ns", "ascending"),
                                   ("span_id", "ascending")])  # fmt: skip
    return pc.take(kept, order)


def _table_getter(parts: list[Any], run: str, index: int) -> tuple[int, Any]:
    """``(events, get)``: ``get(name)`` gives column ``name`` of ``run``'s events in event
    order, normalised (:data:`FIRST_COLUMNS` are read at once, the others when asked for)."""
    first = pa.concat_tables([p.read(FIRST_COLUMNS) for p in parts])
    take = _run_rows(first, run)
    n = len(take)
    cache: dict[str, Any] = {}

    def raw(name: str) -> Any:
        col = cache.get(name)
        if col is None:
            if name in FIRST_COLUMNS:
                whole = first.column(name)
            else:
                whole = pa.chunked_array(
                    [c for p in parts for c in p.read([name]).column(0).chunks],
                    type=EVENT_TYPES[name],
                )
            col = cache[name] = pc.take(whole, take)
        return col

    def get(name: str) -> Any:
        if name in _BOOLS:
            return pc.fill_null(raw(name), False)
        if name in _INTS0:
            return pc.fill_null(raw(name), 0)
        if name == "error":
            err = raw("error")
            return pc.if_else(pc.equal(err, ""), pa.scalar(None, pa.string()), err)
        if name == "transfer":
            return pc.fill_null(raw("transfer"), "none")
        if name == "site":
            return _site_column(raw("file"), raw("line"), raw("function"))
        if name == "seq":
            return pa.array(np.arange(n, dtype=np.int64))
        if name == "run":
            return pa.array(np.full(n, index, dtype=np.int64))
        if name == "parent":
            return _parents(raw("span_id"), raw("parent_id"), get("group"))
        return raw(name)

    return n, get


def _parents(span_id: Any, parent_id: Any, group: Any) -> Any:
    """Position of each event's parent when that parent is a deepcopy group event, else -1."""
    groups = np.flatnonzero(np.asarray(group.to_numpy(zero_copy_only=False)))
    n = len(span_id)
    if not len(groups):
        return pa.array(np.full(n, -1, dtype=np.int64))
    ids = pc.take(span_id, pa.array(groups, pa.int64()))
    where = pc.fill_null(pc.index_in(parent_id, value_set=ids), -1)
    where = np.asarray(where.to_numpy(zero_copy_only=False), dtype=np.int64)
    return pa.array(np.where(where >= 0, groups[np.maximum(where, 0)], -1))


def _table_runs(table: Any) -> Iterator[RunColumns]:
    from copytrace.analysis._table_view import _run_order

    for i, run in enumerate(_run_order(table)):
        parts = [p for p in table.parts if run in p.runs]
        n, get = _table_getter(parts, run, i)
        yield RunColumns(n, i, get)


# --- building: from views in memory ------------------------------------------------------------
def _ev_getter(evs: Sequence[Ev]) -> Any:
    def get(name: str) -> Any:
        values = [getattr(e, name) for e in evs]
        if name in _LISTS:
            values = [list(v) if v else [] for v in values]
        return pa.array(values, _type_of(name))

    return get


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
        yield RunColumns(len(evs), run, _ev_getter(evs), evs)
