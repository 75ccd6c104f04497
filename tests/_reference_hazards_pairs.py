"""Reference hazard rules that pair or compare events (data-inplace, aliasing-snapshot,
redundant-copy, round-trip, clone-detach-order), one Python object per event: see
``tests/_reference_hazards.py``."""

from __future__ import annotations

from _reference_hazards_base import (
    _OWN_RULE,
    _Acc,
    _accs,
    _is_copy,
    _plural,
    _what,
    format_bytes,
)

from copytrace.analysis._findings import Finding
from copytrace.analysis._view import Ev


# --- data-inplace ----------------------------------------------------------------------------
def data_inplace(events: list[Ev]) -> list[Finding]:
    out = []
    for e in events:
        if e.op not in ("data_get", "data_set") or not e.saved_by:
            continue
        acc = _Acc()
        acc.add(e, e.bytes_logical, e.write_site or e.site, e.site)
        what = f"`{e.src_name}` ({_what(e)})" if e.src_name else f"a {_what(e)} tensor"
        nodes = ", ".join(e.saved_by)
        if e.op == "data_get":
            message = (
                f"in-place write through `.data` of {what} changed it after {nodes} had saved "
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
                f"`.data =` rebound {what} after {nodes} had saved it for backward; the "
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
    accs = _accs((e.load_site or e.site, e, e.bytes_logical, (e.load_site, e.site))
                 for e in events if e.snapshot and e.stale)  # fmt: skip
    out = []
    for acc in accs.values():
        handover = [e for e in acc.events if e.op != "detach" or e.load_site]
        if not handover:
            out.append(
                acc.finding(
                    "aliasing-snapshot",
                    f"`state_dict()` returned {_plural(acc.count, 'tensor')} that share storage "
                    "with the live model, and they were changed in place (e.g. by "
                    "`optimizer.step()`) while they were kept: the snapshot no longer holds "
                    f"the values it was taken with ({format_bytes(acc.bytes)})",
                    "Copy the values: `{k: v.detach().clone() for k, v in "
                    "model.state_dict().items()}` (or `copy.deepcopy(model.state_dict())`).",
                )
            )
            continue
        holder = (handover[0].via or "load_state_dict").split(".")[0]
        out.append(
            acc.finding(
                "aliasing-snapshot",
                f"`load_state_dict(other.state_dict())`"
                f"{f' at `{handover[0].load_site}`' if handover[0].load_site else ''} left "
                f"{_plural(acc.count, 'tensor')} "
                f"({holder} state, {format_bytes(acc.bytes)}) aliased to the live source: "
                "`state_dict()` returns references and the load kept them (a no-op `.to`, or "
                "`assign=True`), and an in-place update of the source (e.g. its `step()`) "
                "then changed what the other holder sees",
                "Hand over a copy of the state: `b.load_state_dict(copy.deepcopy("
                "a.state_dict()))`, or clone each state tensor (`v.detach().clone()`).",
            )
        )
    return out


# --- redundant-copy -------------------------------------------------------------------------------
def redundant_copy(events: list[Ev]) -> list[Finding]:
    # deepcopy makes independent state on purpose (a target net, a snapshot): repeating it
    # is deepcopy-in-loop's business, not a redundant copy.
    # A copy written in place is not interchangeable with another copy of the same source
    # (one clone per consumer that modifies its argument): neither is redundant.
    # Copies made inside a torch function (a scheduler cloning its learning rates) are not
    # the user's to fold or reuse.
    # An activation checkpoint's recomputation makes its copy again on purpose.
    copies = [e for e in events if _is_copy(e) and e.op != "deepcopy" and not e.via
              and not e.recompute]
    unwritten = [e for e in copies if not e.inplace_writes and e.op not in _OWN_RULE]
    # (a) the same unchanged source view copied to the same kind of result within a step
    same: dict[tuple, list[Ev]] = {}
    for e in unwritten:
        key = (
            e.step, e.src_storage, e.src_offset, e.src_stride, e.shape, e.src_version, e.dtype,
            e.dst_device,
        )  # fmt: skip
        same.setdefault(key, []).append(e)
    repeat: dict[tuple, _Acc] = {}
    for group in same.values():
        if len(group) < 2:
            continue
        sites = tuple(sorted({e.site or "" for e in group}))
        acc = repeat.setdefault(sites, _Acc())
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
                f"the same unchanged source ({_what(first)}) was copied again within a step: "
                f"{_plural(extra, 'extra copy')} ({first.op}), "
                f"{format_bytes(acc.bytes)} allocated for data already copied",
                "Make the copy once per step and reuse it.",
            )
        )
    # (b) a copy of the fresh result of a copy, on the same line
    by_dst = {e.dst_storage: e for e in copies if e.dst_storage is not None}
    chains: dict[str | None, _Acc] = {}
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
        ):
            continue
        acc = chains.setdefault(a.site, _Acc())
        acc.add(a, a.bytes_allocated)
        acc.add(b, 0)
    for acc in chains.values():
        ops = " -> ".join(dict.fromkeys(e.op for e in acc.events))
        out.append(
            acc.finding(
                "redundant-copy",
                f"a copy of a fresh copy on one line ({ops}): the intermediate result is "
                f"copied again and dropped, {format_bytes(acc.bytes)} allocated for nothing",
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
    accs: dict[tuple, _Acc] = {}
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
        acc = accs.setdefault((a.site, b.site), _Acc())
        acc.add(a, 0, a.site)
        acc.add(b, b.bytes_logical, b.site)
    out = []
    for acc in accs.values():
        a, b = acc.events[0], acc.events[1]
        way = "host->device->host" if a.transfer == "h2d" else "device->host->device"
        out.append(
            acc.finding(
                "round-trip",
                f"{way}: `{a.op}` moved {_what(a)} to {a.dst_device} and `{b.op}` moved the "
                f"unchanged result straight back to {b.dst_device} "
                f"({_plural(acc.count // 2, 'round trip')}, {format_bytes(acc.bytes)} moved back)",
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
    accs: dict[str | None, _Acc] = {}
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
        acc = accs.setdefault(a.site, _Acc())
        acc.add(a, a.bytes_allocated)
        acc.add(b, 0)
    return [
        acc.finding(
            "clone-detach-order",
            f"`clone().detach()` ({_plural(acc.count // 2, 'time')}, "
            f"{format_bytes(acc.bytes)}): the clone is recorded by autograd (CloneBackward0) "
            "and then cut off again",
            "Write `t.detach().clone()`: the copy is then made outside autograd.",
        )
        for acc in accs.values()
    ]
