"""Differential fuzzing: random short programs over the copy/alias ops, traced vs untraced.

For every generated program the traced results must equal the untraced ones (values, dtype,
requires_grad, grad_fn type), and every recorded event's ``bytes_allocated`` and ``alias``
must agree with an independent check of the storages involved.

Examples per run: ``COPYTRACE_FUZZ_EXAMPLES`` (default 40, a few seconds); e.g.
``COPYTRACE_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz.py`` for a longer local run.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
