"""The report model built from the columnar table (DuckDB, one module per section) equals the
model the previous builder (Python loops over loaded events, kept in
``tests/_reference_model.py``) makes of the same trace: every total, table, finding and, when
every event fits the timeline, every event.

Traces: a real one (a small traced torch loop with clones, aliases, no-op conversions, a
deepcopy and a repeated ``torch.tensor(t)`` hazard), the synthetic trace of ``_tracegen``
(cut file, groups, a transfer), a larger generated one and a directory of two processes.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import _reference_model as reference
import pytest
import torch
from _tracegen import write_many, write_trace

import copytrace
from copytrace.dashboards import build_model
from copytrace.tracefile import event_table, load_trace

FIELDS = (
    "runs", "totals", "stages", "bad_lines", "files", "steps", "call_sites", "modules", "ops",
    "transfers", "transfers_by_run", "groups", "hazards", "analysis", "cube", "site_labels",
    "site_sources",
)  # fmt: skip


def _plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _compare(path: Path, analyze: bool = True) -> Any:
    """Compare both models of ``path``. Without the analysis the new model shows the
    hazards the tracer wrote into the trace, which the old one dropped: those are left out
    of the comparison (and checked by the caller)."""
    old = reference.build_model(load_trace(path), analyze=analyze)
    new = build_model(event_table(path, cache=False), analyze=analyze)
    for name in FIELDS if analyze else [f for f in FIELDS if f != "hazards"]:
        a, b = _plain(getattr(new, name)), _plain(getattr(old, name))
        if name == "hazards":  # new: the runs (processes) each hazard was seen in
            assert all(h.pop("runs") for h in a)
            for h in a:  # new: each finding's patch (tests/test_fix.py checks them)
                for key in ("patch", "patch_reason", "patch_exact", "no_patch"):
                    h.pop(key)
        if name == "totals" and not analyze:
            a["hazard_count"] = b["hazard_count"]
        assert a == b, name
    assert new.n_events == old.n_events == new.n_sampled
    events = [new.event(i) for i in range(new.n_events)]
    if not analyze:
        for e in events:
            e["hazard"] = None
    assert events == [old.event(i) for i in range(old.n_events)]
    return new


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.contiguous().clone())


def test_real_trace(tmp_path: Path) -> None:
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with copytrace.trace(tmp_path, flush_events=16) as t:
        for _ in range(6):
            x = torch.randn(3, 8).to(torch.float32)
            loss = net(x).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            log = torch.tensor(loss.detach())  # a copy of an existing tensor, each step
            del log
        copy.deepcopy(net)
    assert t.trace_path is not None
    model = _compare(tmp_path)
    # what was compared is not empty: 6 steps of events, a deepcopy group, a finding
    assert model.totals.copy_count >= 6 and model.totals.group_count == 1
    assert model.analysis == "ran" and model.hazards


def test_synthetic_trace(tmp_path: Path) -> None:
    write_trace(tmp_path, truncated=True)
    model = _compare(tmp_path)
    assert model.bad_lines == 1 and model.totals.events == 7


@pytest.mark.parametrize("analyze", [True, False])
def test_generated_trace(tmp_path: Path, analyze: bool) -> None:
    write_many(tmp_path, 3000, large_every=7)
    model = _compare(tmp_path, analyze)
    assert model.totals.events == 3000
    if not analyze:  # the trace's own hazards (its copytrace.hazards span), one per site
        assert {(h.code, h.source) for h in model.hazards} == {("CT-TEST", "trace")}
        # every 250th of 3000 events is named: 12, at the 4 call sites (large_every=7)
        assert len(model.hazards) == 4 and sum(len(h.event_ids) for h in model.hazards) == 12


def test_two_processes(tmp_path: Path) -> None:
    write_trace(tmp_path, pid=11)
    write_trace(tmp_path, pid=12, gz=True)
    model = _compare(tmp_path)
    assert [r.label for r in model.runs] == ["pid 11", "pid 12"]


def test_summary_model_skips_only_the_hazards_events(tmp_path: Path) -> None:
    """``hazard_events=False`` (the terminal summary's model) changes nothing but the
    hazards' call sites and steps, which then are the findings' own; the timeline still
    builds (with no hazard marked)."""
    write_many(tmp_path, 3000, large_every=7)
    full = build_model(event_table(tmp_path), analyze=False)
    lean = build_model(event_table(tmp_path), analyze=False, hazard_events=False)
    assert _plain(lean.totals) == _plain(full.totals)
    assert _plain(lean.call_sites) == _plain(full.call_sites)
    assert _plain(lean.steps) == _plain(full.steps)
    # the trace's own hazards: 4, one per call site, naming 12 events in all
    assert [(h.code, h.message, h.event_ids, h.runs) for h in lean.hazards] == [
        (h.code, h.message, h.event_ids, h.runs) for h in full.hazards
    ]
    assert len(lean.hazards) == 4
    assert full.ev_hazard.count(-1) < len(full.ev_hazard)  # the full model marks them
    assert set(lean.ev_hazard) == {-1} and len(lean.ev_hazard) == len(full.ev_hazard)


@pytest.mark.parametrize("form", ["prefixed", "underscore"])
def test_span_ids_of_another_form(tmp_path: Path, form: str) -> None:
    """The report keys span ids of 16 lower-case hex digits (the tracer's) by their value;
    a trace with ids of another form (here every id prefixed, or some with a ``_``, which
    DuckDB's integer cast would skip) reads them as text: the same model as the reference,
    the trace's hazards still marked on their events."""
    import re

    write_many(tmp_path, 3000, large_every=7)
    (path,) = tmp_path.glob("*.otlp.jsonl")

    def other(m: re.Match[str]) -> str:
        sid = m.group(1)
        if form == "prefixed":
            return f'"x{sid}"'
        # every id ending in 0 (a tenth): '_' for its second digit, which is 0 here (ids are
        # small numbers), so the id reads as the same number to the cast but is not hex
        return f'"{sid[0]}_{sid[2:]}"' if sid.endswith("0") and sid[1] == "0" else m.group(0)

    text, n = re.subn(r'"([0-9a-f]{16})"', other, path.read_text())
    assert n > 3000 and "_" in text if form == "underscore" else "x0" in text
    path.write_text(text)
    new = _compare(tmp_path, analyze=False)
    # the trace's hazards name 12 events (see test_generated_trace), marked on the timeline
    assert len(new.ev_hazard) - new.ev_hazard.count(-1) == 12
    assert all(not re.fullmatch("[0-9a-f]{16}", s) for s in new.ev_span_id) or (
        form == "underscore" and any("_" in s for s in new.ev_span_id))  # fmt: skip
