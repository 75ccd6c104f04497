"""One test per API op: bytes, alias flag, devices and graph attachment as recorded."""

from __future__ import annotations

import copy
import gc
import weakref
from collections import Counter

import pytest
import torch
import torch.nn as nn

import copytrace
from copytrace.tracer import _native

# The aten-level path this suite runs on: copytrace's C++ observer, or the Python dispatch
# mode (COPYTRACE_OBSERVER=python, or no compiler).
NATIVE = _native.load() is not None


def traced(fn):
    """Run ``fn()`` under a trace that writes nothing; return (result, events, trace)."""
    with copytrace.trace(write=False) as t:
        result = fn()
    return result, t.events, t


def only(events, op):
    found = [e for e in events if e.op == op]
    assert len(found) == 1, f"expected one {op} event, got {events}"
    return found[0]


def test_clone_of_leaf_requiring_grad_is_an_attached_copy():
    src = torch.randn(1000, requires_grad=True)
    out, events, _ = traced(lambda: src.clone())
    ev = only(events, "clone")
    assert ev.bytes_allocated == 4000  # 1000 float32 x 4 B
    assert ev.bytes_logical == 4000
    assert not ev.alias and not ev.noop
    assert ev.grad_fn == "CloneBackward0"
    assert ev.graph == "attached" and ev.requires_grad and not ev.is_leaf
    assert (ev.src_device, ev.dst_device, ev.transfer) == ("cpu", "cpu", "none")
    assert ev.aten == ("aten::clone",)
    assert ev.shape == (1000,) and ev.dtype == "float32"
    assert len(events) == 1
    assert type(out.grad_fn).__name__ == "CloneBackward0"


def test_torch_clone_function_form_is_the_same_event():
    src = torch.randn(10, 10)
    _, events, _ = traced(lambda: torch.clone(src))
    ev = only(events, "clone")
    assert ev.bytes_allocated == 400  # 100 float32
    assert ev.graph == "none"


def test_data_get_is_a_detached_alias():
    src = torch.randn(1000, requires_grad=True)
    out, events, _ = traced(lambda: src.data)
    ev = only(events, "data_get")
    assert ev.bytes_allocated == 0 and ev.alias and not ev.noop
    assert ev.graph == "detached" and not ev.requires_grad and ev.grad_fn is None
    # `.data` is a shallow copy of the TensorImpl made without the dispatcher; torch routes it
    # through aten::detach only for tensors or modes with the Python key (a Python mode).
    assert ev.aten == (() if NATIVE else ("aten::detach",))
    assert out.data_ptr() == src.data_ptr()


def test_detach_of_non_leaf_is_a_detached_alias():
    leaf = torch.randn(8, requires_grad=True)
    act = leaf.sigmoid()
    _, events, _ = traced(lambda: act.detach())
    ev = only(events, "detach")
    assert (ev.bytes_allocated, ev.alias, ev.graph, ev.is_leaf) == (0, True, "detached", True)
    assert ev.src_requires_grad


def test_detach_in_place_is_recorded_without_dispatch():
    x = torch.randn(4, requires_grad=True) * 2
    _, events, _ = traced(lambda: x.detach_())
    ev = only(events, "detach_")
    assert ev.noop and ev.alias and ev.bytes_allocated == 0
    assert ev.aten == ()  # detach_ never reaches the dispatcher (torch 2.13)


def test_deepcopy_of_tensor_copies_its_storage():
    src = torch.randn(4, requires_grad=True)
    out, events, _ = traced(lambda: copy.deepcopy(src))
    ev = only(events, "deepcopy")
    assert ev.bytes_allocated == 16 and not ev.alias  # 4 float32
    assert ev.is_leaf and ev.requires_grad and ev.graph == "detached"
    assert not ev.group
    assert out.data_ptr() != src.data_ptr()


def test_deepcopy_of_tensor_counts_its_grad_too():
    src = torch.randn(4, requires_grad=True)
    src.grad = torch.ones(4)
    out, events, _ = traced(lambda: copy.deepcopy(src))
    ev = only(events, "deepcopy")
    assert ev.bytes_allocated == 32  # data 16 B + .grad 16 B
    assert out.grad is not None and out.grad.data_ptr() != src.grad.data_ptr()


def test_deepcopy_of_module_is_one_group_over_its_parameters():
    layer = nn.Linear(8, 8)
    out, events, _ = traced(lambda: copy.deepcopy(layer))
    groups = [e for e in events if e.group]
    children = [e for e in events if not e.group]
    assert len(groups) == 1
    group = groups[0]
    # weight 8x8 float32 = 256 B, bias 8 float32 = 32 B
    assert group.bytes_allocated == 288 and group.tensors == 2
    assert group.object_type == "torch.nn.modules.linear.Linear"
    assert sorted(e.bytes_allocated for e in children) == [32, 256]
    assert all(e.parent == group.seq and e.op == "deepcopy" for e in children)
    assert isinstance(out.weight, nn.Parameter) and out.weight.data_ptr() != layer.weight.data_ptr()


def test_deepcopy_counts_a_shared_storage_once():
    base = torch.zeros(100)
    obj = {"a": base, "b": base[10:20], "c": base}  # one storage, 400 B
    out, events, _ = traced(lambda: copy.deepcopy(obj))
    group = only([e for e in events if e.group], "deepcopy")
    assert group.bytes_allocated == 400
    assert out["b"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()


def test_deepcopy_of_object_without_tensors_is_not_an_event():
    _, events, _ = traced(lambda: copy.deepcopy({"lr": 0.1, "names": ["a", "b"]}))
    assert events == []


def test_to_same_device_and_dtype_is_a_noop_alias():
    src = torch.randn(16)
    out, events, _ = traced(lambda: src.to("cpu"))
    ev = only(events, "to")
    assert out is src
    assert ev.noop and ev.alias and ev.bytes_allocated == 0 and ev.aten == ()


def test_cpu_on_cpu_is_a_noop_alias():
    src = torch.randn(16)
    _, events, _ = traced(lambda: src.cpu())
    ev = only(events, "cpu")
    assert ev.noop and ev.bytes_allocated == 0


def test_to_with_copy_true_and_dtype_change_allocate():
    src = torch.randn(16)  # 64 B as float32
    _, events, _ = traced(lambda: (src.to("cpu", copy=True), src.double()))
    forced = only(events, "to")
    assert forced.bytes_allocated == 64 and not forced.alias and forced.aten == ("aten::_to_copy",)
    widened = only(events, "double")
    assert widened.bytes_allocated == 128 and widened.dtype == "float64"
    assert widened.src_dtype == "float32"


def test_contiguous_copies_only_when_needed():
    src = torch.randn(4, 4)
    _, events, _ = traced(lambda: (src.contiguous(), src.t().contiguous()))
    noop, real = [e for e in events if e.op == "contiguous"]
    assert noop.noop and noop.bytes_allocated == 0
    assert not real.alias and real.bytes_allocated == 64 and real.aten == ("aten::clone",)


def test_copy_into_existing_tensor_allocates_nothing():
    src = torch.randn(100, requires_grad=True)
    dst = torch.zeros(100)
    _, events, _ = traced(lambda: dst.copy_(src))
    ev = only(events, "copy_")
    assert ev.bytes_allocated == 0 and ev.bytes_logical == 400 and not ev.alias
    assert ev.aten == ("aten::copy_",)
    assert ev.graph == "attached"  # dst now has CopyBackwards to src


def test_torch_tensor_of_a_tensor_is_a_detached_copy():
    src = torch.randn(1000, requires_grad=True)
    with pytest.warns(UserWarning):
        _, events, _ = traced(lambda: torch.tensor(src))
    ev = only(events, "tensor_ctor")
    assert ev.bytes_allocated == 4000 and ev.graph == "detached" and ev.is_leaf
    assert "aten::_to_copy" in ev.aten


def test_torch_tensor_of_a_list_is_not_a_copy_event():
    _, events, _ = traced(lambda: torch.tensor([1.0, 2.0]))
    assert events == []


def test_numpy_is_an_alias():
    src = torch.arange(6.0)
    arr, events, _ = traced(lambda: src.numpy())
    ev = only(events, "numpy")
    assert ev.alias and ev.bytes_allocated == 0
    arr[0] = 42.0
    assert src[0].item() == 42.0


def test_data_set_rebinds_storage():
    dst = torch.zeros(3)
    new = torch.ones(3)
    _, events, _ = traced(lambda: setattr(dst, "data", new))
    ev = only(events, "data_set")
    assert ev.alias and ev.bytes_allocated == 0
    assert dst.data_ptr() == new.data_ptr()


def test_call_site_is_the_users_line():
    src = torch.randn(3)
    with copytrace.trace(write=False) as t:
        _, line = src.clone(), _line()  # the same line on purpose
    ev = only(t.events, "clone")
    assert ev.file == __file__ and ev.line == line
    assert ev.function == "test_call_site_is_the_users_line"


def _line():
    import sys

    return sys._getframe(1).f_lineno


def test_steps_and_phases_in_a_training_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    with copytrace.trace(write=False) as t:
        for _ in range(3):
            loss = model(x.to("cpu")).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.detach()
    # auto-step: each optimizer.step() ends a step, so the 3 batch moves land in steps 0, 1, 2
    assert [e.step for e in t.events if e.op == "to"] == [0, 1, 2]
    assert t.stats["steps"] == 4  # steps 0-2 plus the (empty) tail after the last step()
    # autograd's own detaches (saving outputs for backward) are shallow copies that reach the
    # dispatcher only under a Python mode: counted on that path (the observer counts only the
    # bare aten::detach calls torch really makes, e.g. in the optimizer).
    if not NATIVE:
        assert t.stats["internal_detaches"] > 0
    assert {e.op for e in t.events} == {"to", "detach"}


def test_module_path_and_forward_phase():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x).t().contiguous()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x)

    net = Net()
    _, events, _ = traced(lambda: net(torch.randn(2, 4)))
    ev = only(events, "contiguous")
    assert ev.module == "Net.block" and ev.phase == "forward"
    assert ev.bytes_allocated == 32  # 4x2 float32


def test_backward_copy_is_implicit_with_backward_phase():
    x = torch.randn(8, requires_grad=True)
    y = x.double()  # ToCopyBackward0 casts the gradient back to float32 in backward

    def run():
        y.sum().backward()

    _, events, _ = traced(run)
    ev = only(events, "implicit")
    assert ev.phase == "backward" and ev.aten == ("aten::_to_copy",)
    assert ev.dtype == "float32" and ev.src_dtype == "float64" and ev.bytes_allocated == 32


def test_results_identical_traced_and_untraced():
    def program():
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
        ema = copy.deepcopy(model)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for _ in range(3):
            x = torch.randn(4, 6).to("cpu")
            out = model(x)
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                    pe.copy_(0.9 * pe + 0.1 * p)
        snap = {k: v.clone() for k, v in model.state_dict().items()}
        return out.detach(), loss.detach(), snap, [p.detach().clone() for p in ema.parameters()]

    plain = program()
    traced_result, events, _ = traced(program)
    kinds = Counter((e.op, e.group, e.alias, e.noop) for e in events)
    assert kinds == {
        ("deepcopy", True, False, False): 1,  # ema = deepcopy(model): one group ...
        ("deepcopy", False, False, False): 4,  # ... of 2 weights and 2 biases
        ("to", False, True, True): 3,  # x.to("cpu") on the CPU: a no-op, once per iteration
        ("copy_", False, False, False): 12,  # EMA update: 4 parameters x 3 iterations
        # state_dict() detaches 4 tensors; out.detach(), loss.detach(); 4 p.detach()
        ("detach", False, True, False): 4 + 2 + 4,
        ("clone", False, False, False): 4 + 4,  # the snapshot's clones; 4 .detach().clone()
    }
    for a, b in zip(
        torch.utils._pytree.tree_leaves(plain),
        torch.utils._pytree.tree_leaves(traced_result),
        strict=True,
    ):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_exception_passes_through_unchanged_and_is_recorded():
    class Cache(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.last = None

        def forward(self, x):
            self.last = self.fc(x)  # a non-leaf kept on the module
            return self.last

    m = Cache()
    m(torch.randn(1, 2))
    with pytest.raises(RuntimeError) as plain:
        copy.deepcopy(m)
    with copytrace.trace(write=False) as t, pytest.raises(RuntimeError) as under:
        copy.deepcopy(m)
    assert str(under.value) == str(plain.value)
    assert [e.error for e in t.events if e.group] == ["RuntimeError"]


def test_tracer_keeps_no_tensor_alive():
    refs = []
    with copytrace.trace(write=False) as t:
        for _ in range(3):
            a = torch.randn(100, requires_grad=True)
            b = a.clone()
            c = b.detach()
            d = copy.deepcopy(nn.Linear(3, 3))
            refs += [weakref.ref(a), weakref.ref(b), weakref.ref(c), weakref.ref(d.weight)]
            del a, b, c, d
    gc.collect()
    # per iteration: clone, detach, and a deepcopy group with its 2 copies (weight, bias)
    assert [e.op for e in t.events] == ["clone", "detach", "deepcopy", "deepcopy", "deepcopy"] * 3
    assert len(t.events) == 15
    assert [r() for r in refs] == [None] * len(refs)


def test_nested_trace_delegates_to_the_active_one():
    src = torch.randn(2)
    with copytrace.trace(write=False) as outer:
        with copytrace.trace(write=False) as inner:
            src.clone()
        assert inner is outer
        src.clone()
    assert len(outer.events) == 2


def test_errors_in_recording_are_counted_not_raised(monkeypatch, capsys):
    import warnings

    from copytrace.tracer import _recorder

    def broken(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(_recorder.Recorder, "_record_api", broken)
    src = torch.randn(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # even with warnings as errors, nothing reaches the user
        with copytrace.trace(write=False) as t:
            out = src.clone()
    assert torch.equal(out, src)
    assert t.stats["errors"] == 1
    assert "copytrace: 1 internal error(s) while tracing (last: ValueError: boom)" in (
        capsys.readouterr().err
    )


def test_explicit_steps_override_optimizer_auto_steps():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 2)
    with copytrace.trace(write=False) as t:
        for _ in range(3):
            model(x.to("cpu")).sum().backward()
            opt.step()  # would advance the step on its own ...
            t.step()  # ... but the user's marks win, from the first one on
    assert [e.step for e in t.events if e.op == "to"] == [0, 1, 2]
    assert t.stats["steps"] == 4


def test_compiled_function_runs_compiled_with_same_results_under_tracing():
    @torch.compile(backend="eager")
    def fn(x):
        y = x.clone() * 2
        return y.sin() + x.t().contiguous().t()

    x = torch.randn(4, 4)
    expected = fn(x)  # compiled outside the trace
    with copytrace.trace(write=False) as t:
        for _ in range(3):
            got = fn(x)
    assert torch.equal(expected, got)
    # The compiled region runs compiled: its clone and contiguous are not traced op by op;
    # each of the 3 calls is one compiled call instead.
    assert t.events == []
    compiled = t.session._engagement.compiled
    assert compiled is not None and compiled.calls_total == 3


def test_fullgraph_compiled_function_runs_compiled_under_tracing():
    # Untraced, torch raises "found no compiled frames" for fullgraph=True under any dispatch
    # mode; copytrace's modes are off the stacks while compiled code runs, so it compiles.
    @torch.compile(fullgraph=True, backend="eager")
    def fn(x):
        return (x.clone() * 2).sum()

    assert fn(torch.ones(4)).item() == 8.0
    with copytrace.trace(write=False) as t:
        got = fn(torch.ones(5))  # a new shape: compiled again while tracing
    assert got.item() == 10.0
    assert t.events == []
    from torch._dynamo import eval_frame

    assert eval_frame._stance.stance == "default"
    assert "enter_exit_hooks" not in eval_frame._TorchDynamoContext.__dict__  # removed on exit
