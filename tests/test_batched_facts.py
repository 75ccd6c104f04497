"""Copies of batched tensors (``torch.func.vmap``), each checked against what a plain
``TorchDispatchMode`` sees (the dispatch-level truth).

A batched tensor is a view of one member of a physical tensor that holds the whole batch: the
body of a vmapped function runs once, and each of its copies copies every member at once. A
dispatch mode (below functorch's batching key) sees that one call on the physical tensor. So a
``clone`` inside ``vmap`` over 5 members of 4096 B allocates 20480 B.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, stack_module_state, vmap
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace

SETUPS = [
    pytest.param({"level": "lean"}, id="lean"),
    pytest.param({"level": "full"}, id="full"),
    pytest.param({"level": "full", "observer": "python"}, id="python"),
]
_COPY_OPS = ("clone", "_to_copy")


class Allocations(TorchDispatchMode):
    """Ground truth: each copy op a dispatch mode sees, with its result's storage bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _COPY_OPS and isinstance(out, torch.Tensor):
            self.made.append((name, out.untyped_storage().nbytes()))
        return out


def _facts(events: list, op: str) -> list[tuple]:
    return [
        (e.aten, e.bytes_allocated, e.bytes_logical, e.batch_size, e.shape)
        for e in events
        if e.op == op
    ]


@pytest.mark.parametrize("setup", SETUPS)
def test_a_clone_inside_vmap_allocates_the_whole_batch(setup: dict) -> None:
    x = torch.randn(5, 64, 16)  # 5 members of 64 x 16 float32 = 4096 B each

    def body(a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    with Allocations() as truth:
        vmap(body)(x)
    assert truth.made == [("clone", 20480)]  # one call, the whole batch: 5 x 4096 B
    with copytrace.trace(write=False, **setup) as t:
        out = vmap(body)(x)
    assert torch.equal(out, x)
    assert _facts(t.events, "clone") == [(("aten::clone",), 20480, 20480, 5, (64, 16))]
    (ev,) = [e for e in t.events if e.op == "clone"]
    assert ev.src_storage is not None and ev.dst_storage is not None
    assert ev.src_storage != ev.dst_storage and not ev.alias
    assert t.stats["errors"] == 0


@pytest.mark.parametrize("setup", SETUPS)
def test_a_dtype_conversion_and_nested_vmap(setup: dict) -> None:
    x = torch.randn(5, 64, 16)

    def widen(a: torch.Tensor) -> torch.Tensor:
        return a.to(torch.float64)

    def copy_row(a: torch.Tensor) -> torch.Tensor:
        return a.clone()  # a row of 16 values, over 5 x 64 members

    with Allocations() as truth:
        vmap(widen)(x)
        vmap(vmap(copy_row))(x)
    # float64 doubles the 20480 B; the nested clone copies all 5 x 64 rows at once
    assert truth.made == [("_to_copy", 40960), ("clone", 20480)]
    with copytrace.trace(write=False, **setup) as t:
        vmap(widen)(x)
        vmap(vmap(copy_row))(x)
    assert _facts(t.events, "to") == [(("aten::_to_copy",), 40960, 40960, 5, (64, 16))]
    assert _facts(t.events, "clone") == [(("aten::clone",), 20480, 20480, 320, (16,))]
    assert all(e.batch_size is None for e in t.events if e.op not in ("to", "clone"))


class _Member(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
        h = x.clone()  # each member edits its own copy of its input
        h[:, :2] = h[:, :2] * sign
        return self.fc2(torch.relu(self.fc1(h)))


def _ensemble() -> tuple:
    torch.manual_seed(0)
    members = [_Member() for _ in range(5)]
    params, buffers = stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")

    def one(p: dict, b: dict, x: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
        return functional_call(base, (p, b), (x, sign))

    def one_to_numpy(p: dict, b: dict, x: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
        factor = sign.clone().cpu().numpy()  # a member's value to NumPy: vmap refuses it
        return functional_call(base, (p, b), (x, sign)) * float(factor)

    return params, buffers, one, one_to_numpy


def _run_ensemble(x: torch.Tensor, signs: torch.Tensor) -> tuple:
    params, buffers, one, one_to_numpy = _ensemble()
    out = vmap(one)(params, buffers, x, signs)
    with pytest.raises(RuntimeError) as err:
        vmap(one_to_numpy)(params, buffers, x, signs)
    return out, str(err.value)


@pytest.mark.parametrize("setup", SETUPS)
def test_an_ensemble_of_functional_calls_under_vmap(setup: dict) -> None:
    x = torch.randn(5, 64, 16)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    params, buffers, one, _ = _ensemble()
    with Allocations() as truth:
        vmap(one)(params, buffers, x, signs)
    # the members' input copy: one clone of the whole batch, 5 x 64 x 16 x 4 = 20480 B
    assert [m for m in truth.made if m[0] == "clone"] == [("clone", 20480)]
    expected, message = _run_ensemble(x, signs)
    with copytrace.trace(write=False, **setup) as t:
        out, traced_message = _run_ensemble(x, signs)
    assert torch.equal(out, expected) and traced_message == message
    clones = [e for e in t.events if e.op == "clone"]
    # the forward's `h = x.clone()`, then the refused member's `sign.clone()`: 5 x 4 B
    assert [(e.bytes_allocated, e.batch_size, e.aten) for e in clones] == [
        (20480, 5, ("aten::clone",)),
        (20, 5, ("aten::clone",)),
    ]
    assert clones[0].function == "forward" and clones[0].shape == (64, 16)
    numpy = [e for e in t.events if e.op == "numpy"]
    assert [e.error for e in numpy] == ["RuntimeError"]
    assert t.stats["errors"] == 0


@pytest.mark.parametrize("setup", SETUPS)
def test_per_member_gradients_under_vmap(setup: dict) -> None:
    def loss(w: torch.Tensor) -> torch.Tensor:
        return (w.clone() * w.double()).sum().float()

    w = torch.randn(4, 8)  # 4 members of 8 float32
    with Allocations() as truth:
        vmap(torch.func.grad(loss))(w)
    # the whole batch each time: clone 4 x 8 x 4 = 128 B, double 256 B, the scalar float
    # 4 x 4 = 16 B, then the backward's casts of the gradients
    assert truth.made[:3] == [("clone", 128), ("_to_copy", 256), ("_to_copy", 16)]
    with copytrace.trace(write=False, **setup) as t:
        vmap(torch.func.grad(loss))(w)
    assert [e.bytes_allocated for e in t.events] == [n for _, n in truth.made]
    assert [(e.op, e.batch_size) for e in t.events[:3]] == [
        ("clone", 4), ("double", 4), ("float", 4),
    ]  # fmt: skip
    assert t.stats["errors"] == 0
