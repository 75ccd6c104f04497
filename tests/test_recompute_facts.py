"""Copies an activation checkpoint makes again in backward (``torch.utils.checkpoint``),
checked against what a plain ``TorchDispatchMode`` sees (the dispatch-level truth).

Under checkpointing a block's forward runs twice per step: once in forward, and again in
backward to rebuild the activations it did not keep. The second run is the user's own code:
its copies are the user's ops on the user's lines, in the block's module, marked
``recompute`` and phase backward. They are the trade checkpointing makes, not copies to
reuse: ``redundant-copy`` does not report them.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import copytrace
from copytrace.analysis import analyze
from copytrace.tracefile import event_table

SETUPS = [
    pytest.param({"level": "lean"}, id="lean"),
    pytest.param({"level": "full"}, id="full"),
    pytest.param({"level": "full", "observer": "python"}, id="python"),
]


class Casts(TorchDispatchMode):
    """Ground truth: each ``_to_copy`` a dispatch mode sees, as (result dtype, in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "_to_copy":
            dtype = str(out.dtype).removeprefix("torch.")
            self.casts.append((dtype, torch._C._current_graph_task_id() >= 0))
        return out


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # the upcast
        h = self.fc(self.norm(h)).relu()
        return x + h.to(x.dtype)  # the cast back


def _line(text: str) -> int:
    lines, first = inspect.getsourcelines(Block.forward)
    return first + next(i for i, line in enumerate(lines) if text in line)


UPCAST, DOWN = _line("x.float()"), _line("h.to(x.dtype)")


class Net(nn.Module):
    def __init__(self, mode: str, d: int = 128) -> None:
        super().__init__()
        self.stem = nn.Linear(64, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.mode = mode

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = self.stem(inp).to(torch.bfloat16)
        if self.mode == "sequential":
            x = checkpoint_sequential(self.blocks, 2, x, use_reentrant=False)
        for blk in self.blocks if self.mode != "sequential" else ():
            if self.mode == "plain":
                x = blk(x)
            else:
                x = checkpoint(blk, x, use_reentrant=self.mode == "reentrant")
        return x.float().square().mean()


def _train(mode: str, steps: int, t: object = None) -> list[float]:
    torch.manual_seed(1)
    net = Net(mode)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    inp = torch.randn(32, 64)
    losses = []
    for _ in range(steps):
        loss = net(inp)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if t is not None:
            t.step()  # type: ignore[attr-defined]
    return losses


def _upcasts(events: list, line: int) -> list[tuple]:
    return [
        (e.op, e.phase, e.module, e.recompute, e.bytes_allocated, e.graph, e.via)
        for e in events
        if e.file == __file__ and e.line == line and e.step == 0
    ]


@pytest.mark.parametrize("setup", SETUPS)
def test_checkpoint_reruns_the_users_upcast_in_backward(setup: dict, tmp_path: Path) -> None:
    with Casts() as truth:
        _train("checkpoint", 1)
    # per block: the upcast in forward and again in backward (non-reentrant checkpointing
    # stops recomputing once the saved tensors are rebuilt: the cast back is not re-run)
    x_f32 = [c for c in truth.casts if c[0] == "float32"]
    assert x_f32.count(("float32", True)) >= 2
    expected = _train("checkpoint", 3)
    with copytrace.trace(tmp_path, **setup) as t:
        assert _train("checkpoint", 3, t) == expected
    # x is bf16 [32, 128]: the fp32 upcast allocates 32 x 128 x 4 = 16384 B
    fwd = [("float", "forward", f"Net.blocks.{i}", False, 16384, "attached", None) for i in (0, 1)]
    bwd = [("float", "backward", f"Net.blocks.{i}", True, 16384, "attached", None) for i in (1, 0)]
    assert _upcasts(t.events, UPCAST) == fwd + bwd
    assert [(e.phase, e.recompute) for e in t.events if e.line == DOWN and e.step == 0] == [
        ("forward", False), ("forward", False),
    ]  # fmt: skip
    codes = [(f.code, f.call_sites) for f in analyze(event_table(t.trace_path))]
    assert not [c for c, sites in codes if c == "redundant-copy"], codes
    assert t.stats["errors"] == 0


@pytest.mark.parametrize("setup", SETUPS)
def test_reentrant_checkpoint_reruns_the_whole_block(setup: dict) -> None:
    with Casts() as truth:
        _train("reentrant", 1)
    # the reentrant form re-runs the whole forward: both casts of each block, in backward
    backward = [c for c in truth.casts if c[1]]
    assert backward.count(("float32", True)) >= 2 and backward.count(("bfloat16", True)) >= 2
    with copytrace.trace(write=False, **setup) as t:
        _train("reentrant", 1, t)
    again = [(e.op, e.line, e.module) for e in t.events if e.recompute]
    assert again == [
        ("float", UPCAST, "Net.blocks.1"), ("to", DOWN, "Net.blocks.1"),
        ("float", UPCAST, "Net.blocks.0"), ("to", DOWN, "Net.blocks.0"),
    ]  # fmt: skip
    assert all(e.phase == "backward" and e.via is None for e in t.events if e.recompute)
    # autograd's own casts of the gradients (ToCopyBackward0) are no recomputation
    assert [e for e in t.events if e.via == "ToCopyBackward0" and e.recompute] == []


@pytest.mark.parametrize("setup", SETUPS[1:])
def test_checkpoint_sequential_and_a_plain_run(setup: dict) -> None:
    counts = []
    for mode in ("sequential", "plain"):
        with Casts() as truth:
            _train(mode, 1)
        counts.append(truth.casts.count(("float32", True)))
    # the fp32 casts in backward beyond the plain run's (gradient casts) are recomputed
    # upcasts: checkpoint_sequential runs its last segment without a checkpoint, so with
    # 2 segments of one block only the first block's upcast runs again
    assert counts[0] - counts[1] == 1
    with copytrace.trace(write=False, **setup) as t:
        _train("sequential", 1, t)
        _train("plain", 1, t)
    first, second = [e for e in t.events if e.step == 0], [e for e in t.events if e.step == 1]
    assert [e.module for e in first if e.recompute and e.line == UPCAST] == ["Net.blocks.0"]
    # the plain run: one upcast per block, nothing recomputed
    assert [(e.phase, e.recompute) for e in second if e.line == UPCAST] == [
        ("forward", False), ("forward", False),
    ]  # fmt: skip
    assert not [e for e in second if e.recompute]


def _inner(h: torch.Tensor) -> torch.Tensor:
    return h.half().relu()  # the inner checkpoint's cast


def _outer(x: torch.Tensor) -> torch.Tensor:
    h = x.float() * 2  # the outer checkpoint's cast
    return checkpoint(_inner, h, use_reentrant=False)


class CastPairs(TorchDispatchMode):
    """Ground truth: each ``_to_copy`` in backward as (source dtype, result dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "_to_copy" and torch._C._current_graph_task_id() >= 0:
            self.pairs.append((str(args[0].dtype)[6:], str(out.dtype)[6:]))
        return out


@pytest.mark.parametrize("setup", SETUPS[1:])
def test_nested_checkpoints_rerun_each_users_cast(setup: dict) -> None:
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    with CastPairs() as truth:
        checkpoint(_outer, x, use_reentrant=False).sum().backward()
    # recomputed casts: bf16 -> fp32 (outer) and fp32 -> fp16 (inner); the gradient casts
    # autograd makes go the other way (fp32 -> bf16, fp16 -> fp32)
    outer, inner = truth.pairs.count(("bfloat16", "float32")), truth.pairs.count(("float32", "float16"))
    assert outer >= 1 and inner >= 1
    with copytrace.trace(write=False, **setup) as t:
        checkpoint(_outer, x, use_reentrant=False).sum().backward()
    again = [(e.op, e.src_dtype, e.dtype) for e in t.events if e.recompute]
    assert sorted(again) == sorted(
        [("float", "bfloat16", "float32")] * outer + [("half", "float32", "float16")] * inner
    )
    assert all(e.function in ("_outer", "_inner") for e in t.events if e.recompute)
