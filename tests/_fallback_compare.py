"""Shared by the tests that compare the Python fallback's values with torch's untraced ones
(``test_fallback_values.py``, ``test_fallback_backward.py``): a plain dispatch mode, and one
program run three ways."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace


class PlainMode(TorchDispatchMode):
    """Any dispatch mode at all: what the fallback's would do without copytrace's care."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def bits(values):
    """Each tensor's bytes (detached, cloned to a contiguous CPU copy first)."""
    return [v.detach().clone().numpy().tobytes() for v in values]


def run(program, how):
    """``program()``'s tensors (values and gradients) as bytes, seed 0: ``"untraced"``,
    ``"plain"`` (under :class:`PlainMode`) or ``"traced"`` (on the fallback, whose dispatch
    mode is then on the stack, with no internal error; the caller sets
    ``COPYTRACE_OBSERVER=python``)."""
    torch.manual_seed(0)
    if how == "untraced":
        return bits(program())
    if how == "plain":
        with PlainMode():
            return bits(program())
    assert how == "traced", how
    with copytrace.trace(write=False) as t:
        assert torch._C._len_torch_dispatch_stack() == 1  # the fallback's mode is on
        out = bits(program())
    assert t.stats["errors"] == 0, t.first_error
    return out
