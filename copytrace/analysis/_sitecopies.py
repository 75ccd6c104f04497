"""The budget's copies per (step, call site) of one run, as columns.

A step's or the whole trace's call sites are counted by ``np.bincount`` over a run's columns;
their text (``file:line function``) is built only for the few rows a budget line names (its
top sites), never one Python object per (step, site): on a trace whose every copy has its own
call site that would be one dict entry per event.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["SiteCopies", "UNKNOWN_SITE", "column_sites", "top_sites", "whole_trace"]

#: The name of the copies without a call site.
UNKNOWN_SITE = "(unknown call site)"


class SiteCopies:
    """Counted copies per group (a step's call site, or a call site over the trace).

    Args:
        nbytes: bytes allocated per group (int64).
        copies: copies per group (int64).
        site: a code per group for its call site (equal sites, equal codes, within a run).
        where: ``(file, line, function)`` arrays, one row per group (the group's first copy),
            from which its text is built when asked for; or ``text``.
        text: the groups' call sites as text (a pyarrow string array), when already built.
    """

    def __init__(self, nbytes: np.ndarray, copies: np.ndarray, site: np.ndarray,
                 where: tuple[Any, Any, Any] | None = None, text: Any = None) -> None:  # fmt: skip
        self.bytes = nbytes
        self.copies = copies
        self.site = site
        self._where = where
        self._text = text

    def texts(self, idx: np.ndarray) -> Any:
        """The call sites of groups ``idx`` (a pyarrow string array; no site:
        :data:`UNKNOWN_SITE`)."""
        if self._text is not None:
            return pc.take(self._text, pa.array(idx, pa.int64()))
        from copytrace.analysis._columns import _site_column

        assert self._where is not None
        at = pa.array(idx, pa.int64())
        cols = []
        for col in self._where:
            col = pc.take(col, at)
            if isinstance(col, pa.ChunkedArray):
                col = col.combine_chunks()
            if pa.types.is_dictionary(col.type):
                col = pc.cast(col, col.type.value_type)
            cols.append(col)
        return pc.fill_null(_site_column(*cols), UNKNOWN_SITE)

    def sites(self, lo: int, hi: int) -> dict[str, list[int]]:
        """``call site -> [bytes, copies]`` of groups ``lo .. hi-1``."""
        out: dict[str, list[int]] = {}
        texts = self.texts(np.arange(lo, hi)).to_pylist()
        for site, b, c in zip(texts, self.bytes[lo:hi].tolist(), self.copies[lo:hi].tolist(),
                              strict=True):  # fmt: skip
            row = out.setdefault(site, [0, 0])
            row[0] += b
            row[1] += c
        return out

    def top(self, lo: int, hi: int, n: int) -> list[tuple[str, int, int]]:
        """The ``n`` groups of ``lo .. hi-1`` with the most bytes, then copies, then by call
        site: ``(site, bytes, copies)``. Only the groups that tie with the ``n``-th are
        named, and ordered by pyarrow."""
        b, c = self.bytes[lo:hi], self.copies[lo:hi]
        if not len(b):
            return []
        order = np.lexsort((-c, -b))
        nth = order[min(n, len(b)) - 1]
        cand = np.flatnonzero((b > b[nth]) | ((b == b[nth]) & (c >= c[nth])))
        table = pa.table({"b": b[cand], "c": c[cand], "s": self.texts(cand + lo)})
        table = table.sort_by([("b", "descending"), ("c", "descending"), ("s", "ascending")])
        table = table.slice(0, n)
        return list(zip(table["s"].to_pylist(), table["b"].to_pylist(), table["c"].to_pylist(),
                        strict=True))  # fmt: skip


def top_sites(rows: list[tuple[str, int, int]]) -> str:
    """``site (B B, N copies), ...``."""
    return ", ".join(f"{site} ({b} B, {c} cop{'y' if c == 1 else 'ies'})" for site, b, c in rows)


def column_sites(rc: Any) -> tuple[np.ndarray, SiteCopies] | None:
    """One run's counted copies (not groups, aliases, no-ops or failed calls) by (step, call
    site): each group's step (ascending) and the groups; None without copies."""
    from copytrace.analysis._columns import _combine
    from copytrace.analysis._dense import first_rows

    mask = ~rc.flag("group") & ~rc.flag("alias") & ~rc.flag("noop") & rc.null("error")
    rows = np.flatnonzero(mask)
    if not len(rows):
        return None
    steps = rc.np("step")[rows]
    site = rc.codes("site", rows)
    key = _combine([steps, site])  # by step, then site
    first = first_rows(key)
    # bincount sums in float64: exact while a group's bytes stay below 2**53 (8 PiB)
    nbytes = np.bincount(key, weights=rc.np("bytes_allocated")[rows], minlength=len(first))
    copies = np.bincount(key, minlength=len(first))
    nbytes, copies = nbytes.astype(np.int64), copies.astype(np.int64)
    if rc._evs is not None:  # events from memory: their sites are text already
        text = pc.fill_null(pa.array(rc.values("site", rows[first]), pa.string()), UNKNOWN_SITE)
        return steps[first], SiteCopies(nbytes, copies, site[first], text=text)
    at = rc._at(rows[first])
    where = tuple(pc.take(rc.raw(k), at) for k in ("file", "line", "function"))
    store = SiteCopies(nbytes, copies, site[first], where)
    return steps[first], store


def whole_trace(parts: list[tuple[SiteCopies, int, int]]) -> SiteCopies:
    """The call sites over the whole trace: ``parts`` are ``(groups, lo, hi)`` of each run's
    steps; one group per call site (across runs, by text)."""
    from copytrace.analysis._columns import _dense
    from copytrace.analysis._dense import dense, first_rows

    stores = list(dict.fromkeys(s for s, _, _ in parts))  # each run's groups once
    if len(stores) == 1 and stores[0]._where is not None:  # no text to merge runs by
        store = stores[0]
        idx = np.concatenate([np.arange(lo, hi) for _, lo, hi in parts])
        _, code = dense(store.site[idx])
        at = pa.array(idx[first_rows(code)], pa.int64())
        return SiteCopies(np.bincount(code, weights=store.bytes[idx]).astype(np.int64),
                          np.bincount(code, weights=store.copies[idx]).astype(np.int64),
                          np.arange(len(at)), tuple(pc.take(c, at) for c in store._where))
    sums, texts = [], []
    for store in stores:
        spans = [(lo, hi) for s, lo, hi in parts if s is store]
        idx = np.concatenate([np.arange(lo, hi) for lo, hi in spans])
        _, code = dense(store.site[idx])
        first = first_rows(code)
        b = np.bincount(code, weights=store.bytes[idx]).astype(np.int64)
        c = np.bincount(code, weights=store.copies[idx]).astype(np.int64)
        sums.append((b, c))
        texts.append(store.texts(idx[first]))
    text = pa.chunked_array(texts, pa.string()).combine_chunks()
    code = _dense(pc.dictionary_encode(text))
    first = first_rows(code)
    b = np.bincount(code, weights=np.concatenate([s[0] for s in sums])).astype(np.int64)
    c = np.bincount(code, weights=np.concatenate([s[1] for s in sums])).astype(np.int64)
    return SiteCopies(b, c, np.arange(len(first)), text=pc.take(text, pa.array(first)))
