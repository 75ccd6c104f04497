"""Analyser views (:class:`~copytrace.analysis._view.Ev`) built from the columnar event table
(:func:`copytrace.tracefile.event_table`), one run at a time, column by column.

Normalisation (defaults, call-site text) runs in pyarrow over whole columns, values are
dictionary-decoded (equal values share one Python object) and rows are converted a chunk at
a time, so memory stays near that of the ``Ev`` objects themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from copytrace.analysis._view import Ev

__all__ = ["TableRuns", "table_runs"]

_BOOLS = ("group", "alias", "noop", "non_blocking", "requires_grad", "src_requires_grad",
          "snapshot", "stale", "autocast_nocache")  # fmt: skip
_INTS0 = ("step", "bytes_allocated", "bytes_logical")
_TUPLES = ("aten", "shape", "src_stride", "saved_by")
_PLAIN = ("op", "error", "dtype", "src_dtype", "src_device", "dst_device", "graph", "grad_fn",
          "phase", "module", "object_type", "via", "src_storage", "src_offset", "src_version",
          "dst_storage", "dst_version", "inplace_writes", "write_site", "src_name",
          "retained_bytes", "pinned", "span_id", "load_site", "origin")  # fmt: skip


def _maker(keys: tuple[str, ...]) -> Any:
    """``make(seq, run, parent, *values of keys)``: an :class:`Ev` with one plain store per
    slot (slots not in ``keys`` are None)."""
    names = ("seq", "run", "parent", *keys)
    body = "".join(f"    e.{n} = {n}\n" for n in names)
    body += "".join(f"    e.{n} = None\n" for n in Ev.__slots__ if n not in names)
    src = f"def make({', '.join(names)}):\n    e = new(Ev)\n{body}    return e\n"
    namespace: dict[str, Any] = {"new": object.__new__, "Ev": Ev}
    exec(src, namespace)  # noqa: S102
    return namespace["make"]


_KEYS = tuple(k for k in (*_BOOLS, *_INTS0, *_TUPLES, *_PLAIN, "transfer", "site", "lib_site")
              if k in Ev.__slots__)  # fmt: skip
_MAKE = _maker(_KEYS)


def _run_order(table: Any) -> list[str]:
    """Runs by start (the run span's, else the earliest span's), then trace id."""
    import pyarrow.compute as pc

    starts: dict[str, int] = {}
    run_starts: dict[str, int] = {}
    for part in table.parts:
        tab = part.read(["run", "name", "start_ns"])
        if tab.num_rows == 0:
            continue
        grouped = tab.group_by("run").aggregate([("start_ns", "min")]).to_pylist()
        for row in grouped:
            starts[row["run"]] = min(starts.get(row["run"], row["start_ns_min"]),
                                     row["start_ns_min"])  # fmt: skip
        runs = tab.filter(pc.equal(tab.column("name"), "copytrace.run")).to_pylist()
        for row in runs:
            run_starts[row["run"]] = row["start_ns"]
    return sorted(starts, key=lambda r: (run_starts.get(r, starts[r]), r))


def _run_rows(table: Any, run: str) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    from copytrace.tracefile import META_SPANS

    parts = []
    meta = pa.array(sorted(META_SPANS))
    for part in table.parts:
        if run not in part.runs:
            continue
        alone = part.runs == [run]  # no filter to apply (and no copy to make) by run
        tab = part.read(_COLUMNS, filters=None if alone else pc.equal(pc.field("run"), run))
        parts.append(tab.filter(pc.invert(pc.is_in(tab.column("name"), meta))))
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def _site_column(tab: Any, p: str = "") -> Any:
    """The user's (``p=""``) or the library's (``p="lib_"``) call site per row."""
    import pyarrow.compute as pc

    file = tab.column(p + "file")
    line = pc.cast(tab.column(p + "line"), "string")
    func = tab.column(p + "function")
    site = pc.if_else(pc.is_valid(line), pc.binary_join_element_wise(file, line, ":"), file)
    with_func = pc.binary_join_element_wise(site, func, " ")
    has_func = pc.fill_null(pc.greater(pc.utf8_length(func), 0), False)
    site = pc.if_else(has_func, with_func, site)
    empty = pc.fill_null(pc.equal(file, ""), True)
    return pc.if_else(empty, None, site)


_CHUNK = 65_536
_COLUMNS = sorted({*_BOOLS, *_INTS0, *_TUPLES, *_PLAIN, "error", "transfer", "file", "line",
                   "function", "lib_file", "lib_line", "lib_function", "parent_id", "name",
                   "start_ns", "end_ns"})  # fmt: skip


def _decoded(col: Any) -> list[Any]:
    """A column as Python values, equal values sharing one object (dictionary-decoded: far
    less memory than one object per row, and faster)."""
    import numpy as np
    import pyarrow.compute as pc

    enc = pc.dictionary_encode(col)
    if hasattr(enc, "combine_chunks"):
        enc = enc.combine_chunks()
    values = np.array([*enc.dictionary.to_pylist(), None], dtype=object)
    idx = pc.fill_null(enc.indices, len(enc.dictionary)).to_numpy(zero_copy_only=False)
    return values[idx].tolist()


def _tuples(col: Any) -> list[tuple]:
    """A list column as tuples, equal tuples sharing one object: joined into text in
    pyarrow, dictionary-decoded, and each distinct text split back once."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ints = pa.types.is_integer(col.type.value_type)
    text = pc.binary_join(pc.cast(col, pa.list_(pa.string())) if ints else col, "\x1f")
    as_tuple: dict[Any, tuple] = {None: (), "": ()}
    out = _decoded(text)
    for key in set(out):
        if key not in as_tuple:
            parts = key.split("\x1f")
            as_tuple[key] = tuple(int(x) for x in parts) if ints else tuple(parts)
    return [as_tuple[k] for k in out]


def _views(tab: Any, run_index: int, start: int, position: dict[str, int]) -> list[Ev]:
    """Views of the rows of one chunk of a run (``start``: the chunk's first seq)."""
    import pyarrow.compute as pc

    cols: dict[str, list[Any]] = {}
    for name in _BOOLS:
        cols[name] = pc.fill_null(tab.column(name), False).to_pylist()
    for name in _INTS0:
        cols[name] = _decoded(pc.fill_null(tab.column(name), 0))
    for name in _TUPLES:
        cols[name] = _tuples(tab.column(name))
    for name in _PLAIN:
        cols[name] = _decoded(tab.column(name)) if name != "span_id" else \
            tab.column(name).to_pylist()  # fmt: skip
    error = tab.column("error")
    cols["error"] = _decoded(pc.if_else(pc.equal(error, ""), None, error))
    cols["transfer"] = _decoded(pc.fill_null(tab.column("transfer"), "none"))
    cols["site"] = _decoded(_site_column(tab))
    cols["lib_site"] = _decoded(_site_column(tab, "lib_"))
    parents = [position.get(p, -1) if p else -1 for p in tab.column("parent_id").to_pylist()]
    make = _MAKE
    values = zip(*(cols[k] for k in _KEYS), strict=True)
    return [make(start + i, run_index, parents[i], *row) for i, row in enumerate(values)]


def _run_views(tab: Any, run_index: int) -> list[Ev]:
    """Views of a run's rows in event order (start, end, span id), a chunk at a time (the
    rows are taken in order per chunk, never copied whole)."""
    import pyarrow.compute as pc

    order = pc.sort_indices(tab, [("start_ns", "ascending"), ("end_ns", "ascending"),
                                  ("span_id", "ascending")])  # fmt: skip
    # parents that are events are deepcopy groups: only their positions are needed
    is_group = pc.fill_null(pc.take(tab.column("group"), order), False)
    span_ids = pc.take(tab.column("span_id"), order)
    position = {span_ids[i].as_py(): i for i in pc.indices_nonzero(is_group).to_pylist()}
    out: list[Ev] = []
    for start in range(0, tab.num_rows, _CHUNK):
        chunk = tab.take(order.slice(start, _CHUNK))
        out.extend(_views(chunk, run_index, start, position))
    return out


def table_runs(table: Any, order: list[str] | None = None) -> Iterator[list[Ev]]:
    """One list of :class:`Ev` per run of an :class:`~copytrace.tracefile.EventTable`, in run
    order (start time, then trace id); only one run's views live at a time if the caller
    drops them."""
    import gc

    for i, run in enumerate(_run_order(table) if order is None else order):
        rows = _run_rows(table, run)
        # Millions of small objects, all kept and without cycles: the cyclic GC would walk
        # them again and again for nothing (3x slower), so pause it while building them.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            views = _run_views(rows, i)
        finally:
            if was_enabled:
                gc.enable()
        del rows
        yield views


#: Up to this many events the views are kept for the next pass (``check`` makes three);
#: beyond it each pass builds them again, one run at a time, so memory stays at one run's.
KEEP_VIEWS = 2_000_000


class TableRuns:
    """The runs of a table as lists of :class:`Ev`, built when iterated (a sequence for
    :func:`~copytrace.analysis._view.runs_of`'s callers, which only iterate and count)."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self._order = _run_order(table)
        self._kept: list[list[Ev]] | None = None

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[list[Ev]]:
        if self._kept is not None:
            yield from self._kept
            return
        keep = sum(p.rows for p in self.table.parts) <= KEEP_VIEWS
        kept: list[list[Ev]] = []
        for views in table_runs(self.table, self._order):
            if keep:
                kept.append(views)
            yield views
            if not keep:  # the caller has moved on: free this run before the next
                views.clear()
        if keep:
            self._kept = kept
