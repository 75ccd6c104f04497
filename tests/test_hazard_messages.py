"""What each hazard finding says, word for word: code, severity, message, fix, bytes, steps and
call sites of one canonical program per rule that the CPU can run (``docs/hazards.md``).

These are the texts users read in the report, ``copytrace summary`` and ``copytrace check``;
a change to one is a change of the product and shows here. The rules' edge cases (a 1-byte
copy, a scalar, the hot-loop threshold) are pinned down too."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import copytrace
from copytrace._units import format_bytes_exact
from copytrace.analysis._rules import is_hot

_SOURCE = Path(__file__).read_text(encoding="utf-8").splitlines()


def site(tag: str, function: str) -> str:
    (line,) = [i for i, text in enumerate(_SOURCE, 1) if text.rstrip().endswith(f"# site: {tag}")]
    return f"{__file__}:{line} {function}"


def findings(program: Callable[[Any], None]) -> list[tuple]:
    with copytrace.trace(write=False) as t:
        program(t)
    assert t.stats["errors"] == 0
    return [
        (f.code, f.severity, f.message, f.fix, f.bytes, f.steps, f.call_sites)
        for f in copytrace.analyze(t.events)
    ]


_KEEP_DETACHED = (
    "Keep `t.detach()` (or `t.item()` for a number) instead, also when adding it to a total, "
    "or make the copy under `torch.no_grad()`."
)
_CTOR_FIX = (
    "Use `t.detach().clone()` when a copy is needed, or `torch.as_tensor(t)` / `t.to(dtype)` "
    "when it is not. For a list of tensors, `torch.stack(ts)` keeps the autograd graph "
    "(`torch.stack(ts).detach()` when the cut is meant)."
)


def _data_write(t: Any) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    inp = torch.randn(3, 6, requires_grad=True)
    pending = layer(inp).sum()  # AddmmBackward0 saves weight.t()
    layer.weight.data[:, 2] -= 0.25  # site: data-write
    pending.backward()


def test_data_inplace() -> None:
    assert findings(_data_write) == [
        (
            "data-inplace",
            "error",
            "in-place write through `.data` of `Linear.weight` (float32 4x6) changed it after "
            "AddmmBackward0.mat2 had saved it for backward; the backward that followed used the "
            "new values, and autograd could not tell (`.data` has its own version counter): the "
            "gradient is silently wrong",
            "Change the tensor itself, under `torch.no_grad()` and after the backward that needs "
            "its old value, instead of writing through `.data`, so that autograd checks the "
            "write.",
            96,  # the 4x6 float32 weight
            [0],
            [site("data-write", "_data_write")],
        )
    ]


def _keep_clones(n: int) -> Callable[[Any], None]:
    def keep(t: Any) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        x = torch.randn(4, 8)
        keep.history = []  # type: ignore[attr-defined]
        for _ in range(n):
            keep.history.append(model(x).pow(2).mean().clone())  # type: ignore[attr-defined]  # site: keep-clone
            t.step()

    return keep


def test_graph_retaining_copy_one_and_several() -> None:
    # per step: x (128 B), the ReLU output (256 B) and pow's input (16 B) stay saved
    assert findings(_keep_clones(3)) == [
        (
            "graph-retaining-copy",
            "warning",
            "3 attached clone results (CloneBackward0) outlived their steps with the autograd "
            "graph, itself or through a tensor computed from it (a running total), and no "
            "backward ran through that graph: 1200 B (1.2 KiB) of saved tensors kept alive",
            _KEEP_DETACHED,
            1200,
            [0, 1, 2],
            [site("keep-clone", "keep")],
        )
    ]
    ((*_, message), *_) = [(f[2],) for f in findings(_keep_clones(1))]
    assert message == (
        "1 attached clone result (CloneBackward0) outlived its step with the autograd graph, "
        "itself or through a tensor computed from it (a running total), and no backward ran "
        "through that graph: 400 B of saved tensors kept alive"
    )


def _snapshot(t: Any) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    for step in range(3):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 0:
            _snapshot.best = model.state_dict()  # type: ignore[attr-defined]  # site: snapshot


def test_aliasing_snapshot() -> None:
    assert findings(_snapshot) == [
        (
            "aliasing-snapshot",
            "warning",
            "`state_dict()` returned 2 tensors that share storage with the live model, and they "
            "were changed in place (e.g. by `optimizer.step()`) while they were kept: the "
            "snapshot no longer holds the values it was taken with (40 B)",
            "Copy the values: `{k: v.detach().clone() for k, v in model.state_dict().items()}` "
            "(or `copy.deepcopy(model.state_dict())`).",
            40,  # weight 2x4 + bias 2, float32
            [1],
            [site("snapshot", "_snapshot")],
        )
    ]


def _twice(x: torch.Tensor) -> Callable:
    def program(t: Any) -> None:
        program.a = x.clone()  # type: ignore[attr-defined]  # site: first-copy
        program.b = x.to(x.dtype, copy=True)  # type: ignore[attr-defined]  # site: second-copy

    return program


@pytest.mark.parametrize(
    ("x", "what", "nbytes"),
    [
        (torch.arange(16.0), "float32 16", "64 B"),
        (torch.tensor(3.0), "float32 scalar", "4 B"),
        (torch.tensor(True), "bool scalar", "1 B"),  # a copy of 1 byte is a copy
    ],
    ids=["vector", "scalar", "one-byte"],
)
def test_redundant_copy_of_the_same_source(x: torch.Tensor, what: str, nbytes: str) -> None:
    # the first copy's op names the finding, whatever the later ones were
    program = _twice(x)
    assert findings(program) == [
        (
            "redundant-copy",
            "warning",
            f"the same unchanged source ({what}) was copied again within a step: 1 extra copy "
            f"(clone), {nbytes} allocated for data already copied",
            "Make the copy once per step and reuse it.",
            x.numel() * x.element_size(),
            [0],
            [site("first-copy", "program"), site("second-copy", "program")],
        )
    ]


def _chain(t: Any) -> None:
    x = torch.arange(16.0)
    _chain.y = x.double().clone()  # type: ignore[attr-defined]  # site: chain


def _chain_over_two_lines(t: Any) -> None:
    x = torch.arange(16.0)
    y = x.double()
    _chain_over_two_lines.z = y.clone()  # type: ignore[attr-defined]


def test_redundant_copy_chain_on_one_line_only() -> None:
    assert findings(_chain) == [
        (
            "redundant-copy",
            "warning",
            "a copy of a fresh copy on one line (double -> clone): the intermediate result is "
            "copied again and dropped, 128 B allocated for nothing",
            "Fold the chain into one call, e.g. a single `t.to(device, dtype)` or one `clone()`.",
            128,  # the float64 intermediate
            [0],
            [site("chain", "_chain")],
        )
    ]
    assert findings(_chain_over_two_lines) == []  # a kept intermediate: not a chain


def _deepcopy_each_step(t: Any) -> None:
    model = nn.Linear(4, 4)
    for _ in range(3):
        _deepcopy_each_step.target = copy.deepcopy(model)  # type: ignore[attr-defined]  # site: deepcopy
        t.step()


def test_deepcopy_in_loop() -> None:
    assert findings(_deepcopy_each_step) == [
        (
            "deepcopy-in-loop",
            "warning",
            "copy.deepcopy of torch.nn.modules.linear.Linear ran 3 times in 3 steps (0-2), 240 B "
            "allocated",
            "Deep-copy once before the loop and refresh the copy in place each step: "
            "`target.load_state_dict(model.state_dict())`, or for an EMA "
            "`torch._foreach_lerp_(ema_params, params, 1 - decay)`.",
            240,  # 3 x (4x4 + 4) float32
            [0, 1, 2],
            [site("deepcopy", "_deepcopy_each_step")],
        )
    ]


def _deepcopy_tensors_and_dicts(t: Any) -> None:
    w = torch.ones(4)  # 16 B
    keep = []
    for _ in range(3):
        keep.append(copy.deepcopy(w))  # site: deepcopy-tensor
        t.step()
    for _ in range(3):
        keep.append(copy.deepcopy({"w": w}))  # site: deepcopy-dict
        t.step()


def test_deepcopy_in_loop_of_a_tensor_and_of_a_state_dict() -> None:
    message = "copy.deepcopy of {} ran 3 times in 3 steps ({}), 48 B allocated"  # 3 x 16 B
    assert findings(_deepcopy_tensors_and_dicts) == [
        (
            "deepcopy-in-loop",
            "warning",
            message.format("torch.Tensor", "0-2"),
            "Allocate the copy once and refresh it with `dst.copy_(src)` each step.",
            48,
            [0, 1, 2],
            [site("deepcopy-tensor", "_deepcopy_tensors_and_dicts")],
        ),
        (
            "deepcopy-in-loop",
            "warning",
            message.format("builtins.dict", "3-5"),
            "Allocate the copy once and refresh it in place each step: "
            "`for k, v in sd.items(): snap[k].copy_(v)`.",
            48,
            [3, 4, 5],
            [site("deepcopy-dict", "_deepcopy_tensors_and_dicts")],
        ),
    ]


def _ctor(t: Any) -> None:
    w = torch.ones(10, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning against it
        for _ in range(2):
            torch.tensor(w)  # site: ctor
            t.step()
        w.new_tensor(w)  # site: new-tensor


def test_tensor_ctor_copy() -> None:
    assert findings(_ctor) == [
        (
            "tensor-ctor-copy",
            "warning",
            "`torch.tensor(t)` of an existing tensor copies it and cuts it from the autograd "
            "graph (2 times, 80 B); torch warns against this form",
            _CTOR_FIX,
            80,
            [0, 1],
            [site("ctor", "_ctor")],
        ),
        (
            "tensor-ctor-copy",
            "warning",
            "`t.new_tensor(x)` of an existing tensor copies it and cuts it from the autograd "
            "graph (1 time, 40 B); torch warns against this form",
            _CTOR_FIX,
            40,
            [2],
            [site("new-tensor", "_ctor")],
        ),
    ]


def _as_tensor(t: Any) -> None:
    w = torch.ones(3, requires_grad=True)
    parts = [w[0] * 2, w[1] * 3]  # 0-d, each with a grad_fn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's scalar-conversion warning
        torch.as_tensor(parts)  # site: as-tensor
        torch.as_tensor(w)  # w itself: no copy, no finding


def test_tensor_ctor_copy_of_as_tensor_names_stack_not_as_tensor() -> None:
    assert findings(_as_tensor) == [
        (
            "tensor-ctor-copy",
            "warning",
            "`torch.as_tensor([t, ...])` of an existing tensor copies it and cuts it from the "
            "autograd graph (1 time, 8 B); torch warns against this form",  # 2 float32
            "For a list of tensors, `torch.stack(ts)` keeps the autograd graph "
            "(`torch.stack(ts).detach()` when the cut is meant).",
            8,
            [0],
            [site("as-tensor", "_as_tensor")],
        ),
    ]


def _clone_detach(t: Any) -> None:
    w = torch.ones(5, requires_grad=True)
    _clone_detach.s = w.clone().detach()  # type: ignore[attr-defined]  # site: clone-detach


def test_clone_detach_order() -> None:
    assert findings(_clone_detach) == [
        (
            "clone-detach-order",
            "info",
            "`clone().detach()` (1 time, 20 B): the clone is recorded by autograd "
            "(CloneBackward0) and then cut off again",
            "Write `t.detach().clone()`: the copy is then made outside autograd.",
            20,
            [0],
            [site("clone-detach", "_clone_detach")],
        )
    ]


def _noops(t: Any) -> None:
    x = torch.ones(4)
    for _ in range(3):
        x = x.to("cpu")  # site: noop-to
        x = x.contiguous()  # site: noop-contiguous
        t.step()


def test_noop_conversion() -> None:
    message = (
        "`.{}()` returned its input unchanged (already {}) 3 times in 3 steps: harmless, Python "
        "overhead only"
    )
    assert findings(_noops) == [
        (
            "noop-conversion",
            "info",
            message.format("to", "float32 on cpu"),
            "Drop the `.to()` call, or guard it (`if t.device != device:`) if the hot loop "
            "matters.",
            0,
            [0, 1, 2],
            [site("noop-to", "_noops")],
        ),
        (
            "noop-conversion",
            "info",
            message.format("contiguous", "contiguous"),
            "Drop the `.contiguous()` call if the tensor is always contiguous there.",
            0,
            [0, 1, 2],
            [site("noop-contiguous", "_noops")],
        ),
    ]


def test_format_bytes_units() -> None:
    assert [format_bytes_exact(n) for n in (0, 1023, 1024, 1536 << 10, 3 << 30, 5 << 40)] == [
        "0 B",
        "1023 B",
        "1024 B (1.0 KiB)",
        "1572864 B (1.5 MiB)",
        "3221225472 B (3.0 GiB)",
        "5497558138880 B (5.0 TiB)",
    ]
    assert format_bytes_exact(1 << 50) == "1125899906842624 B (1024.0 TiB)"  # no unit beyond TiB


def test_is_hot_threshold() -> None:
    # hot: at least 3 distinct steps, in at least half the steps from the first to the last
    assert is_hot([0, 1, 5])  # 3 of 6 steps: exactly half
    assert not is_hot([0, 1, 6])  # 3 of 7
    assert not is_hot([4, 4, 5, 5])  # 2 distinct steps
    assert is_hot([7, 8, 9, 9])
