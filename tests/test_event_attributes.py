"""Span attributes of events: the generated ``event_attributes`` against the field tables."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import copytrace
from copytrace import schema
from copytrace.export.otlp_json import event_attributes
from copytrace.schema import CopyEvent

_KEEP = object()


def _reference(ev: CopyEvent) -> dict:
    """The attributes as the field tables define them (one loop per table)."""
    attrs: dict = {}
    for field, key in schema.STR_FIELDS:
        value = getattr(ev, field)
        if value and value != schema.OMITTED_DEFAULTS.get(key, _KEEP):
            attrs[key] = value
    for field, key in schema.SCALAR_FIELDS:
        value = getattr(ev, field)
        if value is not None:
            default = schema.OMITTED_DEFAULTS.get(key, _KEEP)
            if value != default or type(value) is not type(default):
                attrs[key] = value
    for field, key in schema.ANALYSIS_FIELDS:
        value = getattr(ev, field, None)
        if value is not None and value is not False and value != ():
            attrs[key] = list(value) if isinstance(value, tuple) else value
    if ev.transfer != "h2d":
        attrs.pop("copytrace.pinned", None)
    if ev.aten:
        attrs["copytrace.aten"] = list(ev.aten)
    if ev.shape:
        attrs["copytrace.shape"] = list(ev.shape)
    if ev.group:
        attrs["copytrace.group"] = True
        attrs["copytrace.tensors"] = ev.tensors
    return attrs


def test_attributes_of_a_training_step_match_the_field_tables(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with copytrace.trace(tmp_path, write=False) as t:
        x = torch.randn(3, 4).to(torch.float64).float()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema = copy.deepcopy(model)
        snap = {k: v.detach().clone() for k, v in model.state_dict().items()}
        _ = (ema, snap, x.data, x[torch.tensor([0, 2])], x.numpy())
    events = t.events
    assert {ev.op for ev in events} >= {"to", "float", "deepcopy", "clone", "detach", "index"}
    for ev in events:
        assert list(event_attributes(ev).items()) == list(_reference(ev).items())


def test_attributes_of_hand_made_events() -> None:
    h2d = CopyEvent(op="to", transfer="h2d", pinned=True, src_device="cpu", dst_device="cuda:0")
    d2h = CopyEvent(op="to", transfer="d2h", pinned=False, bytes_allocated=0, alias=0)
    group = CopyEvent(op="deepcopy", group=True, tensors=3, saved_by=("A.x",), stale=True)
    for ev in (h2d, d2h, group, CopyEvent()):
        assert list(event_attributes(ev).items()) == list(_reference(ev).items())
    assert event_attributes(h2d)["copytrace.pinned"] is True  # written on H2D only
    assert "copytrace.pinned" not in event_attributes(d2h)
    assert event_attributes(d2h)["copytrace.alias"] == 0  # an int 0 is not the False default
    assert event_attributes(group)["copytrace.saved_by"] == ["A.x"]
