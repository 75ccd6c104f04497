"""``inplace_writes`` of fresh copies: the version counter's advance while the copy lived (the
C++ observer, levels full and lean), the in-place calls on it (the Python fallback); and level
lean's write watch (a RecordFunction callback of the C++ observer, no mode)."""

from __future__ import annotations

import gc
import threading
import warnings
from typing import Any

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack

import copytrace
from copytrace.tracer import _native

NATIVE = _native.load() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="C++ observer unavailable here")
LEVELS = [pytest.param(level, marks=needs_native) for level in ("full", "lean")]


def _writes(keep: list[Any]) -> None:
    x = torch.randn(8)
    a = x.clone()
    a[2:5].mul_(2)  # through a view of the copy
    b = x.clone()
    torch.add(x, 1, out=b)  # out= into the copy
    c = x.clone()
    keep.append(c.sum() + c[0])  # only read
    d = x.clone()
    x.add_(1)  # near miss: the source is written after the copy, not the copy
    e = x.to(torch.float64)
    e.add_(1).mul_(2)  # two in-place ops
    e.relu_()
    f = x.clone().view(2, 4)  # the copy itself dies at once; its view lives on
    f[0].zero_()
    keep.extend((a, b, d, e, f))


def _trace(level: str, observer: str = "native") -> copytrace.Trace:
    keep: list[Any] = []
    with copytrace.trace(write=False, level=level, observer=observer) as t:
        _writes(keep)
    return t


@pytest.mark.parametrize("level", LEVELS)
def test_version_counter_counts_writes_through_views_and_out(level: str) -> None:
    t = _trace(level)
    assert [e.op for e in t.events] == ["clone"] * 4 + ["to", "clone"]
    # a: mul_ on a view 1; b: out= 1; c: read 0; d: a write into the source 0; e: add_, mul_,
    # relu_ 3; f: zero_ on a view of the view, after the copy's own tensor died 1
    assert [e.inplace_writes for e in t.events] == [1, 1, 0, 0, 3, 1]


def test_python_fallback_counts_the_calls_on_the_copy_itself() -> None:
    t = _trace("full", observer="python")
    # only calls whose first argument is the copy: b's out= and the views' writes are not seen,
    # and f's own tensor died at once
    assert [e.inplace_writes for e in t.events] == [0, 0, 0, 0, 3, 0]


@pytest.mark.parametrize("level", LEVELS)
def test_count_is_final_for_copies_dead_before_a_flush_and_alive_at_stop(level: str) -> None:
    x = torch.randn(4)
    with copytrace.trace(write=False, level=level, observer="native") as t:
        gone = x.clone()
        gone.add_(1)
        del gone  # dies written once, before anything reads the count
        live = x.clone()
        live.add_(1)
        events = t.session._rec.watch.live_events()  # what a flush holds back: only `live`
        assert [e.op for e in events] == ["clone"]
        live.sub_(1)  # still counts: the copy is alive
    assert [e.inplace_writes for e in t.events] == [1, 2]


@needs_native
def test_lean_watches_an_index_result_without_a_mode() -> None:
    x = torch.arange(6.0)
    idx = torch.tensor([1, 4])
    with copytrace.trace(write=False, level="lean", observer="native") as t:
        rows = x[idx]
        stacks = [torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()]
        y = x.clone()  # recorded once, by the wrappers
        rows.zero_()
        total = rows.sum()  # a use after the write: the write is not lost
        del rows
        x[idx].fill_(1.0)  # lost: written, then dropped unused
    assert stacks == [0, 0]
    assert [e.op for e in t.events] == ["index", "clone", "index"]
    assert [e.inplace_writes for e in t.events] == [1, 0, 1]
    assert [e.write_site is None for e in t.events] == [True, True, False]
    assert t.events[2].write_site.endswith(" test_lean_watches_an_index_result_without_a_mode")
    assert torch.equal(x, torch.arange(6.0)) and total.item() == 0.0 and y.shape == (6,)


@needs_native
def test_lean_write_watch_ends_with_the_result_also_when_it_dies_on_another_thread() -> None:
    native = _native.load()
    x = torch.arange(6.0)
    box = []
    with copytrace.trace(write=False, level="lean", observer="native") as t:
        box.append(x[torch.tensor([0, 2])])
        watching = native.watched()  # (keys, callback registered)
        box[0].add_(1)
        thread = threading.Thread(target=box.clear)  # the last reference dies there
        thread.start()
        thread.join()
        t.step()  # the step boundary finds it dead: its key is unwatched, the callback gone
        after = native.watched()
    assert watching == (1, True) and after == (0, False)
    assert [(e.op, e.inplace_writes, e.write_site is None) for e in t.events] == [
        ("index", 1, False)
    ]


@needs_native
def test_a_program_mode_sees_only_the_program_calls_at_level_lean() -> None:
    from torch.overrides import TorchFunctionMode

    seen: list[str] = []

    class Log(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", "?"))
            return func(*args, **(kwargs or {}))

    x = torch.arange(6.0)
    idx = torch.tensor([1, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with copytrace.trace(write=False, level="lean", observer="native") as t:
            with Log() as log:
                rows = x[idx]
                stack = _get_current_function_mode_stack()
                rows.mul_(2)
                del rows
    assert stack == [log]
    assert seen == ["__getitem__", "mul_"]  # the program's mode sees the program's calls only
    assert [(e.op, e.inplace_writes, e.write_site is None) for e in t.events] == [
        ("index", 1, False)
    ]


@pytest.mark.parametrize("level", LEVELS)
def test_kept_copies_are_not_tracked_by_the_cycle_collector(level: str) -> None:
    # Each fresh copy followed by its version counter is kept as (handle, record) until it
    # dies: through C (`.to` of a tensor without grad: api_mode.cpp's keep_version) and
    # through Python (`clone` of a leaf that requires grad: an attached copy, Watch.follow).
    # A tracked pair outliving two young collections reached the oldest generation and
    # brought the next full collection closer; the handle is no GC type and the record is
    # untracked, so the pair is untracked too.
    x = torch.randn(4, requires_grad=True)
    y = torch.randn(4)
    keep = []
    with copytrace.trace(write=False, level=level) as t:
        keep += [x.clone(), y.to(torch.float64)]
        kept = list(t.session._rec.watch.copies.kept)
    assert [ev.op for _, ev in kept] == ["clone", "to"]
    assert [type(v).__name__ for v, _ in kept] == ["VersionRef", "VersionRef"]
    assert not any(gc.is_tracked(ev) for _, ev in kept)
    assert [gc.is_tracked(pair) for pair in kept] == [False, False]
    native = _native.load()
    assert gc.is_tracked(native.kept_pair(kept[0][0], []))  # a tracked item keeps it tracked
