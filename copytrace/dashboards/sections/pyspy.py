"""py-spy's sampled view in the report: an icicle of the samples, and the cross-check of the
sampled shares against the traced ones, for each py-spy profile beside the trace files.

Like every section, it is shipped as JSON (:func:`payload_pyspy`) and drawn by ``report.js``;
the parsing and the shares are :mod:`copytrace.pyspy.profile`'s.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from copytrace.pyspy.compare import pid_of, traced_numbers
from copytrace.pyspy.profile import (
    API,
    KERNEL,
    TRACER,
    Profile,
    SampleStats,
    Stack,
    analyze,
    classify,
    find_profiles,
    load_profile,
    scope,
)
from copytrace.pyspy.profile import label as frame_label

__all__ = ["payload_pyspy", "pyspy_figure", "pyspy_profiles"]

# --- figure --------------------------------------------------------------------------------------
_COLOURS = {KERNEL: "#d62728", API: "#ff7f0e", TRACER: "#9467bd"}
_INSIDE_COPY = "#f7b6a8"
_PYTHON = "#9ecae1"
_NATIVE = "#d9d9d9"
#: Native frames that only pass a call on (dispatcher, boxing, pybind11, CPython's call
#: machinery): folded into their caller so that the icicle shows the frames that matter.
_PLUMBING = re.compile(
    r"^0x|^c10::impl::|^c10::Dispatcher::|^c10::BoxedKernel|^c10::KernelFunction|::redispatch$"
    r"|^torch::jit::|^pybind11::|^_?Py[A-Z]|^_?PyEval|^_?PyObject|^cfunction_|^method_vectorcall"
    r"|^vectorcall|^slot_tp_|^torch::autograd::TypeError_to_NotImplemented_|^std::"
    r"|^torch::handle_torch_function"
)
#: Python frames that only pass a call on: ``nn.Module.__call__``'s layers, torch's
#: decorators and override/op-call helpers.
_PY_PLUMBING = re.compile(
    r"torch/nn/modules/module\.py:(?:Module\._wrapped_call_impl|Module\._call_impl.*)$"
    r"|torch/utils/_contextlib\.py:.*decorate_context$"
    r"|torch/overrides\.py:handle_torch_function$"
    r"|torch/_ops\.py:OpOverload(?:Packet)?\.__call__$"
)
#: Python frames of the launcher (runpy, copytrace's CLI and start-up hook) above the program.
_LAUNCH_FILES = re.compile(r"runpy|copytrace/cli/|copytrace/__main__\.py|copytrace/launch/")


def _visible_frames(profile: Profile, frames: Sequence[int]) -> list[int]:
    """A stack without its launcher prefix and plumbing frames (see :data:`_PLUMBING`)."""
    start = 0
    for k, fid in enumerate(frames):
        fr = profile.frames[fid]
        if fr.line and _LAUNCH_FILES.search(fr.file.replace("\\", "/")):
            start = k + 1
    out = []
    for fid in frames[start:]:
        fr = profile.frames[fid]
        if fr.native and _PLUMBING.search(fr.name):
            continue
        if fr.line and _PY_PLUMBING.search(f"{fr.file.replace(chr(92), '/')}:{fr.name}"):
            continue
        out.append(fid)
    return out


def _tree(
    profile: Profile,
    stacks: Iterable[Stack],
    min_share: float,
    max_nodes: int,
    copies_only: bool = False,
) -> tuple[list[str], list[str], list[str], list[float], list[str], list[str]]:
    """Merged call tree as parallel lists for ``go.Icicle`` (ids, labels, parents, values,
    colours, hover). ``copies_only``: only samples in a copy, each cut at its first copy
    frame (so the tree shows who called the copies)."""
    kinds = [classify(f) for f in profile.frames]
    stacks = list(stacks)
    multi = len({(s.pid, s.thread) for s in stacks}) > 1
    root = "samples in copies" if copies_only else "all samples"
    # (parent id, label) -> [id, value, kind, inside a copy, hover]
    nodes: dict[tuple[str, str], list[Any]] = {}
    order: list[tuple[str, str]] = []
    counter = [0]
    total = 0.0

    def node(parent: str, label: str, kind: str, inside: bool, hover: str, w: float) -> str:
        key = (parent, label)
        entry = nodes.get(key)
        if entry is None:
            counter[0] += 1
            entry = nodes[key] = [f"n{counter[0]}", 0.0, kind, inside, hover]
            order.append(key)
        entry[1] += w
        return str(entry[0])

    for st in stacks:
        frames = _visible_frames(profile, st.frames)
        if copies_only:
            cut = next((k for k, fid in enumerate(frames) if kinds[fid] in (KERNEL, API)), None)
            if cut is None:
                continue
            frames = frames[: cut + 1]
        total += st.weight
        parent = "root"
        if multi:
            label = f"pid {st.pid} {st.thread}".strip() if st.pid else (st.thread or "thread")
            parent = node(parent, label, "", False, html.escape(label), st.weight)
        inside = False
        for fid in frames:
            fr = profile.frames[fid]
            kind = kinds[fid]
            hover = html.escape(fr.name if len(fr.name) < 300 else fr.name[:297] + "...")
            if fr.file:
                hover += "<br>" + html.escape(fr.file + (f":{fr.line}" if fr.line else ""))
            parent = node(parent, frame_label(fr), kind, inside, hover, st.weight)
            inside = inside or kind in (KERNEL, API)
    total = total or 1.0
    threshold = min_share * total
    kept = [k for k in order if nodes[k][1] >= threshold]
    if len(kept) > max_nodes:
        cut_value = sorted((nodes[k][1] for k in kept), reverse=True)[max_nodes - 1]
        kept = [k for k in kept if nodes[k][1] >= cut_value]
    kept_ids = {nodes[k][0] for k in kept} | {"root"}
    ids, labels, parents = ["root"], [root], [""]
    values, colours, hovers = [total], [_PYTHON], [f"{root}<br>{total:.3g} {profile.unit}"]
    for key in kept:
        parent, label = key
        if parent not in kept_ids:
            continue
        nid, value, kind, inside, hover = nodes[key]
        colour = _COLOURS.get(kind) or (_INSIDE_COPY if inside else None)
        if colour is None:
            colour = _PYTHON if "(" in label and label.endswith(")") and ":" in label else _NATIVE
        ids.append(nid)
        labels.append(html.escape(label))
        parents.append(parent)
        values.append(value)
        colours.append(colour)
        extra = f" · {kind}" if kind else (" · inside a copy" if inside else "")
        hovers.append(f"{hover}<br>{value / total:.1%} of these samples{extra}")
    return ids, labels, parents, values, colours, hovers


def pyspy_figure(
    profile: Profile, main_pid: int | None = None, *, min_share: float = 0.002,
    max_nodes: int = 3000, maxdepth: int = 16,
) -> Any:  # fmt: skip
    """An icicle of py-spy's samples (root on top), copy frames highlighted.

    Two views, switched by buttons: every sample, and only the samples in a copy, each
    stack cut at its first copy frame (who calls the copies). Copy kernels are red, copy
    API calls orange, copytrace's own frames purple and frames below a copy pale red; other
    Python frames are blue, native frames grey. The launcher's frames above the program and
    native plumbing frames (dispatcher, pybind11, CPython calls) are left out. Click a box
    to zoom into it.

    Args:
        profile: What :func:`load_profile` returned.
        main_pid: Draw only this process's main thread (or these processes', a collection)
            when the profile has it.
        min_share: Leave out frames below this share of the samples.
        max_nodes: At most this many boxes per view.
        maxdepth: Levels shown at once.

    Returns:
        A ``plotly.graph_objects.Figure``.
    """
    import plotly.graph_objects as go

    stats = analyze(profile, main_pid)
    stacks, _ = scope(profile, main_pid)
    fig = go.Figure()
    for copies_only in (False, True):
        ids, labels, parents, values, colours, hovers = _tree(
            profile, stacks, min_share, max_nodes, copies_only
        )
        fig.add_trace(
            go.Icicle(
                ids=ids,
                labels=labels,
                parents=parents,
                values=values,
                branchvalues="total",
                marker={"colors": colours, "line": {"width": 0.5, "color": "#ffffff"}},
                hovertext=hovers,
                hoverinfo="text",
                tiling={"orientation": "v"},
                maxdepth=maxdepth,
                textfont={"size": 11},
                visible=not copies_only,
                name="copies only" if copies_only else "all samples",
            )
        )
    fig.update_layout(
        title={
            "text": (
                f"py-spy samples ({html.escape(stats.scope)}): copy work "
                f"{stats.copy_work_share:.1%}, copy kernels {stats.kernel_share:.1%}, "
                f"copytrace {stats.tracer_share:.1%}"
            ),
            "x": 0.01,
            "xanchor": "left",
        },
        height=640,
        margin={"l": 10, "r": 10, "t": 80, "b": 10},
        template="plotly_white",
        updatemenus=[_VIEW_BUTTONS],
    )
    return fig


#: The icicle's two views (``pyspy_figure``'s two traces): every sample, or copies only.
_VIEW_BUTTONS = {
    "type": "buttons", "direction": "right", "x": 1.0, "xanchor": "right", "y": 1.08,
    "yanchor": "bottom", "showactive": True,
    "buttons": [
        {"label": "all samples", "method": "update", "args": [{"visible": [True, False]}]},
        {"label": "copies: who calls them", "method": "update",
         "args": [{"visible": [False, True]}]},
    ],
}  # fmt: skip


# --- the section's payload ------------------------------------------------------------------------
def pyspy_profiles(model: Any) -> list[Path]:
    """The py-spy profiles for a report of ``model``, looked for beside its trace files: a
    report of one trace file takes only that process's profile, a report of several takes
    every profile beside them."""
    files = [Path(f) for f in getattr(model, "files", []) or []]
    if not files:
        return []
    stems = [f.name.split(".", 1)[0] for f in files]
    found: list[Path] = []
    for d in sorted({f.parent for f in files}):
        for prof in find_profiles(d):
            stem = prof.name.split(".", 1)[0]
            if len(files) > 1 or any(t == stem or t.startswith(stem + "-") for t in stems):
                found.append(prof)
    return found


def payload_pyspy(model: Any, profiles: Sequence[Path] | None = None) -> list[dict[str, Any]]:
    """One entry per py-spy profile (``[]`` when there is none; default: those of
    :func:`pyspy_profiles`).

    Each entry is ``{"name": file name, "error": why it could not be read}`` or ``{"name",
    "scope", "rows": [[measure, share text, what it counts]], "top": [[frame, kind, share
    text]], "fig": the icicle as plotly JSON}``: the cross-check table (sampled shares next
    to the traced ones), the top copy frames and :func:`pyspy_figure`.
    """
    out: list[dict[str, Any]] = []
    for path in pyspy_profiles(model) if profiles is None else profiles:
        pid: Any = pid_of(path)
        traced_pids = {getattr(r, "pid", None) for r in getattr(model, "runs", []) or []}
        traced_pids.discard(None)
        if pid not in traced_pids and traced_pids:
            pid = sorted(traced_pids)  # a launcher sampled with its workers: theirs
        try:
            profile = load_profile(path)
            stats = analyze(profile, pid)
            fig = json.loads(pyspy_figure(profile, pid).to_json())
        except (OSError, ValueError, KeyError, TypeError) as err:
            out.append({"name": path.name, "error": str(err)})
            continue
        traced = traced_numbers(model, pid) if model is not None else None
        out.append({"name": path.name, "scope": stats.scope, "rows": _rows(stats, traced),
                    "top": [[f.label, f.kind, _pct(f.share)] for f in stats.top_copy_frames],
                    "fig": fig})  # fmt: skip
    return out


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _rows(stats: SampleStats, traced: dict[str, float | None] | None) -> list[list[str]]:
    """The cross-check table: ``[measure, share, what it counts]``."""
    unit = "s" if stats.unit == "seconds" else "samples"
    rows = [["samples", f"{stats.samples:,} ({stats.weight:.3g} {unit})", stats.scope]]
    rows.append(["sampled: copy work", _pct(stats.copy_work_share),
                 "in copy API calls and aten copy ops that no other op called, less "
                 "copytrace's own frames in them: what the traced copy time measures"])  # fmt: skip
    if traced:
        rows.append(["traced: copy time", _pct(traced.get("copy_share")),
                     "copytrace's timers: summed event duration / run duration"])  # fmt: skip
    rows.append(["sampled: copytrace recording copies", _pct(stats.copy_call_tracer_share),
                 "copytrace's own frames inside those calls"])  # fmt: skip
    rows.append(["sampled: copytrace in all", _pct(stats.tracer_share),
                 "the tracer's own code anywhere (its handlers run on every torch call)"])  # fmt: skip
    if traced and traced.get("overhead_share") is not None:
        rows.append(["traced: overhead", _pct(traced.get("overhead_share")),
                     "copytrace's timers: its own recording time / run duration"])  # fmt: skip
    rows.append(["sampled: copy kernels", _pct(stats.kernel_share),
                 "aten copy kernels, wherever called from"])  # fmt: skip
    rows.append(["... inside other ops", _pct(stats.kernel_in_ops_share),
                 "copy kernels run inside another aten op (addmm copying its bias, cat...): "
                 "not recorded by the trace"])  # fmt: skip
    rows.append(["sampled: copy API calls", _pct(stats.api_share),
                 "clone/to/contiguous/copy_/detach/deepcopy... calls, copytrace's handling "
                 "included"])  # fmt: skip
    if not stats.native:
        rows.append(["note", "no native frames", "kernel shares need py-spy --native"])
    return rows
