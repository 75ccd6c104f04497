"""Conformance tests: real-world copy and alias situations, and what copytrace records for them.

Each group of tests below re-creates, in a few lines, a situation PyTorch users have reported
(``.data`` vs ``.detach()``, deepcopy of modules, no-op ``.to()``, hidden copies in
``reshape``...) and checks the events of ``copytrace.trace(write=False)`` against what a
copy-tracing tool must observe on it: bytes allocated, alias / no-op flags, graph attachment,
``grad_fn`` names, op names, autograd's own detaches kept out of the events (they are only
counted in ``t.stats["internal_detaches"]``), exceptions passing through unchanged, and results
identical with and without tracing.

Where a situation is a hazard, the tests assert the facts it is built on, and then the finding
``copytrace.analyze`` makes of them (its code, its lines, its bytes) together with a near miss
that must stay clean; each runs on both observer paths (``COPYTRACE_OBSERVER=python`` for the
fallback).

A test marked ``xfail(strict=True)`` documents something the tracer records wrongly or misses
today; its ``reason`` says what, and it starts to fail (XPASS) once the tracer is fixed.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

import copytrace
from copytrace import CopyEvent, Trace
from copytrace.tracer import _native

# copytrace's C++ observer (default) or the Python dispatch mode (COPYTRACE_OBSERVER=python).
# They differ where torch itself differs: `.data` and autograd's own saved-output detaches are
# shallow copies made without the dispatcher, which torch routes through aten::detach only
# under a Python mode; the observer sees what the dispatcher really runs.
NATIVE = _native.load() is not None
DATA_ATEN = () if NATIVE else ("aten::detach",)
# nn.Parameter.__deepcopy__: Parameter(self.data.clone()); the new Parameter detaches its data
PARAM_DEEPCOPY_ATEN = ("aten::clone", "aten::detach") if NATIVE else ("aten::detach", "aten::clone")

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def run_traced(fn: Callable[[], Any]) -> tuple[Trace, Any]:
    """Run ``fn`` inside a non-writing trace; return the trace and what ``fn`` returned."""
    with copytrace.trace(write=False) as t:
        result = fn()
    return t, result


def raise_traced(fn: Callable[[], Any]) -> tuple[Trace, BaseException]:
    """Run ``fn`` inside a trace, expecting it to raise out of the ``with`` block."""
    t = copytrace.trace(write=False)
    with pytest.raises(Exception) as info:
        with t:
            fn()
    return t, info.value


def raise_untraced(fn: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def assert_same_exception(untraced: BaseException, traced: BaseException) -> None:
    assert type(traced) is type(untraced)
    assert str(traced) == str(untraced)


def copies(t: Trace) -> list[CopyEvent]:
    """Events that are not deepcopy groups (what the reports sum over)."""
    return [e for e in t.events if not e.group]


def groups(t: Trace) -> list[CopyEvent]:
    return [e for e in t.events if e.group]


def allocated(t: Trace) -> int:
    return sum(e.bytes_allocated for e in copies(t))


def only_event(t: Trace) -> CopyEvent:
    events = t.events
    assert len(events) == 1, events
    return events[0]


def same_file(a: str | None, b: str) -> bool:
    return a is not None and os.path.realpath(a) == os.path.realpath(b)


@contextlib.contextmanager
def swap_on_conversion(enabled: bool) -> Iterator[None]:
    """Select ``nn.Module._apply``'s ``.data`` setter path (False) or swap_tensors path (True)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(enabled)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


# --------------------------------------------------------------------------------------------
# .data vs .detach(): both alias the activation; only .detach() shares the version counter
# --------------------------------------------------------------------------------------------


def _write_through_alias(how: str) -> dict[str, Any]:
    leaf = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    act = leaf.sigmoid()  # SigmoidBackward0 saves its *output* for backward
    view = act.detach() if how == "detach" else act.data
    facts: dict[str, Any] = {
        "shares_storage": view.data_ptr() == act.data_ptr(),
        "version_before": act._version,
    }
    view.zero_()  # overwrite the saved output through the alias
    facts["version_after"] = act._version
    try:
        act.sum().backward()  # raises for "detach"; silently wrong for "data"
    except RuntimeError as err:
        facts["backward"] = (type(err), str(err))
    else:
        facts["backward"] = leaf.grad.tolist()  # tolist: no copy event of its own
    return facts


@pytest.mark.parametrize("how, op", [("detach", "detach"), ("data", "data_get")])
def test_detach_and_data_of_activation_are_zero_byte_aliases_cut_from_graph(
    how: str, op: str
) -> None:
    leaf = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    act = leaf.sigmoid()
    assert type(act.grad_fn).__name__ == "SigmoidBackward0"
    t, view = run_traced(lambda: act.detach() if how == "detach" else act.data)

    ev = only_event(t)
    assert ev.op == op  # the function mode tells .data from .detach() ...
    assert ev.aten == (("aten::detach",) if how == "detach" or not NATIVE else ())
    assert ev.alias is True and ev.noop is False
    assert ev.bytes_allocated == 0
    assert ev.bytes_logical == 12  # 3 float32 = 12 B
    assert ev.graph == "detached"
    assert ev.src_requires_grad is True
    assert ev.requires_grad is False and ev.grad_fn is None and ev.is_leaf is True
    assert t.stats["internal_detaches"] == 0  # the user's detach is an event, not bookkeeping
    assert view.data_ptr() == act.data_ptr()


def test_inplace_write_through_detach_alias_is_version_tracked_and_raises_unchanged() -> None:
    untraced = _write_through_alias("detach")
    t, traced = run_traced(lambda: _write_through_alias("detach"))

    # version counter facts: detach() shares the counter, so the write is seen (0 -> 1)
    assert traced["shares_storage"] and untraced["shares_storage"]
    assert (traced["version_before"], traced["version_after"]) == (0, 1)
    assert (untraced["version_before"], untraced["version_after"]) == (0, 1)
    # backward refuses, with the same exception as untraced
    assert traced["backward"][0] is RuntimeError
    assert "modified by an inplace operation" in traced["backward"][1]
    assert traced["backward"] == untraced["backward"]

    # only the user's detach is an event; the in-place zero_ is not a copy
    assert [e.op for e in t.events] == ["detach"]
    assert t.events[0].alias and t.events[0].graph == "detached"
    assert t.events[0].error is None
    # sigmoid saving its output is autograd's own detach: counted, not recorded
    assert NATIVE or t.stats["internal_detaches"] >= 1


def test_backward_error_passes_through_the_trace_unchanged() -> None:
    def write_then_backward() -> None:
        leaf = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
        act = leaf.sigmoid()
        act.detach().zero_()
        act.sum().backward()

    untraced = raise_untraced(write_then_backward)
    _, traced = raise_traced(write_then_backward)
    assert isinstance(traced, RuntimeError)
    assert_same_exception(untraced, traced)


def test_data_alias_inplace_write_is_not_version_tracked() -> None:
    untraced = _write_through_alias("data")
    t, traced = run_traced(lambda: _write_through_alias("data"))

    # version counter facts: .data has its own counter, so the saved output looks untouched
    assert untraced["shares_storage"] and traced["shares_storage"]
    assert (traced["version_before"], traced["version_after"]) == (0, 0)
    assert (untraced["version_before"], untraced["version_after"]) == (0, 0)
    # the silently wrong gradient (all zeros) is the same with and without tracing
    assert traced["backward"] == untraced["backward"] == [0.0, 0.0, 0.0]

    ev = [e for e in t.events if e.op == "data_get"]
    assert len(ev) == 1 and len(t.events) == 1
    assert ev[0].alias is True and ev[0].bytes_allocated == 0 and ev[0].graph == "detached"
    assert ev[0].aten == DATA_ATEN


# --------------------------------------------------------------------------------------------
# deepcopy of a module that cached a graph-attached activation
# --------------------------------------------------------------------------------------------


class CachingNet(nn.Module):
    """Stores an intermediate activation on ``self`` during forward."""

    def __init__(self, cache_detached: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.cache_detached = cache_detached
        self.last_hidden: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.last_hidden = h.detach() if self.cache_detached else h
        return h.relu()


def test_deepcopy_of_fresh_module_is_one_group_of_two_parameter_copies() -> None:
    torch.manual_seed(0)
    net = CachingNet()
    t, dup = run_traced(lambda: copy.deepcopy(net))

    (group,) = groups(t)
    children = copies(t)
    # fc.weight 8x8 float32 = 256 B, fc.bias 8 float32 = 32 B -> 288 B
    assert [c.bytes_allocated for c in children] == [256, 32]
    assert group.bytes_allocated == 288 == allocated(t)
    assert group.tensors == 2
    assert group.object_type == f"{CachingNet.__module__}.CachingNet"
    assert group.error is None
    assert all(c.parent == group.seq and c.op == "deepcopy" for c in children)
    assert all(not c.alias and c.is_leaf and c.requires_grad for c in children)
    assert torch.equal(dup.fc.weight, net.fc.weight)
    assert dup.fc.weight.data_ptr() != net.fc.weight.data_ptr()


def test_deepcopy_of_module_caching_graph_activation_raises_unchanged() -> None:
    torch.manual_seed(0)
    net = CachingNet()
    net(torch.randn(2, 8))
    assert net.last_hidden is not None
    assert type(net.last_hidden.grad_fn).__name__ == "AddmmBackward0"

    untraced = raise_untraced(lambda: copy.deepcopy(net))
    t, traced = raise_traced(lambda: copy.deepcopy(net))
    assert isinstance(traced, RuntimeError)
    assert "graph leaves" in str(traced)
    assert_same_exception(untraced, traced)

    (group,) = groups(t)
    assert group.error == "RuntimeError"
    failed = [c for c in copies(t) if c.error is not None]
    assert len(failed) == 1
    # the refused tensor: the cached 2x8 activation, attached to the graph (needs grad)
    assert failed[0].error == "RuntimeError"
    assert failed[0].shape == (2, 8) and failed[0].src_requires_grad is True
    assert failed[0].bytes_allocated == 0
    assert failed[0].parent == group.seq
    # the two parameters were copied before the failure: 256 + 32 B
    assert sum(c.bytes_allocated for c in copies(t) if c.error is None) == 288


def test_trace_keeps_recording_after_a_failed_deepcopy() -> None:
    torch.manual_seed(0)
    broken = CachingNet()
    broken(torch.randn(2, 8))
    fixed = CachingNet(cache_detached=True)
    fixed(torch.randn(2, 8))

    with copytrace.trace(write=False) as t:
        with pytest.raises(RuntimeError):
            copy.deepcopy(broken)
        copy.deepcopy(fixed)

    first, second = groups(t)
    assert first.error == "RuntimeError" and second.error is None
    assert [c.parent for c in copies(t) if c.seq > second.seq] == [second.seq] * 3
    assert t.stats["errors"] == 0


@pytest.mark.parametrize("level", ["lean", "full"])
def test_tensors_deep_copied_inside_objects_are_placed_at_the_users_deepcopy(level: str) -> None:
    torch.manual_seed(0)
    broken = CachingNet()
    broken(torch.randn(2, 8))  # caches an attached activation: its deepcopy raises
    fixed = CachingNet(cache_detached=True)
    fixed(torch.randn(2, 8))
    state = {"step": torch.tensor(3), "buf": torch.zeros(4)}

    def copy_all() -> None:
        with contextlib.suppress(RuntimeError):
            copy.deepcopy(broken)
        copy.deepcopy(fixed)
        copy.deepcopy(state)

    with copytrace.trace(write=False, level=level) as t:
        copy_all()
    # Tensor.__deepcopy__ hands its call to a function mode through torch's
    # handle_torch_function (a Python mode on the stack: the fallback, or level "full"); each
    # tensor's copy is still the user's deepcopy, reached through no torch function
    children = copies(t)
    assert [(e.error, e.bytes_allocated) for e in children] == [
        (None, 256), (None, 32), ("RuntimeError", 0),  # weight 8x8, bias 8, the cache
        (None, 256), (None, 32), (None, 64),  # the detached 2x8 cache copied
        (None, 8), (None, 16),  # an int64 step, 4 float32
    ]  # fmt: skip
    assert [e.via for e in children] == [None] * 8
    first, second, third = (g.line for g in groups(t))
    assert [e.line for e in children] == [first] * 3 + [second] * 3 + [third] * 2
    assert [e.function for e in children] == ["copy_all"] * 8


def test_tensor_deep_copied_under_the_programs_function_mode_is_placed_at_its_deepcopy() -> None:
    from torch.overrides import TorchFunctionMode

    class PassThroughFunctions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    state = {"buf": torch.zeros(4)}
    with copytrace.trace(write=False, level="full") as t:  # copytrace's function mode too
        with PassThroughFunctions():
            copy.deepcopy(state)  # Tensor.__deepcopy__ reaches each mode: two entries to pass
    (group,) = groups(t)
    (child,) = copies(t)
    assert (child.bytes_allocated, child.via, child.line) == (16, None, group.line)  # 4 float32


def test_deepcopy_of_module_with_detached_cache_copies_three_tensors() -> None:
    torch.manual_seed(0)
    net = CachingNet(cache_detached=True)
    net(torch.randn(2, 8))
    t, dup = run_traced(lambda: copy.deepcopy(net))

    (group,) = groups(t)
    # 256 B weight + 32 B bias + cached 2x8 float32 activation (64 B) = 352 B
    assert sorted(c.bytes_allocated for c in copies(t)) == [32, 64, 256]
    assert group.bytes_allocated == 352 and group.tensors == 3
    assert dup.last_hidden.data_ptr() != net.last_hidden.data_ptr()
    assert torch.equal(dup.last_hidden, net.last_hidden)


def test_detach_inside_forward_is_attributed_to_module_and_forward_phase() -> None:
    torch.manual_seed(0)
    net = CachingNet(cache_detached=True)
    x = torch.randn(2, 8)
    t, _ = run_traced(lambda: net(x))

    ev = only_event(t)  # the user's h.detach(); relu saving its output is internal
    assert ev.op == "detach" and ev.alias and ev.bytes_allocated == 0
    assert ev.phase == "forward"
    assert ev.module == "CachingNet"
    assert ev.graph == "detached"
    assert NATIVE or t.stats["internal_detaches"] >= 1


def test_forward_caching_attached_activation_records_no_user_copy() -> None:
    torch.manual_seed(0)
    net = CachingNet()
    x = torch.randn(2, 8)
    t, out = run_traced(lambda: net(x))
    assert t.events == []
    assert NATIVE or t.stats["internal_detaches"] >= 1  # relu saved its output
    assert net.last_hidden is not None and net.last_hidden.grad_fn is not None
    assert torch.equal(out, net.fc(x).relu())


# --------------------------------------------------------------------------------------------
# deepcopy keeps .grad for plain tensors, drops it for nn.Parameter
# --------------------------------------------------------------------------------------------


def test_deepcopy_of_plain_tensor_counts_its_grad_copy() -> None:
    torch.manual_seed(0)
    plain = torch.randn(4, requires_grad=True)
    plain.grad = torch.ones(4)
    t, dup = run_traced(lambda: copy.deepcopy(plain))

    ev = only_event(t)
    assert ev.op == "deepcopy" and not ev.group
    # data 4 float32 = 16 B, plus .grad 4 float32 = 16 B -> 32 B allocated
    assert ev.bytes_allocated == 32
    assert ev.bytes_logical == 16
    assert ev.aten == ("aten::copy_", "aten::copy_")  # data storage, then grad storage
    assert ev.alias is False and ev.is_leaf and ev.requires_grad
    assert dup.grad is not None and torch.equal(dup.grad, plain.grad)
    assert dup.grad.data_ptr() != plain.grad.data_ptr()


def test_deepcopy_of_parameters_drops_grad_and_counts_only_data() -> None:
    def make() -> nn.Linear:
        torch.manual_seed(0)
        layer = nn.Linear(2, 3)
        for p in layer.parameters():
            p.grad = torch.full_like(p, 7.0)
        return layer

    untraced = copy.deepcopy(make())
    layer = make()
    t, dup = run_traced(lambda: copy.deepcopy(layer))

    (group,) = groups(t)
    # weight 3x2 float32 = 24 B, bias 3 float32 = 12 B; the grads (36 B) are not copied
    assert [c.bytes_allocated for c in copies(t)] == [24, 12]
    assert group.bytes_allocated == 36 and group.tensors == 2
    assert all(c.aten == PARAM_DEEPCOPY_ATEN for c in copies(t))
    assert dup.weight.grad is None and dup.bias.grad is None
    assert untraced.weight.grad is None and untraced.bias.grad is None
    assert t.stats["internal_detaches"] == 0  # Parameter.__deepcopy__'s .data is folded in


def test_deepcopy_of_single_parameter_is_one_event_without_grad_bytes() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(2, 3)
    layer.weight.grad = torch.ones(3, 2)
    t, dup = run_traced(lambda: copy.deepcopy(layer.weight))
    ev = only_event(t)
    assert ev.op == "deepcopy"
    assert ev.bytes_allocated == 24  # 3x2 float32; the 24 B grad is dropped by Parameter
    assert isinstance(dup, nn.Parameter) and dup.grad is None


# --------------------------------------------------------------------------------------------
# what each detach flavour looks like: detach, .data, detach_, .numpy(), wrapper subclass
# --------------------------------------------------------------------------------------------


def test_detach_inplace_is_a_noop_alias_seen_only_by_function_mode() -> None:
    base = torch.tensor([1.0, 2.0], requires_grad=True)
    y = base * 2
    t, out = run_traced(y.detach_)

    ev = only_event(t)
    assert ev.op == "detach_"
    assert ev.aten == ()  # detach_ never reaches the dispatch mode
    assert ev.noop is True and ev.alias is True  # returns y itself
    assert ev.bytes_allocated == 0 and ev.bytes_logical == 8  # 2 float32 = 8 B
    assert out is y and not y.requires_grad and y.grad_fn is None
    assert t.stats["internal_detaches"] == 0


def test_detach_inplace_on_nonleaf_is_recorded_as_cut_from_graph() -> None:
    base = torch.tensor([1.0, 2.0], requires_grad=True)
    y = base * 2
    assert y.requires_grad and y.grad_fn is not None
    t, _ = run_traced(y.detach_)
    ev = only_event(t)
    assert ev.src_requires_grad is True
    assert ev.graph == "detached"


def test_numpy_of_detached_tensor_folds_its_own_detach_into_the_numpy_event() -> None:
    base = torch.tensor([1.0, 2.0], requires_grad=True)
    t, arr = run_traced(lambda: base.detach().numpy())

    detach, numpy_ev = t.events
    assert (detach.op, numpy_ev.op) == ("detach", "numpy")
    # two aten::detach at dispatch level: one per call, neither counted as internal
    assert detach.aten == ("aten::detach",) and numpy_ev.aten == ("aten::detach",)
    assert t.stats["internal_detaches"] == 0
    for ev in (detach, numpy_ev):
        assert ev.alias is True and ev.bytes_allocated == 0 and ev.bytes_logical == 8
    assert detach.graph == "detached"
    assert numpy_ev.graph == "none"  # its input no longer requires grad
    assert isinstance(arr, np.ndarray)
    assert np.shares_memory(arr, base.detach().numpy())


def test_numpy_of_tensor_requiring_grad_raises_unchanged() -> None:
    base = torch.tensor([1.0, 2.0], requires_grad=True)
    untraced = raise_untraced(base.numpy)
    t, traced = raise_traced(base.numpy)
    assert_same_exception(untraced, traced)
    ev = only_event(t)
    assert ev.op == "numpy" and ev.error == "RuntimeError"
    assert ev.bytes_allocated == 0


class Wrapped(torch.Tensor):
    """A minimal wrapper subclass: no storage of its own, real data in ``inner``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapped:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, dtype=inner.dtype, device=inner.device,
            requires_grad=inner.requires_grad,
        )  # fmt: skip

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(a: Any) -> Any:
            return a.inner if isinstance(a, Wrapped) else a

        def wrap(a: Any) -> Any:
            return Wrapped(a) if isinstance(a, torch.Tensor) else a

        return tree_map(wrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))


def test_wrapper_subclass_detach_reaches_dispatch_once() -> None:
    w = Wrapped(torch.tensor([3.0], requires_grad=True))
    t, out = run_traced(w.detach)
    ev = only_event(t)
    assert ev.op == "detach"
    # the wrapper takes detach at the Python key and calls it again on its inner tensor: both
    # paths see that one call (torch 2.13: once; releases before torch PR #163671 saw two)
    assert ev.aten == ("aten::detach",)
    assert t.stats["internal_detaches"] == 0
    assert isinstance(out, Wrapped) and torch.equal(out.inner, w.inner)


def test_wrapper_subclass_detach_is_zero_byte_alias() -> None:
    w = Wrapped(torch.tensor([3.0], requires_grad=True))
    t, _ = run_traced(w.detach)
    ev = only_event(t)
    assert ev.alias is True
    assert ev.bytes_allocated == 0


# --------------------------------------------------------------------------------------------
# a program's own Python dispatch handler (a mode, a wrapper subclass) above copytrace's
# --------------------------------------------------------------------------------------------


class PassThrough(TorchDispatchMode):
    """A do-nothing dispatch mode of the program's own, as logging and counting modes are."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _copies_torch_makes() -> tuple[torch.Tensor, torch.Tensor]:
    leaf = torch.arange(4.0, requires_grad=True)
    leaf.double().sum().backward()  # ToCopyBackward0 casts the float64 grad back: implicit
    return torch.arange(6.0).reshape(2, 3).t().reshape(6), leaf.grad  # reshape's hidden clone


def _event_facts(t: Trace) -> list[tuple[str, tuple[str, ...], int, str]]:
    return [(e.op, e.aten, e.bytes_allocated, e.phase) for e in t.events]


# Without a program's mode: .double() of 4 float32 makes 32 B; backward's ToCopyBackward0 makes
# the 4 float32 grad again (16 B), implicitly; reshape(2, 3) of contiguous input is a view (0 B)
# and reshape after .t() clones 6 float32 (24 B).
COPIES_TORCH_MAKES = [
    ("reshape", (), 0, "other"),
    ("reshape", ("aten::clone",), 24, "other"),
    ("double", ("aten::_to_copy",), 32, "other"),
    ("implicit", ("aten::_to_copy",), 16, "backward"),
]


@pytest.mark.parametrize("stack", ["one mode", "two modes", "FlopCounterMode"])
def test_copies_under_the_programs_own_dispatch_mode_are_recorded_as_without_it(
    stack: str,
) -> None:
    def under_modes() -> tuple[torch.Tensor, torch.Tensor]:
        with contextlib.ExitStack() as modes:
            if stack == "FlopCounterMode":
                modes.enter_context(FlopCounterMode(display=False))
            else:
                for _ in range(2 if stack == "two modes" else 1):
                    modes.enter_context(PassThrough())
            return _copies_torch_makes()

    t_plain, plain = run_traced(_copies_torch_makes)
    t, traced = run_traced(under_modes)
    # the mode takes each op at the Python key and calls it again: that call is the op itself,
    # neither hidden as an op inside another one's kernel nor recorded twice
    assert sorted(_event_facts(t)) == sorted(_event_facts(t_plain)) == sorted(COPIES_TORCH_MAKES)
    assert all(torch.equal(a, b) for a, b in zip(traced, plain, strict=True))


def test_kernel_internal_copy_under_the_programs_mode_stays_unrecorded() -> None:
    # addmm's CPU kernel copies the bias into its output (a copy_ inside another op's kernel,
    # which no dispatch mode sees): not an event with the program's mode on either
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    x = torch.randn(2, 8)
    mode = PassThrough()

    def forward() -> torch.Tensor:
        with mode:
            return layer(x)

    t, out = run_traced(forward)
    assert "aten.addmm.default" in mode.ops and "aten.copy_.default" not in mode.ops
    assert t.events == []
    assert torch.equal(out, layer(x))


class CallsTwice(torch.Tensor):
    """A wrapper subclass whose handler calls each op once for its result, then once more."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> CallsTwice:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(a: Any) -> Any:
            return a.inner if isinstance(a, CallsTwice) else a

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))  # the handler's own
        return tree_map(lambda a: CallsTwice(a) if isinstance(a, torch.Tensor) else a, out)


def test_handler_calling_the_op_again_counts_its_first_call_only() -> None:
    w = CallsTwice(torch.arange(4.0))
    t, out = run_traced(w.clone)
    ev = only_event(t)
    # the first call is the op itself; the second, made after it ran, is the handler's own
    # work, which copytrace's dispatch mode (below the subclass) does not see either
    assert ev.op == "clone" and ev.aten == ("aten::clone",)
    assert ev.bytes_allocated == 16  # the inner 4 float32
    assert isinstance(out, CallsTwice) and torch.equal(out.inner, torch.arange(4.0))


# --------------------------------------------------------------------------------------------
# autograd's own detaches are bookkeeping, not user events
# --------------------------------------------------------------------------------------------


def test_output_saved_for_backward_is_counted_not_recorded() -> None:
    leaf = torch.randn(5, requires_grad=True)
    t, out = run_traced(leaf.exp)  # exp saves its output: one internal detach
    assert t.events == []
    assert t.stats["internal_detaches"] == (0 if NATIVE else 1)
    assert torch.equal(out, leaf.detach().exp())


def test_backward_detaches_are_counted_not_recorded() -> None:
    def first_backward() -> torch.Tensor:
        torch.manual_seed(0)
        leaf = torch.randn(5, requires_grad=True)
        out = leaf.exp()
        out.sum().backward()
        return leaf.grad

    untraced = first_backward()
    t, traced = run_traced(first_backward)
    assert t.events == []
    # forward: 1 (saved output); backward: unpacking it + AccumulateGrad storing .grad
    assert NATIVE or t.stats["internal_detaches"] >= 2
    assert torch.equal(traced, untraced)


def test_grad_accumulation_in_later_backward_records_nothing() -> None:
    leaf = torch.randn(5, requires_grad=True)
    leaf.exp().sum().backward()
    before = leaf.grad.clone()
    t, _ = run_traced(lambda: leaf.sin().sum().backward())  # grad accumulates with add_
    assert t.events == []
    assert torch.allclose(leaf.grad, before + leaf.detach().cos())


def test_user_detach_next_to_autograd_detach_is_recorded_once() -> None:
    leaf = torch.randn(5, requires_grad=True)

    def both() -> torch.Tensor:
        out = leaf.exp()  # internal detach
        return out.detach()  # user detach

    t, _ = run_traced(both)
    assert [e.op for e in t.events] == ["detach"]
    assert t.stats["internal_detaches"] == (0 if NATIVE else 1)


def test_copy_made_by_autograd_in_backward_is_implicit_backward_event() -> None:
    leaf = torch.randn(4, requires_grad=True)
    total = leaf.double().sum()  # forward conversion happens outside the trace
    t, _ = run_traced(total.backward)
    ev = only_event(t)
    # ToCopyBackward0 converts the float64 grad back to float32: 4 float32 = 16 B
    assert ev.op == "implicit" and ev.aten == ("aten::_to_copy",)
    assert ev.phase == "backward"
    assert (ev.src_dtype, ev.dtype) == ("float64", "float32")
    assert ev.bytes_allocated == 16


# --------------------------------------------------------------------------------------------
# deepcopy of a module and of its state_dict
# --------------------------------------------------------------------------------------------


def test_deepcopy_of_batchnorm_copies_two_parameters_and_three_buffers() -> None:
    bn = nn.BatchNorm1d(4)
    t, dup = run_traced(lambda: copy.deepcopy(bn))

    (group,) = groups(t)
    children = copies(t)
    # weight, bias, running_mean, running_var: 4 float32 = 16 B each;
    # num_batches_tracked: one int64 = 8 B -> 72 B
    assert [c.bytes_allocated for c in children] == [16, 16, 16, 16, 8]
    assert group.bytes_allocated == 72 and group.tensors == 5
    assert group.object_type == "torch.nn.modules.batchnorm.BatchNorm1d"
    assert all(c.op == "deepcopy" and c.parent == group.seq for c in children)
    assert all(c.dst_device == "cpu" and c.is_leaf and not c.alias for c in children)
    # parameters go through Parameter.__deepcopy__ (.data + clone), buffers through
    # Tensor.__deepcopy__ (storage copy)
    assert [c.aten for c in children[:2]] == [PARAM_DEEPCOPY_ATEN] * 2
    assert [c.aten for c in children[2:]] == [("aten::copy_",)] * 3
    assert [c.requires_grad for c in children] == [True, True, False, False, False]
    assert children[-1].dtype == "int64"
    assert t.stats["internal_detaches"] == 0
    assert not any(
        a.data_ptr() == b.data_ptr()
        for a, b in zip(bn.state_dict().values(), dup.state_dict().values(), strict=True)
    )


def test_deepcopy_of_state_dict_is_five_aliases_then_five_copies() -> None:
    bn = nn.BatchNorm1d(4)

    def snapshot() -> dict[str, torch.Tensor]:
        return copy.deepcopy(bn.state_dict())

    t, snap = run_traced(snapshot)
    aliases = [e for e in t.events if e.op == "detach"]
    (group,) = groups(t)
    assert len(aliases) == 5  # state_dict() detaches each entry
    assert all(a.alias and a.bytes_allocated == 0 and a.seq < group.seq for a in aliases)
    assert [a.bytes_logical for a in aliases] == [16, 16, 16, 16, 8]
    assert group.bytes_allocated == 72 and group.tensors == 5  # as for the module
    assert group.object_type == "collections.OrderedDict"
    assert allocated(t) == 72
    # the call site skips torch's frames and lands on the user's function
    assert all(same_file(e.file, __file__) and e.function == "snapshot" for e in t.events)
    assert list(snap) == list(bn.state_dict())


# --------------------------------------------------------------------------------------------
# torch.tensor(t) vs clone().detach() vs detach().clone()
# --------------------------------------------------------------------------------------------


def _source() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(1000, requires_grad=True)


@pytest.mark.parametrize(
    "op, build",
    [
        ("tensor_ctor", lambda src: torch.tensor(src)),
        ("new_tensor", lambda src: src.new_tensor(src)),
    ],
)
def test_copy_construct_from_tensor_is_one_detached_copy_with_warning(
    op: str, build: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    src = _source()
    with warnings.catch_warnings(record=True) as plain:
        warnings.simplefilter("always")
        expected = build(src)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t, built = run_traced(lambda: build(src))

    ev = only_event(t)
    assert ev.op == op
    assert ev.bytes_allocated == 4000  # 1000 float32 = 4000 B
    assert ev.aten == ("aten::detach", "aten::_to_copy")
    assert ev.alias is False
    assert ev.is_leaf is True and ev.requires_grad is False and ev.grad_fn is None
    assert ev.graph == "detached"
    assert t.stats["internal_detaches"] == 0
    assert torch.equal(built, expected) and built.data_ptr() != src.data_ptr()
    # the "use sourceTensor.detach().clone()" warning still reaches the user, unchanged
    assert len(seen) == len(plain) == 1
    assert seen[0].category is plain[0].category is UserWarning
    assert str(seen[0].message) == str(plain[0].message)
    assert "detach().clone()" in str(seen[0].message)


# u.new_tensor(data) copies data and takes only u's dtype and device: what was copied, and
# whether the copy cut a graph, are data's facts, whatever u is.
@pytest.mark.parametrize(
    "owner_grad, data_grad, build",
    [
        (False, True, lambda u, d: u.new_tensor(d)),  # a graph tensor copied out of its graph
        (True, False, lambda u, d: u.new_tensor(d)),  # the near miss: nothing cut
        (False, True, lambda u, d: u.new_tensor([d[0], d[1], d[2]])),  # its 0-d elements
    ],
)
def test_new_tensor_records_its_data_not_its_owner(
    owner_grad: bool, data_grad: bool, build: Callable[..., torch.Tensor]
) -> None:
    owner = torch.zeros(5, dtype=torch.float64, requires_grad=owner_grad)
    data = torch.ones(3, requires_grad=True) * 2 if data_grad else torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = build(owner, data)
        t, built = run_traced(lambda: build(owner, data))
    assert torch.equal(built, expected) and built.dtype == torch.float64  # the owner's dtype
    ev = only_event(t)
    assert ev.op == "new_tensor" and ev.shape == (3,)
    assert ev.bytes_allocated == 24  # 3 float64
    assert ev.src_dtype == "float32" and ev.dtype == "float64"  # data's dtype, then owner's
    assert ev.src_requires_grad is data_grad
    assert ev.graph == ("detached" if data_grad else "none")
    (finding,) = hazards(t, "tensor-ctor-copy")
    assert ("cuts it from the autograd graph" in finding.message) is data_grad


def _construct(src: torch.Tensor) -> torch.Tensor:
    return torch.tensor(src)  # the warning belongs to this line


def _softmax_without_dim(x: torch.Tensor) -> torch.Tensor:
    return F.softmax(x)  # the implicit-dim deprecation warning belongs to this line


# Both paths name the user's line: a C++ warning (the tensor-from-tensor one) on the Python
# fallback too, whose mode calls torch from a frame placed at the program's line
# (tracer/_warnplace.py); a Python-level torch function's warning (softmax's implicit dim)
# through the fallback's warnings shim, which counts its stacklevel past the mode.


@pytest.mark.parametrize(
    "call",
    [
        _construct,
        _softmax_without_dim,
    ],
)
def test_warnings_from_traced_calls_point_at_user_line(
    call: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    src = _source()
    with warnings.catch_warnings(record=True) as plain:
        warnings.simplefilter("always")
        call(src)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_traced(lambda: call(src))
    assert len(seen) == len(plain) == 1
    assert same_file(plain[0].filename, __file__)
    assert (seen[0].filename, seen[0].lineno) == (plain[0].filename, plain[0].lineno)


def test_clone_then_detach_attaches_then_cuts_graph() -> None:
    src = _source()
    t, out = run_traced(lambda: src.clone().detach())

    clone, detach = t.events
    assert clone.op == "clone" and clone.aten == ("aten::clone",)
    assert clone.bytes_allocated == 4000  # 1000 float32
    assert clone.graph == "attached" and clone.grad_fn == "CloneBackward0"
    assert clone.requires_grad is True and clone.is_leaf is False
    assert detach.op == "detach" and detach.alias and detach.bytes_allocated == 0
    assert detach.graph == "detached"
    assert allocated(t) == 4000
    assert out.is_leaf and not out.requires_grad and torch.equal(out, src.detach())


def test_detach_then_clone_never_attaches() -> None:
    src = _source()
    t, out = run_traced(lambda: src.detach().clone())

    detach, clone = t.events
    assert detach.op == "detach" and detach.alias and detach.bytes_allocated == 0
    assert detach.graph == "detached"
    assert clone.op == "clone" and clone.bytes_allocated == 4000  # 1000 float32
    assert clone.graph == "none" and clone.grad_fn is None and clone.requires_grad is False
    assert allocated(t) == 4000
    assert out.is_leaf and not out.requires_grad and torch.equal(out, src.detach())


# --------------------------------------------------------------------------------------------
# no-op conversions return self
# --------------------------------------------------------------------------------------------

NOOP_CONVERSIONS = {
    "to": lambda x: x.to("cpu"),
    "cpu": lambda x: x.cpu(),
    "float": lambda x: x.float(),
    "contiguous": lambda x: x.contiguous(),
    "to(dtype)": lambda x: x.to(torch.float32),
}


@pytest.mark.parametrize("name", list(NOOP_CONVERSIONS))
def test_noop_conversion_returns_input_as_zero_byte_identity_alias(name: str) -> None:
    x = torch.zeros(4, 4)
    t, out = run_traced(lambda: NOOP_CONVERSIONS[name](x))

    ev = only_event(t)
    assert ev.op == name.split("(")[0]
    assert ev.noop is True and ev.alias is True
    assert ev.aten == ()  # nothing reached the dispatch mode
    assert ev.bytes_allocated == 0 and ev.bytes_logical == 64  # 16 float32 = 64 B
    assert ev.transfer == "none" and ev.src_device == ev.dst_device == "cpu"
    assert out is x  # as untraced


def test_write_through_noop_to_changes_the_original_when_traced() -> None:
    def stage_and_bump() -> torch.Tensor:
        x = torch.zeros(4, 4)
        staging = x.to("cpu")  # looks like a private copy
        staging += 1.0
        return x

    untraced = stage_and_bump()
    t, traced = run_traced(stage_and_bump)
    assert torch.equal(traced, untraced) and bool(traced[0, 0] == 1.0)
    assert [(e.op, e.noop) for e in t.events] == [("to", True)]


@pytest.mark.parametrize(
    "op, convert, nbytes, aten, dtype",
    [
        # 16 float32 = 64 B
        ("to", lambda x: x.to("cpu", copy=True), 64, "aten::_to_copy", "float32"),
        # 16 float64 = 128 B
        ("double", lambda x: x.double(), 128, "aten::_to_copy", "float64"),
        # transposed 4x4 float32 made contiguous = 64 B
        ("contiguous", lambda x: x.t().contiguous(), 64, "aten::clone", "float32"),
    ],
)
def test_forced_or_real_conversion_is_a_copy(
    op: str, convert: Callable[[torch.Tensor], torch.Tensor], nbytes: int, aten: str, dtype: str
) -> None:
    x = torch.arange(16.0).reshape(4, 4)
    t, out = run_traced(lambda: convert(x))
    ev = only_event(t)
    assert ev.op == op and ev.aten == (aten,)
    assert ev.noop is False and ev.alias is False
    assert ev.bytes_allocated == nbytes and ev.dtype == dtype
    assert out is not x and out.data_ptr() != x.data_ptr()
    assert torch.equal(out, convert(x))


# --------------------------------------------------------------------------------------------
# keeping loss / loss.clone() across iterations keeps every iteration's graph alive
# --------------------------------------------------------------------------------------------


def _eval_loop(keep: Callable[[torch.Tensor], Any], iters: int = 3) -> tuple[list[Any], int]:
    """Evaluation loop that never calls backward; returns the history and how many of the
    iterations' ReLU activations (saved for backward) are still alive afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    batch = torch.randn(4, 16)
    history: list[Any] = []
    probes = []
    for _ in range(iters):
        act = model[1](model[0](batch))
        probes.append(weakref.ref(act))
        loss = model[2](act).pow(2).mean()
        del act
        history.append(keep(loss))
        del loss
    gc.collect()
    return history, sum(p() is not None for p in probes)


def test_loss_clone_each_iteration_is_a_graph_attached_4_byte_copy() -> None:
    t, (history, _) = run_traced(lambda: _eval_loop(lambda loss: loss.clone()))
    evs = t.events
    assert len(evs) == 3  # one per iteration
    for ev in evs:
        assert ev.op == "clone" and ev.shape == ()
        assert ev.bytes_allocated == 4  # one float32 scalar
        assert ev.grad_fn == "CloneBackward0"
        assert ev.requires_grad is True and ev.is_leaf is False and ev.graph == "attached"
        assert ev.phase == "other" and ev.module is None  # outside any module's forward
    assert all(type(h.grad_fn).__name__ == "CloneBackward0" for h in history)


def test_loss_detach_is_zero_byte_alias_and_item_records_nothing() -> None:
    t_detach, _ = run_traced(lambda: _eval_loop(lambda loss: loss.detach()))
    assert [e.op for e in t_detach.events] == ["detach"] * 3
    for ev in t_detach.events:
        assert ev.alias is True and ev.bytes_allocated == 0
        assert ev.graph == "detached" and ev.grad_fn is None

    t_item, (history, _) = run_traced(lambda: _eval_loop(lambda loss: loss.item()))
    assert t_item.events == []
    assert all(isinstance(h, float) for h in history)


@pytest.mark.parametrize(
    "strategy, keep",
    [
        ("clone", lambda loss: loss.clone()),
        ("raw", lambda loss: loss),
        ("detach", lambda loss: loss.detach()),
        ("item", lambda loss: loss.item()),
    ],
)
def test_tracing_does_not_change_how_long_activations_live(
    strategy: str, keep: Callable[[torch.Tensor], Any]
) -> None:
    _, alive_untraced = _eval_loop(keep)
    _, (_, alive_traced) = run_traced(lambda: _eval_loop(keep))
    assert alive_traced == alive_untraced
    # graph-retaining strategies keep all 3 activations; detach/item keep none
    assert alive_traced == (3 if strategy in ("clone", "raw") else 0)


# --------------------------------------------------------------------------------------------
# reshape: a view on contiguous input, a hidden copy after .t()
# --------------------------------------------------------------------------------------------


def _reshape(transpose_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(6.0).reshape(2, 3)  # 2x3 float32 = 24 B, contiguous
    return x, (x.t().reshape(6) if transpose_first else x.reshape(3, 2))


def _poke(x: torch.Tensor, r: torch.Tensor) -> bool:
    """Write into the reshape result; return whether the write reached the source."""
    r.view(-1)[0] = 100.0
    return x.flatten()[0].item() == 100.0


def test_reshape_of_contiguous_input_allocates_nothing_and_shares_writes() -> None:
    t, (x, r) = run_traced(lambda: _reshape(False))
    assert allocated(t) == 0
    assert all(e.bytes_allocated == 0 and e.op != "implicit" for e in t.events)
    assert r.data_ptr() == x.data_ptr()
    assert torch.equal(r, _reshape(False)[1])  # same values as untraced
    assert _poke(x, r)  # a write into the "reshaped" tensor changes the source, as untraced
    assert _poke(*_reshape(False))


def test_reshape_of_transposed_input_is_a_hidden_24_byte_copy() -> None:
    t, (x, r) = run_traced(lambda: _reshape(True))
    assert allocated(t) == 24  # hidden copy: 6 float32 = 24 B
    (ev,) = [e for e in t.events if not e.alias]  # the reshape(2, 3) building x is a view
    assert ev.aten == ("aten::clone",)
    assert ev.alias is False
    assert r.data_ptr() != x.data_ptr()
    assert torch.equal(r, _reshape(True)[1])  # same values as untraced
    assert not _poke(x, r)  # the write stays in the copy, as untraced
    assert not _poke(*_reshape(True))


def test_reshape_of_contiguous_input_is_recorded_as_alias() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    t, _ = run_traced(lambda: x.reshape(3, 2))
    ev = only_event(t)
    assert ev.op == "reshape"
    assert ev.alias is True and ev.noop is False
    assert ev.bytes_allocated == 0 and ev.bytes_logical == 24 and ev.shape == (3, 2)


def test_reshape_of_transposed_input_is_recorded_as_reshape_copy() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    t, _ = run_traced(lambda: x.t().reshape(6))
    ev = only_event(t)
    assert ev.op == "reshape"
    assert "aten::clone" in ev.aten
    assert ev.alias is False and ev.bytes_allocated == 24  # 6 float32
    assert ev.shape == (6,)


def test_reshape_hidden_copy_reports_graph_attachment() -> None:
    xg = torch.arange(6.0, requires_grad=True).reshape(2, 3)
    t, out = run_traced(lambda: xg.t().reshape(6))
    assert type(out.grad_fn).__name__ == "UnsafeViewBackward0"
    ev = only_event(t)
    assert ev.grad_fn == "UnsafeViewBackward0"
    assert ev.graph == "attached" and ev.requires_grad is True
    assert ev.bytes_allocated == 24


# --------------------------------------------------------------------------------------------
# in-place edit of a Parameter slice: grad mode, no_grad, and through .data
# --------------------------------------------------------------------------------------------

DELTA = 0.25


def _edit_weight_slice(how: str) -> dict[str, Any]:
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    inp = torch.randn(3, 6, requires_grad=True)
    pending = layer(inp).sum()  # AddmmBackward0 saved the weight to compute d(inp)
    delta = torch.full((4,), DELTA)
    facts: dict[str, Any] = {"version_before": layer.weight._version}
    if how == "grad":
        layer.weight[:, 2] -= delta
    elif how == "no_grad":
        with torch.no_grad():
            layer.weight[:, 2] -= delta
    else:
        layer.weight.data[:, 2] -= delta
    facts["version_after"] = layer.weight._version
    facts["weight"] = layer.weight.tolist()  # tolist: no copy event of its own
    try:
        pending.backward()
        facts["backward"] = inp.grad.tolist()
    except RuntimeError as err:
        facts["backward"] = (type(err), str(err))
    return facts


def test_inplace_edit_of_parameter_slice_in_grad_mode_raises_unchanged() -> None:
    untraced = raise_untraced(lambda: _edit_weight_slice("grad"))
    t, traced = raise_traced(lambda: _edit_weight_slice("grad"))
    assert isinstance(traced, RuntimeError)
    assert "leaf Variable that requires grad" in str(traced)
    assert_same_exception(untraced, traced)
    assert allocated(t) == 0


def test_no_grad_slice_edit_bumps_version_and_allocates_nothing() -> None:
    untraced = _edit_weight_slice("no_grad")
    t, traced = run_traced(lambda: _edit_weight_slice("no_grad"))

    # getitem -> sub_ -> setitem: setitem copies the slice onto itself (copy_ into existing)
    ev = only_event(t)
    assert ev.op == "implicit" and ev.aten == ("aten::copy_",)
    assert ev.bytes_allocated == 0 and ev.bytes_logical == 16  # 4 float32 written in place
    # version counter facts: two in-place writes (sub_ and copy_), same as untraced
    assert traced["version_after"] - traced["version_before"] == 2
    assert untraced["version_after"] - untraced["version_before"] == 2
    assert traced["weight"] == untraced["weight"]
    # the graph that saved the weight refuses to backward, as untraced
    assert traced["backward"] == untraced["backward"]
    assert "modified by an inplace operation" in traced["backward"][1]


def test_data_slice_edit_is_alias_plus_write_invisible_to_version_counter() -> None:
    untraced = _edit_weight_slice("data")
    t, traced = run_traced(lambda: _edit_weight_slice("data"))

    data, write = t.events
    assert data.op == "data_get" and data.aten == DATA_ATEN
    assert data.alias is True and data.bytes_allocated == 0
    assert data.bytes_logical == 96  # 4x6 float32 weight
    assert data.graph == "detached"
    assert write.op == "implicit" and write.aten == ("aten::copy_",)
    assert write.bytes_allocated == 0
    assert allocated(t) == 0
    # version counter facts: unchanged, so the pending backward silently uses the new weight
    assert traced["version_after"] == traced["version_before"]
    assert untraced["version_after"] == untraced["version_before"]
    assert traced["weight"] == untraced["weight"]
    assert isinstance(traced["backward"], list)  # backward ran, with the edited weight
    assert traced["backward"] == untraced["backward"]


# --------------------------------------------------------------------------------------------
# module.double(): conversion copies plus `.data` set, or swap_tensors
# --------------------------------------------------------------------------------------------


def _convert_layer() -> dict[str, Any]:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    weight = layer.weight
    old_ptr = weight.data_ptr()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    version_before = weight._version
    layer.double()
    return {
        "same_parameter": weight is layer.weight,
        "optimizer_ref_ok": opt.param_groups[0]["params"][0] is layer.weight,
        "dtype": weight.dtype,
        "storage_changed": weight.data_ptr() != old_ptr,
        "versions": (version_before, weight._version),
        "weight": weight.tolist(),  # tolist: no copy event of its own
    }


def test_module_double_records_two_conversions_and_two_data_sets() -> None:
    with swap_on_conversion(False):
        untraced = _convert_layer()
        t, traced = run_traced(_convert_layer)

    assert traced == untraced
    assert traced["same_parameter"] and traced["optimizer_ref_ok"]
    assert traced["dtype"] == torch.float64 and traced["storage_changed"]
    assert traced["versions"] == (1, 1)  # the .data setter keeps the counter

    assert [e.op for e in t.events] == ["double", "data_set", "double", "data_set"]
    w_conv, w_set, b_conv, b_set = t.events
    # weight 3x4: 48 B float32 -> 96 B float64; bias 3: 12 B -> 24 B; 120 B new in all
    assert (w_conv.bytes_allocated, b_conv.bytes_allocated) == (96, 24)
    assert w_conv.aten == b_conv.aten == ("aten::_to_copy",)
    assert (w_conv.src_dtype, w_conv.dtype) == ("float32", "float64")
    assert w_set.bytes_allocated == b_set.bytes_allocated == 0
    assert w_set.alias and b_set.alias
    assert (w_set.shape, b_set.shape) == ((3, 4), (3,))
    assert w_set.dtype == b_set.dtype == "float64"
    assert allocated(t) == 120


def test_module_double_swap_path_records_the_two_conversions() -> None:
    with swap_on_conversion(True):
        untraced = _convert_layer()
        t, traced = run_traced(_convert_layer)

    assert traced == untraced
    assert traced["same_parameter"] and traced["optimizer_ref_ok"]
    assert traced["dtype"] == torch.float64 and traced["storage_changed"]
    assert traced["versions"] == (1, 0)  # swap_tensors brings in the new tensor's counter

    conversions = [e for e in t.events if e.op == "double"]
    assert [e.bytes_allocated for e in conversions] == [96, 24]  # 120 B as on the .data path
    assert all(e.aten == ("aten::_to_copy",) for e in conversions)
    assert not any(e.op == "data_set" for e in t.events)
    assert allocated(t) == 120


def test_module_double_swap_path_records_parameter_rebinding() -> None:
    with swap_on_conversion(True):
        t, _ = run_traced(_convert_layer)
    rebinds = [e for e in t.events if e.op != "double"]
    assert len(rebinds) == 2  # one per parameter, as data_set on the other path
    assert [e.shape for e in rebinds] == [(3, 4), (3,)]
    assert all(e.bytes_allocated == 0 and e.dtype == "float64" for e in rebinds)
    assert [e.op for e in rebinds] == ["swap_tensors", "swap_tensors"] and all(
        e.alias for e in rebinds
    )


# --------------------------------------------------------------------------------------------
# copy.copy(t) is a new tensor on the same storage
# --------------------------------------------------------------------------------------------


def test_shallow_copy_of_tensor_allocates_nothing_and_shares_writes() -> None:
    def shallow_then_write() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.arange(4.0)
        shallow = copy.copy(x)
        shallow[0] = -1.0
        return x, shallow

    ux, us = shallow_then_write()
    t, (tx, ts) = run_traced(shallow_then_write)
    assert allocated(t) == 0
    assert ts is not tx and ts.data_ptr() == tx.data_ptr()
    assert tx.tolist() == ux.tolist() == [-1.0, 1.0, 2.0, 3.0]
    assert torch.equal(ts, us)


def test_shallow_copy_of_tensor_is_recorded_as_alias() -> None:
    x = torch.arange(4.0)
    t, _ = run_traced(lambda: copy.copy(x))
    ev = only_event(t)
    assert ev.op == "copy"  # docs/trace-format.md: `copy` (`copy.copy`)
    assert ev.alias is True and ev.noop is False
    assert ev.bytes_allocated == 0 and ev.bytes_logical == 16  # 4 float32
    assert ev.shape == (4,)


def test_deep_copy_of_tensor_is_a_16_byte_copy() -> None:
    x = torch.arange(4.0)
    t, dup = run_traced(lambda: copy.deepcopy(x))
    ev = only_event(t)
    assert ev.op == "deepcopy" and not ev.alias
    assert ev.bytes_allocated == 16  # 4 float32
    assert dup.data_ptr() != x.data_ptr() and torch.equal(dup, x)


def test_parameter_dict_copy_is_shallow_and_allocates_nothing() -> None:
    pd = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
    t, pd_copy = run_traced(pd.copy)
    assert t.events == []
    assert pd_copy["w"] is pd["w"]


# --------------------------------------------------------------------------------------------
# hazards the situations above and below are built on: helpers
# --------------------------------------------------------------------------------------------


def hazards(t: Trace, code: str) -> list[copytrace.Finding]:
    return [f for f in copytrace.analyze(t.events) if f.code == code]


def site_lines(finding: copytrace.Finding) -> set[int]:
    """The line numbers of a finding's call sites (``file:line function``)."""
    return {int(site.split(" ")[0].rsplit(":", 1)[1]) for site in finding.call_sites}


def lines_of(t: Trace, op: str) -> set[int]:
    return {e.line for e in t.events if e.op == op and not e.group}


# --------------------------------------------------------------------------------------------
# an optimizer "copied" through load_state_dict(other.state_dict()) shares its state tensors
# --------------------------------------------------------------------------------------------


def _hand_over_optimizer_state(deep: bool) -> bool:
    """Train a parent, start a child optimizer from the parent's state, train the parent on;
    return whether the child's momentum changed with it."""
    torch.manual_seed(0)
    parent = nn.Linear(8, 8)
    opt_parent = torch.optim.SGD(parent.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 8)

    def train_parent() -> None:
        opt_parent.zero_grad()
        parent(x).square().mean().backward()
        opt_parent.step()

    train_parent()
    child = nn.Linear(8, 8)
    opt_child = torch.optim.SGD(child.parameters(), lr=0.1, momentum=0.9)
    state = opt_parent.state_dict()
    opt_child.load_state_dict(copy.deepcopy(state) if deep else state)
    before = opt_child.state[child.weight]["momentum_buffer"].tolist()
    train_parent()
    return opt_child.state[child.weight]["momentum_buffer"].tolist() != before


def test_optimizer_state_handover_aliases_the_live_state_and_is_flagged() -> None:
    assert _hand_over_optimizer_state(deep=False) is True  # untraced: the child follows
    t, changed = run_traced(lambda: _hand_over_optimizer_state(deep=False))
    assert changed is True

    # load_state_dict keeps each state tensor through a no-op .to(): weight 8x8 and bias 8
    # momentum buffers, float32: 256 + 32 B, none allocated
    handover = [e for e in t.events if e.op == "to"]
    assert [(e.noop, e.alias, e.bytes_allocated, e.bytes_logical) for e in handover] == [
        (True, True, 0, 256), (True, True, 0, 32),
    ]  # fmt: skip
    (finding,) = hazards(t, "aliasing-snapshot")
    assert site_lines(finding) & {e.line for e in handover}
    assert finding.bytes == 288


def test_deep_copied_optimizer_state_is_not_flagged() -> None:
    assert _hand_over_optimizer_state(deep=True) is False
    t, changed = run_traced(lambda: _hand_over_optimizer_state(deep=True))
    assert changed is False
    assert hazards(t, "aliasing-snapshot") == []
    (group,) = groups(t)
    assert group.bytes_allocated == 288  # the two momentum buffers, copied


def test_module_state_dict_kept_while_training_is_flagged_and_its_deepcopy_is_not() -> None:
    def keep_best(deep: bool) -> bool:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        best = model.state_dict()
        if deep:
            best = copy.deepcopy(best)
        kept = best["weight"].tolist()
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
        return best["weight"].tolist() != kept

    t, changed = run_traced(lambda: keep_best(deep=False))
    assert changed is True  # the "best" weights moved with the model
    assert len(hazards(t, "aliasing-snapshot")) == 1
    t, changed = run_traced(lambda: keep_best(deep=True))
    assert changed is False
    assert hazards(t, "aliasing-snapshot") == []


# --------------------------------------------------------------------------------------------
# an in-place op on an advanced-indexing result writes into a temporary copy
# --------------------------------------------------------------------------------------------


def _reinit_rows(how: str) -> bool:
    """Zero three rows of an embedding; return whether the embedding changed."""
    torch.manual_seed(0)
    emb = nn.Embedding(50, 8)
    rows = torch.tensor([3, 17, 42])
    before = emb.weight.tolist()
    with torch.no_grad():
        if how == "fill_":
            emb.weight[rows].fill_(0.0)
        elif how == "init":
            nn.init.zeros_(emb.weight[rows])
        elif how == "copy_ range":
            emb.weight[range(0, 2), :].copy_(torch.ones(2, 8))
        else:
            emb.weight[rows] = 0.0  # index_put_: writes back
    return emb.weight.tolist() != before


@pytest.mark.parametrize(
    "how, gathered",
    [("fill_", 96), ("init", 96), ("copy_ range", 64)],  # 3 or 2 rows x 8 float32
)
def test_inplace_write_into_advanced_index_copy_is_a_lost_write(how: str, gathered: int) -> None:
    assert _reinit_rows(how) is False  # untraced: the write never reaches the embedding
    t, changed = run_traced(lambda: _reinit_rows(how))
    assert changed is False
    (index,) = [e for e in t.events if e.op == "index"]
    assert index.bytes_allocated == gathered and index.alias is False
    (finding,) = hazards(t, "lost-inplace-write")
    assert finding.severity == "error"
    assert site_lines(finding) == {index.line}


def test_index_assignment_writes_back_and_is_not_flagged() -> None:
    assert _reinit_rows("index_put_") is True
    t, changed = run_traced(lambda: _reinit_rows("index_put_"))
    assert changed is True
    assert [e for e in t.events if e.op == "index"] == []  # no gathered copy
    assert hazards(t, "lost-inplace-write") == []


# --------------------------------------------------------------------------------------------
# one clone per consumer that writes in place is needed; two clones nobody writes are not
# --------------------------------------------------------------------------------------------


def _scale_(t: torch.Tensor) -> torch.Tensor:
    t.mul_(2.0)  # writes into its argument: each caller hands in its own copy
    return t.sum()


def test_clone_per_inplace_consumer_is_not_a_redundant_copy() -> None:
    torch.manual_seed(0)
    x = torch.randn(1000)
    t, (a, b) = run_traced(lambda: (_scale_(x.clone()), _scale_(x.clone())))
    clones = [e for e in t.events if e.op == "clone"]
    assert [e.bytes_allocated for e in clones] == [4000, 4000]  # 1000 float32 each
    # the first copy was written (its version counter moved) before the second was made
    assert hazards(t, "redundant-copy") == []
    assert torch.equal(a, b) and torch.equal(a, _scale_(x.clone()))


def test_two_clones_nobody_writes_are_one_redundant_copy() -> None:
    torch.manual_seed(0)
    x = torch.randn(1000)
    t, (c, d) = run_traced(lambda: (x.clone(), x.clone()))
    (finding,) = hazards(t, "redundant-copy")
    assert finding.bytes == 4000  # the second clone: data already copied
    assert site_lines(finding) == lines_of(t, "clone")
    assert torch.equal(c, d)


# --------------------------------------------------------------------------------------------
# torch.tensor([...]) of 0-d tensors that require grad: a copy that cuts the graph
# --------------------------------------------------------------------------------------------


def _combine_losses(how: str) -> tuple[float, list[float]]:
    """Three per-layer 0-d losses combined into one auxiliary loss; return the loss and the
    gradient it gives the layers' weights."""
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(4, 3) for _ in range(3)])
    x = torch.randn(5, 4)
    parts = [layer(x).softmax(-1).mean(0).var() for layer in layers]  # each 0-d, needs grad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's scalar-conversion warning for the list form
        build = {"tensor": torch.tensor, "as_tensor": torch.as_tensor, "stack": torch.stack,
                 "Tensor": torch.Tensor, "FloatTensor": torch.FloatTensor}[how]  # fmt: skip
        aux = build(parts).sum()
    if aux.requires_grad:
        aux.backward()
    grads = [float(layer.weight.grad.abs().sum()) if layer.weight.grad is not None else 0.0
             for layer in layers]  # fmt: skip
    return aux.item(), grads


@pytest.mark.parametrize(
    ("how", "op", "call"),
    [
        ("tensor", "tensor_ctor", "torch.tensor(t)"), ("as_tensor", "as_tensor", "torch.as_tensor(["),
        ("Tensor", "legacy_ctor", "torch.Tensor(["), ("FloatTensor", "legacy_ctor", "torch.Tensor(["),
    ],
)  # fmt: skip
def test_tensor_of_a_list_of_graph_tensors_is_a_detached_copy_and_flagged(
    how: str, op: str, call: str
) -> None:
    untraced = _combine_losses(how)
    t, traced = run_traced(lambda: _combine_losses(how))
    assert traced == untraced and traced[1] == [0.0, 0.0, 0.0]  # no gradient reaches them
    (ev,) = [e for e in t.events if e.op == op]
    assert ev.bytes_allocated == 12  # 3 float32
    assert ev.graph == "detached" and ev.src_requires_grad is True and ev.grad_fn is None
    (finding,) = hazards(t, "tensor-ctor-copy")
    assert site_lines(finding) == {ev.line}
    assert f"`{call}" in finding.message and "cuts it from the autograd graph" in finding.message
    assert "torch.stack(ts)" in finding.fix  # keeps the graph: as_tensor would not


def test_stack_of_graph_tensors_and_tensor_of_floats_are_not_flagged() -> None:
    untraced = _combine_losses("stack")
    t, traced = run_traced(lambda: _combine_losses("stack"))
    assert traced == untraced and all(g > 0.0 for g in traced[1])
    assert [e for e in t.events if e.op == "tensor_ctor"] == []
    t, _ = run_traced(lambda: torch.tensor([0.5, 2.0]))  # from Python floats
    assert hazards(t, "tensor-ctor-copy") == []


def test_as_tensor_of_a_list_of_graph_tensors_runs_as_untraced() -> None:
    untraced = _combine_losses("as_tensor")
    _, traced = run_traced(lambda: _combine_losses("as_tensor"))
    assert traced == untraced and traced[1] == [0.0, 0.0, 0.0]  # cut like torch.tensor's


# the legacy constructors reach no function mode: copytrace swaps their tp_new (_legacy.py)
OBSERVERS = ("auto", "python")  # the C++ observer where it can be built, and the fallback


@pytest.mark.parametrize("observer", OBSERVERS)
@pytest.mark.parametrize("ctor", [torch.Tensor, torch.FloatTensor, torch.DoubleTensor])
def test_legacy_constructor_of_a_list_of_graph_tensors_is_a_detached_copy(
    ctor: Any, observer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    w = torch.ones(2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's scalar-conversion warning
        t, out = run_traced(lambda: ctor([w[0] * 2, w[1] * 3]))
    assert out.tolist() == [2.0, 3.0] and out.grad_fn is None and type(out) is torch.Tensor
    (ev,) = t.events
    assert ev.op == "legacy_ctor" and ev.alias is False and ev.error is None
    assert ev.bytes_allocated == 2 * out.element_size()  # float32: 8 B, float64: 16 B
    assert ev.graph == "detached" and ev.src_requires_grad is True
    (finding,) = hazards(t, "tensor-ctor-copy")
    assert site_lines(finding) == {ev.line}
    assert "`torch.Tensor([t, ...])` of an existing tensor copies it and cuts it" in finding.message
    assert "torch.stack(ts)" in finding.fix and ".to(dtype)" in finding.fix


@pytest.mark.parametrize("observer", OBSERVERS)
def test_legacy_constructor_of_plain_tensors_is_a_copy_and_its_error_is_the_programs(
    observer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    a, b = torch.tensor(1.5), torch.tensor(2.5)
    t, out = run_traced(lambda: torch.Tensor([[a, b], [b, a]]))
    assert out.tolist() == [[1.5, 2.5], [2.5, 1.5]]
    (ev,) = t.events  # as torch.tensor([[a, b], [b, a]]): a copy of existing tensors
    assert (ev.op, ev.bytes_allocated, ev.graph) == ("legacy_ctor", 16, "none")  # 4 float32
    # torch.LongTensor refuses float tensors: the program gets torch's error, as untraced
    with pytest.raises(TypeError) as untraced:
        torch.LongTensor([a, b])
    t, err = raise_traced(lambda: torch.LongTensor([a, b]))
    assert type(err) is TypeError and str(err) == str(untraced.value)
    assert [(e.op, e.error) for e in t.events] == [("legacy_ctor", "TypeError")]


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("observer", OBSERVERS)
def test_legacy_constructor_near_misses_are_not_recorded(
    observer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    src = torch.arange(3.0, requires_grad=True)

    def near_misses() -> list[torch.Tensor]:
        return [
            torch.Tensor(3), torch.Tensor(2, 3), torch.Tensor([1.0, 2.0]),
            torch.FloatTensor([1.0, 2.0]), torch.LongTensor(2), torch.Tensor(src),
            _Sub(src), torch.Tensor._make_subclass(_Sub, src.detach()), torch.Tensor([]),
        ]  # fmt: skip

    t, made = run_traced(near_misses)
    assert [list(m.shape) for m in made] == [[3], [2, 3], [2], [2], [2], [3], [3], [3], [0]]
    alias = made[5]  # torch.Tensor(t) of one tensor: torch's aten::alias, no copy
    assert alias is not src and alias.data_ptr() == src.data_ptr() and alias.grad_fn is not None
    assert type(made[6]) is _Sub and made[6].data_ptr() == src.data_ptr()
    assert [e for e in t.events if e.op == "legacy_ctor"] == []
    assert [e for e in t.events if not e.alias] == []  # nothing here allocates a copy
    assert hazards(t, "tensor-ctor-copy") == []


def test_as_tensor_of_one_tensor_or_of_numbers_is_not_a_copy() -> None:
    src = torch.randn(4)  # float32: 16 B
    t, (same, floats) = run_traced(lambda: (torch.as_tensor(src), torch.as_tensor([0.5, 2.0])))
    assert same is src  # torch returns its input: no copy to record
    assert t.events == [] and hazards(t, "tensor-ctor-copy") == []
    t, wide = run_traced(lambda: torch.as_tensor(src, dtype=torch.float64))
    # a conversion, recorded as the aten copy it runs (4 float64 = 32 B), not as as_tensor
    assert [(e.op, e.bytes_allocated) for e in t.events] == [("implicit", 32)]
    assert torch.equal(wide, src.double()) and hazards(t, "tensor-ctor-copy") == []


# --------------------------------------------------------------------------------------------
# .to(bfloat16).float() rounds; .double().float() gives the input back: only that is redundant
# --------------------------------------------------------------------------------------------


def test_lossless_round_trip_is_redundant_and_bf16_rounding_is_not() -> None:
    torch.manual_seed(0)
    raw = torch.randn(16, 48, 7)  # float32: 16*48*7*4 = 21504 B

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        rounded = raw.to(torch.bfloat16).float()
        same = raw.double().float()
        return rounded, same

    t, (rounded, same) = run_traced(both)
    assert not torch.equal(rounded, raw) and torch.equal(same, raw)
    by_op = [(e.op, e.dtype, e.bytes_allocated) for e in t.events]
    assert by_op == [
        ("to", "bfloat16", 10752), ("float", "float32", 21504),
        ("double", "float64", 43008), ("float", "float32", 21504),
    ]  # fmt: skip
    (finding,) = hazards(t, "redundant-copy")
    assert site_lines(finding) == lines_of(t, "double")  # the float64 line only
    assert lines_of(t, "double").isdisjoint(lines_of(t, "to"))
    assert finding.bytes == 43008  # the intermediate float64 copy, allocated for nothing


# --------------------------------------------------------------------------------------------
# activation checkpointing re-runs the user's upcast in backward
# --------------------------------------------------------------------------------------------


class UpcastBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # upcast of a bfloat16 activation
        return x + self.fc(h).relu().to(x.dtype)


def _checkpointed_step(use_ckpt: bool) -> float:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = UpcastBlock(32)
    x = torch.randn(8, 32, requires_grad=True).to(torch.bfloat16)
    y = checkpoint(block, x, use_reentrant=False) if use_ckpt else block(x)
    loss = y.float().square().mean()
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("use_ckpt", [True, False])
def test_checkpoint_recomputes_the_users_upcast_without_a_redundant_copy(use_ckpt: bool) -> None:
    untraced = _checkpointed_step(use_ckpt)
    t, traced = run_traced(lambda: _checkpointed_step(use_ckpt))
    assert traced == untraced
    upcasts = [e for e in t.events if e.op == "float" and e.module == "UpcastBlock"]
    # 8x32 float32 = 1024 B each: in forward, and again in backward when checkpointed
    assert [(e.phase, e.bytes_allocated) for e in upcasts] == [("forward", 1024)] + (
        [("backward", 1024)] if use_ckpt else []
    )
    assert all(e.graph == "attached" for e in upcasts)
    assert hazards(t, "redundant-copy") == []


@pytest.mark.parametrize("use_ckpt", [True, False])
def test_checkpoint_stops_recomputing_before_the_users_downcast(use_ckpt: bool) -> None:
    t, _ = run_traced(lambda: _checkpointed_step(use_ckpt))
    downcasts = [e for e in t.events if e.op == "to" and e.module == "UpcastBlock"]
    # relu's output is the last tensor the block saves for backward; non-reentrant checkpoint
    # stops re-running forward once it has rebuilt it, so the cast back to bfloat16 after it
    # (8x32 bfloat16 = 512 B) runs in forward only, with or without checkpointing
    assert [(e.phase, e.dtype, e.bytes_allocated) for e in downcasts] == [
        ("forward", "bfloat16", 512)
    ]


# --------------------------------------------------------------------------------------------
# Module.to() on the swap_tensors path, after an EMA copy kept up with state_dict()
# --------------------------------------------------------------------------------------------


def _ema_then_convert() -> tuple[list[str], list[str]]:
    """An EMA model updated through both models' state_dict(), then converted to float64 on
    the swap_tensors path (which refuses any tensor something holds a weakref to)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    ema = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)

    @torch.no_grad()
    def update() -> None:  # its loop variables, the last aliases, die when it returns
        for e, m in zip(ema.state_dict().values(), model.state_dict().values(), strict=True):
            e.copy_(e * 0.9 + 0.1 * m)

    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        update()
    ema.to(torch.float64)
    return [str(p.dtype) for p in ema.parameters()], [str(v) for v in ema(x.double()).tolist()]


def test_swap_path_conversion_succeeds_traced_after_state_dict_aliases() -> None:
    with swap_on_conversion(True):
        untraced = _ema_then_convert()
        t, traced = run_traced(_ema_then_convert)
    assert traced == untraced and traced[0] == ["torch.float64"] * 4

    # deepcopy: weight 16x8 + bias 16 + weight 2x16 + bias 2, float32 = 512+64+128+8 = 712 B
    first_group = groups(t)[0]
    assert first_group.tensors == 4 and first_group.bytes_allocated == 712
    # per update: 8 state_dict() aliases (4 per model) and 4 copy_ into the EMA's tensors
    assert len([e for e in t.events if e.op == "detach"]) == 2 * 8
    assert [e.bytes_allocated for e in t.events if e.op == "copy_"] == [0] * (2 * 4)
    assert hazards(t, "aliasing-snapshot") == []  # the aliases are used at once and dropped
    # the conversion: one float64 copy (twice the bytes: 1424 B) and one swap per parameter
    conversions = [e for e in t.events if e.op == "to" and e.dtype == "float64"]
    assert sum(e.bytes_allocated for e in conversions) == 2 * 712 and len(conversions) == 4
    swaps = [e for e in t.events if e.op == "swap_tensors"]
    assert len(swaps) == 4 and all(e.alias and e.bytes_allocated == 0 for e in swaps)


def test_swap_path_downcast_records_half_the_bytes_and_one_swap_per_parameter() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with swap_on_conversion(True):
        t, _ = run_traced(lambda: model.to(torch.bfloat16))
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16] * 4
    # each float32 parameter becomes a bfloat16 copy: 16x8, 16, 2x16, 2 elements x 2 B
    conversions = [(e.src_dtype, e.dtype, e.bytes_allocated) for e in t.events if e.op == "to"]
    assert conversions == [
        ("float32", "bfloat16", 256), ("float32", "bfloat16", 32),
        ("float32", "bfloat16", 64), ("float32", "bfloat16", 4),
    ]  # fmt: skip
    swaps = [(e.shape, e.alias, e.bytes_allocated) for e in t.events if e.op == "swap_tensors"]
    assert swaps == [((16, 8), True, 0), ((16,), True, 0), ((2, 16), True, 0), ((2,), True, 0)]
    assert copytrace.analyze(t.events) == []


# --------------------------------------------------------------------------------------------
# clone inside torch.func.vmap: the bytes really allocated are the whole batch's
# --------------------------------------------------------------------------------------------


def test_clone_inside_vmap_records_the_whole_batch_once_per_call() -> None:
    from torch.func import vmap

    x = torch.randn(5, 64, 16)  # 5 members x 64 x 16 float32 = 20480 B

    def member(xi: torch.Tensor) -> torch.Tensor:
        h = xi.clone()  # a private copy of this member's input
        h[:, :2] = 0.0
        return h.sum()

    untraced = vmap(member)(x)
    t, traced = run_traced(lambda: vmap(member)(x))
    assert torch.equal(traced, untraced)
    (clone,) = [e for e in t.events if e.op == "clone"]  # the body runs once, batched
    assert clone.bytes_allocated == 20480  # not one member's 4096 B
    assert t.stats["errors"] == 0


def test_numpy_of_a_batched_tensor_fails_unchanged_and_is_recorded_as_failed() -> None:
    from torch.func import vmap

    flips = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])

    def to_numpy(f: torch.Tensor) -> torch.Tensor:
        return f * float(f.clone().cpu().numpy())

    untraced = raise_untraced(lambda: vmap(to_numpy)(flips))
    t, traced = raise_traced(lambda: vmap(to_numpy)(flips))
    assert_same_exception(untraced, traced)
    ops = [(e.op, e.bytes_allocated, e.noop, e.error) for e in t.events]
    # clone of the batch of 5 float32 = 20 B; .cpu() returns its input; .numpy() raised
    assert ops == [
        ("clone", 20, False, None),
        ("cpu", 0, True, None),
        ("numpy", 0, False, "RuntimeError"),
    ]
    assert t.stats["errors"] == 0


def test_stacking_an_ensemble_aliases_its_leaves_and_a_meta_template_allocates_nothing() -> None:
    from torch.func import stack_module_state

    torch.manual_seed(0)
    members = [nn.Linear(4, 2) for _ in range(3)]

    def stack_and_template() -> tuple[dict[str, torch.Tensor], nn.Module]:
        params, _ = stack_module_state(members)  # torch.stack, then a detached leaf of it
        return params, copy.deepcopy(members[0]).to("meta")

    t, (params, template) = run_traced(stack_and_template)
    assert params["weight"].shape == (3, 2, 4) and template.weight.is_meta
    # the stacked leaves: 3 members x (2x4 weight, 2 bias) float32 = 96 B and 24 B, aliased
    leaves = [e for e in t.events if e.op == "detach"]
    assert [(e.bytes_logical, e.bytes_allocated, e.alias) for e in leaves] == [
        (96, 0, True), (24, 0, True),
    ]  # fmt: skip
    assert {e.via for e in leaves} == {"construct_stacked_leaf"}
    (group,) = groups(t)
    assert group.bytes_allocated == 40 and group.tensors == 2  # 32 B + 8 B, really copied
    to_meta = [e for e in t.events if e.op == "to"]
    # a meta tensor has no memory: what a real copy would move, and nothing allocated
    assert [(e.dst_device, e.fake, e.bytes_logical, e.bytes_allocated) for e in to_meta] == [
        ("meta", True, 32, 0), ("meta", True, 8, 0),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# a torch.Tensor subclass made from an existing tensor, and torch.tensor(t) under torch.device
# --------------------------------------------------------------------------------------------


class Sampler(torch.Tensor):
    """A tensor subclass whose ``.to()`` re-wraps itself and sets ``.data``."""

    def to(self, *args: Any, **kwargs: Any) -> Sampler:  # type: ignore[override]
        new = Sampler(self)  # Tensor.__new__(cls, t): torch's legacy constructor, an alias
        new.data = super().to(*args, **kwargs)
        return new


def _make_samplers() -> tuple[str, str, list[str]]:
    z = Sampler(torch.zeros(8, 16)).to("cpu", torch.float32)  # same device and dtype
    y = Sampler(torch.zeros(8)).to("cpu", torch.int64)  # a real conversion: 8 x 8 B
    errors = []
    for _ in range(2):
        try:
            copy.deepcopy(z)
        except RuntimeError as err:  # torch refuses the default deepcopy of such a subclass
            errors.append(str(err)[:40])
    return f"{type(z).__name__} {z.dtype}", f"{type(y).__name__} {y.dtype}", errors


def test_subclass_from_existing_tensor_runs_as_untraced_and_its_copies_are_recorded() -> None:
    untraced = _make_samplers()
    t, traced = run_traced(_make_samplers)
    assert traced == untraced
    assert untraced[:2] == ("Sampler torch.float32", "Sampler torch.int64")
    assert len(untraced[2]) == 2
    to = [(e.noop, e.alias, e.bytes_allocated) for e in t.events if e.op == "to"]
    assert to == [(True, True, 0), (False, False, 64)]
    assert [e.op for e in t.events if e.op == "data_set"] == ["data_set", "data_set"]
    failed = [e for e in t.events if e.op == "deepcopy"]
    assert [(e.error, e.bytes_allocated) for e in failed] == [("RuntimeError", 0)] * 2


def _neighbours(coords: torch.Tensor, rcut: torch.Tensor) -> torch.Tensor:
    with torch.device("cpu"):  # a default-device context: itself a TorchFunctionMode
        rc = torch.tensor(rcut)  # already a tensor: a copy, and torch's warning
        return (torch.cdist(coords, coords) < rc).sum(-1)


def test_tensor_ctor_under_device_context_is_recorded_and_flagged() -> None:
    torch.manual_seed(0)
    coords, rcut = torch.randn(16, 3), torch.tensor(1.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        untraced = _neighbours(coords, rcut)
        t, traced = run_traced(lambda: _neighbours(coords, rcut))
    assert torch.equal(traced, untraced)
    (ev,) = [e for e in t.events if e.op == "tensor_ctor"]
    assert ev.bytes_allocated == 4 and ev.aten == ("aten::detach", "aten::_to_copy")
    (finding,) = hazards(t, "tensor-ctor-copy")
    assert site_lines(finding) == {ev.line}


def test_warning_filter_on_the_module_torch_names_matches_traced_as_untraced() -> None:
    def construct_under_device() -> str:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "error", message="To copy construct", module=r"torch\.utils\._device"
            )
            try:
                with torch.device("cpu"):
                    torch.tensor(torch.ones(3))
            except UserWarning as w:
                return f"raised: {str(w)[:30]}"
            return "no exception"

    untraced = construct_under_device()
    _, traced = run_traced(construct_under_device)
    assert traced == untraced == "raised: To copy construct from a tenso"  # 30 characters


# --------------------------------------------------------------------------------------------
# the hazards of the situations above: each found where it is, absent from its near miss
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how, flagged", [("data", True), ("detach", False)])
def test_write_through_data_alias_of_saved_activation_is_flagged_detach_is_not(
    how: str, flagged: bool
) -> None:
    t, _ = run_traced(lambda: _write_through_alias(how))
    found = hazards(t, "data-inplace")
    # through .detach() autograd raises by itself: nothing silent to report
    assert len(found) == (1 if flagged else 0)
    if flagged:
        assert found[0].severity == "error" and "SigmoidBackward0" in found[0].message
        assert site_lines(found[0]) >= lines_of(t, "data_get")


@pytest.mark.parametrize("how, flagged", [("data", True), ("no_grad", False)])
def test_parameter_slice_edit_through_data_is_flagged_no_grad_is_not(
    how: str, flagged: bool
) -> None:
    t, _ = run_traced(lambda: _edit_weight_slice(how))
    found = hazards(t, "data-inplace")
    assert len(found) == (1 if flagged else 0)  # no_grad's write makes backward raise instead
    if flagged:
        assert "AddmmBackward0" in found[0].message


def test_deepcopy_of_module_caching_graph_activation_is_flagged() -> None:
    torch.manual_seed(0)
    net = CachingNet()
    net(torch.randn(2, 8))
    fixed = CachingNet(cache_detached=True)
    fixed(torch.randn(2, 8))

    def both() -> None:
        with contextlib.suppress(RuntimeError):
            copy.deepcopy(net)
        copy.deepcopy(fixed)  # the near miss: the cache was detached

    t, _ = run_traced(both)
    (finding,) = hazards(t, "deepcopy-nonleaf")
    assert "last_hidden" in finding.message and "AddmmBackward0" in finding.message
    assert site_lines(finding) == {groups(t)[0].line}


@pytest.mark.parametrize(
    "strategy, keep, flagged",
    [
        ("clone", lambda loss: loss.clone(), True),
        ("detach", lambda loss: loss.detach(), False),
    ],
)
def test_loss_clones_kept_across_iterations_are_flagged_detach_is_not(
    strategy: str, keep: Callable[[torch.Tensor], Any], flagged: bool
) -> None:
    t, _ = run_traced(lambda: _eval_loop(keep))
    found = hazards(t, "graph-retaining-copy")
    assert len(found) == (1 if flagged else 0)
    if flagged:
        assert site_lines(found[0]) == lines_of(t, "clone")
        assert found[0].bytes > 0  # the saved activations kept alive


def _write_into_result(how: str) -> float:
    """Keep a conversion's result apart from its input, write into it in place; return how
    much the input changed."""
    x = torch.zeros(4, 4)
    if how == "no-op to":
        staging = x.to("cpu")  # on a CPU-only run: x itself
    elif how == "reshape view":
        staging = x.reshape(16)  # contiguous input: a view
    elif how == "copy.copy":
        staging = copy.copy(x)  # a new tensor on the same storage
    elif how == "to copy=True":
        staging = x.to("cpu", copy=True)
    else:
        staging = x.t().reshape(16)  # not contiguous: a copy
    staging += 1.0  # meant for a private copy
    return float(x.sum())


@pytest.mark.parametrize(
    "how, flagged",
    [
        ("no-op to", True),
        ("reshape view", True),
        ("copy.copy", True),
        ("to copy=True", False),
        ("reshape copy", False),
    ],
)
def test_write_into_a_result_that_shares_its_input_is_flagged(how: str, flagged: bool) -> None:
    untraced = _write_into_result(how)
    t, traced = run_traced(lambda: _write_into_result(how))
    assert traced == untraced == (16.0 if flagged else 0.0)  # 16 elements changed, or none
    found = hazards(t, "alias-write")
    assert len(found) == (1 if flagged else 0)
    if flagged:
        assert len(site_lines(found[0])) == 2  # the write's line, then the call's


def test_copy_construct_and_clone_detach_order_are_flagged() -> None:
    src = _source()

    def three_forms() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.tensor(src)
        src.clone().detach()
        src.detach().clone()  # the near miss of both

    t, _ = run_traced(three_forms)
    (ctor,) = hazards(t, "tensor-ctor-copy")
    assert site_lines(ctor) == lines_of(t, "tensor_ctor")
    (order,) = hazards(t, "clone-detach-order")
    assert order.severity == "info" and order.bytes == 4000  # 1000 float32
    detach_first = max(e.line for e in t.events if e.op == "detach")  # detach().clone()
    assert detach_first not in site_lines(order) | site_lines(ctor)
