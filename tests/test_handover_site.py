"""An aliased ``state_dict()`` handover names the load that aliased, not only the
``state_dict()`` line: the events carry ``load_site`` and ``aliasing-snapshot`` lists it first.

The aliasing itself is checked against a plain ``TorchDispatchMode``: the load runs no aten op
that writes new memory (no ``copy_``, ``clone`` or ``_to_copy``), and the receiver's tensors sit
on the source's storages. Findings are read both from the live events and from the trace file.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace
from copytrace.analysis import analyze, format_findings
from copytrace.tracefile import event_table

_SOURCE = Path(__file__).read_text().splitlines()
_COPY_OPS = {"copy_", "clone", "_to_copy"}


def site(name: str, function: str) -> str:
    """``file:line function`` of the line tagged ``# site: name`` in this file."""
    (line,) = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(f"# site: {name}")]
    return f"{__file__}:{line} {function}"


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(4, 8)).square().mean().backward()
        opt.step()


def module_assign(log: OpLog | None = None) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    parent, child = nn.Linear(8, 4), nn.Linear(8, 4)
    opt = torch.optim.SGD(parent.parameters(), lr=0.1)
    sd = parent.state_dict()  # site: module-sd
    with log or OpLog():
        child.load_state_dict(sd, assign=True)  # site: module-load
    _train(parent, opt)
    return parent, child


def optimizer_load(log: OpLog | None = None) -> tuple[Any, Any]:
    torch.manual_seed(0)
    parent = nn.Linear(8, 4)
    opt_parent = torch.optim.SGD(parent.parameters(), lr=0.1, momentum=0.9)
    _train(parent, opt_parent)
    opt_child = torch.optim.SGD(copy.deepcopy(parent).parameters(), lr=0.1, momentum=0.9)
    state = opt_parent.state_dict()  # site: opt-sd
    with log or OpLog():
        opt_child.load_state_dict(state)  # site: opt-load
    _train(parent, opt_parent)
    return opt_parent, opt_child


def test_the_truth_the_loads_alias_without_a_copy() -> None:
    log = OpLog()
    parent, child = module_assign(log)
    assert not _COPY_OPS & set(log.ops)
    assert child.weight.untyped_storage().data_ptr() == parent.weight.untyped_storage().data_ptr()
    log = OpLog()
    opt_parent, opt_child = optimizer_load(log)
    assert not _COPY_OPS & set(log.ops)  # same device and dtype: the state tensors are kept
    kept = [s["momentum_buffer"].data_ptr() for s in opt_child.state.values()]
    assert kept == [s["momentum_buffer"].data_ptr() for s in opt_parent.state.values()]


def _findings_both_ways(program: Any, tmp_path: Path) -> tuple[list, list, list]:
    with copytrace.trace(tmp_path) as t:
        keep = program()
    assert t.stats["errors"] == 0
    del keep
    live = [f for f in analyze(t.events) if f.code == "aliasing-snapshot"]
    filed = [f for f in analyze(event_table(t.trace_path)) if f.code == "aliasing-snapshot"]
    return live, filed, t.events


def test_assign_load_is_named_first_then_the_state_dict_line(tmp_path: Path) -> None:
    live, filed, events = _findings_both_ways(module_assign, tmp_path)
    for findings in (live, filed):
        (f,) = findings
        assert f.call_sites == [site("module-load", "module_assign"),
                                site("module-sd", "module_assign")]  # fmt: skip
        assert f.bytes == 4 * 8 * 4 + 4 * 4  # weight and bias, float32
        assert f"at `{site('module-load', 'module_assign')}`" in f.message
        assert "load_state_dict" in f.message
    handed = [e for e in events if e.snapshot]
    assert {e.load_site for e in handed} == {site("module-load", "module_assign")}


def test_optimizer_load_that_silently_aliases_is_named(tmp_path: Path) -> None:
    live, filed, _ = _findings_both_ways(optimizer_load, tmp_path)
    for findings in (live, filed):
        (f,) = findings
        # the no-op `.to` aliases are made inside the load: their own site is the load line
        assert f.call_sites == [site("opt-load", "optimizer_load")], format_findings(findings)
        assert f.bytes == 4 * 8 * 4 + 4 * 4  # the two momentum buffers


def test_near_miss_a_copied_state_on_its_own_line_is_clean() -> None:
    def program() -> None:
        parent, child = nn.Linear(8, 4), nn.Linear(8, 4)
        opt = torch.optim.SGD(parent.parameters(), lr=0.1)
        sd = copy.deepcopy(parent.state_dict())
        child.load_state_dict(sd, assign=True)  # owns the copies: nothing shared
        _train(parent, opt)

    with copytrace.trace(write=False) as t:
        program()
    assert [f.code for f in analyze(t.events)] == []
    assert not any(e.load_site for e in t.events)
