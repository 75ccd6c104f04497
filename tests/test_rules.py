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
