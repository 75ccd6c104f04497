"""The watch's two contracts: what it asks of its recorder, and which event fields it may
change after an event is recorded (the fields the session's hold-back is for)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import copytrace
from copytrace.schema import CopyEvent
from copytrace.tracer import watch
from copytrace.tracer._recorder import Recorder

WATCH_DIR = Path(watch.__file__).parent


def test_late_fields_are_event_fields() -> None:
    assert set(watch.LATE_FIELDS) <= set(CopyEvent.__slots__)


#: What the WatchHost protocol declares: the only members of the recorder a watch may use.
HOST_MEMBERS = {n for n in vars(watch.WatchHost) if not n.startswith("_")}


def test_recorder_is_a_watch_host() -> None:
    members = HOST_MEMBERS
    assert {"note_error", "watch_writes", "owner_name", "owner_name_by_identity"} == members
    rec = Recorder()
    for name in members:
        assert callable(getattr(rec, name))
    assert rec.watch.host is rec


def test_watch_package_reads_no_recorder_internals() -> None:
    # Only the WatchHost methods: no import of the recorder and no `rec` attribute.
    for path in WATCH_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "copytrace.tracer._recorder" not in imported, path.name
        assert not any(isinstance(n, ast.Attribute) and n.attr == "rec" for n in ast.walk(tree))
        uses = {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Attribute)
            and n.value.attr == "host"
        }
        assert uses <= HOST_MEMBERS, (path.name, uses)


def test_a_late_fact_lands_on_a_held_event_only() -> None:
    # x.data is an alias of a tensor that requires grad: watched until it dies, so its event
    # is held back; an in-place write through it sets a late field (inplace_writes = 1).
    w = torch.randn(4, requires_grad=True)
    with copytrace.trace(write=False) as t:
        alias = w.data
        held = {id(ev) for ev in t.session._rec.watch.live_events()}
        alias.add_(1.0)
    (ev,) = [e for e in t.events if e.op == "data_get"]
    assert id(ev) in held
    assert ev.inplace_writes == 1
