"""Modules, optimizers and compiled functions while tracing: no reference to them.

copytrace names the module an event was made in (``tracer/_modules.py``), follows
``state_dict()`` handovers between modules, optimizers and schedulers
(``tracer/_handover.py``) and names a compiled call after its function
(``tracer/compiled/_calls.py``) without any reference, strong or weak, to those objects: what
``weakref.getweakrefcount`` / ``getweakrefs`` read of them while tracing is what they read
untraced. Names are checked against the live modules at each event, so a module that takes
the address of a dead one is never named after it. Each test is listed in
``docs/observer-effects.md``.
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import traceback
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import copytrace

OBSERVERS = ["native", "python"]


class _Cast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float64).float()  # a copy inside a module call: the module is named


def _weakrefs(objects: list[Any]) -> list[tuple[int, int]]:
    return [(weakref.getweakrefcount(o), len(weakref.getweakrefs(o))) for o in objects]


def _handover_program(t: Any) -> tuple[list[Any], list[tuple[int, int]], bool]:
    """A forward and backward through named modules, a module handover and an optimizer
    handover that the parent's training then changes: the weak reference counts of every
    module and optimizer read inside, and whether the child's momentum changed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), _Cast(), nn.Linear(3, 2))
    other = nn.Sequential(nn.Linear(4, 3), _Cast(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt2 = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    other.load_state_dict(model.state_dict(), assign=True)  # shares the model's parameters
    opt2.load_state_dict(opt.state_dict())  # shares the momentum buffers
    momentum = next(iter(opt2.state.values()))["momentum_buffer"]
    before = momentum.clone()
    model[0].weight.clone()  # an event inside no module call
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        if t is not None:
            t.step()
    changed = not torch.equal(before, momentum)
    objects = [model, *model, other, *other, opt, opt2]
    return objects, _weakrefs(objects), changed


@pytest.mark.parametrize("observer", OBSERVERS)
@pytest.mark.parametrize("level", ["lean", "full"])
def test_modules_and_optimizers_hold_no_weakref_while_tracing(observer, level, monkeypatch):
    # module paths and state_dict() handovers: weakref.getweakrefcount and getweakrefs of
    # every module and optimizer read inside the trace as untraced, and the handover is still
    # found (the parent's steps write into the shared momentum: stale)
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    _, plain, changed = _handover_program(None)
    assert changed  # the bug is real: the child's momentum moved with the parent's steps
    with copytrace.trace(write=False, level=level) as t:
        objects, during, _ = _handover_program(t)
    # as untraced, not zero: once dynamo has compiled in the process, torch itself keeps a weak
    # reference on each module made after (mutation_guard's GenerationTracker)
    assert during == plain
    assert [n for n, _ in plain[-2:]] == [0, 0]  # the optimizers: torch keeps none on them
    assert t.stats["errors"] == 0
    assert {e.module for e in t.events if e.op == "to" and e.phase == "forward"} == {
        "Sequential.1"
    }
    assert any(e.snapshot and e.stale for e in t.events if e.via and "Optimizer" in e.via)


def _double(x: torch.Tensor) -> torch.Tensor:
    return x.clone() * 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).clone()


@pytest.mark.parametrize("observer", OBSERVERS)
def test_compiled_functions_and_guards_hold_no_weakref_while_tracing(observer, monkeypatch):
    # a compiled call is named after its function, read at each call (tracer/compiled/
    # _calls.py, compiled.cpp's source_of); dynamo's guard managers are read afresh at each
    # compile and engage (_aside._sensitive): no weak reference on any of them
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    torch._dynamo.reset()
    net = _Net()
    functions = [torch.compile(_double, backend="eager"), torch.compile(net, backend="eager")]
    x = torch.ones(3)
    for fn in functions:
        fn(x)  # compiled untraced first: dynamo's own references are made

    def guards() -> list[Any]:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        codes = [_double.__code__, _Net.forward.__code__]
        return [e.guard_manager for c in codes for e in _debug_get_cache_entry_list(c)]

    objects = [_double, net, *functions, *guards()]
    assert len(objects) == 6  # one cache entry per compiled function
    before = _weakrefs(objects)
    with copytrace.trace(write=False) as t:
        for fn in functions:
            fn(x)
        torch.compile(lambda y: y + 1, backend="eager")(x)  # a compile while tracing
        during = _weakrefs([_double, net, *functions, *guards()[:2]])
        calls = [(c.function, c.line) for c in t.session._engagement.compiled.calls]
    assert during == before
    assert calls[:2] == [
        ("_double", _double.__code__.co_firstlineno),
        ("forward", _Net.forward.__code__.co_firstlineno),
    ]
    assert t.stats["errors"] == 0
    torch._dynamo.reset()


# --- id reuse: modules made and dropped in a loop ---------------------------------------------
class _Copy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()  # the event; a module without parameters


class _WithLin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.copy = _Copy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.copy(self.lin(x))


class _A(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = _WithLin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _C(nn.Module):
    """``_A``'s layout under another name: its modules are made in the same order, so they
    take the addresses of a dropped ``_A``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.other = _WithLin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other(x)


class _B(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(_Copy(), _WithLin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _reuse_program(rounds: int) -> tuple[list[str], list[tuple[int, ...]]]:
    """Make, call and drop an ``_A``, a ``_C`` or a ``_B`` per round (in turn, so that one
    class's modules land at the addresses of another's): the path each clone should have (the
    root by its class, ``#n`` left off), and the ids of each round's modules."""
    x = torch.ones(1, 2)
    want: list[str] = []
    ids: list[tuple[int, ...]] = []
    for i in range(rounds):
        root = (_A, _C, _B)[i % 3]()
        ids.append(tuple(id(m) for m in root.modules()))
        root(x)
        if isinstance(root, (_A, _C)):
            path = "_A.proj.copy" if isinstance(root, _A) else "_C.other.copy"
            want.append(path)
            (root.proj if isinstance(root, _A) else root.other)(x)  # called outside its root:
            want.append(path)  # named where it was met
        else:
            want += ["_B.inner.0", "_B.inner.1.copy"]
            root.inner[0](x)  # no parameter to tell it from another: named as a root
            want.append("_Copy")
        del root
        gc.collect()
    return want, ids


@pytest.mark.parametrize("observer", OBSERVERS)
def test_a_module_at_a_dead_module_address_is_named_by_its_own_path(observer, monkeypatch):
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    with copytrace.trace(write=False) as t:
        want, ids = _reuse_program(18)
    # the allocator did reuse addresses: some round's modules took those of a dropped one
    seen: set[int] = set()
    reused = 0
    for round_ids in ids:
        reused += len(seen & set(round_ids))
        seen |= set(round_ids)
    assert reused > 0, ids
    got = [e.module for e in t.events if e.op == "clone"]
    assert [_unnumbered(p) for p in got] == want
    assert t.stats["errors"] == 0


def _unnumbered(path: str | None) -> str | None:
    """``path`` without its root's ``#n`` (which numbers roots met at other addresses)."""
    if path is None:
        return None
    root, _, rest = path.partition(".")
    root = root.split("#")[0]
    return f"{root}.{rest}" if rest else root


# --- the patched functions: what a program sees while tracing --------------------------------
def _frames(err: BaseException) -> list[tuple[str, str]]:
    """(file name, function) of each entry of ``err``'s traceback."""
    return [(os.path.basename(f.filename), f.name) for f in traceback.extract_tb(err.__traceback__)]


def _patch_view() -> dict[str, Any]:
    """What a program reads of the patched functions (not their identity): results, names,
    signatures' text, and the error and traceback of a failing deepcopy, load_state_dict and
    swap_tensors."""
    import inspect

    class Bad:
        def __deepcopy__(self, memo: Any) -> Any:
            raise ValueError("no copy")

    out: dict[str, Any] = {}
    src = {"w": torch.ones(2)}
    out["deepcopy"] = torch.equal(copy.deepcopy(src)["w"], src["w"])
    out["copy_shares"] = copy.copy(src["w"]).data_ptr() == src["w"].data_ptr()
    a, b = torch.zeros(2), torch.ones(2)
    torch.utils.swap_tensors(a, b)
    out["swapped"] = (a.tolist(), b.tolist())
    p = nn.Parameter(torch.ones(2))
    out["param_deepcopy"] = type(copy.deepcopy(p)).__name__
    out["signatures"] = [
        str(inspect.signature(f))
        for f in (copy.deepcopy, copy.copy, torch.utils.swap_tensors, nn.Module.load_state_dict,
                  nn.Parameter.__deepcopy__)
    ]  # fmt: skip
    try:
        inspect.signature(torch.from_numpy)  # a builtin method: none
    except ValueError as err:
        out["from_numpy_signature"] = str(err)
    patched = (copy.deepcopy, copy.copy, torch.utils.swap_tensors, torch.from_numpy,
               nn.Parameter.__deepcopy__)  # fmt: skip
    out["names"] = [(f.__module__, f.__name__, f.__qualname__, f.__doc__) for f in patched]
    # by module and qualified name; inspect.getsource through __wrapped__ (inspect.unwrap)
    out["pickled"] = [pickle.dumps(f) for f in patched if f is not torch.from_numpy]
    out["source"] = [inspect.getsource(f) for f in patched if f is not torch.from_numpy]
    try:
        copy.deepcopy([Bad()])
    except ValueError as err:
        out["deepcopy_error"] = str(err)
        out["deepcopy_tb"] = _frames(err)
    try:
        nn.Linear(2, 2).load_state_dict({"weight": torch.ones(3, 3)})
    except RuntimeError as err:
        out["load_error"] = str(err).splitlines()[0]
        out["load_tb"] = _frames(err)
    try:
        torch.utils.swap_tensors(torch.ones(2), 3)
    except Exception as err:
        out["swap_error"] = (type(err).__name__, str(err), _frames(err))
    return out


@pytest.mark.parametrize("observer", OBSERVERS)
def test_patched_functions_while_tracing(observer, monkeypatch):
    # copy.deepcopy, copy.copy, torch.utils.swap_tensors, nn.Parameter.__deepcopy__ and the
    # state_dict / load_state_dict wrappers while tracing: results, signatures, names,
    # docstrings, pickles, source, errors and their tracebacks (copytrace's frames taken out,
    # tracer/_hide.py) read as untraced. What stays (docs/observer-effects.md): `is`
    # comparisons with the originals (and copytrace's frames in a stack read inside them).
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    originals = (copy.deepcopy, copy.copy, torch.utils.swap_tensors, nn.Module.load_state_dict)
    plain = _patch_view()
    with copytrace.trace(write=False) as t:
        traced = _patch_view()
        now = (copy.deepcopy, copy.copy, torch.utils.swap_tensors, nn.Module.load_state_dict)
    assert traced == plain
    assert [a is b for a, b in zip(now, originals, strict=True)] == [False] * 4  # what stays
    assert t.stats["errors"] == 0
