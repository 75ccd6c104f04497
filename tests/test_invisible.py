"""copytrace's touches on the process, one test each: a program cannot observe them.

``docs/observer-effects.md`` lists every way copytrace changes the process while it traces and
after; each entry names the test here that shows a program cannot tell. Every test compares a
traced run against the same code untraced (or the process before and after a trace), through
what a program itself can read: results, exceptions, warnings, ``weakref.getweakrefs``,
torch's mode stacks, dispatch calls a subclass sees, torch's hook dicts, and the C function
pointers and type slots CPython calls through (read with ctypes, checked against their names).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import warnings
import weakref

import pytest
import torch

import copytrace
from copytrace.tracer import _native

_PTR = ctypes.sizeof(ctypes.c_void_p)


def _ptr(address: int) -> int:
    return ctypes.c_void_p.from_address(address).value or 0


def _name_at(address: int) -> str:
    return ctypes.string_at(_ptr(address)).decode()


def _c_pointers() -> dict[str, int]:
    """Every C pointer CPython calls ``torch.Tensor``'s methods, torch's functions, ``.data``
    and ``x[i]`` through: ``ml_meth`` and ``vectorcall`` of each method descriptor of
    ``TensorBase`` (Include/descrobject.h: PyDescr_COMMON, then d_method and vectorcall), the
    ``vectorcall`` and ``ml_meth`` of each builtin function of ``torch``
    (Include/cpython/methodobject.h), the get/set of ``Tensor.data``'s PyGetSetDef, and the
    ``__getitem__`` slots of ``torch.Tensor`` and ``nn.Parameter``. Each method definition
    read is checked by its name, so a wrong offset fails instead of comparing garbage."""
    out: dict[str, int] = {}
    method_descriptor = type(torch._C.TensorBase.clone)
    for name, value in vars(torch._C.TensorBase).items():
        if type(value) is method_descriptor:
            method = _ptr(id(value) + 5 * _PTR)  # d_method
            assert _name_at(method) == name
            out[f"TensorBase.{name}.ml_meth"] = _ptr(method + _PTR)
            out[f"TensorBase.{name}.vectorcall"] = _ptr(id(value) + 6 * _PTR)
    builtin = type(torch.clone)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if type(value) is builtin and getattr(value, "__self__", None) is not None:
            method = _ptr(id(value) + 2 * _PTR)  # m_ml
            if _name_at(method) != name:
                continue  # an alias bound under another name (its own entry is read)
            out[f"torch.{name}.ml_meth"] = _ptr(method + _PTR)
            out[f"torch.{name}.vectorcall"] = _ptr(id(value) + 6 * _PTR)
    data = vars(torch._C.TensorBase)["data"]
    getset = _ptr(id(data) + 5 * _PTR)  # d_getset
    assert _name_at(getset) == "data"
    out["TensorBase.data.get"] = _ptr(getset + _PTR)
    out["TensorBase.data.set"] = _ptr(getset + 2 * _PTR)
    get_slot = ctypes.pythonapi.PyType_GetSlot
    get_slot.restype, get_slot.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_int]
    for cls in (torch.Tensor, torch.nn.Parameter):
        for slot, number in (("sq_item", 44), ("mp_subscript", 5)):  # Include/typeslots.h
            out[f"{cls.__name__}.{slot}"] = get_slot(cls, number) or 0
    for cls in (torch._C.TensorBase, torch.Tensor, *_legacy_types()):  # the legacy constructors
        out[f"{cls.__module__}.{cls.__name__}.tp_new"] = get_slot(cls, 65) or 0
    out["tensortype.tp_call"] = get_slot(type(torch.FloatTensor), 50) or 0
    return out


def _legacy_types() -> list[type]:
    return sorted((c for c in torch._tensor_classes if type(c) is type(torch.FloatTensor)), key=str)


def _exercise() -> None:
    """Calls that reach every kind of patch of the default level."""
    w = torch.nn.Parameter(torch.randn(4, 3))
    x = w.clone().to(torch.float64)
    x[torch.tensor([0, 2])].zero_()
    w.data.mul_(1.0)
    torch.clone(w.detach())
    _ = x[1:3]


# --- C pointers and type slots ---------------------------------------------------------------
def test_no_c_pointer_or_type_slot_left_changed_after_tracing():
    before = _c_pointers()
    assert len(before) > 500  # every Tensor method and torch function was read
    with copytrace.trace(write=False):
        _exercise()
    after = _c_pointers()
    changed = sorted(k for k in before if before[k] != after.get(k))
    assert changed == []


class _Before(torch.Tensor):  # a subclass made before the trace: it holds TensorBase's tp_new
    pass


class _OwnNew(_Before):
    def __new__(cls, t):
        return super().__new__(cls, t)  # TensorBase.__new__'s safety check compares tp_new slots


def _tp_new(cls: type) -> int:
    get_slot = ctypes.pythonapi.PyType_GetSlot
    get_slot.restype, get_slot.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_int]
    return get_slot(cls, 65) or 0  # Py_tp_new, Include/typeslots.h


@pytest.mark.parametrize("observer", ["auto", "python"])
def test_legacy_constructor_slots_are_given_back_at_stop(observer, monkeypatch):
    # While tracing, the C++ observer swaps the tp_new of TensorBase, of the classes that hold
    # its pointer and of torch.FloatTensor & co.; the fallback tensortype's tp_call (and its
    # __call__) and torch.Tensor.__new__. At stop every slot is torch's again.
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    meta = type(torch.FloatTensor)
    new_before, meta_before = torch.Tensor.__new__, dict(vars(meta))
    before = _c_pointers()
    src = torch.arange(3.0)
    with copytrace.trace(write=False) as t:
        during = _c_pointers()

        class Made(torch.Tensor):  # made while tracing: inherits what torch.Tensor holds now
            pass

        made = (Made(src), _Before(src), _OwnNew(src), torch.FloatTensor([src[0], src[1]]))
    assert [type(m).__name__ for m in made] == ["Made", "_Before", "_OwnNew", "Tensor"]
    assert [e.op for e in t.events] == ["legacy_ctor"]  # the list, not the subclasses
    changed = {k for k in before if before[k] != during[k]}
    if t.observer_path == "native":  # torch.Tensor.__new__ untouched, tp_new of every class swapped
        assert {"torch.FloatTensor.tp_new", "torch._C.TensorBase.tp_new"} <= changed
    else:
        assert "tensortype.tp_call" in changed
    assert _c_pointers() == before
    assert _tp_new(Made) == _tp_new(_Before) == _tp_new(torch._C.TensorBase)
    assert torch.Tensor.__new__ is new_before and dict(vars(meta)) == meta_before
    assert "__new__" not in vars(torch.Tensor)


def test_tensor_sequence_slot_unchanged_while_tracing():
    # torch.Tensor has no sq_item (TensorBase sets only mp_subscript): a tensor is no sequence
    # for CPython's abstract API, which torch.tensor([...]) relies on.
    before = _c_pointers()
    with copytrace.trace(write=False):
        during = _c_pointers()
    for cls in ("Tensor", "Parameter"):
        assert during[f"{cls}.sq_item"] == before[f"{cls}.sq_item"] == 0


# --- torch.tensor of sequences of tensors -----------------------------------------------------
def _constructor_forms() -> list:
    a, b, c = torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0, requires_grad=True)
    v, u = torch.ones(2), torch.zeros(2)
    return [
        lambda: torch.tensor([a, b, c.detach()]),
        lambda: torch.tensor([a, 2.5, b]),
        lambda: torch.tensor([[a, b], [b, a]]),
        lambda: torch.tensor([v, u]),  # torch refuses: not 1-element tensors
        # (not of c itself: torch warns of that once per process, TORCH_WARN_ONCE)
        lambda: torch.tensor([c.detach() * 2, a]),
        lambda: torch.as_tensor([a, b]),
        lambda: torch.as_tensor([[1, a], [b, 4]], dtype=torch.float64),
        lambda: torch.tensor([[v[0], v[1]]]),
        lambda: torch.Tensor([a, b]),
        lambda: torch.FloatTensor([a, 3]),
        lambda: torch.tensor([a]).new_tensor([b, a]),
    ]


def _outcomes(forms: list) -> list:
    out = []
    for form in forms:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = form()
                got = ("ok", result.dtype, tuple(result.shape), result.tolist())
            except Exception as err:
                got = ("raised", type(err), str(err))
        out.append((got, [(w.category, str(w.message)) for w in caught]))
    return out


def test_tensor_constructors_of_tensor_sequences_unchanged():
    forms = _constructor_forms()
    untraced = _outcomes(forms)
    assert untraced[0][0] == ("ok", torch.float32, (3,), [1.0, 2.0, 3.0])
    assert untraced[3][0][0] == "raised"  # a sequence of 2-element tensors
    with copytrace.trace(write=False):
        traced = _outcomes(forms)
        with torch.device("meta"):
            meta = _outcomes(forms[:3])
    after = _outcomes(forms)
    with torch.device("meta"):
        meta_untraced = _outcomes(forms[:3])
    assert traced == untraced
    assert after == untraced  # and nothing is left broken once tracing stopped
    assert meta == meta_untraced


# --- tensor-likes --------------------------------------------------------------------------
class _TensorLike:
    """Not a tensor: takes every torch call through ``__torch_function__`` (as in torch's own
    override tests) and has a ``grad_fn`` that is a plain function."""

    grad_fn = staticmethod(lambda: None)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return ("handled", func.__name__)


@pytest.mark.parametrize("level", ["lean", "full"])
def test_tensor_like_with_function_grad_fn_causes_no_internal_error(level):
    like = _TensorLike()
    calls = [
        lambda: torch.autograd.backward(like),
        lambda: torch.autograd.backward([like, like]),
        lambda: torch.autograd.grad(like, [like]),
        lambda: torch.Tensor.backward(like),
    ]
    untraced = [call() for call in calls]
    with copytrace.trace(write=False, level=level) as t:
        traced = [call() for call in calls]
    assert traced == untraced == [("handled", "backward")] * 2 + [("handled", "grad")] + [
        ("handled", "backward")
    ]
    assert t.stats["errors"] == 0


# --- the start-up hook and pytest ----------------------------------------------------------
def test_traced_pytest_session_under_warnings_as_errors(tmp_path):
    # COPYTRACE=1 makes the start-up hook (copytrace_hook.pth) import copytrace before pytest
    # runs; pytest then marks the plugin's package for assertion rewriting and, for a package
    # already imported, issues a config-time warning, which -W error turns into an abort.
    import os
    import subprocess
    import sys

    (tmp_path / "test_tiny.py").write_text(
        "import torch\n\n\ndef test_clone():\n    assert torch.ones(3).clone().sum() == 3\n"
    )
    env = {**os.environ, "COPYTRACE": "1", "COPYTRACE_REPORT": "0"}
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-W", "error", "-m", "pytest", "-q", "-W", "error",
           "-p", "no:cacheprovider", "test_tiny.py"]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "1 passed" in output and "Warning" not in output
    assert list((tmp_path / "copytrace-out").glob("copytrace-*")), "the session was not traced"


# --- kernel registrations ----------------------------------------------------------------
_OVERRIDE_PROGRAM = """
import json, sys, warnings
import torch
import copytrace

def override():
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("sin", lambda *args, **kwargs: None, "CPU")  # torch has a CPU kernel for sin
    return lib

when = sys.argv[1]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if when != "untraced":
        trace = copytrace.trace(write=False, level="full")  # the level that registers kernels
        trace.__enter__()
        torch.ones(3).to(torch.float64).clone()  # through copytrace's _to_copy and clone
    if when == "during":
        lib = override()
    if when != "untraced":
        trace.__exit__(None, None, None)
        assert trace.stats["errors"] == 0 and trace.events, "not traced"
    if when != "during":
        lib = override()
print(json.dumps([[w.category.__name__, str(w.message), w.filename] for w in caught]))
"""


@pytest.mark.parametrize("when", ["after", "during"])
def test_program_override_of_a_kernel_warns_as_untraced(tmp_path, when):
    # torch warns once per process on a kernel override ("Overriding a previously registered
    # kernel", TORCH_WARN_ONCE): copytrace's own registrations must not spend that warning.
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "override.py"
    script.write_text(_OVERRIDE_PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COPYTRACE")}

    def caught(mode: str) -> list:
        done = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    untraced = caught("untraced")
    # Whether torch warns here is its release's business (2.13.0 warns once; 2.14.1 registers
    # this override silently): read from the untraced run, then the traced run must match it.
    assert len(untraced) <= 1
    assert all("Overriding a previously registered kernel" in w[1] for w in untraced)
    traced = caught(when)
    # the message names the new kernel's line: the same line (one override()) in both runs
    assert traced == untraced


# --- reads through dispatch ----------------------------------------------------------------
class _PythonStrides(torch.Tensor):
    """A wrapper subclass that answers its strides in Python and counts every aten call its
    ``__torch_dispatch__`` sees."""

    calls: dict[str, int] = {}
    policy = "strides"

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=inner.device,
            dispatch_sizes_strides_policy=cls.policy,
        )  # fmt: skip

    def __init__(self, inner):
        self.inner = inner

    #: the metadata queries a wrapper answers from its inner tensor (policy "sizes": all)
    _ANSWERS = {
        torch.ops.aten.sym_stride.default: torch.Tensor.stride,
        torch.ops.aten.is_contiguous.default: torch.Tensor.is_contiguous,
        torch.ops.aten.sym_size.default: torch.Tensor.size,
        torch.ops.aten.sym_numel.default: torch.Tensor.numel,
        torch.ops.aten.sym_storage_offset.default: torch.Tensor.storage_offset,
        torch.ops.aten.dim.default: torch.Tensor.dim,
    }

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.calls[str(func)] = cls.calls.get(str(func), 0) + 1
        if func in cls._ANSWERS:
            return cls._ANSWERS[func](args[0].inner)
        unwrap = torch.utils._pytree.tree_map_only(cls, lambda x: x.inner, (args, kwargs or {}))
        out = func(*unwrap[0], **unwrap[1])
        return torch.utils._pytree.tree_map_only(torch.Tensor, cls, out)


class _PythonSizes(_PythonStrides):
    """The same, answering its sizes, numel and storage offset in Python too."""

    policy = "sizes"


def _copies_of_python_strides(cls: type = _PythonStrides) -> dict[str, int]:
    cls.calls = {}
    s = cls(torch.randn(3, 4))
    s.clone(), s.to(torch.float64), s.detach(), torch.clone(s)
    return cls.calls


@pytest.mark.parametrize("observer", ["native", "python"])
@pytest.mark.parametrize("level", ["lean", "full"])
def test_subclass_answering_strides_in_python_sees_no_extra_dispatch(observer, level, monkeypatch):
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    untraced = _copies_of_python_strides()
    # the wrapper's aten calls: two clones, one _to_copy, one detach (no sym_stride: a
    # program that never reads a stride never asks the subclass)
    assert untraced == {"aten.clone.default": 2, "aten._to_copy.default": 1,
                        "aten.detach.default": 1}  # fmt: skip
    with copytrace.trace(write=False, level=level) as t:
        traced = _copies_of_python_strides()
    assert traced == untraced
    assert [e.op for e in t.events] == ["clone", "to", "detach", "clone"]
    # not read: the subclass answers it. Without the extension the storage offset is not
    # read either (the subclass might answer its sizes too), and no view is recorded: ()
    unread = None if _native.loaded() is not None else ()
    assert all(e.src_stride == unread for e in t.events)
    assert t.stats["errors"] == 0


@pytest.mark.parametrize("observer", ["native", "python"])
@pytest.mark.parametrize("level", ["lean", "full", "api"])
def test_subclass_answering_sizes_in_python_sees_no_extra_dispatch(observer, level, monkeypatch):
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    untraced = _copies_of_python_strides(_PythonSizes)
    # no sym_size, sym_numel, sym_storage_offset: the program reads no size
    assert untraced == {"aten.clone.default": 2, "aten._to_copy.default": 1,
                        "aten.detach.default": 1}  # fmt: skip
    with copytrace.trace(write=False, level=level) as t:
        traced = _copies_of_python_strides(_PythonSizes)
    assert traced == untraced
    assert [e.op for e in t.events] == ["clone", "to", "detach", "clone"]
    if _native.loaded() is not None:  # the TensorImpl's own sizes, read without dispatch
        assert [e.shape for e in t.events] == [(3, 4)] * 4
        assert [e.bytes_logical for e in t.events] == [48, 96, 48, 48]  # 12 x 4 or 8 bytes
    else:  # without the extension they cannot be read without asking the subclass: unknown
        assert [e.shape for e in t.events] == [()] * 4
        assert [e.bytes_logical for e in t.events] == [0] * 4
    assert t.stats["errors"] == 0


def test_own_sizes_read_without_dispatch():
    from copytrace.tracer import _facts

    native = _native.load()
    if native is None:
        pytest.skip("the C++ observer reads the TensorImpl's own sizes")
    inner = torch.randn(4, 5)[1:]  # storage offset 5
    sizes = _PythonSizes(inner)
    _PythonSizes.calls = {}
    assert native.sizes_strides_policy(sizes) == 2
    assert _facts.own_sizes(sizes) == native.sizes_default(sizes) == ((3, 5), 15, 0)
    assert _PythonSizes.calls == {}  # nothing asked of the subclass
    # torch answers a plain tensor's and a strides-policy subclass's sizes itself
    assert native.sizes_default(inner) == ((3, 5), 15, 5)
    assert _facts.own_sizes(inner) is _facts.own_sizes(_PythonStrides(inner)) is _facts._ASK


def test_which_tensors_answer_strides_in_python(monkeypatch):
    from copytrace.tracer import _facts

    tensors = [_PythonStrides(torch.randn(2)), torch.randn(2), torch.nn.Parameter(torch.randn(2))]
    expected = [True, False, False]
    native = _native.load()
    if native is not None:  # the TensorImpl's flag: 1 for policy "strides"
        assert [native.sizes_strides_policy(t) for t in tensors] == [1, 0, 0]
        assert [_facts.strides_in_python(t) for t in tensors] == expected
    monkeypatch.setattr(_native, "loaded", lambda: None)  # no observer: from the type
    assert [_facts.strides_in_python(t) for t in tensors] == expected


# --- hooks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("observer", ["native", "python"])
def test_optimizer_hook_dicts_stay_empty_and_steps_are_still_counted(observer, monkeypatch):
    from torch.optim import optimizer as optim_module

    # the C++ observer: a RecordFunction callback on torch's Optimizer.step# scope; the Python
    # fallback: its function mode, which sees that scope's profiler ops
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    monkeypatch.setenv("COPYTRACE_AUTO_STEP", "1")  # each optimizer.step() ends a step
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with copytrace.trace(write=False) as t:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            model.weight.clone()  # one event per step, in the step its optimizer.step() ends
            seen.append((len(optim_module._global_optimizer_pre_hooks),
                         len(optim_module._global_optimizer_post_hooks)))  # fmt: skip
            opt.step()
            opt.zero_grad()
    assert seen == [(0, 0)] * 3
    assert t.observer_path == observer
    assert [e.step for e in t.events if e.op == "clone"] == [0, 1, 2]
    assert t.stats["steps"] == 4  # three steps ended by optimizer.step(), and the open one
    assert t.stats["errors"] == 0


# --- references to user tensors ------------------------------------------------------------
def _weakref_counts(module) -> list[int]:
    import weakref

    return [len(weakref.getweakrefs(p)) for p in module.parameters()]


@pytest.mark.parametrize("observer", ["native", "python"])
def test_state_dict_leaves_no_weakref_and_the_swap_path_works(observer, monkeypatch):
    # torch.utils.swap_tensors (Module.to on the swap path) refuses a tensor with a weakref
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with copytrace.trace(write=False) as t:
            state = model.state_dict()  # detach() aliases of every parameter
            counts = _weakref_counts(model)
            model.to(torch.float64)
            dtypes = {p.dtype for p in model.parameters()}
        del state
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert counts == [0, 0, 0, 0]
    assert dtypes == {torch.float64}
    assert t.observer_path == observer
    assert t.stats["errors"] == 0


@pytest.mark.parametrize("observer", ["native", "python"])
def test_kept_state_dict_changed_in_place_is_still_found_stale(observer, monkeypatch):
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    model = torch.nn.Linear(3, 2)
    with copytrace.trace(write=False) as t:
        kept = model.state_dict()  # two detach() aliases: weight and bias
        refs = [weakref.getweakrefcount(p) for p in model.parameters()]
        with torch.no_grad():
            model.weight.mul_(2.0)  # written through the parameter: the kept weight changes
        t.step()
    assert refs == [0, 0] and len(kept) == 2
    snaps = [e for e in t.events if e.snapshot]
    assert [e.stale for e in snaps] == [True, False]  # the weight's alias; the bias unchanged
    assert t.stats["errors"] == 0


@pytest.mark.parametrize("observer", ["native", "python"])
def test_data_alias_and_rebinding_leave_no_weakref_and_both_can_be_swapped(observer, monkeypatch):
    import weakref

    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    w = torch.nn.Parameter(torch.randn(3))
    # level full: at level lean the alias keeps a weakref while its mode watches it
    with copytrace.trace(write=False, level="full") as t:
        loss = (w * w).sum()  # mul saves w: the backward below reads the rebound tensor
        alias = w.data  # watched for in-place writes while it lives
        alias.mul_(2.0)
        w.data = torch.ones(3)  # a rebinding, pending until the next backward
        refs = [len(weakref.getweakrefs(x)) for x in (w, alias)]
        loss.backward()  # (torch's swap_tensors refuses a tensor a live graph saved)
        del loss
        torch.utils.swap_tensors(alias, torch.full((3,), 5.0))
        torch.utils.swap_tensors(w, torch.nn.Parameter(torch.zeros(3)))
        saved_by = [ev.saved_by for ev in t.events if ev.op == "data_set"]
    assert refs == [0, 0]
    assert alias.tolist() == [5.0, 5.0, 5.0] and w.tolist() == [0.0, 0.0, 0.0]
    # w * w saves w twice (self and other, read in dir() order): the rebinding is found
    assert saved_by == [("MulBackward0.other", "MulBackward0.self")]
    assert t.stats["errors"] == 0


@pytest.mark.parametrize("observer", ["native", "python"])
def test_rebound_parameter_holds_no_weakref_at_the_default_level(observer, monkeypatch):
    import weakref

    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    w = torch.nn.Parameter(torch.randn(3))
    with copytrace.trace(write=False) as t:
        loss = (w * 2.0).sum()
        w.data = torch.ones(3)  # a pending rebinding until the backward below
        refs = len(weakref.getweakrefs(w))
        loss.backward()
        torch.utils.swap_tensors(w, torch.nn.Parameter(torch.zeros(3)))
    assert refs == 0 and w.tolist() == [0.0, 0.0, 0.0]
    assert t.stats["errors"] == 0


def test_data_alias_leaves_no_weakref_on_its_source():
    w = torch.nn.Parameter(torch.randn(3))
    with copytrace.trace(write=False):
        alias = w.data  # copytrace watches writes through it while it lives
        import weakref

        assert weakref.getweakrefs(w) == []
        torch.utils.swap_tensors(w, torch.nn.Parameter(torch.zeros(3)))
        del alias
    assert w.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("observer", ["native", "python"])
def test_index_result_at_level_full_holds_no_weakref_and_a_lost_write_is_still_found(
    observer, monkeypatch
):
    import weakref

    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    x = torch.randn(4)
    idx = torch.tensor([0, 2])

    def lose_a_write() -> tuple[int, torch.Tensor]:
        gather = x[idx]  # a fresh gather, not a view: the write below is lost
        gather.zero_()
        refs = len(weakref.getweakrefs(gather))
        torch.utils.swap_tensors(gather, torch.ones(2))  # a tensor with a weakref is refused
        return refs, gather.clone()

    with copytrace.trace(write=False, level="full") as t:
        refs, after_swap = lose_a_write()
        torch.ones(2).add_(1)  # the next watched call finds the gather gone
    assert refs == 0 and after_swap.tolist() == [1.0, 1.0]
    (index,) = [e for e in t.events if e.op == "index"]
    assert index.write_site is not None and index.write_site.endswith(" lose_a_write")
    assert index.inplace_writes == 1  # zero_ bumped the gather's counter once (one call)
    assert t.stats["errors"] == 0


@pytest.mark.parametrize("observer", ["native", "python"])
def test_attached_copies_hold_nothing_and_a_retained_graph_is_still_found(observer, monkeypatch):
    # the watch of graph-retaining copies once kept a weakref on each attached copy and a
    # "copytrace.life" token in its grad_fn.metadata
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x = torch.randn(4, 8)
    w = torch.randn(3, requires_grad=True)
    history, seen = [], []
    with copytrace.trace(write=False) as t:
        for _ in range(3):
            history.append(model(x).pow(2).mean().clone())  # kept with its graph
            copy = w.clone()  # an attached copy that nothing saved: swappable
            seen.append((weakref.getweakrefcount(history[-1]), dict(history[-1].grad_fn.metadata),
                         weakref.getweakrefcount(copy)))  # fmt: skip
            torch.utils.swap_tensors(copy, torch.zeros(3))
            t.step()
    assert seen == [(0, {}, 0)] * 3
    assert t.observer_path == observer
    # per step: x (4x8 float32 = 128 B) and the ReLU output (4x16 = 256 B) saved by the Linear
    # layers, and pow's input (4x1 = 16 B)
    kept = [e.retained_bytes for e in t.events if e.op == "clone" and e.shape == ()]
    assert kept == [400, 400, 400]
    assert t.stats["errors"] == 0


@pytest.mark.skipif(_native.load() is None, reason="the Python fallback's modes are the mechanism")
def test_default_level_keeps_the_mode_stacks_while_an_index_result_and_a_data_alias_live():
    import weakref

    w = torch.nn.Parameter(torch.randn(4))
    idx = torch.tensor([0, 2])

    def stacks() -> tuple[int, int]:
        return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()

    with copytrace.trace(write=False) as t:  # the default level: lean
        before = stacks()
        loss = (w * w).sum()  # mul saves w: the write through the alias below is hidden
        gather = w.detach()[idx]  # a fresh gather, not a view
        alias = w.data  # autograd cannot see writes through it
        during = stacks()
        gather.zero_()
        alias.mul_(2.0)
        written = stacks()
        refs = [weakref.getweakrefcount(x) for x in (gather, alias, w)]
        loss.backward()  # reads the overwritten w: data-inplace
        del gather  # written and never used: lost-inplace-write
        after = stacks()
    assert before == during == written == after == (0, 0)
    assert refs == [0, 0, 0]
    (index,) = [e for e in t.events if e.op == "index"]
    (data,) = [e for e in t.events if e.op == "data_get"]
    site = " test_default_level_keeps_the_mode_stacks_while_an_index_result_and_a_data_alias_live"
    assert index.write_site is not None and index.write_site.endswith(site)
    assert data.inplace_writes == 1 and data.write_site.endswith(site)
    # w * w saves w twice (self and other, read in dir() order)
    assert data.saved_by == ("MulBackward0.other", "MulBackward0.self")
    assert t.stats["errors"] == 0


@pytest.mark.parametrize("observer", ["native", "python"])
def test_grad_fn_metadata_stays_the_program_own_and_backward_copies_name_their_forward(
    observer, monkeypatch
):
    # copytrace once tagged each recorded copy's grad_fn.metadata with its forward call
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    w = torch.randn(3, requires_grad=True)
    with copytrace.trace(write=False) as t:
        line = sys._getframe().f_lineno + 1  # the next line's
        y = w.to(torch.float64)  # ToCopyBackward0 casts the gradient back in backward
        y.grad_fn.metadata["mine"] = 1  # the program's own use of the dict
        meta = dict(y.grad_fn.metadata)
        y.sum().backward()
    assert meta == {"mine": 1}
    (back,) = [e for e in t.events if e.phase == "backward"]  # an implicit _to_copy
    assert back.origin == f"{__file__}:{line}"  # named after its forward call, as before
    assert t.stats["errors"] == 0


# --- RecordFunction callbacks ----------------------------------------------------------------
_BACKWARD_WATCH_PROGRAM = """
import torch
import torch.nn.functional as F
import copytrace

x = torch.randn(3, requires_grad=True)
w = torch.randn(4, 3, requires_grad=True)
options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)
with copytrace.trace(write=False, level="lean") as trace:
    # reduction='none' recomputes in backward, gathering there (an index result: watched)
    loss = F.linear_cross_entropy(x, w, torch.tensor(1), reduction="none", options=options)
    torch.autograd.backward([loss], [torch.ones_like(loss)])
assert trace.stats["errors"] == 0
print("done")
"""


def test_write_watch_registered_in_backward_leaves_no_torch_log_line(tmp_path):
    # The autograd engine runs a backward under a ThreadLocalStateGuard: the thread's
    # RecordFunction callbacks are the graph task's copy until backward returns. The lean write
    # watch's callback, registered there for an index result made in backward, is gone from
    # the thread once backward returns; removing it at stop made torch log "Requested callback
    # is not found" (record_function.cpp) on the program's stderr.
    import os
    import subprocess
    import sys

    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        pytest.skip("this torch has no chunked linear_cross_entropy")
    script = tmp_path / "backward_watch.py"
    script.write_text(_BACKWARD_WATCH_PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COPYTRACE")}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "done"
    assert "callback" not in done.stderr, done.stderr


_DYNAMO_AFTER_TRACE = """
import sys
import numpy as np, torch
import copytrace
if sys.argv[1] == "traced":  # a trace before the program first imports torch._dynamo
    with copytrace.trace(write=False):
        torch.ones(2).clone()
from torch._dynamo.utils import counters
ones = np.ones(4, dtype=np.float32)
@torch.compile(backend="eager")
def f(x):
    return x * 2 + torch.from_numpy(ones)
f(torch.ones(4))
print(sum(counters["graph_break"].values()), dict(counters["stats"]))
"""


def test_dynamo_imported_after_a_trace_sees_torch_own_functions(tmp_path):
    # torch._dynamo keeps some torch functions it sees when imported: imported while
    # copytrace's torch.from_numpy patch stood, it kept the patch and graph-broke on
    # torch.from_numpy after the trace. The same program compiles the same, traced or not.
    script = tmp_path / "dynamo_after.py"
    script.write_text(_DYNAMO_AFTER_TRACE)

    def run(mode: str) -> str:
        proc = subprocess.run([sys.executable, str(script), mode], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    untraced = run("untraced")
    assert untraced.startswith("0 ")  # one graph, no break (read from torch, not pinned)
    assert run("traced") == untraced


# --- modules imported while tracing --------------------------------------------------------
_BINDS_AT_IMPORT = '''
"""Binds torch's and copy's callables when imported, as libraries do."""
import copy
from copy import deepcopy
from copy import copy as shallow

import torch
from torch import from_numpy
from torch.utils import swap_tensors
from warnings import warn

state_dict = torch.nn.Module.state_dict
backward = torch.Tensor.backward
param_deepcopy = torch.nn.Parameter.__deepcopy__


def clone_all(x, *, _copy=copy.deepcopy):
    return _copy(x)


def first(x, _copy=deepcopy):
    return _copy(x)


class Cloner:
    copier = staticmethod(deepcopy)
    numpy = from_numpy

    @classmethod
    def make(cls, x, _copy=copy.copy):
        return _copy(x)
'''


def _bindings(module) -> dict[str, object]:
    return {
        "deepcopy": module.deepcopy, "shallow": module.shallow, "from_numpy": module.from_numpy,
        "swap_tensors": module.swap_tensors, "state_dict": module.state_dict, "warn": module.warn,
        "backward": module.backward, "param_deepcopy": module.param_deepcopy,
        "clone_all": module.clone_all.__kwdefaults__["_copy"],
        "first": module.first.__defaults__[0], "Cloner.copier": module.Cloner.copier,
        "Cloner.numpy": module.Cloner.numpy, "Cloner.make": module.Cloner.make.__defaults__[0],
    }  # fmt: skip


@pytest.mark.parametrize("level", ["lean", "full"])
def test_module_imported_while_tracing_keeps_no_patched_callable(level, tmp_path, monkeypatch):
    import copy
    import importlib

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "binds_before.py").write_text(_BINDS_AT_IMPORT)
    (tmp_path / "binds_while.py").write_text(_BINDS_AT_IMPORT)
    monkeypatch.delitem(sys.modules, "binds_before", raising=False)
    monkeypatch.delitem(sys.modules, "binds_while", raising=False)
    before = importlib.import_module("binds_before")  # untraced: torch's and copy's own
    own = _bindings(before)
    assert own["deepcopy"] is copy.deepcopy and own["backward"] is torch.Tensor.backward
    with copytrace.trace(write=False, level=level) as t:
        during = importlib.import_module("binds_while")
        x = torch.randn(3)
        during.first(x)  # while tracing, what it bound is copytrace's: the copy is recorded
        patched = _bindings(during)
    assert [e.op for e in t.events] == ["deepcopy"]
    assert patched["deepcopy"] is not copy.deepcopy  # it did bind copytrace's
    # after stop: every name holds what the same import untraced holds
    after = _bindings(during)
    assert {k: v is own[k] for k, v in after.items()} == dict.fromkeys(own, True)
    assert _bindings(before) == own  # a module imported before the trace is left alone
    assert t.stats["errors"] == 0


# --- the node tags (copytrace/tracer/_node_tags.py) ------------------------------------------
@pytest.mark.parametrize("observer", ["native", "python"])
def test_node_tags_drop_dead_nodes_and_walk_the_heap_only_on_the_fallback(observer, monkeypatch):
    from copytrace.tracer import _node_tags

    if observer == "native" and _native.load() is None:
        pytest.skip("no C++ observer here")
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    monkeypatch.setattr(_node_tags, "_MIN", 64)  # a smaller table: prunes every 64 tags
    walks = []
    walk = _node_tags._live_node_keys
    monkeypatch.setattr(_node_tags, "_live_node_keys", lambda: walks.append(1) or walk())
    w = torch.randn(3, requires_grad=True)
    with copytrace.trace(write=False) as t:
        for _ in range(200):
            w.to(torch.float64)  # a ToCopyBackward0 tagged, dead at once
        line = sys._getframe().f_lineno + 1  # the next line's
        kept = w.to(torch.float64)
        sizes = len(t.session._rec.node_tags._tags)
        kept.sum().backward()  # its backward copy is named after its forward call
    # 201 tags, every one dead by the next: pruned to none at each 64th, so fewer than 64 left
    assert sizes < 64
    assert (len(walks) == 0) == (observer == "native")  # the C++ path: weak pointers, no walk
    (back,) = [e for e in t.events if e.phase == "backward"]
    assert back.origin == f"{__file__}:{line}"
    assert t.stats["errors"] == 0


# --- warnings.warn shims (copytrace/tracer/_warnshim.py) ---------------------------------------
def _softmax_warnings() -> list[tuple[str, str, int]]:
    import torch.nn.functional as F

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.softmax(torch.randn(3))  # no dim: a UserWarning with a stacklevel, naming this line
        warnings.warn("mine", UserWarning, stacklevel=0)  # 0 and 1: the caller
    return [(w.category.__name__, w.filename, w.lineno) for w in caught]


@pytest.mark.parametrize("observer", ["native", "python"])
@pytest.mark.parametrize("level", ["lean", "full", "api"])
def test_stacklevel_warning_names_the_program_line_as_untraced(observer, level, monkeypatch):
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    plain = _softmax_warnings()
    with copytrace.trace(write=False, level=level) as t:
        traced = _softmax_warnings()
    assert traced == plain
    assert [f for _, f, _ in plain] == [__file__, __file__]
    assert warnings.warn is _warnings_warn  # put back
    assert t.stats["errors"] == 0


_warnings_warn = warnings.warn
