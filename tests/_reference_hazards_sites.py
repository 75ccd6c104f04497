"""Reference hazard rules that group events by call site (graph-retaining-copy,
stale-kept-copy, lost-inplace-write, pageable-transfer, deepcopy-in-loop, alias-write,
deepcopy-nonleaf, tensor-ctor-copy, noop-conversion), one Python object per event: see
``tests/_reference_hazards.py``."""

from __future__ import annotations

from typing import Any

from _reference_hazards_base import (
    _OWN_RULE,
    CONVERSION_OPS,
    _Acc,
    _accs,
    _plural,
    _what,
    format_bytes,
    is_hot,
)

from copytrace.analysis._findings import Finding
from copytrace.analysis._rules import (
    CTOR_CALLS,
    CTOR_FIXES,
    alias_write_text,
    deepcopy_nonleaf_text,
)
from copytrace.analysis._view import Ev


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
