"""Differential fuzzing: random short programs over the copy/alias ops, traced vs untraced.

For every generated program the traced results must equal the untraced ones (values, dtype,
requires_grad, grad_fn type), and every recorded event's ``bytes_allocated`` and ``alias``
must agree with an independent check of the storages involved.

A second generator wraps such programs in what real code wraps them in: ``torch.no_grad``,
CPU autocast, ``with torch.device``, the program's own TorchFunctionMode or TorchDispatchMode
(entered inside the trace or around it), and mixes in tensor subclass creation (``S(t)``,
``_make_subclass``, ``as_subclass``) and, in some programs, a ``torch.compile``d function. The
traced run must give the same results (type, values, dtype, strides, autograd facts), raise
the same exceptions, show the user's mode the same calls, and run the compiled function's
graph as many times as the untraced run. Both tests run on the C++ observer and on the Python
fallback (``COPYTRACE_OBSERVER=python``, as CI's fallback part runs this file).

Examples per run: ``COPYTRACE_FUZZ_EXAMPLES`` (default 40, a few seconds each); e.g.
``COPYTRACE_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz.py`` for a longer local run.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import types
import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace

EXAMPLES = int(os.environ.get("COPYTRACE_FUZZ_EXAMPLES", "40"))


def _is_float(t):
    return t.dtype.is_floating_point


# Each op: (name, applicable(t), fn(t) -> tensor). Each produces exactly one copytrace event.
def _copy_into(t):
    dst = torch.empty_like(t)
    return dst.copy_(t)


OPS = {
    "clone": (lambda t: True, lambda t: t.clone()),
    "detach": (lambda t: True, lambda t: t.detach()),
    "data": (lambda t: True, lambda t: t.data),
    "to_same": (lambda t: True, lambda t: t.to(t.dtype)),
    "to_double": (lambda t: True, lambda t: t.to(torch.float64)),
    "to_copy": (lambda t: True, lambda t: t.to("cpu", copy=True)),
    "float": (lambda t: True, lambda t: t.float()),
    "contiguous": (lambda t: True, lambda t: t.contiguous()),
    "reshape": (lambda t: True, lambda t: t.reshape(-1)),
    "copy_": (lambda t: True, _copy_into),
    "deepcopy": (lambda t: t.is_leaf, lambda t: copy.deepcopy(t)),
    "copy.copy": (lambda t: not t.requires_grad, lambda t: copy.copy(t)),
    "tensor_ctor": (lambda t: True, lambda t: torch.tensor(t)),
}


@st.composite
def programs(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int64, torch.float16]))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    transposed = len(shape) > 1 and draw(st.booleans())
    requires_grad = dtype.is_floating_point and draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    ops = draw(st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=6))
    chain = draw(st.lists(st.booleans(), min_size=len(ops), max_size=len(ops)))
    return dtype, shape, transposed, requires_grad, seed, ops, chain


def _make(dtype, shape, transposed, requires_grad, seed):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(shape, generator=g) * 10).to(dtype)
    if transposed:
        base = base.transpose(0, -1)
    if requires_grad:
        base = base.detach().requires_grad_(True)
    return base


def _run(program, tracer=None):
    """Run the program (under ``tracer`` if given); return (name, input, output) per op."""
    dtype, shape, transposed, requires_grad, seed, ops, chain = program
    x = _make(dtype, shape, transposed, requires_grad, seed)
    with tracer if tracer is not None else contextlib.nullcontext():
        return _apply(x, ops, chain)


def _apply(x, ops, chain):
    current = x
    pairs = []
    for name, use_last in zip(ops, chain, strict=True):
        src = current if use_last else x
        applicable, fn = OPS[name]
        if not applicable(src):
            src = x if applicable(x) else None
        if src is None:
            pairs.append((name, None, None))
            continue
        out = fn(src)
        pairs.append((name, src, out))
        current = out
    return pairs


def _expected(name, src, out):
    """Independent bytes/alias check from storages alone."""
    if name == "copy_":
        return 0, False  # writes into an existing tensor
    same = out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
    if src.numel() == 0:
        same = True
    return (0 if same else out.untyped_storage().nbytes()), same


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(programs())
def test_traced_equals_untraced_and_events_match_storages(program):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.tensor(t) warns, traced and untraced alike
        plain = _run(program)
        t = copytrace.trace(write=False)
        traced = _run(program, t)
    assert t.stats["errors"] == 0
    ran = [(n, s, o) for n, s, o in traced if o is not None]
    events = [e for e in t.events if not e.group]
    assert len(events) == len(ran), (program, [e.op for e in events])
    for (name, src, out), ev in zip(ran, events, strict=True):
        want_bytes, want_alias = _expected(name, src, out)
        assert (ev.bytes_allocated, ev.alias) == (want_bytes, want_alias), (name, ev)
        assert ev.shape == tuple(out.shape) and ev.dtype == str(out.dtype).removeprefix("torch.")
    for (n1, _, a), (n2, _, b) in zip(plain, traced, strict=True):
        assert n1 == n2
        if a is None:
            assert b is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.requires_grad == b.requires_grad
        assert type(a.grad_fn) is type(b.grad_fn)
        assert torch.equal(a.detach(), b.detach())


# --- programs in contexts, with subclasses, user modes and a compiled function ---------------


class Sub(torch.Tensor):
    """A plain Python subclass, as user code makes them."""


_GRAPH_CALLS = [0]


def _counting_backend(gm, example_inputs):
    """A torch.compile backend that runs the FX graph and counts the calls into it."""

    def run(*args):
        _GRAPH_CALLS[0] += 1
        return gm.forward(*args)

    return run


def _affine(t):
    return (t * 2 + 1).clone()


def _compiled(t):
    """``_affine`` compiled afresh: a new code object, so that no earlier example's compiled
    code (or dynamo's choice to run a frame eagerly under a dispatch mode, which sticks to the
    code object) carries over."""
    fresh = types.FunctionType(_affine.__code__.replace(), globals(), "_affine")
    return torch.compile(fresh, backend=_counting_backend, dynamic=True)(t)


EXTRA_OPS = {
    "subclass": (lambda t: True, lambda t: Sub(t)),
    "make_subclass": (lambda t: t.is_leaf, lambda t: Sub._make_subclass(Sub, t, t.requires_grad)),
    "as_subclass": (lambda t: True, lambda t: t.as_subclass(Sub)),
    "as_tensor": (lambda t: True, lambda t: t.as_subclass(torch.Tensor)),
    "matmul": (lambda t: t.dtype != torch.float16, lambda t: t.reshape(-1, 1) @ t.reshape(1, -1)),
}
_COMPILED_OP = (lambda t: type(t) is torch.Tensor and t.dtype == torch.float32, _compiled)
CONTEXTS = ("none", "no_grad", "autocast", "device")
USER_MODES = ("none", "function-inside", "function-outside", "dispatch-inside", "dispatch-outside")


class _CountFunctions(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.armed = False
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.armed:
            self.calls[resolve_name(func) or repr(func)] += 1
        return func(*args, **(kwargs or {}))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.armed = False
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.armed:
            self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


@st.composite
def wrapped_programs(draw):
    base = draw(programs())
    ops = draw(st.lists(st.sampled_from(sorted(OPS) + sorted(EXTRA_OPS)), min_size=1, max_size=6))
    if draw(st.integers(0, 3)) == 0:  # compiled code in one program of four: compiles are slow
        ops.insert(draw(st.integers(0, len(ops))), "compiled")
    chain = draw(st.lists(st.booleans(), min_size=len(ops), max_size=len(ops)))
    context = draw(st.sampled_from(CONTEXTS))
    user_mode = draw(st.sampled_from(USER_MODES))
    return (*base[:5], ops, chain), context, user_mode


def _context(name):
    if name == "no_grad":
        return torch.no_grad()
    if name == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if name == "device":
        return torch.device("cpu")
    return contextlib.nullcontext()


def _outcome(fn, src):
    try:
        return fn(src)
    except Exception as err:  # the same exception must come traced and untraced
        return err


def _run_wrapped(program, context, user_mode, traced):
    """Run the program in its context and user mode; return (results, mode calls, graph calls)."""
    dtype, shape, transposed, requires_grad, seed, ops, chain = program
    x = _make(dtype, shape, transposed, requires_grad, seed)
    mode = None
    if user_mode != "none":
        mode = _CountFunctions() if user_mode.startswith("function") else _CountOps()
    outside = mode if mode is not None and user_mode.endswith("outside") else None
    inside = mode if mode is not None and user_mode.endswith("inside") else None
    tracer = copytrace.trace(write=False) if traced else None
    graph_calls = _GRAPH_CALLS[0]
    with outside or contextlib.nullcontext(), tracer or contextlib.nullcontext():
        with inside or contextlib.nullcontext(), _context(context):
            if mode is not None:
                mode.armed = True
            results = []
            current = x
            for name, use_last in zip(ops, chain, strict=True):
                src = current if use_last else x
                applicable, fn = _COMPILED_OP if name == "compiled" else {**OPS, **EXTRA_OPS}[name]
                if not applicable(src):
                    results.append((name, None))
                    continue
                out = _outcome(fn, src)
                results.append((name, out))
                if isinstance(out, torch.Tensor):
                    current = out
            if mode is not None:
                mode.armed = False
    calls = dict(mode.calls) if mode is not None else {}
    errors = tracer.stats["errors"] if tracer is not None else 0
    return results, calls, _GRAPH_CALLS[0] - graph_calls, errors


def _same_result(a, b):
    if a is None or b is None or isinstance(a, Exception) or isinstance(b, Exception):
        assert type(a) is type(b) and str(a) == str(b), (a, b)
        return
    assert type(a) is type(b)
    assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
    assert (a.requires_grad, a.is_leaf) == (b.requires_grad, b.is_leaf)
    assert type(a.grad_fn) is type(b.grad_fn)
    plain_a, plain_b = (v.detach().as_subclass(torch.Tensor) for v in (a, b))
    assert torch.equal(plain_a, plain_b)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(wrapped_programs())
def test_modes_subclasses_and_compiled_code_see_the_same_program(wrapped):
    program, context, user_mode = wrapped
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.tensor(t) warns, traced and untraced alike
        plain, plain_calls, plain_graphs, _ = _run_wrapped(program, context, user_mode, False)
        traced, traced_calls, traced_graphs, errors = _run_wrapped(
            program, context, user_mode, True
        )
    assert errors == 0
    for (n1, a), (n2, b) in zip(plain, traced, strict=True):
        assert n1 == n2
        _same_result(a, b)
    assert traced_calls == plain_calls  # the user's mode sees the program's calls, no others
    assert traced_graphs == plain_graphs  # compiled code ran compiled, as often
