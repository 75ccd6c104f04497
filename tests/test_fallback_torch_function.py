"""On the Python fallback, the aten ops its dispatch mode passes on reach no ``__torch_function__``.

An ``OpOverload`` called from Python asks the function modes and its arguments' types'
``__torch_function__`` before it runs (torch's ``_get_operation_for_overload_or_packet``); the
dispatcher, which runs the op untraced, asks neither. Most ops reach the fallback's dispatch
mode from inside a function mode's handler, where that mode is off, so this showed only for ops
that reach the dispatcher past the function modes: ``Tensor.set_`` calls none, and
``copy.copy(t)`` rebuilds the tensor with it. Each test runs a program untraced and traced on
the fallback, and compares what the program's function mode or subclass saw.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode, resolve_name

import copytrace


@pytest.fixture(autouse=True)
def _fallback(monkeypatch):
    monkeypatch.setenv("COPYTRACE_OBSERVER", "python")


def _name(func) -> str:
    return resolve_name(func) or repr(func)


class _Seen(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(_name(func))
        return func(*args, **(kwargs or {}))


class Seeing(torch.Tensor):
    """A subclass that notes every call its ``__torch_function__`` is asked about."""

    calls: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(_name(func))
        return super().__torch_function__(func, types, args, kwargs)


def _traced_or_not(traced: bool) -> contextlib.AbstractContextManager:
    return copytrace.trace(write=False) if traced else contextlib.nullcontext()


def test_a_function_mode_sees_the_calls_of_copy_copy_as_untraced():
    def run(traced: bool) -> tuple[list[str], torch.Tensor, list[str]]:
        x = torch.arange(4.0)
        mode = _Seen()
        with _traced_or_not(traced) as t:
            with mode:
                out = copy.copy(x)
        ops = [e.op for e in t.events] if traced else []
        return mode.calls, out, ops

    plain, plain_out, _ = run(False)
    traced, out, ops = run(True)
    assert "copy" in ops  # the copy was recorded: the fallback's modes were on
    assert traced == plain  # before: aten.set_.source_Storage_storage_offset once more
    assert "aten.set_.source_Storage_storage_offset" not in plain
    assert type(out) is type(plain_out) and torch.equal(out, plain_out)


def test_a_subclass_sees_the_calls_of_set_from_a_storage_as_untraced():
    def run(traced: bool) -> tuple[list[str], type]:
        storage = torch.arange(6.0).untyped_storage()
        x = torch.empty(0).as_subclass(Seeing)
        Seeing.calls = []
        with _traced_or_not(traced):
            out = x.set_(storage, 0, (2, 3), (3, 1)).clone()
        return Seeing.calls, type(out)

    plain = run(False)
    traced = run(True)
    assert traced == plain  # before: aten.set_ asked this subclass too
    assert plain[0] and plain[1] is Seeing  # clone is asked about, set_ is not (as above)
