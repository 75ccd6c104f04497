"""``stale-kept-copy``: a copy of a parameter kept across optimizer steps and used after the
parameter changed in place (its version counter moved), with its near misses.

The truth comes from a plain ``TorchDispatchMode``: how many casts of the weight the forwards
really made (autocast's weight cache makes one for all steps), and whether the copy the last
forward used still equals the parameter.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace
from copytrace.analysis import analyze, format_findings

_SOURCE = Path(__file__).read_text().splitlines()
STEPS = 3


def line_of(name: str) -> int:
    (line,) = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(f"# site: {name}")]
    return line


class WeightCasts(TorchDispatchMode):
    """Ground truth: ``_to_copy`` calls whose input is the weight (by storage)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.ptr = weight.untyped_storage().data_ptr()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if (
            func.overloadpacket is torch.ops.aten._to_copy
            and args[0].untyped_storage().data_ptr() == self.ptr
        ):
            self.casts += 1
        return func(*args, **(kwargs or {}))


def _setup() -> tuple[nn.Linear, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.ones(2, 8)


def autocast_around_the_loop(step: bool = True, truth: bool = False) -> Any:
    model, opt, x = _setup()
    log = WeightCasts(model.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # site: autocast-outside
        for _ in range(STEPS):
            with log if truth else contextlib.nullcontext():
                out = model(x)
            opt.zero_grad()
            out.float().sum().backward()  # site: autocast-backward
            if step:
                opt.step()
    return log.casts, model


def autocast_inside_the_step(truth: bool = False) -> Any:
    model, opt, x = _setup()
    log = WeightCasts(model.weight)
    for _ in range(STEPS):
        with (
            torch.autocast("cpu", dtype=torch.bfloat16),
            log if truth else contextlib.nullcontext(),
        ):
            out = model(x)
        opt.zero_grad()
        out.float().sum().backward()
        opt.step()
    return log.casts, model


def kept_cast(step: bool = True) -> Any:
    model, opt, x = _setup()
    w64 = model.weight.to(torch.float64)  # site: kept
    for _ in range(STEPS):
        out = x.double() @ w64.t()
        opt.zero_grad()
        out.sum().backward()  # site: kept-backward
        if step:
            opt.step()
    return torch.equal(w64.float(), model.weight), model


def _traced(program: Any, **kwargs: Any) -> tuple[Any, list]:
    with copytrace.trace(write=False) as t:
        result = program(**kwargs)
    assert t.stats["errors"] == 0
    return result, analyze(t.events)


def test_autocast_cache_kept_across_optimizer_steps() -> None:
    casts, _ = autocast_around_the_loop(truth=True)
    _, findings = _traced(autocast_around_the_loop)
    assert casts == 1  # the truth: one cast of the weight for three forwards
    (f,) = [x for x in findings if x.code == "stale-kept-copy"]
    assert f.severity == "error" and f.steps == [1, 2]
    assert "autocast's weight cache" in f.message and "`Linear`" in f.message
    assert "cache_enabled=False" in f.fix
    assert f.call_sites == [f"{__file__}:{line_of('autocast-backward')} autocast_around_the_loop"]
    assert f.bytes == 2 * (4 * 8 + 4) * 4  # weight and bias gradients (float32), 2 steps


def test_a_cast_kept_outside_the_loop() -> None:
    (same, _), findings = _traced(kept_cast)
    assert not same  # the truth: the kept copy no longer holds the parameter's values
    (f,) = [x for x in findings if x.code == "stale-kept-copy"]
    assert f.steps == [1, 2]
    assert f.call_sites == [f"{__file__}:{line_of('kept')}",
                            f"{__file__}:{line_of('kept-backward')} kept_cast"]  # fmt: skip
    assert f"the copy made at `{__file__}:{line_of('kept')}`" in f.message


def test_near_miss_autocast_entered_each_step() -> None:
    casts, _ = autocast_inside_the_step(truth=True)
    _, findings = _traced(autocast_inside_the_step)
    assert casts == STEPS  # the truth: a fresh cast every step
    assert "stale-kept-copy" not in [f.code for f in findings], format_findings(findings)


def test_near_miss_kept_copies_whose_source_never_changes() -> None:
    casts, _ = autocast_around_the_loop(step=False, truth=True)
    _, findings = _traced(autocast_around_the_loop, step=False)
    assert casts == 1
    (same, _), more = _traced(kept_cast, step=False)
    assert same  # no optimizer step: the kept copy is still right
    assert "stale-kept-copy" not in [f.code for f in findings + more]
