"""copytrace's C++ observer: parity with the Python dispatch mode, the fallback without a
compiler, coexistence with torch.profiler, subclasses, other modes and warnings."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace
from copytrace.tracer import _native

NATIVE = _native.load() is not None
needs_native = pytest.mark.skipif(
    not NATIVE and not os.environ.get("COPYTRACE_REQUIRE_INTEGRATION"),
    reason="C++ observer unavailable here",
)

# Fields compared event by event between the two paths (all but timing and sequence facts).
FIELDS = (
    "op", "bytes_allocated", "bytes_logical", "alias", "noop", "shape", "dtype", "src_dtype",
    "src_device", "dst_device", "transfer", "requires_grad", "src_requires_grad", "grad_fn",
    "is_leaf", "graph", "phase", "step", "module", "file", "line", "function", "origin",
    "error", "group", "tensors",
)  # fmt: skip


def _program() -> None:
    """Copies and aliases of every kind a training step makes (API, implicit, backward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = copy.deepcopy(model)
    for _ in range(2):
        x = torch.randn(4, 8).to(torch.float64).float()
        loss = model(x).double().pow(2).mean()  # ToCopyBackward0 casts the gradient back
        opt.zero_grad()
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        with torch.no_grad():
            for p, q in zip(ema.parameters(), model.parameters(), strict=True):
                p.copy_(q)
        snap = {k: v.clone() for k, v in model.state_dict().items()}
        flat = x.t().reshape(-1)  # a hidden copy: reshape of a transposed tensor
        _ = (logged, snap, flat, x.data, torch.tensor(x.detach()), x.contiguous(), x.cpu())


def _events(observer: str) -> list[tuple]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with copytrace.trace(write=False, observer=observer) as t:
            _program()
    return [tuple(getattr(e, f) for f in FIELDS) for e in t.events]


@needs_native
def test_observer_records_the_same_events_as_the_python_dispatch_mode() -> None:
    native = _events("auto")
    python = _events("python")
    # _program makes 2 x (to, float, double, backward's _to_copy, detach, clone, ...) events;
    # compare every field of every event, in order
    assert len(native) == len(python) > 30
    for a, b in zip(native, python, strict=True):
        assert dict(zip(FIELDS, a, strict=True)) == dict(zip(FIELDS, b, strict=True))


@needs_native
def test_subclass_creation_from_a_tensor_made_while_tracing() -> None:
    class S(torch.Tensor):
        pass

    with copytrace.trace(write=False) as t:
        base = torch.randn(3)
        made = [S(base), torch.Tensor._make_subclass(S, base), base.as_subclass(S)]
        param = nn.Parameter(torch.randn(2))
    assert [type(m) for m in made] == [S, S, S] and type(param) is nn.Parameter
    assert t.stats["errors"] == 0


@needs_native
def test_other_modes_see_exactly_what_they_see_untraced() -> None:
    class CountF(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    class CountD(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    x = torch.randn(2, 3, requires_grad=True)

    def work() -> tuple[int, int]:
        with CountF() as f, CountD() as d:
            for _ in range(19):
                copy.copy(x)
            copy.deepcopy(model)
            model(x).clone().sum().backward()
            _ = (x.data, x.detach().to(torch.float64))
        return f.n, d.n

    plain = work()
    with copytrace.trace(write=False) as t:
        traced = work()
    assert traced == plain
    assert len(t.events) > 20  # copytrace still recorded the copies under the user's modes


def test_beside_torch_profiler() -> None:
    x = torch.randn(16, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with copytrace.trace(write=False) as t:
            y = x.clone().to(torch.float64)
    names = {e.name for e in prof.events()}
    assert {"aten::clone", "aten::_to_copy"} <= names  # the profiler still sees the ops
    assert [e.op for e in t.events] == ["clone", "to"]
    assert y.dtype == torch.float64


def test_no_compiler_falls_back_to_the_python_mode(tmp_path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, copytrace
            with copytrace.trace(write=False) as t:
                torch.randn(4).clone()
            # the default level, lean, needs the C++ observer: the run says it traced as full
            print([e.op for e in t.events], t.observer_path, t.level,
                  t.session.run_attributes()["copytrace.level"])
            """
        )
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"))
    env["COPYTRACE_CACHE_DIR"] = str(tmp_path / "cache")  # nothing built there
    env.pop("COPYTRACE_OBSERVER", None)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['clone'] python lean full"
    lines = [ln for ln in proc.stderr.splitlines() if "C++ observer unavailable" in ln]
    assert len(lines) == 1 and "no C++ compiler found" in lines[0]


def test_doctor_names_the_active_path() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", "doctor"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    expected = "aten level: C++ observer" if NATIVE else "aten level: Python dispatch mode"
    assert expected in proc.stdout
    assert f"torch {torch.__version__}" in proc.stdout
    level = "level: lean (COPYTRACE_LEVEL)" if NATIVE else "level: full (COPYTRACE_LEVEL=lean"
    assert level in proc.stdout


def test_fake_tensor_copies_are_copies_of_no_real_memory() -> None:
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.empty(8, 4)  # float32: 8 x 4 x 4 B = 128 logical bytes
    with copytrace.trace(write=False) as t:
        with mode:
            cloned = fake.clone()
            copied = copy.deepcopy(fake)
    real = torch.randn(8, 4)
    with copytrace.trace(write=False) as t2:
        with FakeCopyMode(FakeTensorMode()):
            under_copy_mode = copy.deepcopy(real)
    assert type(cloned).__name__ == type(copied).__name__ == "FakeTensor"
    assert type(under_copy_mode).__name__ == "FakeTensor"
    for ev in [*t.events, *t2.events]:
        assert ev.op in ("clone", "deepcopy")
        assert (ev.alias, ev.fake, ev.bytes_allocated, ev.bytes_logical) == (False, True, 0, 128)
    assert [e.op for e in t.events] == ["clone", "deepcopy"]
    assert [e.op for e in t2.events] == ["deepcopy"]


@needs_native
def test_level_lean_records_the_same_events_with_no_mode() -> None:
    from torch.overrides import _get_current_function_mode_stack

    def events(level: str) -> list[tuple]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with copytrace.trace(write=False, level=level) as t:
                if level == "lean":
                    assert _get_current_function_mode_stack() == []  # no Python mode at all
                _program()
        return [tuple(getattr(e, f) for f in FIELDS) for e in t.events]

    full, lean = events("full"), events("lean")
    # every field of every event, in order (the same program as the parity test above)
    assert len(lean) == len(full) > 30
    for a, b in zip(lean, full, strict=True):
        assert dict(zip(FIELDS, a, strict=True)) == dict(zip(FIELDS, b, strict=True))
    # the class attributes are torch's own again, and read from the class they always were
    assert torch.Tensor.clone is torch._C.TensorBase.clone
    assert torch.Tensor.__dict__.get("data") is None


@needs_native
def test_level_lean_sees_bound_calls_and_lost_writes_as_full_does() -> None:
    from torch.overrides import _get_current_function_mode_stack

    x = torch.randn(3, requires_grad=True)
    idx = torch.tensor([0, 2])
    bound = x.clone  # bound before tracing: recorded too (torch's own pointer is hot-patched)

    def program() -> None:
        bound()
        x.clone()
        x.detach()[idx].zero_()  # a write into a temporary gather: a lost write

    with copytrace.trace(write=False, level="lean") as lean:
        program()
        # the mode joined only while the gather lived (to see the write into it), and left
        assert _get_current_function_mode_stack() == []
    with copytrace.trace(write=False, level="full") as full:
        program()
    # the bound call is recorded as the clone it is (torch's pointer is hot-patched); the lost
    # write into the gather has the same site at both levels
    assert [(e.op, e.aten) for e in lean.events] == [
        ("clone", ("aten::clone",)), ("clone", ("aten::clone",)), ("detach", ("aten::detach",)),
        ("index", ()),
    ]  # fmt: skip
    assert [e.op for e in full.events] == ["clone", "clone", "detach", "index"]
    for t in (lean, full):
        assert [e.write_site is None for e in t.events] == [True, True, True, False]
    # zero_ bumped the gather's version counter once; an alias (detach) has no count
    assert [e.inplace_writes for e in lean.events] == [0, 0, None, 1]
    assert [e.inplace_writes for e in full.events] == [0, 0, None, 1]
    assert lean.events[3].write_site == full.events[3].write_site
    assert lean.events[3].write_site.endswith(" program")


# --- level lean: torch's own pointers hot-patched (_native/hotpatch.cpp, hot_install) -------
def _bound_before_program(x: torch.Tensor, y: torch.Tensor) -> None:
    """Calls of callables taken before tracing started (set up by the caller)."""
    bound_clone, bound_detach_, bound_to, clone, reshape, tensor = _BOUND
    bound_clone()
    bound_detach_()  # y: a non-leaf, cut from its graph in place
    bound_to(torch.float64)
    clone(x, memory_format=torch.contiguous_format)
    reshape(x.t(), (-1,))  # a hidden copy
    tensor(x.detach())


_BOUND: tuple = ()


def _ptr_ml_meth(descr: object) -> int:
    """torch's C function pointer behind a method_descriptor (PyMethodDescrObject.d_method
    follows the PyDescrObject header: refcount, type, d_type, d_name, d_qualname)."""
    import ctypes

    method_def = ctypes.c_void_p.from_address(id(descr) + 5 * ctypes.sizeof(ctypes.c_void_p))
    return ctypes.c_void_p.from_address(method_def.value + ctypes.sizeof(ctypes.c_void_p)).value


def _ptr_vectorcall(fn: object) -> int | None:
    """PyCFunctionObject.vectorcall of a builtin function (after refcount, type, m_ml, m_self,
    m_module, m_weakreflist)."""
    import ctypes

    return ctypes.c_void_p.from_address(id(fn) + 6 * ctypes.sizeof(ctypes.c_void_p)).value


@needs_native
def test_level_lean_records_callables_taken_before_tracing_as_full_does() -> None:
    global _BOUND
    from torch import clone, reshape, tensor  # imported before tracing

    def events(level: str) -> list[dict]:
        global _BOUND
        x = torch.randn(3, 4, requires_grad=True)
        y = x * 2
        _BOUND = (x.clone, y.detach_, x.to, clone, reshape, tensor)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.tensor(a tensor) warns
            with copytrace.trace(write=False, level=level) as t:
                _bound_before_program(x, y)
        return [{f: getattr(e, f) for f in FIELDS} for e in t.events]

    lean, full = events("lean"), events("full")
    # one API event per call, every field as level full records it (line: the call's own)
    assert [e["op"] for e in lean] == [
        "clone", "detach_", "to", "clone", "reshape", "detach", "tensor_ctor",
    ]  # fmt: skip
    assert lean == full
    assert (lean[0]["bytes_allocated"], lean[2]["bytes_allocated"]) == (48, 96)  # 12 x 4, x 8
    assert lean[1]["alias"] and lean[1]["bytes_allocated"] == 0
    _BOUND = ()


@needs_native
def test_level_lean_leaves_torchs_callables_in_place_and_restores_the_pointers() -> None:
    from copytrace.tracer import _native

    native = _native.load()
    names = ("clone", "to", "detach", "detach_", "data", "numpy", "copy_", "reshape")
    tensor_dict = {n: torch.Tensor.__dict__.get(n) for n in names}
    base_dict = {n: torch._C.TensorBase.__dict__[n] for n in names}
    keyed = {torch.clone: "clone", torch.reshape: "reshape"}  # hashed before tracing
    functions = (torch.clone, torch.reshape, torch.tensor)
    before = [_ptr_ml_meth(torch._C.TensorBase.clone), *map(_ptr_vectorcall, functions)]
    x = torch.randn(4)
    bound = x.clone
    for _ in range(3):  # started and stopped again: each time the same
        with copytrace.trace(write=False, level="lean") as t:
            assert torch.Tensor.clone is torch._C.TensorBase.clone
            assert {n: torch.Tensor.__dict__.get(n) for n in names} == tensor_dict
            assert {n: torch._C.TensorBase.__dict__[n] for n in names} == base_dict
            assert keyed[torch.clone] == "clone" and keyed[torch.reshape] == "reshape"
            during = [_ptr_ml_meth(torch._C.TensorBase.clone), *map(_ptr_vectorcall, functions)]
            assert all(a != b for a, b in zip(before, during, strict=True))
            assert native.hot_count() > 20  # the C methods and functions of the table, data
            bound()
        assert [e.op for e in t.events] == ["clone"]
        after = [_ptr_ml_meth(torch._C.TensorBase.clone), *map(_ptr_vectorcall, functions)]
        assert after == before and native.hot_count() == 0
    # after stop: torch's own code runs, nothing is recorded into the last trace
    assert torch.equal(bound(), x) and torch.clone(x).data_ptr() != x.data_ptr()
    assert len(t.events) == 1


@needs_native
def test_level_lean_a_user_mode_sees_torchs_callable_and_the_copy_is_recorded_once() -> None:
    seen: list = []

    class Log(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))  # re-enters the hot-patched pointer

    x = torch.randn(3)
    bound = x.clone
    with copytrace.trace(write=False, level="lean") as t:
        with Log():
            bound()
            torch.clone(x)
            _ = x.data
    # what the mode receives untraced: torch's own callables
    with Log():
        untraced = list(seen)
        seen.clear()
        bound()
        torch.clone(x)
        _ = x.data
    assert seen == untraced
    assert untraced[:2] == [torch._C.TensorBase.clone, torch.clone]
    assert untraced[2] == torch._C.TensorBase.data.__get__
    assert [e.op for e in t.events] == ["clone", "clone", "data_get"]
