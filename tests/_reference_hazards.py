"""Reference: the hazard rules as they ran before the columnar analyser (one Python object
per event, :class:`copytrace.analysis._view.Ev`), kept only for the differential test
(tests/test_hazard_diff.py). ``analyze_reference`` gives the findings the analyser gave then.
"""


from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from copytrace.analysis._findings import HAZARDS, Finding
from copytrace.analysis._rules import (
    CTOR_CALLS,
    CTOR_FIXES,
    alias_write_text,
    deepcopy_nonleaf_text,
)
from copytrace.analysis._view import Ev

__all__ = ["RULES", "analyze_reference"]

#: Conversions whose no-op form is reported (``copytrace.op`` values).
CONVERSION_OPS = frozenset((
    "to", "cpu", "cuda", "type", "float", "double", "half", "bfloat16", "int", "long",
    "short", "char", "byte", "bool", "contiguous",
))  # fmt: skip
#: A site is "in a hot loop" when it fires in at least this many steps ...
HOT_MIN_STEPS = 3
#: ... and in at least this share of the steps between its first and last one.
HOT_DENSITY = 0.5


def format_bytes(n: int) -> str:
    """``4000`` -> ``4000 B``; ``123456`` -> ``123456 B (120.6 KiB)``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{n} B ({value:.1f} {unit})"
    return f"{n} B"  # pragma: no cover


def is_hot(steps: Iterable[int]) -> bool:
    """Whether events in ``steps`` come from a loop that runs (about) every step."""
    distinct = sorted(set(steps))
    if len(distinct) < HOT_MIN_STEPS:
        return False
    return len(distinct) >= HOT_DENSITY * (distinct[-1] - distinct[0] + 1)


def _what(e: Ev) -> str:
    shape = "x".join(str(d) for d in e.shape) if e.shape else "scalar"
    return f"{e.dtype or '?'} {shape}"


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word[:-1]}ies" if word.endswith("copy") else f"{n} {word}s"


class _Acc:
    """Evidence for one finding, accumulated over events."""

    def __init__(self) -> None:
        self.events: list[Ev] = []
        self._ids: set[int] = set()
        self.sites: list[str] = []
        self.bytes = 0
        self.count = 0
        self.extra = 0

    def add(self, e: Ev, nbytes: int = 0, *sites: str | None) -> None:
        if id(e) not in self._ids:
            self._ids.add(id(e))
            self.events.append(e)
        for site in sites or (e.site,):
            if site and site not in self.sites:
                self.sites.append(site)
        self.bytes += nbytes
        self.count += 1

    def finding(self, code: str, message: str, fix: str, severity: str | None = None) -> Finding:
        events = sorted(self.events, key=lambda e: e.seq)
        return Finding(
            code=code,
            severity=severity or HAZARDS[code].severity,
            message=message,
            fix=fix,
            call_sites=list(self.sites),
            bytes=self.bytes,
            steps=sorted({e.step for e in events}),
            event_seqs=[e.seq for e in events],
            run=events[0].run if events else 0,
            span_ids=[e.span_id for e in events if e.span_id],
        )


def _accs(keyed: Iterable[tuple[Any, Ev, int, tuple[str | None, ...]]]) -> dict[Any, _Acc]:
    accs: dict[Any, _Acc] = {}
    for key, e, nbytes, sites in keyed:
        accs.setdefault(key, _Acc()).add(e, nbytes, *sites)
    return accs


def _is_copy(e: Ev) -> bool:
    """A copy into new storage, with its storage facts recorded."""
    return (
        not e.group
        and e.error is None
        and not e.alias
        and not e.noop
        and e.bytes_allocated > 0
        and e.src_storage is not None
        and e.src_version is not None
        and e.op != "copy_"
    )


#: Copies another rule reports in full (tensor-ctor-copy): not reported again as redundant.
_OWN_RULE = frozenset(("tensor_ctor", "new_tensor", "as_tensor", "legacy_ctor"))


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


# --- graph-retaining-copy ------------------------------------------------------------------------
def graph_retaining_copy(events: list[Ev]) -> list[Finding]:
    accs = _accs(
        (e.site, e, e.retained_bytes or 0, ())
        for e in events
        if not e.group and (e.retained_bytes or 0) > 0
    )
    out = []
    for acc in accs.values():
        e = acc.events[0]
        out.append(
            acc.finding(
                "graph-retaining-copy",
                f"{_plural(acc.count, 'attached ' + e.op + ' result')} "
                f"({e.grad_fn or 'in the graph'}) outlived "
                f"{'its step' if acc.count == 1 else 'their steps'} with the autograd graph, "
                "itself or through a tensor computed from it (a running total), and no "
                "backward ran through that graph: "
                f"{format_bytes(acc.bytes)} of saved tensors kept alive",
                "Keep `t.detach()` (or `t.item()` for a number) instead, also when adding it "
                "to a total, or make the copy under `torch.no_grad()`.",
            )
        )
    return out


# --- stale-kept-copy -------------------------------------------------------------------------
def stale_kept_copy(events: list[Ev]) -> list[Finding]:
    accs: dict[Any, _Acc] = {}
    for e in events:
        if e.stale and not e.snapshot and e.phase == "backward":
            acc = accs.get((e.origin, e.module))
            if acc is None:
                acc = accs[(e.origin, e.module)] = _Acc()
                acc.sites = [s for s in (e.origin, e.site) if s]
            acc.add(e, e.bytes_logical, None)
    out = []
    for (origin, module), acc in accs.items():
        steps = {e.step for e in acc.events}
        made = (f"the copy made at `{origin}`" if origin else
                f"a cast of a parameter of `{module or '?'}` made by autocast")  # fmt: skip
        kept = ("kept and" if origin else
                "reused from autocast's weight cache (the autocast region spans the steps) and")  # fmt: skip
        out.append(
            acc.finding(
                "stale-kept-copy",
                f"{made} was {kept} used in {_plural(len(steps), 'later step')} after the "
                "parameter it copies had changed in place (its version counter moved, e.g. "
                "by `optimizer.step()`): the forward computed with the old values, and the "
                "gradient reached the parameter through the stale copy",
                "Make the copy inside each step, after `optimizer.step()`; enter "
                "`torch.autocast` inside the step (its cache is cleared when the region exits), "
                "or pass `cache_enabled=False`.",
            )
        )
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


# --- lost-inplace-write ----------------------------------------------------------------------
#: copytrace.op of a gather into fresh storage (advanced indexing and its relatives).
INDEX_OPS = frozenset(("index", "index_select", "masked_select", "take", "gather",
                       "take_along_dim"))  # fmt: skip
_INDEX_FORM = {
    "index": "x[idx]", "index_select": "index_select", "masked_select": "masked_select",
    "take": "take", "gather": "gather", "take_along_dim": "take_along_dim",
}  # fmt: skip


def lost_inplace_write(events: list[Ev]) -> list[Finding]:
    accs = _accs(
        ((e.write_site, e.site), e, e.bytes_logical, (e.write_site, e.site))
        for e in events
        if e.op in INDEX_OPS and e.write_site and e.error is None and not e.group
    )
    out = []
    for acc in accs.values():
        e = acc.events[0]
        form = _INDEX_FORM.get(e.op, e.op)
        out.append(
            acc.finding(
                "lost-inplace-write",
                f"an in-place write went into the fresh copy that advanced indexing "
                f"(`{form}`, {_what(e)}) returned, and the copy was then dropped unused: "
                f"the write never reached the indexed tensor "
                f"({_plural(acc.count, 'time')}, {format_bytes(acc.bytes)} written and lost)",
                "Write through index assignment, which writes into the tensor itself: "
                "`x[idx] = value`, `x[idx] *= 2`, `x.index_fill_(0, idx, 0)` or "
                "`x.index_copy_(0, idx, src)`; for `nn.init`, initialise a new tensor and "
                "assign it: `w[idx] = nn.init.normal_(torch.empty_like(w[idx]))`.",
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


# --- pageable-transfer ------------------------------------------------------------------------------
def pageable_transfer(events: list[Ev]) -> list[Finding]:
    accs = _accs(
        (e.site, e, e.bytes_logical, ())
        for e in events
        if e.transfer == "h2d"
        and e.op != "implicit"  # the pinned flag is recorded for API calls only
        and not e.group
        and e.error is None
        and not e.non_blocking
        and e.pinned is False
    )
    out = []
    for acc in accs.values():
        steps = {e.step for e in acc.events}
        if not is_hot(steps):
            continue
        out.append(
            acc.finding(
                "pageable-transfer",
                f"{_plural(acc.count, 'host-to-device copy')} from pageable (unpinned) memory "
                f"without non_blocking, in {len(steps)} steps ({format_bytes(acc.bytes)}): "
                "each one blocks the host until the copy is done",
                "Pin the host tensor (`DataLoader(pin_memory=True)` or `t.pin_memory()`) and "
                "pass `non_blocking=True`.",
            )
        )
    return out


# --- deepcopy-in-loop --------------------------------------------------------------------------------
_DICTS = ("builtins.dict", "collections.OrderedDict")


def deepcopy_in_loop(events: list[Ev]) -> list[Finding]:
    accs = _accs(
        (e.site, e, e.bytes_allocated, ())
        for e in events
        if e.op == "deepcopy" and (e.group or e.parent in (None, -1)) and e.error is None
    )
    out = []
    for acc in accs.values():
        steps = {e.step for e in acc.events}
        if not is_hot(steps):
            continue
        kinds = {e.object_type or "torch.Tensor" for e in acc.events}
        kind = ", ".join(sorted(kinds))
        if kinds <= set(_DICTS):
            fix = (
                "Allocate the copy once and refresh it in place each step: "
                "`for k, v in sd.items(): snap[k].copy_(v)`."
            )
        elif not any(e.group for e in acc.events):
            fix = "Allocate the copy once and refresh it with `dst.copy_(src)` each step."
        else:
            fix = (
                "Deep-copy once before the loop and refresh the copy in place each step: "
                "`target.load_state_dict(model.state_dict())`, or for an EMA "
                "`torch._foreach_lerp_(ema_params, params, 1 - decay)`."
            )
        out.append(
            acc.finding(
                "deepcopy-in-loop",
                f"copy.deepcopy of {kind} ran {_plural(acc.count, 'time')} in {len(steps)} "
                f"steps ({min(steps)}-{max(steps)}), {format_bytes(acc.bytes)} allocated",
                fix,
            )
        )
    return out


# --- alias-write --------------------------------------------------------------------------------
#: ops whose alias result the tracer watches for an in-place write
_ALIAS_WRITE_OPS = CONVERSION_OPS | {"reshape", "copy"}


def alias_write(events: list[Ev]) -> list[Finding]:
    accs = _accs(
        ((e.write_site, e.site), e, e.bytes_logical, (e.write_site, e.site))
        for e in events
        if e.op in _ALIAS_WRITE_OPS and e.alias and e.write_site and e.error is None
        and not e.group
    )  # fmt: skip
    out = []
    for acc in accs.values():
        e = acc.events[0]
        returned, fix = alias_write_text(e.op, e.noop, e.dtype, e.dst_device)
        out.append(
            acc.finding(
                "alias-write",
                f"{returned}: the result ({_what(e)}) shares its data with the input, and an "
                "in-place write into one of them changed the other while the program still "
                "held both "
                f"({_plural(acc.count, 'time')}, {format_bytes(acc.bytes)} written)",
                fix,
            )
        )
    return out


# --- deepcopy-nonleaf ------------------------------------------------------------------------------
def deepcopy_nonleaf(events: list[Ev]) -> list[Finding]:
    accs = _accs(
        ((e.site, e.src_name), e, e.bytes_logical, ())
        for e in events
        if e.op == "deepcopy" and not e.group and e.error is not None and e.grad_fn
    )
    return [
        acc.finding(
            "deepcopy-nonleaf",
            deepcopy_nonleaf_text(acc.events[0].src_name, acc.events[0].grad_fn,
                                  _what(acc.events[0])) + f" ({_plural(acc.count, 'time')})",
            "Store a detached tensor (`self.last = h.detach()`), or drop the attribute before "
            "copying; where the values must travel with the copy, keep `h.detach().clone()`.",
        )
        for acc in accs.values()
    ]


# --- tensor-ctor-copy -----------------------------------------------------------------------------------
def tensor_ctor_copy(events: list[Ev]) -> list[Finding]:
    accs = _accs(
        (e.site, e, e.bytes_allocated, ())
        for e in events
        if e.op in _OWN_RULE and not e.group and e.error is None and not e.via
    )
    out = []
    for acc in accs.values():
        e = acc.events[0]
        call = CTOR_CALLS[e.op]
        graph = " and cuts it from the autograd graph" if e.src_requires_grad else ""
        out.append(
            acc.finding(
                "tensor-ctor-copy",
                f"`{call}` of an existing tensor copies it{graph} "
                f"({_plural(acc.count, 'time')}, {format_bytes(acc.bytes)}); torch warns "
                "against this form",
                CTOR_FIXES[e.op],
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


# --- noop-conversion ---------------------------------------------------------------------------------------
def noop_conversion(events: list[Ev]) -> list[Finding]:
    accs = _accs(
        ((e.site, e.op), e, 0, ())
        for e in events
        if e.noop
        and e.op in CONVERSION_OPS
        and not e.group
        and e.error is None
        and not e.via  # made inside a torch function (clip_grad_norm_...): not the user's call
    )
    out = []
    for acc in accs.values():
        steps = {e.step for e in acc.events}
        if not is_hot(steps):
            continue
        e = acc.events[0]
        already = "contiguous" if e.op == "contiguous" else f"{e.dtype} on {e.dst_device}"
        if e.op == "contiguous":
            fix = "Drop the `.contiguous()` call if the tensor is always contiguous there."
        else:
            fix = (
                f"Drop the `.{e.op}()` call, or guard it (`if t.device != device:`) if the hot "
                "loop matters."
            )
        out.append(
            acc.finding(
                "noop-conversion",
                f"`.{e.op}()` returned its input unchanged (already {already}) "
                f"{_plural(acc.count, 'time')} in {len(steps)} steps: harmless, Python "
                "overhead only",
                fix,
            )
        )
    return out


#: The rules, in report order.
RULES: tuple[Callable[[list[Ev]], list[Finding]], ...] = (
    data_inplace,
    lost_inplace_write,
    graph_retaining_copy,
    alias_write,
    aliasing_snapshot,
    stale_kept_copy,
    redundant_copy,
    round_trip,
    pageable_transfer,
    deepcopy_in_loop,
    deepcopy_nonleaf,
    tensor_ctor_copy,
    clone_detach_order,
    noop_conversion,
)


_ORDER = {code: i for i, code in enumerate(HAZARDS)}


def analyze_reference(source: Any) -> list[Finding]:
    """The findings of ``source`` (as for :func:`copytrace.analysis.analyze`), sorted as the
    analyser sorts them, computed by the rules above over :func:`runs_of`'s views."""
    from copytrace.analysis._findings import SEVERITIES
    from copytrace.analysis._view import runs_of

    findings = [f for events in runs_of(source) for rule in RULES for f in rule(events)]
    return sorted(
        findings,
        key=lambda f: (
            SEVERITIES.index(f.severity),
            _ORDER.get(f.code, len(_ORDER)),
            -f.bytes,
            f.run,
            f.event_seqs[:1],
        ),
    )
