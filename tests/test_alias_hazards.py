"""Two hazard kinds from public bug reports, each in several forms, with its near misses.

* ``alias-write``: an in-place write through a result that aliases its input where a copy
  was likely meant: a conversion with nothing to do (``.to()``, ``.cpu()``, ``.float()``,
  ``.type()``, ``.contiguous()`` return their input itself), a ``reshape()`` that returned a
  view, ``copy.copy(t)`` (a new tensor on the same storage). The same program written with a
  real copy (``copy=True``, ``clone()``, ``copy.deepcopy``, a reshape that copies) is clean,
  and so is a write whose input nothing else holds any more (a temporary, a rebound name).
* ``deepcopy-nonleaf``: ``copy.deepcopy`` of an object holding a tensor still in the autograd
  graph (an activation a forward stored on its module, a model output in a dict) raises;
  the finding names where the tensor was held. Detached caches and leaves copy cleanly.

Programs run under ``copytrace.trace(write=False)``; call sites are located by
``# site: <name>`` comments. Every near miss must give no finding at all.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import copytrace
from copytrace.analysis import Finding, analyze, format_findings
from copytrace.tracer import _native

_SOURCE = Path(__file__).read_text().splitlines()
NATIVE = _native.load() is not None


def site(name: str, function: str) -> str:
    """``file:line function`` of the line tagged ``# site: name`` in this file."""
    tag = f"# site: {name}"
    lines = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(tag)]
    assert len(lines) == 1, f"tag {tag!r} found {len(lines)} times"
    return f"{__file__}:{lines[0]} {function}"


def traced(fn: Callable[[], Any], **options: Any) -> tuple[Any, list[Finding]]:
    """Run ``fn`` traced; what it returned and the findings (no tracer error allowed)."""
    with copytrace.trace(write=False, **options) as t:
        result = fn()
    assert t.stats["errors"] == 0, t.session._rec.last_error
    return result, analyze(t.events)


# --------------------------------------------------------------------------------------------
# alias-write: the forms
# --------------------------------------------------------------------------------------------


def _staging_to() -> list[float]:
    t = torch.zeros(2, 3)
    staging = t.to("cpu")  # site: to
    staging += 1.0  # site: to-write
    return t.flatten().tolist()


def _snapshot_cpu() -> list[float]:
    t = torch.zeros(2, 3)
    snap = t.cpu()  # site: cpu
    snap.add_(2.0)  # site: cpu-write
    return t.flatten().tolist()


def _as_float() -> list[float]:
    t = torch.zeros(2, 3)
    f = t.float()  # site: float
    f[0] = 3.0  # site: float-write
    return t.flatten().tolist()


def _as_type() -> list[float]:
    t = torch.zeros(2, 3)
    f = t.type(torch.float32)  # site: type
    f.fill_(4.0)  # site: type-write
    return t.flatten().tolist()


def _contiguous() -> list[float]:
    t = torch.zeros(2, 3)
    c = t.contiguous()  # site: contiguous
    c.mul_(0.0).add_(5.0)  # site: contiguous-write
    return t.flatten().tolist()


def _reshape_view() -> list[float]:
    t = torch.zeros(2, 3)
    r = t.reshape(3, 2)  # site: reshape
    r.view(-1)[0] = 6.0  # site: reshape-write
    return t.flatten().tolist()


def _copy_copy() -> list[float]:
    t = torch.zeros(2, 3)
    shallow = copy.copy(t)  # site: copy
    shallow[0, 0] = 7.0  # site: copy-write
    return t.flatten().tolist()


def _chained_write() -> list[float]:
    t = torch.zeros(2, 3)
    # written in the same expression
    scaled = t.to("cpu").add_(8.0)  # site: chained
    return t.flatten().tolist() + scaled.flatten().tolist()


class _Holder:
    pass


def _attribute_write() -> list[float]:
    t = torch.zeros(2, 3)
    holder = _Holder()
    holder.buf = t.cpu()  # site: attribute
    holder.buf.zero_().add_(9.0)  # site: attribute-write
    return t.flatten().tolist()


def _input_written() -> list[float]:
    t = torch.zeros(2, 3)
    as_float = t.float()  # site: input
    t.add_(10.0)  # site: input-write
    # as_float, meant as a float32 copy of t, changed too
    return as_float.flatten().tolist()


_FORMS = {
    "to": (_staging_to, "to", "`.to()` returned its input itself (already float32 on cpu"),
    "cpu": (_snapshot_cpu, "cpu", "`.cpu()` returned its input itself"),
    "float": (_as_float, "float", "`.float()` returned its input itself"),
    "type": (_as_type, "type", "`.type()` returned its input itself"),
    "contiguous": (_contiguous, "contiguous", "`.contiguous()` returned its input itself"),
    "reshape": (_reshape_view, "reshape", "`reshape()` returned a view of its input"),
    "copy": (_copy_copy, "copy", "`copy.copy(t)` returned a new tensor on the same storage"),
    "chained": (_chained_write, "chained", "`.to()` returned its input itself"),
    "attribute": (_attribute_write, "attribute", "`.cpu()` returned its input itself"),
    "input": (_input_written, "input", "`.float()` returned its input itself"),
}


@pytest.mark.parametrize("form", list(_FORMS))
def test_write_through_an_aliasing_result_changes_the_input_and_is_reported(form: str) -> None:
    program, tag, returned = _FORMS[form]
    untraced = program()
    result, findings = traced(program)
    assert result == untraced  # the write really reached the input, traced as untraced
    assert untraced != [0.0] * 6
    (f,) = findings
    assert f.code == "alias-write" and f.severity == "warning"
    function = program.__name__
    write = site(tag if tag == "chained" else f"{tag}-write", function)
    assert f.call_sites == list(dict.fromkeys([write, site(tag, function)]))
    assert f.message.startswith(returned), f.message
    assert f.bytes == 24  # the 2x3 float32 result
    assert f.message.endswith(
        ": the result (float32 3x2) shares its data with the input, and an in-place write into "
        "one of them changed the other while the program still held both (1 time, 24 B written)"
        if form == "reshape" else "held both (1 time, 24 B written)"
    ), f.message


@pytest.mark.parametrize("level", ["lean", "full", "api"])
def test_every_level_sees_the_writes(level: str) -> None:
    def program() -> None:
        _staging_to(), _reshape_view(), _copy_copy()

    _, findings = traced(program, level=level)
    assert [f.call_sites[1] for f in findings] == [
        site("to", "_staging_to"), site("reshape", "_reshape_view"), site("copy", "_copy_copy"),
    ]  # fmt: skip


def test_python_fallback_sees_the_identity_view_and_copy_copy_writes() -> None:
    """The fallback's dispatch mode sees the writes; a reshape view's input is found held by
    the heap search as on the C++ observer (the mode's handler keeps no reference to it)."""

    def program() -> None:
        _staging_to(), _reshape_view(), _copy_copy()

    _, findings = traced(program, observer="python")
    assert [f.call_sites[1] for f in findings] == [
        site("to", "_staging_to"), site("reshape", "_reshape_view"), site("copy", "_copy_copy"),
    ]  # fmt: skip


def test_python_fallback_near_miss_a_view_of_an_unheld_input_is_clean() -> None:
    """The near miss on the fallback: views of a temporary and of a rebound name, written
    in place, whose input only the view holds (no alias-write)."""
    untraced = _nothing_else_holds()
    result, findings = traced(_nothing_else_holds, observer="python")
    assert result == untraced
    assert findings == [], format_findings(findings)


def test_a_hot_loop_is_reported_once_from_its_first_steps() -> None:
    batch = torch.zeros(8)

    def program() -> list[float]:
        with copytrace.trace(write=False) as t:
            for _ in range(6):
                x = batch.to("cpu")  # site: loop
                x.add_(1.0)  # site: loop-write
                t.step()
        f, hot = analyze(t.events)  # and the hot no-op itself (info)
        assert (f.code, hot.code) == ("alias-write", "noop-conversion")
        assert f.call_sites == [site("loop-write", "program"), site("loop", "program")]
        assert f.steps == [0]  # found in the first step: the site is watched no more
        return batch.tolist()

    assert program() == [6.0] * 8  # every step's write reached the batch


# --------------------------------------------------------------------------------------------
# alias-write: near misses (the same programs with a real copy, or nothing else holding)
# --------------------------------------------------------------------------------------------


def _real_copies() -> list[float]:
    t = torch.zeros(2, 3)
    a = t.to("cpu", copy=True)
    a += 1.0
    b = t.clone()
    b.add_(2.0)
    c = t.double()
    c[0] = 3.0
    d = t.t().contiguous()
    d.fill_(4.0)
    e = t.t().reshape(6)  # not contiguous: a copy
    e[0] = 5.0
    f = t.reshape(3, 2).clone()
    f.mul_(6.0)
    g = copy.deepcopy(t)
    g[0, 0] = 7.0
    return t.flatten().tolist()


def _nothing_else_holds() -> list[float]:
    x = torch.arange(6.0).reshape(2, 3)  # a view of a temporary
    x.add_(1.0)
    z = torch.zeros(6)
    z = z.reshape(2, 3)  # the name rebound: the input is held by the view only
    z.mul_(2.0)
    y = torch.zeros(6)
    y = y.to("cpu")  # rebound: the no-op result is the only name left
    y.add_(1.0)
    w = torch.zeros(6)
    w = w.to("cpu").add_(1.0)  # rebound after the in-place chain
    v = torch.zeros(6)
    fresh = v.float().clone()  # the no-op result is consumed by the clone at once
    v.add_(1.0)
    u = torch.zeros(6).to("cpu")  # the input is a temporary
    u.add_(1.0)
    holder = _Holder()
    holder.buf = torch.zeros(6)
    holder.buf = holder.buf.to("cpu")  # an attribute rebound
    holder.buf.add_(1.0)
    return [*x.flatten().tolist(), *z.flatten().tolist(), *y.tolist(), *w.tolist(),
            *fresh.tolist(), *u.tolist(), *holder.buf.tolist()]  # fmt: skip


def _read_only() -> float:
    t = torch.ones(2, 3)
    staging = t.to("cpu")
    view = t.reshape(3, 2)
    shallow = copy.copy(t)
    return float(staging.sum() + view.sum() + shallow.sum())


def _parameters_updated_by_the_optimizer() -> None:
    lin = nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        w = lin.weight.to("cpu")  # the parameter itself: updated in place by opt.step()
        (torch.ones(1, 3) @ w.t()).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    "program",
    [_real_copies, _nothing_else_holds, _read_only, _parameters_updated_by_the_optimizer],
)
def test_real_copies_and_unheld_inputs_are_clean(program: Callable[[], Any]) -> None:
    untraced = program()
    result, findings = traced(program)
    assert result == untraced
    assert findings == [], format_findings(findings)


# --------------------------------------------------------------------------------------------
# deepcopy-nonleaf
# --------------------------------------------------------------------------------------------


class _Cache(nn.Module):
    """Keeps its last hidden activation, detached or not."""

    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.detach = detach
        self.last_hidden: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.last_hidden = h.detach() if self.detach else h
        return h.relu()


class _Outer(nn.Module):
    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.enc = _Cache(detach)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x)


def _deepcopy_error(obj: Any) -> str | None:
    try:
        copy.deepcopy(obj)  # site: deepcopy
    except RuntimeError as err:
        return str(err)
    return None


def _module_attribute() -> Any:
    net = _Cache(detach=False)
    net(torch.randn(2, 8))
    return net


def _nested_module_attribute() -> Any:
    net = _Outer(detach=False)
    net(torch.randn(2, 8))
    return net


def _output_in_a_dict() -> Any:
    net = _Cache(detach=True)
    return {"logits": net(torch.randn(2, 8)), "step": 3}


def _output_itself() -> Any:
    return _Cache(detach=True)(torch.randn(2, 8))


@pytest.mark.parametrize(
    ("make", "holder", "grad_fn"),
    [
        (_module_attribute, "`_Cache.last_hidden`", "AddmmBackward0"),
        (_nested_module_attribute, "`_Outer.enc.last_hidden`", "AddmmBackward0"),
        (_output_in_a_dict, "`dict['logits']`", "ReluBackward0"),
        (_output_itself, "a float32 2x8 tensor", "ReluBackward0"),
    ],
    ids=["module", "nested", "dict", "tensor"],
)
def test_deepcopy_of_a_held_nonleaf_raises_unchanged_and_names_the_holder(
    make: Callable[[], Any], holder: str, grad_fn: str
) -> None:
    untraced = _deepcopy_error(make())
    assert untraced is not None and "graph leaves" in untraced
    error, findings = traced(lambda: _deepcopy_error(make()))
    assert error == untraced  # torch's error reaches the program unchanged
    (f,) = findings
    assert f.code == "deepcopy-nonleaf" and f.severity == "warning"
    assert f.call_sites == [site("deepcopy", "_deepcopy_error")]
    assert f.message.startswith(
        f"`copy.deepcopy` raised on {holder}, a tensor still in the autograd graph ({grad_fn})"
    ), f.message
    assert f.bytes == 64  # the 2x8 float32 tensor it could not copy
    module = "[" not in holder and "tensor" not in holder
    assert ("every later deepcopy of the module fails" in f.message) == module


class _Locked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.lock = threading.Lock()  # cannot be deep-copied (TypeError)


def _clean_deepcopies() -> list[Any]:
    detached = _Cache(detach=True)
    detached(torch.randn(2, 8))
    leaf = torch.randn(3, requires_grad=True)
    out = [copy.deepcopy(detached), copy.deepcopy(leaf), copy.deepcopy(nn.Parameter(leaf))]
    try:
        copy.deepcopy(_Locked())  # fails for another reason: no tensor in the graph
    except TypeError as err:
        out.append(type(err).__name__)
    return out


def test_detached_caches_leaves_and_other_failures_are_clean() -> None:
    result, findings = traced(_clean_deepcopies)
    assert result[-1] == "TypeError"
    assert torch.equal(result[0].last_hidden, result[0].last_hidden.detach())
    assert findings == [], format_findings(findings)
