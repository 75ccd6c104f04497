"""An attached copy finished in C (``_native/attached.cpp``) leaves what ``Recorder.api_tail``
leaves: the same events, the same grad_fn tags (a backward copy's ``origin`` and ``stale``),
the same attached entries and the same call-site counts (``watch/_accumulate.py``).

Each program runs twice under the C++ observer: as it is, and with ``set_attached`` never
called, so that every attached copy goes to Python's ``api_tail``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import copytrace
from copytrace.tracer import _api_events, _native
from copytrace.tracer._patches import active_recorder

pytestmark = pytest.mark.skipif(_native.load() is None, reason="needs the C++ observer")


def _program(keep: list[Any]) -> None:
    w = torch.randn(8, requires_grad=True)
    for i in range(40):
        a = w.clone()  # attached, outside any module call: the C path's case
        if i % 4 == 0:
            keep.append(a)  # some kept: the site's copies partly alive at its checks
        c = w.to(torch.float64)  # attached, then its backward's copy names this line
        if i % 10 == 0:
            c.sum().backward()  # a backward root: each site starts its count again
        if i == 25:
            with torch.no_grad():
                w.add_(1)  # the leaf changes in place: a kept cast is stale after it


def _state() -> dict[str, Any]:
    """What the tail leaves beside the events, read while tracing (no weak pointer compared)."""
    rec = active_recorder()
    watch = rec.watch
    tags = {k: v[1] for k, v in rec.node_tags._tags.items()}
    attached = [(a.ev.seq, a.seq, a.kind, a.pending, a.storage is not None, a.node is not None)
                for a in watch.attached]  # fmt: skip
    sites = {k: (s.count, s.next_check, s.flagged, s.mark, s.first, s.last.ev.seq)
             for k, s in watch.sites.items()}  # fmt: skip
    seqs = [k[0] for k in tags]
    return {"tags": tags, "attached": attached, "sites": sites, "seqs": seqs}


def _run(monkeypatch: pytest.MonkeyPatch, in_c: bool) -> tuple[list[dict], dict, int]:
    native = _native.load()
    calls = []
    tail = _api_events.ApiEvents.api_tail

    def counted(self: Any, *args: Any) -> None:
        calls.append(args[0])
        tail(self, *args)

    with monkeypatch.context() as m:
        m.setattr(_api_events.ApiEvents, "api_tail", counted)
        if not in_c:
            m.setattr(native, "set_attached", lambda *args: None)
        keep: list[Any] = []
        with copytrace.trace(write=False) as t:
            _program(keep)
            state = _state()
    assert t.stats["errors"] == 0
    events = [{k: v for k, v in e.as_dict().items() if k not in ("start_ns", "end_ns")}
              for e in t.events]  # fmt: skip
    first = min(state["seqs"])  # autograd sequence numbers differ between the runs
    state["tags"] = {(k[0] - first, k[1]): v for k, v in state["tags"].items()}
    state["attached"] = [(e, s - first, *rest) for e, s, *rest in state["attached"]]
    state["sites"] = {k: (*v[:3], v[3] - first, v[4] - first, v[5])
                      for k, v in state["sites"].items()}  # fmt: skip
    del state["seqs"]
    return events, state, len(calls)


def test_attached_copies_in_c_leave_what_python_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    events_c, state_c, calls_c = _run(monkeypatch, in_c=True)
    events_py, state_py, calls_py = _run(monkeypatch, in_c=False)
    # 40 clones + 40 casts (all attached) and 4 backward casts of the gradient
    assert [e["op"] for e in events_c].count("clone") == 40
    backward = [e for e in events_c if e["phase"] == "backward"]
    assert len(backward) == 4 and all(
        e["origin"] and e["origin"].endswith(str(_program.__code__.co_firstlineno + 6))
        for e in backward
    )  # the .to() line
    assert events_c == events_py
    assert state_c == state_py
    # Python's api_tail saw every attached copy; with the C path only the copies a site starts
    # or checks with (its 1st, 4th, 8th, 16th, 32nd copy since a backward) and a tag table or
    # list due for a prune: far fewer than the 80 attached copies
    assert calls_py == 80
    assert calls_c < calls_py // 2
