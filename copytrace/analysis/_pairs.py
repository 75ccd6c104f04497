"""The hazard rules that pair or compare events (a copy and the copy of its result, a move
and the move back, a clone and its detach), in Python over the few events that can take part.

Each rule has two halves: ``candidates(rc)`` picks, vectorised over a run's columns
(:class:`~copytrace.analysis._columns.RunColumns`), every row the rule could use (a superset
that changes none of its findings: whole groups of equal keys, both ends of every possible
pair), and the rule itself runs over the :class:`~copytrace.analysis._view.Ev` of those rows
only, in event order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from copytrace._units import format_bytes_exact
from copytrace.analysis._evidence import OWN_RULE, Acc, is_copy, narrows, plural, what
from copytrace.analysis._evidence import accs as _accs
from copytrace.analysis._findings import Finding
from copytrace.analysis._view import Ev

__all__ = ["PAIR_RULES"]


# --- data-inplace ----------------------------------------------------------------------------
def data_inplace(events: list[Ev]) -> list[Finding]:
    out = []
    for e in events:
        if e.op not in ("data_get", "data_set") or not e.saved_by:
            continue
        acc = Acc()
        acc.add(e, e.bytes_logical, e.write_site or e.site, e.site)
        held = f"`{e.src_name}` ({what(e)})" if e.src_name else f"a {what(e)} tensor"
        nodes = ", ".join(e.saved_by)
        if e.op == "data_get":
            message = (
                f"in-place write through `.data` of {held} changed it after {nodes} had saved "
                "it for backward; the backward that followed used the new values, and autograd "
                "could not tell (`.data` has its own version counter): the gradient is "
                "silently wrong"
            )
            fix = (
                "Change the tensor itself, under `torch.no_grad()` and after the backward "
                "that needs its old value, instead of writing through `.data`, so that "
                "autograd checks the write."
            )
        else:
            message = (
                f"`.data =` rebound {held} after {nodes} had saved it for backward; the "
                "backward that followed used the new values: the gradient is silently wrong"
            )
            fix = (
                "Assign after the pending backward, with `with torch.no_grad(): t.copy_(new)` "
                "instead of rebinding `.data`."
            )
        out.append(acc.finding("data-inplace", message, fix))
    return out


# --- aliasing-snapshot ------------------------------------------------------------------------
def aliasing_snapshot(events: list[Ev]) -> list[Finding]:
    # a handover is grouped by, and names first, the load that made the aliases; then the
    # line whose events are the evidence (the state_dict() call, or the load itself)
    groups = _accs(
        (e.load_site or e.site, e, e.bytes_logical, (e.load_site, e.site))
        for e in events
        if e.snapshot and e.stale
    )
    out = []
    for acc in groups.values():
        handover = [e for e in acc.events if e.op != "detach" or e.load_site]
        if not handover:
            out.append(
                acc.finding(
                    "aliasing-snapshot",
                    f"`state_dict()` returned {plural(acc.count, 'tensor')} that share storage "
                    "with the live model, and they were changed in place (e.g. by "
                    "`optimizer.step()`) while they were kept: the snapshot no longer holds "
                    f"the values it was taken with ({format_bytes_exact(acc.bytes)})",
                    "Copy the values: `{k: v.detach().clone() for k, v in "
                    "model.state_dict().items()}` (or `copy.deepcopy(model.state_dict())`).",
                )
            )
            continue
        holder = (handover[0].via or "load_state_dict").split(".")[0]
        out.append(
            acc.finding(
                "aliasing-snapshot",
                f"`load_state_dict(other.state_dict())`{_at(handover[0].load_site)} left "
                f"{plural(acc.count, 'tensor')} "
                f"({holder} state, {format_bytes_exact(acc.bytes)}) aliased to the live source: "
                "`state_dict()` returns references and the load kept them (a no-op `.to`, or "
                "`assign=True`), and an in-place update of the source (e.g. its `step()`) "
                "then changed what the other holder sees",
                "Hand over a copy of the state: `b.load_state_dict(copy.deepcopy("
                "a.state_dict()))`, or clone each state tensor (`v.detach().clone()`).",
            )
        )
    return out


def _at(site: str | None) -> str:
    return f" at `{site}`" if site else ""


# --- redundant-copy -------------------------------------------------------------------------------
def redundant_copy(events: list[Ev]) -> list[Finding]:
    # deepcopy makes independent state on purpose (a target net, a snapshot): repeating it
    # is deepcopy-in-loop's business, not a redundant copy.
    # A copy written in place is not interchangeable with another copy of the same source
    # (one clone per consumer that modifies its argument): neither is redundant.
    # Copies made inside a torch function (a scheduler cloning its learning rates) are not
    # the user's to fold or reuse.
    copies = [e for e in events if is_copy(e) and e.op != "deepcopy" and not e.via]
    unwritten = [e for e in copies if not e.inplace_writes and e.op not in OWN_RULE]
    # (a) the same unchanged source view copied to the same kind of result within a step
    same: dict[tuple, list[Ev]] = {}
    for e in unwritten:
        key = (
            e.step, e.src_storage, e.src_offset, e.src_stride, e.shape, e.src_version, e.dtype,
            e.dst_device,
        )  # fmt: skip
        same.setdefault(key, []).append(e)
    repeat: dict[tuple, Acc] = {}
    for group in same.values():
        if len(group) < 2:
            continue
        sites = tuple(sorted({e.site or "" for e in group}))
        acc = repeat.setdefault(sites, Acc())
        acc.add(group[0], 0)
        for e in group[1:]:
            acc.add(e, e.bytes_allocated)
            acc.extra += 1
    out = []
    for acc in repeat.values():
        first = acc.events[0]
        extra = acc.extra
        out.append(
            acc.finding(
                "redundant-copy",
                f"the same unchanged source ({what(first)}) was copied again within a step: "
                f"{plural(extra, 'extra copy')} ({first.op}), "
                f"{format_bytes_exact(acc.bytes)} allocated for data already copied",
                "Make the copy once per step and reuse it.",
            )
        )
    # (b) a copy of the fresh result of a copy, on the same line
    by_dst = {e.dst_storage: e for e in copies if e.dst_storage is not None}
    chains: dict[str | None, Acc] = {}
    for b in copies:
        a = by_dst.get(b.src_storage)
        if (
            a is None
            or a is b
            or a.seq >= b.seq
            or a.step != b.step
            or a.site is None
            or a.site != b.site
            or b.src_version != a.dst_version
            or {a.transfer, b.transfer} == {"h2d", "d2h"}  # that is a round trip
            # a first step that narrows the dtype rounds on purpose (x.to(bfloat16).float()):
            # one call straight to the last dtype would give other values
            or narrows(a.src_dtype, a.dtype)
        ):
            continue
        acc = chains.setdefault(a.site, Acc())
        acc.add(a, a.bytes_allocated)
        acc.add(b, 0)
    for acc in chains.values():
        ops = " -> ".join(dict.fromkeys(e.op for e in acc.events))
        out.append(
            acc.finding(
                "redundant-copy",
                f"a copy of a fresh copy on one line ({ops}): the intermediate result is "
                f"copied again and dropped, {format_bytes_exact(acc.bytes)} allocated for nothing",
                "Fold the chain into one call, e.g. a single `t.to(device, dtype)` or one "
                "`clone()`.",
            )
        )
    return out


# --- round-trip -------------------------------------------------------------------------------------
def round_trip(events: list[Ev]) -> list[Finding]:
    moves = [
        e
        for e in events
        if e.transfer in ("h2d", "d2h")
        and not e.group
        and e.error is None
        and not e.alias
        and e.src_storage is not None
    ]
    by_dst = {e.dst_storage: e for e in moves if e.dst_storage is not None}
    accs: dict[tuple, Acc] = {}
    for b in moves:
        a = by_dst.get(b.src_storage)
        if (
            a is None
            or a.seq >= b.seq
            or a.step != b.step
            or {a.transfer, b.transfer} != {"h2d", "d2h"}
            or b.src_version is None
            or b.src_version != a.dst_version
        ):
            continue
        acc = accs.setdefault((a.site, b.site), Acc())
        acc.add(a, 0, a.site)
        acc.add(b, b.bytes_logical, b.site)
    out = []
    for acc in accs.values():
        a, b = acc.events[0], acc.events[1]
        way = "host->device->host" if a.transfer == "h2d" else "device->host->device"
        out.append(
            acc.finding(
                "round-trip",
                f"{way}: `{a.op}` moved {what(a)} to {a.dst_device} and `{b.op}` moved the "
                f"unchanged result straight back to {b.dst_device} "
                f"({plural(acc.count // 2, 'round trip')}, {format_bytes_exact(acc.bytes)} moved back)",
                "Keep using the tensor on the side it came from instead of copying the "
                "unchanged data back.",
            )
        )
    return out


# --- clone-detach-order -----------------------------------------------------------------------------------
def clone_detach_order(events: list[Ev]) -> list[Finding]:
    clones = {
        e.dst_storage: e
        for e in events
        if e.op == "clone"
        and e.graph == "attached"
        and not e.group
        and e.error is None
        and not e.alias
        and e.dst_storage is not None
    }
    accs: dict[str | None, Acc] = {}
    for b in events:
        if b.op not in ("detach", "detach_") or b.error is not None or b.via:
            continue
        a = clones.get(b.src_storage)
        if (
            a is None
            or a.seq >= b.seq
            or a.step != b.step
            or a.site is None
            or a.site != b.site
            or b.src_version != a.dst_version
        ):
            continue
        acc = accs.setdefault(a.site, Acc())
        acc.add(a, a.bytes_allocated)
        acc.add(b, 0)
    return [
        acc.finding(
            "clone-detach-order",
            f"`clone().detach()` ({plural(acc.count // 2, 'time')}, "
            f"{format_bytes_exact(acc.bytes)}): the clone is recorded by autograd (CloneBackward0) "
            "and then cut off again",
            "Write `t.detach().clone()`: the copy is then made outside autograd.",
        )
        for acc in accs.values()
    ]



# --- candidates: vectorised over a run's columns -----------------------------------------------
def _linked(rc: Any, src_side: np.ndarray, dst_side: np.ndarray) -> np.ndarray:
    """Rows of ``src_side`` whose source storage is the result storage of a row of
    ``dst_side``, and rows of ``dst_side`` whose result storage is the source of a row of
    ``src_side``: both ends of every pair a rule could make."""
    src, dst = rc.np("src_storage"), rc.np("dst_storage")
    src_side = src_side & ~rc.null("src_storage")
    dst_side = dst_side & ~rc.null("dst_storage")
    b_end = src_side & np.isin(src, dst[dst_side])
    a_end = dst_side & np.isin(dst, src[src_side])
    return b_end | a_end  # type: ignore[no-any-return]


def _ok(rc: Any) -> np.ndarray:
    """Not a deepcopy group, and the call did not raise."""
    return ~rc.flag("group") & rc.null("error")  # type: ignore[no-any-return]


def _copies(rc: Any) -> np.ndarray:
    """:func:`is_copy`, and neither a deepcopy nor made inside a torch function."""
    return (  # type: ignore[no-any-return]
        _ok(rc) & ~rc.flag("alias") & ~rc.flag("noop")
        & (rc.np("bytes_allocated") > 0)
        & ~rc.null("src_storage") & ~rc.null("src_version")
        & ~rc.eq("op", "copy_") & ~rc.eq("op", "deepcopy") & ~rc.truthy("via")
    )  # fmt: skip


def _data_inplace_rows(rc: Any) -> np.ndarray:
    return rc.isin("op", ("data_get", "data_set")) & rc.truthy("saved_by")  # type: ignore[no-any-return]


def _aliasing_snapshot_rows(rc: Any) -> np.ndarray:
    return rc.flag("snapshot") & rc.flag("stale")  # type: ignore[no-any-return]


def _redundant_copy_rows(rc: Any) -> np.ndarray:
    copies = _copies(rc)
    unwritten = copies & ~rc.truthy("inplace_writes") & ~rc.isin("op", OWN_RULE)
    repeated = np.zeros(rc.n, dtype=bool)
    keys = ("step", "src_storage", "src_offset", "src_stride_key", "shape_key", "src_version",
            "dtype", "dst_device")  # fmt: skip
    for rows in rc.groups(unwritten, keys):
        if len(rows) > 1:
            repeated[rows] = True
    return repeated | _linked(rc, copies, copies)  # type: ignore[no-any-return]


def _moves(rc: Any) -> np.ndarray:
    return (  # type: ignore[no-any-return]
        rc.isin("transfer", ("h2d", "d2h")) & _ok(rc) & ~rc.flag("alias")
        & ~rc.null("src_storage")
    )  # fmt: skip


def _round_trip_rows(rc: Any) -> np.ndarray:
    moves = _moves(rc)
    return _linked(rc, moves, moves)


def _clone_detach_rows(rc: Any) -> np.ndarray:
    clones = (
        rc.eq("op", "clone") & rc.eq("graph", "attached") & _ok(rc) & ~rc.flag("alias")
        & ~rc.null("dst_storage")
    )  # fmt: skip
    detaches = rc.isin("op", ("detach", "detach_")) & rc.null("error") & ~rc.truthy("via")
    return _linked(rc, detaches, clones)


def _over(rule: Any, candidates: Any) -> Any:
    def run(rc: Any) -> list[Finding]:
        rows = np.flatnonzero(candidates(rc))
        return rule(rc.evs(rows)) if len(rows) else []  # type: ignore[no-any-return]

    run.__name__ = rule.__name__
    run.__doc__ = rule.__doc__
    return run


#: The pair rules over a run's columns (``rule(rc) -> findings``).
PAIR_RULES = {
    "data-inplace": _over(data_inplace, _data_inplace_rows),
    "aliasing-snapshot": _over(aliasing_snapshot, _aliasing_snapshot_rows),
    "redundant-copy": _over(redundant_copy, _redundant_copy_rows),
    "round-trip": _over(round_trip, _round_trip_rows),
    "clone-detach-order": _over(clone_detach_order, _clone_detach_rows),
}
