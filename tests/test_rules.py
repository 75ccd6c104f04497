"""The API-event rules are data (``copytrace.tracer._rules.RULES``): the C++ observer's
``record`` classes results as those tables say, and so does the Python path."""

from __future__ import annotations

import pytest
import torch

from copytrace.tracer import _callsite, _modules, _native
from copytrace.tracer._api_events import _PROTOTYPE
from copytrace.tracer._rules import RULES, _transfer
from copytrace.tracer.watch import StorageIds

NATIVE = _native.load()
needs_native = pytest.mark.skipif(NATIVE is None, reason="C++ observer not built")


def _record(op: str, src: torch.Tensor, out: torch.Tensor):
    state = (_PROTOTYPE, StorageIds(), _callsite._code_kind, _modules.CALL_IMPL, {})
    return NATIVE.record(state, op, src, out, None, 0, 0, 1, (), 0, 0)


@needs_native
@pytest.mark.parametrize("op", sorted(RULES.always_alias))
def test_record_calls_an_always_alias_op_an_alias_without_reading_storages(op: str) -> None:
    x = torch.randn(4)
    ev, _, _ = _record(op, x, x.clone())  # a result on another storage: still an alias
    assert ev.alias is True
    assert ev.bytes_allocated == 0


@needs_native
def test_record_reads_storages_for_other_ops() -> None:
    x = torch.randn(4)
    ev, _, _ = _record("clone", x, x.clone())
    assert ev.alias is False
    assert ev.bytes_allocated == 16  # 4 float32 values
    ev, _, _ = _record("reshape", x, x.view(2, 2))
    assert ev.alias is True


@needs_native
@pytest.mark.parametrize("op", sorted(RULES.writes_into))
def test_record_calls_a_write_into_no_alias_and_no_allocation(op: str) -> None:
    x, y = torch.randn(4), torch.randn(4)
    ev, _, _ = _record(op, y, x)  # dst.copy_(src): the result is dst itself
    assert ev.alias is False
    assert ev.bytes_allocated == 0


@needs_native
@pytest.mark.parametrize("op", sorted(RULES.view_is_no_event))
def test_record_makes_no_event_of_a_view_result(op: str) -> None:
    x = torch.randn(4)
    assert _record(op, x, x[0]) is False
    ev, _, _ = _record(op, x, x[[0, 1]])  # an advanced index: a copy, an event
    assert ev.bytes_allocated == 8


def test_transfers_follow_the_table() -> None:
    assert _transfer("cpu", "cpu") == "none"
    assert _transfer("cpu", "cuda:0") == RULES.transfers[(True, False)] == "h2d"
    assert _transfer("cuda:0", "cpu") == RULES.transfers[(False, True)] == "d2h"
    assert _transfer("cuda:0", "cuda:1") == RULES.transfers[(False, False)] == "d2d"


@pytest.fixture
def changed_rules():
    """Hand the C record a changed rule table (``set_record_rules``); the real one is set back
    after the test."""

    def change(**fields):
        NATIVE.set_record_rules(RULES._replace(**fields))

    yield change
    NATIVE.set_record_rules(RULES)


@needs_native
def test_record_follows_a_changed_alias_and_write_table(changed_rules) -> None:
    x = torch.randn(4)
    changed_rules(always_alias=RULES.always_alias | {"clone"})
    assert _record("clone", x, x.clone())[0].alias is True  # storages not read
    changed_rules(writes_into=RULES.writes_into | {"clone"})
    ev, _, _ = _record("clone", x, x.clone())
    assert (ev.alias, ev.bytes_allocated) == (False, 0)
    changed_rules(writes_into=frozenset())  # copy_ now classed by its storages: a new one
    ev, _, _ = _record("copy_", x, torch.randn(4))
    assert ev.bytes_allocated == 16  # 4 float32 values


@needs_native
def test_record_follows_a_changed_view_table(changed_rules) -> None:
    x = torch.randn(4)
    changed_rules(view_is_no_event=frozenset({"reshape"}))
    assert _record("reshape", x, x.view(2, 2)) is False
    assert _record("index", x, x[0])[0].alias is True  # a view, now an event


@needs_native
def test_record_follows_a_changed_host_and_transfer_table(changed_rules) -> None:
    x, m = torch.randn(4), torch.empty(4, device="meta")
    assert _record("to", x, m)[0].transfer == "h2d"  # cpu -> meta: host to a device
    changed_rules(host_device="meta")
    assert _record("to", x, m)[0].transfer == "d2h"
    ups = {(True, False): "up", (False, True): "down", (True, True): "none", (False, False): "x"}
    changed_rules(host_device="meta", transfers=ups)
    assert _record("to", m, x)[0].transfer == "up"  # meta is the host now
    assert _record("to", x, m)[0].transfer == "down"
    ups[(True, False)] = "changed after set-up"  # the results were read at set-up
    assert _record("to", m, x)[0].transfer == "up"


@needs_native
def test_record_leaves_calls_to_python_without_a_table(changed_rules) -> None:
    NATIVE.set_record_rules(None)
    x = torch.randn(4)
    assert _record("clone", x, x.clone()) is None
    with pytest.raises(KeyError):
        changed_rules(transfers={(True, False): "h2d"})
    with pytest.raises(TypeError, match="frozenset"):
        changed_rules(writes_into={"copy_"})


@needs_native
def test_the_fast_path_follows_a_changed_watch_table() -> None:
    """api_mode.cpp's fast_finish starts a fresh copy's in-place write watch unless the op is
    in ``not_fresh``: with ``clone`` added there, the copy's writes are not counted."""
    import copytrace

    def writes(rules) -> list:
        keep = []
        with copytrace.trace(write=False) as t:  # level lean: clone's event made in C ...
            NATIVE.set_record_rules(rules)  # (after the trace's own set-up)
            try:
                for _ in range(2):  # ... from the second on (the first names the thread)
                    keep.append(torch.randn(4).clone().add_(1))
            finally:
                NATIVE.set_record_rules(RULES)
        return [(e.op, e.inplace_writes) for e in t.events]

    assert writes(RULES) == [("clone", 1), ("clone", 1)]
    not_fresh = RULES._replace(not_fresh=RULES.not_fresh | {"clone"})
    assert writes(not_fresh) == [("clone", 1), ("clone", None)]  # the second: no watch
