"""The hazard rules that pair events (a copy and the copy of its result, a move and the move
back, a clone and its detach) or compare them (the same source copied twice in a step), as
joins and group-bys over a run's columns.

Each rule works on whole columns (:class:`~copytrace.analysis._columns.RunColumns`, numpy
and pyarrow compute): a pair is a join of one event's result storage with a later event's
source storage (the latest earlier result with that storage, as a dictionary keyed by
storage would hold it), and a finding is a group of pairs or rows. Python runs once per
finding, to write its message: never once per event. The per-event form of these rules is
kept as the reference of the differential test.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from copytrace._units import format_bytes_exact
from copytrace.analysis._columns import _combine
from copytrace.analysis._dense import dense, distinct, first_rows
from copytrace.analysis._evidence import OWN_RULE, Group, _Row, narrows, plural, what
from copytrace.analysis._findings import Finding

__all__ = ["JOIN_RULES"]


# --- shared ------------------------------------------------------------------------------------
def _ok(rc: Any) -> np.ndarray:
    """Not a deepcopy group, and the call did not raise."""
    return ~rc.flag("group") & rc.null("error")  # type: ignore[no-any-return]


def _copies(rc: Any) -> np.ndarray:
    """A copy into new storage with its storage facts recorded, neither a deepcopy, nor made
    inside a torch function, nor an activation checkpoint's recomputation (the copy it
    exists to make again instead of keeping)."""
    return (  # type: ignore[no-any-return]
        _ok(rc) & ~rc.flag("alias") & ~rc.flag("noop")
        & (rc.np("bytes_allocated") > 0)
        & ~rc.null("src_storage") & ~rc.null("src_version")
        & ~rc.eq("op", "copy_") & ~rc.eq("op", "deepcopy") & ~rc.truthy("via")
        & ~rc.flag("recompute")
    )  # fmt: skip


def _sites(rc: Any) -> np.ndarray:
    """A code per event for its call site (equal sites, equal codes; no site: -1)."""
    out = rc._cache.get("codes:site")
    if out is None:
        out = rc._cache["codes:site"] = rc.codes("site", np.arange(rc.n))
    return out  # type: ignore[no-any-return]


def _join(rc: Any, a_side: np.ndarray, b_side: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``(a, b)``: each ``b`` in ``b_side`` whose source storage is the result storage of
    an ``a`` in ``a_side`` (the last such ``a`` in event order), and that ``a``; aligned
    arrays of event positions, ``b`` ascending."""
    dst, src = rc.ids("dst_storage"), rc.ids("src_storage")
    a_rows = np.flatnonzero(a_side & ~rc.null("dst_storage"))
    b_rows = np.flatnonzero(b_side & ~rc.null("src_storage"))
    if not len(a_rows) or not len(b_rows):
        return a_rows[:0], b_rows[:0]
    order = np.lexsort((a_rows, dst[a_rows]))
    keys, rows = dst[a_rows][order], a_rows[order]
    last = np.append(keys[1:] != keys[:-1], True)  # the last row of each storage
    keys, rows = keys[last], rows[last]
    at = np.minimum(np.searchsorted(keys, src[b_rows]), len(keys) - 1)
    found = keys[at] == src[b_rows]
    return rows[at[found]], b_rows[found]


def _same(rc: Any, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairs in the same step, ``a`` before ``b``, ``b`` reading the version ``a`` made."""
    seq, step = rc.np("seq"), rc.np("step")
    return (  # type: ignore[no-any-return]
        (seq[a] < seq[b]) & (step[a] == step[b])
        & (rc.ids("src_version")[b] == rc.ids("dst_version")[a])
    )  # fmt: skip


def _by_key(key: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Positions grouped by equal ``key``: the groups' keys in order of their first position,
    and each group's positions (ascending)."""
    if not len(key):
        return key, []
    _, inverse = dense(key)
    first = first_rows(inverse)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    label = rank[inverse]
    order = np.argsort(label, kind="stable")
    bounds = np.flatnonzero(np.diff(label[order])) + 1
    groups = np.split(order, bounds)
    return key[[g[0] for g in groups]], groups


def _site_texts(rc: Any, rows: list[int]) -> list[str | None]:
    return rc.values("site", np.asarray(rows, dtype=np.int64))  # type: ignore[no-any-return]


def _op(rc: Any, row: int) -> str:
    return rc.values("op", np.array([row]))[0]  # type: ignore[no-any-return]


def _group(rc: Any, rows: np.ndarray, nbytes: int, sites: list[str | None]) -> Group:
    rows = distinct(rows)
    return Group(rc, rows, np.array([nbytes]), list(dict.fromkeys(s for s in sites if s)))


# --- redundant-copy ------------------------------------------------------------------------------
_SAME_SOURCE = ("step", "src_storage", "src_offset", "src_stride_key", "shape_key",
                "src_version", "dtype", "dst_device")  # fmt: skip


def _site_sets(rc: Any, rows: np.ndarray, label: np.ndarray) -> np.ndarray:
    """A code per group for the set of call sites of its rows (equal sets, equal codes)."""
    site = _sites(rc)[rows] + 1  # no site: 0
    span = int(site.max(initial=0)) + 1
    pairs = distinct(label * span + site)  # sorted by label, then site
    owner, site = pairs // span, pairs % span - 1
    offsets = np.concatenate([[0], np.flatnonzero(np.diff(owner)) + 1, [len(pairs)]])
    lists = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                     pa.array(site).cast(pa.string()))  # fmt: skip
    text = pc.binary_join(lists, ",")
    return np.asarray(pc.dictionary_encode(text).indices.to_numpy(), dtype=np.int64)


def _repeats(rc: Any, copies: np.ndarray) -> list[Finding]:
    """(a) the same unchanged source view copied to the same kind of result within a step,
    one finding per set of call sites."""
    unwritten = copies & ~rc.truthy("inplace_writes") & ~rc.isin("op", OWN_RULE)
    rows, label = rc.labels(unwritten, _SAME_SOURCE)
    if not len(rows):
        return []
    size = np.bincount(label)
    keep = size[label] > 1
    rows, label = rows[keep], label[keep]
    if not len(rows):
        return []
    _, label = dense(label)  # still in order of first row
    first_of = np.full(label.max() + 1, -1, dtype=np.int64)
    first_of[label[::-1]] = np.arange(len(label))[::-1]  # each group's first position
    is_first = first_of[label] == np.arange(len(label))
    _, groups_of = _by_key(_site_sets(rc, rows, label))
    acc = np.empty(label.max() + 1, dtype=np.int64)  # each group's finding, by first row
    for i, groups in enumerate(groups_of):
        acc[groups] = i
    order = np.lexsort((rows, label, acc[label]))  # by finding, then group, then row
    rows, label = rows[order], label[order]
    nbytes = np.where(is_first[order], 0, rc.np("bytes_allocated")[rows])
    bounds = np.flatnonzero(np.diff(acc[label])) + 1
    out = []
    for pos in np.split(np.arange(len(rows)), bounds):
        codes = _sites(rc)[rows[pos]]
        _, codes = dense(codes)
        firsts = first_rows(codes)
        sites = _site_texts(rc, rows[pos[np.sort(firsts)]].tolist())
        g = _group(rc, rows[pos], int(nbytes[pos].sum()), sites)
        extra = len(pos) - len(distinct(label[pos]))
        out.append(g.finding(
            "redundant-copy",
            f"the same unchanged source ({what(g.first)}) was copied again within a step: "
            f"{plural(extra, 'extra copy')} ({_op(rc, int(rows[pos[0]]))}), "
            f"{format_bytes_exact(g.bytes)} allocated for data already copied",
            "Make the copy once per step and reuse it.",
        ))  # fmt: skip
    return out


def _chains(rc: Any, copies: np.ndarray) -> list[Finding]:
    """(b) a copy of the fresh result of a copy, on the same line, one finding per line."""
    a, b = _join(rc, copies, copies)
    site = _sites(rc)
    transfer = rc.isin("transfer", ("h2d",)).astype(np.int8) - rc.isin("transfer", ("d2h",))
    keep = (
        (a != b) & _same(rc, a, b) & (site[a] >= 0) & (site[a] == site[b])
        & (transfer[a] * transfer[b] != -1)  # not h2d then d2h or back: a round trip
    )  # fmt: skip
    a, b = a[keep], b[keep]
    # a first step that narrows the dtype rounds on purpose (x.to(bfloat16).float()): one
    # call straight to the last dtype would give other values. Decided once per dtype pair.
    if len(a):
        pair = _combine([rc.codes("src_dtype", a), rc.codes("dtype", a)])
        firsts = first_rows(pair)  # a row of each dtype pair
        lossy = np.array([narrows(*p) for p in zip(rc.values("src_dtype", a[firsts]),
                                                   rc.values("dtype", a[firsts]), strict=True)])
        a, b = a[~lossy[pair]], b[~lossy[pair]]
    alloc = rc.np("bytes_allocated")
    out = []
    _, pairs_of = _by_key(site[a])
    for pairs in pairs_of:
        both = np.stack([a[pairs], b[pairs]], axis=1).ravel()  # a0, b0, a1, b1, ...
        _, codes = dense(rc.codes("op", both))
        firsts = first_rows(codes)
        ops = rc.values("op", both[np.sort(firsts)])
        g = _group(rc, both, int(alloc[a[pairs]].sum()), _site_texts(rc, [int(a[pairs[0]])]))
        out.append(g.finding(
            "redundant-copy",
            f"a copy of a fresh copy on one line ({' -> '.join(dict.fromkeys(ops))}): the "
            "intermediate result is copied again and dropped, "
            f"{format_bytes_exact(g.bytes)} allocated for nothing",
            "Fold the chain into one call, e.g. a single `t.to(device, dtype)` or one "
            "`clone()`.",
        ))  # fmt: skip
    return out


def _recasts(rc: Any) -> list[Finding]:
    """(c) autocast's cast of the same unchanged weight made again within a step, because its
    weight cache is off: hidden from (a) by the `via` exclusion (autocast casts inside
    torch's functions), yet the user's setting. One finding per user's line."""
    casts = (_ok(rc) & rc.flag("autocast_nocache") & ~rc.null("src_storage")
             & ~rc.null("src_version"))  # fmt: skip
    rows, label = rc.labels(casts, ("step", "src_storage", "src_version", "dtype"))
    if not len(rows):
        return []
    size = np.bincount(label)
    keep = size[label] > 1
    rows, label = rows[keep], label[keep]
    if not len(rows):
        return []
    first = np.zeros(len(rows), dtype=bool)
    first[np.unique(label, return_index=True)[1]] = True  # each weight's first cast in a step
    alloc = rc.np("bytes_allocated")
    out = []
    _, by_site = _by_key(_sites(rc)[rows])
    for pos in by_site:
        extra = int((~first[pos]).sum())
        nbytes = int(alloc[rows[pos][~first[pos]]].sum())
        g = _group(rc, rows[pos], nbytes, _site_texts(rc, [int(rows[pos[0]])]))
        weights = len(np.unique(rc.np("src_storage")[rows[pos]]))
        most = int(size[label[pos]].max())
        out.append(g.finding(
            "redundant-copy",
            f"autocast cast the same unchanged {plural(weights, 'weight')} "
            f"({what(g.first)} from {g.first.src_dtype}) again at each use: up to {most} "
            f"times in a step, {plural(extra, 'extra cast')}, {format_bytes_exact(nbytes)} "
            "allocated for casts already made, because autocast's weight cache is off "
            "(`torch.autocast(..., cache_enabled=False)`)",
            "Leave autocast's weight cache on (the default, `cache_enabled=True`) and enter "
            "`torch.autocast` inside each step: each weight is then cast once per region.",
        ))  # fmt: skip
    return out


def redundant_copy(rc: Any) -> list[Finding]:
    # deepcopy makes independent state on purpose, a copy written in place is not
    # interchangeable with another copy, and copies made inside a torch function are not the
    # user's: see _copies and the per-event reference. Autocast's recasts with its cache off
    # are made inside torch's functions too, but by the user's setting: _recasts.
    copies = _copies(rc)
    return _repeats(rc, copies) + _chains(rc, copies) + _recasts(rc)


# --- round-trip ----------------------------------------------------------------------------------
def round_trip(rc: Any) -> list[Finding]:
    moves = (
        rc.isin("transfer", ("h2d", "d2h")) & _ok(rc) & ~rc.flag("alias")
        & ~rc.null("src_storage")
    )  # fmt: skip
    a, b = _join(rc, moves, moves)
    h2d = rc.eq("transfer", "h2d")
    keep = _same(rc, a, b) & (h2d[a] != h2d[b]) & ~rc.null("src_version")[b]
    a, b = a[keep], b[keep]
    site = _sites(rc)
    logical = rc.np("bytes_logical")
    span = int(site.max(initial=0)) + 2
    out = []
    _, pairs_of = _by_key((site[a] + 1) * span + site[b] + 1)
    for pairs in pairs_of:
        first_a, first_b = int(a[pairs[0]]), int(b[pairs[0]])
        both = np.concatenate([a[pairs], b[pairs]])
        g = _group(rc, both, int(logical[b[pairs]].sum()), _site_texts(rc, [first_a, first_b]))
        ea, eb = _Row(rc, first_a), _Row(rc, first_b)
        way = "host->device->host" if ea.transfer == "h2d" else "device->host->device"
        out.append(g.finding(
            "round-trip",
            f"{way}: `{ea.op}` moved {what(ea)} to {ea.dst_device} and `{eb.op}` moved the "
            f"unchanged result straight back to {eb.dst_device} "
            f"({plural(len(pairs), 'round trip')}, {format_bytes_exact(g.bytes)} moved back)",
            "Keep using the tensor on the side it came from instead of copying the "
            "unchanged data back.",
        ))  # fmt: skip
    return out


# --- clone-detach-order --------------------------------------------------------------------------
def clone_detach_order(rc: Any) -> list[Finding]:
    clones = (
        rc.eq("op", "clone") & rc.eq("graph", "attached") & _ok(rc) & ~rc.flag("alias")
    )  # fmt: skip
    detaches = rc.isin("op", ("detach", "detach_")) & rc.null("error") & ~rc.truthy("via")
    a, b = _join(rc, clones, detaches)
    site = _sites(rc)
    keep = _same(rc, a, b) & (site[a] >= 0) & (site[a] == site[b])
    a, b = a[keep], b[keep]
    alloc = rc.np("bytes_allocated")
    out = []
    _, pairs_of = _by_key(site[a])
    for pairs in pairs_of:
        both = np.concatenate([a[pairs], b[pairs]])
        g = _group(rc, both, int(alloc[a[pairs]].sum()), _site_texts(rc, [int(a[pairs[0]])]))
        out.append(g.finding(
            "clone-detach-order",
            f"`clone().detach()` ({plural(len(pairs), 'time')}, "
            f"{format_bytes_exact(g.bytes)}): the clone is recorded by autograd "
            "(CloneBackward0) and then cut off again",
            "Write `t.detach().clone()`: the copy is then made outside autograd.",
        ))  # fmt: skip
    return out


#: The joined rules over a run's columns (``rule(rc) -> findings``).
JOIN_RULES = {
    "redundant-copy": redundant_copy,
    "round-trip": round_trip,
    "clone-detach-order": clone_detach_order,
}
