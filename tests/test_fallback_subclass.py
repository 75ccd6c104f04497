"""On the Python fallback a tensor subclass's legacy constructor (``S(t)``) runs as untraced.

Under any Python dispatch mode torch's ``base_tensor_ctor`` raises "Creating a new Tensor
subclass ... already associated to a python object" for every ``S(...)`` of a subclass with
no ``__new__`` of its own (the mode's handler gives the tensor it makes a plain ``Tensor``
object first). The fallback steps its dispatch mode aside there (``tracer/_tensor_new.py``);
after the trace ``torch.Tensor`` has no ``__new__`` of its own again and every class's
``tp_new`` slot is ``TensorBase``'s.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace
from copytrace.tracer import _slots


@pytest.fixture(autouse=True)
def _fallback(monkeypatch):
    monkeypatch.setenv("COPYTRACE_OBSERVER", "python")


class Plain(torch.Tensor):
    pass


class Calls(torch.Tensor):
    """A ``__new__`` of its own that calls torch's: ``super().__new__(cls, t)``."""

    def __new__(cls, t):
        return super().__new__(cls, t)


class _PlainMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


FORMS = {
    "S(t)": lambda: Plain(torch.arange(3.0)),
    "S(list)": lambda: Plain([1.0, 2.0]),
    "S(n)": lambda: Plain(2),
    "super().__new__": lambda: Calls(torch.arange(3.0)),
    "Tensor(t)": lambda: torch.Tensor(torch.arange(3.0)),
}


def _made(form: str) -> tuple[str, list[int], list[float] | None]:
    out = FORMS[form]()
    values = None if form == "S(n)" else out.tolist()  # S(n): n uninitialised elements
    return type(out).__name__, list(out.shape), values


@pytest.mark.parametrize("form", list(FORMS))
def test_a_subclass_made_by_the_legacy_constructor_as_untraced(form):
    untraced = _made(form)
    if form != "Tensor(t)":  # any dispatch mode breaks it
        with pytest.raises(RuntimeError, match="already associated to a python object"):
            with _PlainMode():
                _made(form)
    with copytrace.trace(write=False) as t:
        traced = _made(form)
        stacks = (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())
    assert traced == untraced
    assert stacks == (1, 1)  # the dispatch mode is back on the stack after the construction
    assert t.stats["errors"] == 0


def test_torch_tensor_and_its_slots_after_the_trace():
    base = torch._C.TensorBase
    with copytrace.trace(write=False):
        assert "__new__" in torch.Tensor.__dict__
        made_inside = type("MadeInside", (torch.Tensor,), {})
    assert "__new__" not in torch.Tensor.__dict__
    assert torch.Tensor.__new__ is base.__new__
    want = _slots.tp_new(base)
    for cls in (torch.Tensor, Plain, made_inside):
        assert _slots.tp_new(cls) == want, cls
    # near miss: a class with a Python __new__ keeps CPython's generic slot, as untraced
    assert _slots.tp_new(torch.nn.Parameter) != want and _slots.tp_new(Calls) != want


def test_an_error_of_the_constructor_reaches_the_program_as_untraced():
    def build():
        try:
            Plain("not a size")
        except TypeError as err:
            return str(err), [f.name for f in traceback.extract_tb(err.__traceback__)]
        raise AssertionError("no TypeError")

    untraced = build()
    with copytrace.trace(write=False) as t:
        traced = build()
    assert traced == untraced
    assert t.stats["errors"] == 0
