"""``graph-retaining-copy`` in a program with no step boundary: attached copies kept together
within one step, all gone before tracing stops, are still found (``watch/_accumulate.py``).

Each form runs on both observer paths (the C++ observer and ``COPYTRACE_OBSERVER=python``);
no program here calls ``optimizer.step()`` or ``t.step()``, and each keeps its copies in a
container local to a function that returns before tracing stops. Call sites are located by
``# site: <name>`` comments. The near misses must give no ``graph-retaining-copy``.

Bytes per kept graph (``nn.Sequential(Linear(8, 16), ReLU(), Linear(16, 1))`` on a 4x8 float32
batch): the batch (4x8x4 = 128 B) saved by the first Linear, the ReLU output (4x16x4 = 256 B)
saved by the second Linear and by the ReLU itself (one storage, counted once): 384 B; with
``.pow(2)`` after it, pow's input (4x1x4 = 16 B) too: 400 B. Parameters do not count.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import copytrace
from copytrace.analysis import Finding, analyze, format_findings
from copytrace.tracer.watch import Watch

_SOURCE = Path(__file__).read_text().splitlines()
_OBSERVERS = pytest.mark.parametrize("observer", ["native", "python"])


def site(name: str, function: str) -> str:
    """``file:line function`` of the line tagged ``# site: name`` in this file."""
    tag = f"# site: {name}"
    lines = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(tag)]
    assert len(lines) == 1, f"tag {tag!r} found {len(lines)} times"
    return f"{__file__}:{lines[0]} {function}"


def traced(program: Callable[[], Any], observer: str, monkeypatch: Any) -> tuple[Any, list[Finding]]:
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    with copytrace.trace(write=False) as t:
        program()
    assert t.observer_path == observer
    assert t.stats["errors"] == 0, t.session._rec.last_error
    return t, analyze(t.events)


def retaining(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.code == "graph-retaining-copy"]


def _model() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, [torch.randn(4, 8) for _ in range(6)]


# --------------------------------------------------------------------------------------------
# kept graphs, no step boundary
# --------------------------------------------------------------------------------------------


def _loss_history() -> int:
    # an evaluation pass outside torch.no_grad(): each loss is logged as a clone in a list
    # that lives until the function returns (the clones keep every iteration's activations)
    model, batches = _model()
    history = []
    for x in batches:
        loss = model(x).pow(2).mean()
        history.append(loss.clone())  # site: history-clone
    return len(history)


def _dict_in_while() -> int:
    # outputs kept by index in a dict, filled in a while loop
    model, batches = _model()
    kept: dict[int, torch.Tensor] = {}
    i = 0
    while i < len(batches):
        kept[i] = model(batches[i]).clone()  # site: dict-clone
        i += 1
    return len(kept)


def _cloned_outputs(model: nn.Module, batches: list[torch.Tensor]) -> Any:
    for x in batches:
        yield model(x).clone()  # site: generator-clone


def _generator_consumed() -> int:
    # a generator of cloned outputs, gathered into a list at once
    model, batches = _model()
    outputs = list(_cloned_outputs(model, batches))
    return len(outputs)


@_OBSERVERS
@pytest.mark.parametrize(
    "program, tag, function, per_copy",
    [(_loss_history, "history-clone", "_loss_history", 400),
     (_dict_in_while, "dict-clone", "_dict_in_while", 384),
     (_generator_consumed, "generator-clone", "_cloned_outputs", 384)],
    ids=["loss-history", "dict-in-while", "generator"],
)  # fmt: skip
def test_copies_kept_within_one_step_retain_their_graphs(
    program: Callable[[], int], tag: str, function: str, per_copy: int, observer: str,
    monkeypatch: Any,
) -> None:  # fmt: skip
    t, findings = traced(program, observer, monkeypatch)
    (f,) = retaining(findings)
    assert f.call_sites == [site(tag, function)], format_findings(findings)
    # 6 batches: every copy kept while the next ones were made, all gone at the stop
    assert [e.retained_bytes for e in t.events if e.op == "clone"] == [per_copy] * 6
    assert f.bytes == 6 * per_copy and f.steps == [0]


# --------------------------------------------------------------------------------------------
# near misses
# --------------------------------------------------------------------------------------------


def _gather_then_backward() -> int:
    # micro-batch gradient accumulation: the clones are gathered, then one backward runs
    # through all of them (freeing what their graphs saved)
    model, batches = _model()
    losses = [model(x).pow(2).mean().clone() for x in batches]
    torch.stack(losses).mean().backward()
    return len(losses)


def _backward_each_micro_batch() -> int:
    # a clone logged, then the micro-batch's backward through the loss it was taken from
    model, batches = _model()
    logged = []
    for x in batches:
        loss = model(x).pow(2).mean()
        logged.append(loss.clone())
        (loss / len(batches)).backward()
    return len(logged)


def _detached_before_kept() -> int:
    model, batches = _model()
    history = [model(x).pow(2).mean().clone().detach() for x in batches]
    return len(history)


def _rebound_each_iteration() -> int:
    # one clone at a time: the variable is rebound, the previous clone and its graph go
    model, batches = _model()
    last = None
    for x in batches * 4:
        last = model(x).pow(2).mean().clone()
    return int(last is not None)


@_OBSERVERS
@pytest.mark.parametrize(
    "program",
    [_gather_then_backward, _backward_each_micro_batch, _detached_before_kept,
     _rebound_each_iteration],
    ids=["gather-then-backward", "backward-each-micro-batch", "detached", "rebound"],
)  # fmt: skip
def test_gradient_accumulation_detached_or_rebound_copies_retain_nothing(
    program: Callable[[], int], observer: str, monkeypatch: Any
) -> None:
    t, findings = traced(program, observer, monkeypatch)
    assert any(e.graph == "attached" for e in t.events)  # the watch saw attached copies
    assert retaining(findings) == [], format_findings(findings)
    assert [e.retained_bytes for e in t.events if e.retained_bytes] == []


# --------------------------------------------------------------------------------------------
# the check is amortised
# --------------------------------------------------------------------------------------------


@_OBSERVERS
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "rebound"])
def test_a_site_is_checked_when_its_count_doubles(
    keep: bool, observer: str, monkeypatch: Any
) -> None:
    # 100 attached clones from one line and no backward: the site is checked at its 4th, 8th,
    # 16th, 32nd and 64th copy, whether the clones are kept or each replaced by the next
    checks: list[int] = []
    check = Watch._check_site

    def counted(self: Watch, key: Any, s: Any) -> None:
        checks.append(s.count)
        check(self, key, s)

    monkeypatch.setattr(Watch, "_check_site", counted)
    w = torch.ones(3, requires_grad=True)

    def program() -> None:
        kept = []
        for _ in range(100):
            c = w.exp().clone()
            if keep:
                kept.append(c)

    t, findings = traced(program, observer, monkeypatch)
    assert checks == [4, 8, 16, 32, 64]
    # exp saves its result (3 float32 = 12 B): kept, each of the 100 clones retains 12 B
    kept = [e.retained_bytes for e in t.events if e.op == "clone"]
    assert kept == ([12] * 100 if keep else [None] * 100)
    assert len(retaining(findings)) == int(keep)
