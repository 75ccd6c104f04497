"""Inside backward the Python fallback computes what torch computes untraced, bit for bit.

torch runs a function mode's handler with the mode off its stack, and the autograd engine runs
every node under the mode stacks its entry point (``Tensor.backward``, ``torch.autograd.backward``,
``torch.autograd.grad``) was called with. Before ``ValueMode`` the fallback's backward therefore
ran a program's Python code with the dispatch mode alone on the stack, where torch takes other
paths (``isTensorSubclassLike`` is true for every tensor): a forward run again by a checkpoint,
a hook, a custom ``Function``'s backward and a saved-tensor unpack hook computed other bits, and
a non-reentrant checkpoint around a broadcast ``matmul`` raised ``CheckpointError``. Each test
runs a program untraced, under a plain dispatch mode of its own (which shows the values would
differ) and traced on the fallback, and compares every tensor bitwise.
"""

from __future__ import annotations

import pytest
import torch
from _fallback_compare import PlainMode, run
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

import copytrace


@pytest.fixture(autouse=True)
def _fallback(monkeypatch):
    monkeypatch.setenv("COPYTRACE_OBSERVER", "python")


# (5, 5, 5) @ (1, 5, 5), the batch of one not requiring grad: untraced one bmm over the
# expanded batch; under any dispatch mode ATen's _matmul_impl squeezes it and folds the
# product into one mm, with other rounding (and another shape for what it saves)
def _broadcast_matmul(a, c):
    return torch.matmul(a, c).exp()


def _reentrant_checkpoint():
    a, c = torch.randn(5, 5, 5, requires_grad=True), torch.randn(1, 5, 5)
    y = checkpoint(_broadcast_matmul, a, c, use_reentrant=True)
    y.sum().backward()
    return [y, a.grad]


def _non_reentrant_checkpoint():
    a, c = torch.randn(5, 5, 5, requires_grad=True), torch.randn(1, 5, 5)
    y = checkpoint(_broadcast_matmul, a, c, use_reentrant=False)
    y.sum().backward()
    return [y, a.grad]


def _unpack_hook():
    """A saved-tensor codec: kept as it is, handed back through a rotation and its inverse
    (exact up to rounding), so the unpacked value depends on how matmul runs in backward."""
    a = torch.randn(5, 5, 5, requires_grad=True)
    q = torch.linalg.qr(torch.randn(5, 5))[0].unsqueeze(0)

    def unpack(saved):
        return torch.matmul(torch.matmul(saved, q), q.mT)

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y = (a * 1.5).exp()  # exp saves its result
    y.sum().backward()
    return [a.grad]


def _tensor_hook():
    """svdvals of a tensor that needs no grad: untraced LAPACK computes no vectors
    (``_may_require_fw_or_bw_grad`` is false in backward); under a dispatch mode it does."""
    x, m = torch.randn(4, 5, requires_grad=True), torch.randn(6, 6)
    y = x * 2
    y.register_hook(lambda g: g * torch.linalg.svdvals(m)[0])
    y.sum().backward()
    return [x.grad]


class _ProdInBackward(torch.autograd.Function):
    """A custom backward that calls prod: with create_graph its node is made in backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sum(1)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g.unsqueeze(1) * x.prod(1, keepdim=True).expand_as(x)


def _prod_made_in_backward():
    x = torch.randn(4, 5, requires_grad=True)
    (g,) = torch.autograd.grad(_ProdInBackward.apply(x).sum(), x, create_graph=True)
    # the double backward starts at g itself: no forward call after the first backward
    # reaches g's graph (ones_like is a call, but of a tensor with no grad_fn)
    (gg,) = torch.autograd.grad(g, x, torch.ones_like(g))
    return [g, gg]  # gg runs ProdBackward0, whose formula branches on the mode


PROGRAMS = {
    "reentrant checkpoint, matmul": _reentrant_checkpoint,
    "non-reentrant checkpoint, matmul": _non_reentrant_checkpoint,
    "saved-tensor unpack hook, matmul": _unpack_hook,
    "tensor hook, svdvals": _tensor_hook,
    "prod made in backward, double backward": _prod_made_in_backward,
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_backward_computes_as_untraced(name):
    program = PROGRAMS[name]
    untraced = run(program, "untraced")
    assert run(program, "plain") != untraced  # any dispatch mode alone would change them
    assert run(program, "traced") == untraced


def test_a_broadcast_matmul_in_a_non_reentrant_checkpoint_does_not_raise():
    """A forward run with bmm and a recomputation under a dispatch mode alone (the fallback's
    backward without ValueMode) disagree: the recomputed matmul's result, which exp saves, is
    (5, 5) where the forward's was (5, 5, 5), and the checkpoint raises; traced, it runs."""
    a, c = torch.randn(5, 5, 5, requires_grad=True), torch.randn(1, 5, 5)
    y = checkpoint(_broadcast_matmul, a, c, use_reentrant=False)
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="different metadata"):
        with PlainMode():
            y.sum().backward()
    with copytrace.trace(write=False) as t:
        _non_reentrant_checkpoint()
    assert t.stats["errors"] == 0


def test_the_stacks_in_backward_and_after():
    """In a hook the function stack is as in the traced forward (one mode: ValueMode where
    the forward has FunctionMode), the dispatch mode is there, and both stacks are as before
    once backward returns or raises. A copy made in a hook is still recorded as an implicit
    copy of the backward phase: ValueMode records nothing."""
    x = torch.randn(4, 5, requires_grad=True)
    seen = []

    def hook(g):
        modes = torch.overrides._get_current_function_mode_stack()
        seen.append(([type(m).__name__ for m in modes], torch._C._len_torch_dispatch_stack()))
        return g.clone()

    with copytrace.trace(write=False) as t:
        stacks = (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())
        y = x * 2
        y.register_hook(hook)
        y.sum().backward()
        after = (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())
        z = x * 3
        z.register_hook(lambda g: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            z.sum().backward()
        raised = (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())
    assert stacks == after == raised == (1, 1)
    assert seen == [(["ValueMode"], 1)]
    assert [(e.op, e.phase) for e in t.events] == [("implicit", "backward")]
    assert t.stats["errors"] == 0


class _Logged(torch.Tensor):
    """A subclass with a __torch_function__ of its own: it sees every backward call."""

    calls: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", "?"))
        return super().__torch_function__(func, types, args, kwargs or {})


class _Counting(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", "?"))
        return func(*args, **(kwargs or {}))


def test_near_miss_a_subclass_or_a_mode_of_the_program_sees_backward_as_untraced():
    """ValueMode skips one ``has_torch_function`` check to enter the engine; where a
    program's subclass or its own function mode (below copytrace's) would be skipped with it,
    backward is entered as untraced, with no ValueMode: they see the same calls."""

    def with_subclass():
        _Logged.calls = []
        x = torch.randn(4, 5, requires_grad=True)
        (x.as_subclass(_Logged) * 2).sum().backward()
        return _Logged.calls

    def with_mode(traced):
        x = torch.randn(4, 5, requires_grad=True)
        with _Counting() as mode:
            if not traced:
                (x * 2).sum().backward()
                return mode.calls
            with copytrace.trace(write=False):
                (x * 2).sum().backward()
        return mode.calls

    untraced = with_subclass()
    assert "backward" in untraced
    with copytrace.trace(write=False) as t:
        assert with_subclass() == untraced
    assert with_mode(traced=True) == with_mode(traced=False)
    assert "backward" in with_mode(traced=False)
    assert t.stats["errors"] == 0


def _pack_hook():
    """A saved-tensor codec that computes in both hooks: the pack hook runs inside the
    forward op's call (``exp`` saving its result), where torch has popped the calling function
    mode for its handler; the unpack hook runs in backward."""
    a = torch.randn(5, 5, 5, requires_grad=True)
    q = torch.linalg.qr(torch.randn(5, 5))[0].unsqueeze(0)
    hooks = (lambda t: torch.matmul(t, q), lambda p: torch.matmul(p, q.mT))
    with torch.autograd.graph.saved_tensors_hooks(*hooks):
        y = (a * 1.5).exp()
    y.sum().backward()
    return [y, a.grad]


def _pack_hook_only():
    """Only the pack hook computes (the rotation, kept with the rotated value); the unpack
    hook undoes it with no matmul of its own: the difference is made in the forward."""
    a = torch.randn(5, 5, 5, requires_grad=True)
    q = torch.linalg.qr(torch.randn(5, 5))[0].unsqueeze(0)
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: torch.matmul(t, q), lambda p: torch.einsum("bij,kj->bik", p, q[0])
    ):
        y = (a * 1.5).exp()
    y.sum().backward()
    return [y, a.grad]


@pytest.mark.parametrize("program", [_pack_hook, _pack_hook_only])
def test_a_pack_hook_computing_with_matmul(program):
    untraced = run(program, "untraced")
    assert run(program, "plain") != untraced  # the hook's broadcast matmul under a mode
    assert run(program, "traced") == untraced


def test_the_stacks_in_a_pack_hook_and_its_copies():
    """In a pack hook the function stack holds ``ValueMode`` (as an unpack hook's does in
    backward) over the dispatch mode; both stacks are as before after the op, also when the
    hook raises. A clone in the pack hook is recorded as an implicit copy, the op's own
    events are unchanged (``x.clone()`` outside the hooks: one ``clone`` event)."""
    seen = []

    def pack(t):
        modes = torch.overrides._get_current_function_mode_stack()
        seen.append(([type(m).__name__ for m in modes], torch._C._len_torch_dispatch_stack()))
        return t.clone()

    def refuse(t):
        raise ValueError("not saved")

    x = torch.randn(4, 5, requires_grad=True)
    with copytrace.trace(write=False) as t:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p):
            y = x.exp()  # saves its result: one pack call
        after = (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())
        with torch.autograd.graph.saved_tensors_hooks(refuse, lambda p: p):
            with pytest.raises(ValueError, match="not saved"):
                x.exp()
        raised = (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())
        x.clone()
    assert seen == [(["ValueMode"], 1)]
    assert after == raised == (1, 1)
    assert [e.op for e in t.events] == ["implicit", "clone"]
    assert t.stats["errors"] == 0
    assert torch.equal(y, x.exp())


def test_compiled_code_in_backward_runs_with_no_mode_of_copytrace():
    """``ValueMode`` steps aside at a compiled call as the function mode does: compiled
    autograd and a compiled function called from a hook compile with ``fullgraph=True``
    (dynamo would fail on a mode's handler it cannot trace) and give untraced's values."""
    from torch._dynamo import compiled_autograd

    step = torch.compile(lambda g: (g * 3).sin(), backend="eager", fullgraph=True)

    def program():
        x = torch.randn(4, 5, requires_grad=True)
        y = x.exp() * 2
        y.register_hook(step)
        with compiled_autograd._enable(torch.compile(backend="eager", fullgraph=True)):
            y.prod(1).sum().backward()
        return [x.grad]

    untraced = run(program, "untraced")
    torch._dynamo.reset()
    assert run(program, "traced") == untraced
    torch._dynamo.reset()
