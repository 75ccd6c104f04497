"""The hazard rules: each turns the events of one run into findings.

Every rule reads facts the tracer recorded (``docs/trace-format.md``), never guesses from
names alone; ``docs/hazards.md`` documents each code with a minimal example and its near-miss.
A rule that needs a fact the trace lacks (an older trace file) finds nothing.

The rules run over a run's columns (:class:`~copytrace.analysis._columns.RunColumns`): the
rules that group events by call site select and group them vectorised (numpy / pyarrow) and
only build the message in Python, once per finding; the rules that pair events
(``copytrace.analysis._pairs``) run in Python over the few rows that can take part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from copytrace._units import format_bytes_exact
from copytrace.analysis._dense import dense, distinct
from copytrace.analysis._evidence import (
    CONVERSION_OPS,
    HOT_DENSITY,
    HOT_MIN_STEPS,
    OWN_RULE,
    Group,
    is_hot,
    plural,
    what,
)
from copytrace.analysis._findings import Finding
from copytrace.analysis._pairs import PAIR_RULES

__all__ = ["RULES", "RULE_COLUMNS", "is_hot"]


def _sites(*sites: Any) -> list[str]:
    """Distinct true call sites, in order."""
    return list(dict.fromkeys(s for s in sites if s))


def _hot_rows(rc: Any, rows: np.ndarray, label: np.ndarray) -> np.ndarray:
    """Which of ``rows`` belong to a group (``label``) whose steps are hot (:func:`is_hot`),
    over all groups at once."""
    steps, step = dense(rc.np("step")[rows])
    pairs = distinct(label * len(steps) + step)  # each (group, step) once
    group, step = pairs // len(steps), steps[pairs % len(steps)]
    count = np.bincount(group, minlength=int(label.max()) + 1)
    last = np.full(len(count), np.iinfo(np.int64).min)
    np.maximum.at(last, group, step)
    first = np.full(len(count), np.iinfo(np.int64).max)
    np.minimum.at(first, group, step)
    hot = (count >= HOT_MIN_STEPS) & (count >= HOT_DENSITY * (last - first + 1))
    return hot[label]  # type: ignore[no-any-return]


def _groups(
    rc: Any, mask: np.ndarray, keys: Sequence[str], nbytes: str | None, hot: bool = False
) -> list[Group]:
    """One :class:`Group` per distinct value of ``keys`` among the rows in ``mask`` (``hot``:
    only the groups whose steps are hot, chosen over all groups at once); bytes from the
    integer column ``nbytes`` (``None``: 0); call sites: the ``site`` (and, for the key
    ``write_site``, the write site first)."""
    rows, label = rc.labels(mask, keys)
    if hot and len(rows):
        keep = _hot_rows(rc, rows, label)
        rows, label = rows[keep], label[keep]
    if not len(rows):
        return []
    order = np.argsort(label, kind="stable")
    groups = np.split(rows[order], np.flatnonzero(np.diff(label[order])) + 1)
    firsts = np.array([g[0] for g in groups], dtype=np.int64)
    sites = rc.values("site", firsts)
    writes = rc.values("write_site", firsts) if "write_site" in keys else [None] * len(firsts)
    out = []
    for rows, site, write in zip(groups, sites, writes, strict=True):
        counted = rc.ints(nbytes, rows) if nbytes else np.zeros(1, dtype=np.int64)
        out.append(Group(rc, rows, counted, _sites(write, site)))
    return out


def _ok(rc: Any) -> np.ndarray:
    """Not a deepcopy group, and the call did not raise."""
    return ~rc.flag("group") & rc.null("error")  # type: ignore[no-any-return]


# --- stale-kept-copy ------------------------------------------------------------------------------
def stale_kept_copy(rc: Any) -> list[Finding]:
    mask = rc.flag("stale") & ~rc.flag("snapshot") & rc.eq("phase", "backward")
    out = []
    for rows in rc.groups(mask, ("origin", "module")):
        origin, module = rc.values("origin", rows[:1])[0], rc.values("module", rows[:1])[0]
        g = Group(
            rc, rows, rc.ints("bytes_logical", rows), _sites(origin, *rc.values("site", rows[:1]))
        )
        made = (f"the copy made at `{origin}`" if origin else
                f"a cast of a parameter of `{module or '?'}` made by autocast")  # fmt: skip
        kept = ("kept and" if origin else
                "reused from autocast's weight cache (the autocast region spans the steps) and")  # fmt: skip
        out.append(
            g.finding(
                "stale-kept-copy",
                f"{made} was {kept} used in {plural(len(g.steps), 'later step')} after the "
                "parameter it copies had changed in place (its version counter moved, e.g. "
                "by `optimizer.step()`): the forward computed with the old values, and the "
                "gradient reached the parameter through the stale copy",
                "Make the copy inside each step, after `optimizer.step()`; enter "
                "`torch.autocast` inside the step (its cache is cleared when the region exits), "
                "or pass `cache_enabled=False`.",
            )
        )
    return out


# --- graph-retaining-copy ------------------------------------------------------------------------
def graph_retaining_copy(rc: Any) -> list[Finding]:
    mask = ~rc.flag("group") & (rc.filled("retained_bytes") > 0)
    out = []
    for g in _groups(rc, mask, ("site",), "retained_bytes"):
        e = g.first
        out.append(
            g.finding(
                "graph-retaining-copy",
                f"{plural(g.count, 'attached ' + e.op + ' result')} "
                f"({e.grad_fn or 'in the graph'}) outlived "
                f"{'its step' if g.count == 1 else 'their steps'} with the autograd graph, "
                "itself or through a tensor computed from it (a running total), and no "
                "backward ran through that graph: "
                f"{format_bytes_exact(g.bytes)} of saved tensors kept alive",
                "Keep `t.detach()` (or `t.item()` for a number) instead, also when adding it "
                "to a total, or make the copy under `torch.no_grad()`.",
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


def lost_inplace_write(rc: Any) -> list[Finding]:
    mask = rc.isin("op", INDEX_OPS) & rc.truthy("write_site") & _ok(rc)
    out = []
    for g in _groups(rc, mask, ("write_site", "site"), "bytes_logical"):
        e = g.first
        form = _INDEX_FORM.get(e.op, e.op)
        out.append(
            g.finding(
                "lost-inplace-write",
                f"an in-place write went into the fresh copy that advanced indexing "
                f"(`{form}`, {what(e)}) returned, and the copy was then dropped unused: "
                f"the write never reached the indexed tensor "
                f"({plural(g.count, 'time')}, {format_bytes_exact(g.bytes)} written and lost)",
                "Write through index assignment, which writes into the tensor itself: "
                "`x[idx] = value`, `x[idx] *= 2`, `x.index_fill_(0, idx, 0)` or "
                "`x.index_copy_(0, idx, src)`; for `nn.init`, initialise a new tensor and "
                "assign it: `w[idx] = nn.init.normal_(torch.empty_like(w[idx]))`.",
            )
        )
    return out


# --- alias-write -------------------------------------------------------------------------------
#: ops whose alias result is watched for an in-place write (the tracer's RULES.alias_watched)
ALIAS_WRITE_OPS = frozenset((*CONVERSION_OPS, "reshape", "copy"))


def alias_write_text(op: str, noop: bool, dtype: str | None, device: str | None) -> tuple[str, str]:
    """What the call returned, and the fix, for an ``alias-write`` finding of ``op``."""
    if op == "copy":
        return ("`copy.copy(t)` returned a new tensor on the same storage (a tensor has no "
                "`__copy__`: it is rebuilt on its input's memory)",
                "Copy with `t.clone()` (or `copy.deepcopy(t)`) where a private copy is meant.")  # fmt: skip
    if op == "reshape":
        return ("`reshape()` returned a view of its input (its strides allowed one; for a "
                "non-contiguous input the same line copies)",
                "Write `t.reshape(...).clone()` where a private copy is meant, or `t.view(...)` "
                "where sharing is meant.")  # fmt: skip
    already = "contiguous" if op == "contiguous" else f"already {dtype or '?'} on {device or '?'}"
    fix = ("`t.contiguous().clone()`" if op == "contiguous" else
           f"`t.to(..., copy=True)` or `t.{op}().clone()`" if op != "to" else
           "`t.to(..., copy=True)` or `t.clone()`")  # fmt: skip
    return (f"`.{op}()` returned its input itself ({already}; on another device or dtype the "
            "same line copies)",
            f"Make the copy explicit where a private copy is meant: {fix}; where sharing is "
            "meant, write into the input itself.")  # fmt: skip


def alias_write(rc: Any) -> list[Finding]:
    mask = rc.isin("op", ALIAS_WRITE_OPS) & rc.flag("alias") & rc.truthy("write_site") & _ok(rc)
    out = []
    for g in _groups(rc, mask, ("write_site", "site"), "bytes_logical"):
        e = g.first
        returned, fix = alias_write_text(e.op, e.noop, e.dtype, e.dst_device)
        out.append(
            g.finding(
                "alias-write",
                f"{returned}: the result ({what(e)}) shares its data with the input, and an "
                "in-place write into one of them changed the other while the program still "
                "held both "
                f"({plural(g.count, 'time')}, {format_bytes_exact(g.bytes)} written)",
                fix,
            )
        )
    return out


# --- pageable-transfer ------------------------------------------------------------------------------
def pageable_transfer(rc: Any) -> list[Finding]:
    mask = (
        rc.eq("transfer", "h2d")
        & ~rc.eq("op", "implicit")  # the pinned flag is recorded for API calls only
        & _ok(rc)
        & ~rc.flag("non_blocking")
        & rc.eq("pinned", False)
    )
    out = []
    for g in _groups(rc, mask, ("site",), "bytes_logical", hot=True):
        out.append(
            g.finding(
                "pageable-transfer",
                f"{plural(g.count, 'host-to-device copy')} from pageable (unpinned) memory "
                f"without non_blocking, in {len(g.steps)} steps ({format_bytes_exact(g.bytes)}): "
                "each one blocks the host until the copy is done",
                "Pin the host tensor (`DataLoader(pin_memory=True)` or `t.pin_memory()`) and "
                "pass `non_blocking=True`.",
            )
        )
    return out


# --- deepcopy-in-loop --------------------------------------------------------------------------------
_DICTS = ("builtins.dict", "collections.OrderedDict")


def deepcopy_in_loop(rc: Any) -> list[Finding]:
    mask = rc.eq("op", "deepcopy") & rc.null("error")
    children = np.flatnonzero(mask & ~rc.flag("group"))
    mask[children[rc.parents(children) != -1]] = False  # inside a deepcopy group
    out = []
    for g in _groups(rc, mask, ("site",), "bytes_allocated", hot=True):
        steps = g.steps
        kinds = {t or "torch.Tensor" for t in set(rc.values("object_type", g.rows))}
        kind = ", ".join(sorted(kinds))
        if kinds <= set(_DICTS):
            fix = (
                "Allocate the copy once and refresh it in place each step: "
                "`for k, v in sd.items(): snap[k].copy_(v)`."
            )
        elif not rc.flag("group")[g.rows].any():
            fix = "Allocate the copy once and refresh it with `dst.copy_(src)` each step."
        else:
            fix = (
                "Deep-copy once before the loop and refresh the copy in place each step: "
                "`target.load_state_dict(model.state_dict())`, or for an EMA "
                "`torch._foreach_lerp_(ema_params, params, 1 - decay)`."
            )
        out.append(
            g.finding(
                "deepcopy-in-loop",
                f"copy.deepcopy of {kind} ran {plural(g.count, 'time')} in {len(steps)} "
                f"steps ({min(steps)}-{max(steps)}), {format_bytes_exact(g.bytes)} allocated",
                fix,
            )
        )
    return out


# --- deepcopy-nonleaf ------------------------------------------------------------------------------
def deepcopy_nonleaf_text(holder: str | None, grad_fn: str | None, kind: str) -> str:
    """The message of a ``deepcopy-nonleaf`` finding."""
    held = f"`{holder}`" if holder else f"a {kind} tensor"
    if holder and "[" not in holder:  # a module attribute
        kept = ("a forward that stores an activation on its module also keeps that forward's "
                "graph (and its saved tensors) alive, and every later deepcopy of the module "
                "fails")  # fmt: skip
    else:
        kept = "while it is held, it also keeps its forward's graph (and its saved tensors) alive"
    return (
        f"`copy.deepcopy` raised on {held}, a tensor still in the autograd graph "
        f"({grad_fn}): `Tensor.__deepcopy__` copies graph leaves only; {kept}"
    )


_DEEPCOPY_NONLEAF_FIX = (
    "Store a detached tensor (`self.last = h.detach()`), or drop the attribute before copying; "
    "where the values must travel with the copy, keep `h.detach().clone()`."
)


def deepcopy_nonleaf(rc: Any) -> list[Finding]:
    mask = (rc.eq("op", "deepcopy") & ~rc.flag("group") & ~rc.null("error")
            & rc.truthy("grad_fn"))  # fmt: skip
    out = []
    for g in _groups(rc, mask, ("site", "src_name"), "bytes_logical"):
        e = g.first
        out.append(g.finding("deepcopy-nonleaf", deepcopy_nonleaf_text(
            e.src_name, e.grad_fn, what(e)) + f" ({plural(g.count, 'time')})",
            _DEEPCOPY_NONLEAF_FIX))  # fmt: skip
    return out


# --- tensor-ctor-copy -----------------------------------------------------------------------------------
#: the call each op names in the message (as_tensor and the legacy constructors,
#: torch.Tensor and torch.FloatTensor..., are recorded only of a list of tensors)
CTOR_CALLS = {
    "tensor_ctor": "torch.tensor(t)", "new_tensor": "t.new_tensor(x)",
    "as_tensor": "torch.as_tensor([t, ...])", "legacy_ctor": "torch.Tensor([t, ...])",
}  # fmt: skip
_STACK = (
    "For a list of tensors, `torch.stack(ts)` keeps the autograd graph (`torch.stack(ts)."
    "detach()` when the cut is meant)."
)
_ONE = (
    "Use `t.detach().clone()` when a copy is needed, or `torch.as_tensor(t)` / `t.to(dtype)` "
    "when it is not. "
)
#: the fix, by op: for as_tensor and the legacy constructors their own form is what copies
CTOR_FIXES = {
    "tensor_ctor": _ONE + _STACK, "new_tensor": _ONE + _STACK, "as_tensor": _STACK,
    "legacy_ctor": _STACK + " A legacy constructor's dtype is `.to(dtype)` after it "
    "(`torch.FloatTensor`: float32, `torch.LongTensor`: int64, ...).",
}  # fmt: skip
def tensor_ctor_copy(rc: Any) -> list[Finding]:
    mask = rc.isin("op", tuple(OWN_RULE)) & _ok(rc) & ~rc.truthy("via")
    out = []
    for g in _groups(rc, mask, ("site",), "bytes_allocated"):
        e = g.first
        call = CTOR_CALLS[e.op]
        graph = " and cuts it from the autograd graph" if e.src_requires_grad else ""
        out.append(
            g.finding(
                "tensor-ctor-copy",
                f"`{call}` of an existing tensor copies it{graph} "
                f"({plural(g.count, 'time')}, {format_bytes_exact(g.bytes)}); torch warns "
                "against this form",
                CTOR_FIXES[e.op],
            )
        )
    return out


# --- noop-conversion ---------------------------------------------------------------------------------------
def noop_conversion(rc: Any) -> list[Finding]:
    mask = (
        rc.flag("noop")
        & rc.isin("op", CONVERSION_OPS)
        & _ok(rc)
        & ~rc.truthy("via")  # made inside a torch function (clip_grad_norm_...): not the user's
    )
    out = []
    for g in _groups(rc, mask, ("site", "op"), None, hot=True):
        e = g.first
        already = "contiguous" if e.op == "contiguous" else f"{e.dtype} on {e.dst_device}"
        if e.op == "contiguous":
            fix = "Drop the `.contiguous()` call if the tensor is always contiguous there."
        else:
            fix = (
                f"Drop the `.{e.op}()` call, or guard it (`if t.device != device:`) if the hot "
                "loop matters."
            )
        out.append(
            g.finding(
                "noop-conversion",
                f"`.{e.op}()` returned its input unchanged (already {already}) "
                f"{plural(g.count, 'time')} in {len(g.steps)} steps: harmless, Python "
                "overhead only",
                fix,
            )
        )
    return out


#: The rules, in report order (``rule(rc) -> findings`` over a run's columns): one per code of
#: :data:`~copytrace.analysis._findings.HAZARDS`, in the same order.
RULES: tuple[Callable[[Any], list[Finding]], ...] = (
    PAIR_RULES["data-inplace"],
    lost_inplace_write,
    graph_retaining_copy,
    alias_write,
    PAIR_RULES["aliasing-snapshot"],
    stale_kept_copy,
    PAIR_RULES["redundant-copy"],
    PAIR_RULES["round-trip"],
    pageable_transfer,
    deepcopy_in_loop,
    deepcopy_nonleaf,
    tensor_ctor_copy,
    PAIR_RULES["clone-detach-order"],
    noop_conversion,
)

#: The columns the rules and the budget's totals read (each run's are read together first
#: when every rule runs: :meth:`~copytrace.analysis._columns.RunColumns.prefetch`).
RULE_COLUMNS = (
    "op", "saved_by", "write_site", "group", "error", "retained_bytes", "snapshot", "stale",
    "phase", "alias", "noop", "bytes_allocated", "src_storage", "src_version", "via",
    "recompute", "inplace_writes", "step", "src_offset", "src_stride", "shape", "dtype",
    "dst_device", "file", "line", "function", "lib_file", "lib_line", "lib_function",
    "span_id", "dst_storage", "transfer", "dst_version", "src_dtype", "autocast_nocache",
    "bytes_logical", "non_blocking", "pinned", "graph", "grad_fn", "src_name",
)  # fmt: skip
