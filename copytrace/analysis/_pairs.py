"""The rules over pairs and per-event facts: the joined rules
(:mod:`copytrace.analysis._joins`: redundant-copy, round-trip, clone-detach-order) and the two
rules that report each event or site of rare events (data-inplace, aliasing-snapshot), in
Python over the few events that can take part.

Each of the last two has two halves: ``candidates(rc)`` picks, vectorised over a run's columns
(:class:`~copytrace.analysis._columns.RunColumns`), every row the rule could use (a superset
that changes none of its findings: whole groups of equal keys, both ends of every possible
pair), and the rule itself runs over the :class:`~copytrace.analysis._view.Ev` of those rows
only, in event order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from copytrace._units import format_bytes_exact
from copytrace.analysis._evidence import Acc, plural, what
from copytrace.analysis._evidence import accs as _accs
from copytrace.analysis._findings import Finding
from copytrace.analysis._joins import JOIN_RULES
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


# --- candidates: vectorised over a run's columns -----------------------------------------------
def _data_inplace_rows(rc: Any) -> np.ndarray:
    return rc.isin("op", ("data_get", "data_set")) & rc.truthy("saved_by")  # type: ignore[no-any-return]


def _aliasing_snapshot_rows(rc: Any) -> np.ndarray:
    return rc.flag("snapshot") & rc.flag("stale")  # type: ignore[no-any-return]


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
    **JOIN_RULES,
}


def _at(site: str | None) -> str:
    return f" at `{site}`" if site else ""
