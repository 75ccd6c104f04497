"""Hazard kinds from public bug reports: each kind in several forms, with its near misses.

* aliased ``state_dict()`` handover (an optimizer, a module loaded with ``assign=True``, an
  EMA helper): ``aliasing-snapshot``;
* in-place write into the fresh copy advanced indexing returns: ``lost-inplace-write``;
* a graph kept alive through a tensor derived from a gone copy: ``graph-retaining-copy``;
* copies under a ``TorchFunctionMode`` (torch's ``DeviceContext``, the program's own mode):
  the call site and ``tensor-ctor-copy`` are the user's;
* ``redundant-copy`` stays quiet when one copy was written in place.

Programs run under ``copytrace.trace(write=False)``; call sites are located by
``# site: <name>`` comments. Every near miss must give no finding at all.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

import copytrace
from copytrace.analysis import Finding, analyze, format_findings

_SOURCE = Path(__file__).read_text().splitlines()


def site(name: str, function: str) -> str:
    """``file:line function`` of the line tagged ``# site: name`` in this file."""
    tag = f"# site: {name}"
    lines = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(tag)]
    assert len(lines) == 1, f"tag {tag!r} found {len(lines)} times"
    return f"{__file__}:{lines[0]} {function}"


def traced(fn: Callable[[Any], Any]) -> tuple[copytrace.Trace, list[Finding]]:
    with copytrace.trace(write=False) as t:
        fn(t)
    assert t.stats["errors"] == 0, t.session._rec.last_error
    return t, analyze(t.events)


def only(findings: list[Finding], code: str) -> Finding:
    found = [f for f in findings if f.code == code]
    assert len(found) == 1, format_findings(findings)
    return found[0]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    x = torch.ones(4, 8)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


# --------------------------------------------------------------------------------------------
# aliased state handover
# --------------------------------------------------------------------------------------------


def _optimizer_handover(make: Callable[[Any], torch.optim.Optimizer], hand: Callable) -> Any:
    def program(t: Any) -> None:
        torch.manual_seed(0)
        parent = nn.Linear(8, 4)
        opt_parent = make(parent.parameters())
        _train(parent, opt_parent, 2)
        child = copy.deepcopy(parent)
        opt_child = make(child.parameters())
        hand(opt_child, opt_parent)
        before = [s["exp_avg" if "exp_avg" in s else "momentum_buffer"].clone()
                  for s in opt_child.state.values()]  # fmt: skip
        _train(parent, opt_parent, 2)  # the parent keeps training
        after = [s["exp_avg" if "exp_avg" in s else "momentum_buffer"]
                 for s in opt_child.state.values()]  # fmt: skip
        program.changed = any(  # type: ignore[attr-defined]
            not torch.equal(a, b) for a, b in zip(before, after, strict=True)
        )
        program.keep = (opt_parent, opt_child)  # type: ignore[attr-defined]

    return program


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def _hand_over(child: torch.optim.Optimizer, parent: torch.optim.Optimizer) -> None:
    child.load_state_dict(parent.state_dict())  # site: opt-handover


def test_optimizer_state_handover_aliases_live_momentum() -> None:
    # optimizer handover: load_state_dict(other.state_dict()) keeps the parent's momentum buffers
    program = _optimizer_handover(_sgd, _hand_over)
    t, findings = traced(program)
    assert program.changed  # type: ignore[attr-defined]  # the bug is real
    f = only(findings, "aliasing-snapshot")
    assert [x.code for x in findings] == ["aliasing-snapshot"]
    assert f.call_sites == [site("opt-handover", "_hand_over")]
    # the momentum buffers of weight (4x8) and bias (4), float32: 128 + 16 B
    assert f.bytes == 144
    assert "deepcopy" in f.fix and "clone" in f.fix
    handed = [e for e in t.events if e.snapshot]
    # the transfer is two no-op `.to` aliases of 0 B made by the optimizer's load path
    assert [(e.op, e.noop, e.alias, e.bytes_allocated, e.stale) for e in handed] == [
        ("to", True, True, 0, True)
    ] * 2
    assert all(e.via and "Optimizer." in e.via for e in handed)


def test_adam_handover_shares_moments_and_step_counters() -> None:
    program = _optimizer_handover(_adam, _hand_over)
    _, findings = traced(program)
    f = only(findings, "aliasing-snapshot")
    assert f.call_sites == [site("opt-handover", "_hand_over")]
    # per parameter: exp_avg + exp_avg_sq (weight 2 x 128 B, bias 2 x 16 B) and the
    # float32 scalar `step` (2 x 4 B): 288 + 8 B, six tensors
    assert f.bytes == 296 and "6 tensors" in f.message


def test_module_loaded_with_assign_shares_the_source_parameters() -> None:
    def program(t: Any) -> None:
        torch.manual_seed(0)
        parent = nn.Linear(8, 4)
        opt = torch.optim.SGD(parent.parameters(), lr=0.1)
        child = nn.Linear(8, 4)
        child.load_state_dict(parent.state_dict(), assign=True)  # site: assign
        _train(parent, opt, 2)
        program.same = torch.equal(child.weight, parent.weight)  # type: ignore[attr-defined]

    t, findings = traced(program)
    assert program.same  # type: ignore[attr-defined]
    f = only(findings, "aliasing-snapshot")
    assert f.call_sites == [site("assign", "program")]
    assert f.bytes == 4 * 8 * 4 + 4 * 4  # weight and bias, float32
    # the aliases state_dict() returned are long gone: staleness followed the storage
    assert [(e.op, e.snapshot, e.stale) for e in t.events if e.snapshot] == [
        ("detach", True, True)
    ] * 2


class _Ema(nn.Module):
    """An EMA helper that loads the model's weights with assign=True (a shared-storage bug)."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        super().__init__()
        self.shadow = nn.Linear(8, 4)
        self.shadow.load_state_dict(model.state_dict(), assign=True)  # site: ema-load
        self.decay = decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for e, p in zip(self.shadow.parameters(), model.parameters(), strict=True):
            e.mul_(self.decay).add_(p, alpha=1 - self.decay)  # also writes into the model


def test_ema_helper_loaded_by_assign_writes_into_the_model() -> None:
    def program(t: Any) -> None:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        ema = _Ema(model)
        for _ in range(2):
            ema.update(model)
            t.step()
        program.keep = (model, ema)  # type: ignore[attr-defined]

    _, findings = traced(program)
    f = only(findings, "aliasing-snapshot")
    assert f.call_sites == [site("ema-load", "__init__")]


class _DecayScale(torch.optim.lr_scheduler.LRScheduler):
    """A scheduler keeping a tensor it updates in place (a loss-scale-like factor)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.scale = torch.ones(())
        super().__init__(opt)

    def get_lr(self) -> list[float]:
        if self.last_epoch > 0:
            self.scale.mul_(0.5)
        return [base * float(self.scale) for base in self.base_lrs]


def test_scheduler_handover_shares_its_tensor_state() -> None:
    def program(t: Any) -> None:
        model = nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        parent = _DecayScale(opt)
        child = _DecayScale(torch.optim.SGD(nn.Linear(8, 4).parameters(), lr=0.1))
        child.load_state_dict(parent.state_dict())  # site: sched-handover
        for _ in range(2):
            _train(model, opt, 1)
            parent.step()  # halves the child's scale too
        program.scale = float(child.scale)  # type: ignore[attr-defined]

    t, findings = traced(program)
    assert program.scale == 0.25  # type: ignore[attr-defined]
    f = only(findings, "aliasing-snapshot")
    assert f.call_sites == [site("sched-handover", "program")] and f.bytes == 4
    # no recorded call made the alias (__dict__.update): one load_state_dict alias event
    assert [(e.op, e.alias, e.stale) for e in t.events if e.snapshot] == [
        ("load_state_dict", True, True)
    ]


def test_stock_scheduler_handover_without_in_place_change_is_clean() -> None:
    def program(t: Any) -> None:
        model = nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        opt2 = torch.optim.SGD(nn.Linear(8, 4).parameters(), lr=torch.tensor(0.1))
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
        sched2.load_state_dict(sched.state_dict())  # shares base_lrs / _last_lr tensors
        opt2.load_state_dict(opt.state_dict())  # param groups are deep-copied
        for _ in range(3):
            _train(model, opt, 1)
            sched.step()  # replaces _last_lr, writes only opt's own lr tensor

    t, findings = traced(program)
    assert findings == []  # also: torch's own lr clones are not redundant copies
    assert any(e.snapshot and not e.stale for e in t.events)


class _ParamEma:
    """An EMA helper (not a module) holding Parameters made from the model's state_dict():
    they share the model's storage, although the aliases state_dict() returned are gone."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow = {
            k: nn.Parameter(v, requires_grad=False)
            for k, v in model.state_dict().items()  # site: param-ema
        }


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "dropped"])
def test_snapshot_followed_by_storage_after_its_aliases_are_gone(keep: bool) -> None:
    def program(t: Any) -> None:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ema = _ParamEma(model)
        if not keep:
            del ema  # nobody but the model holds the storage: the near miss
        _train(model, opt, 2)
        program.keep = ema if keep else None  # type: ignore[attr-defined]

    t, findings = traced(program)
    if not keep:
        assert findings == []
        return
    f = only(findings, "aliasing-snapshot")
    assert f.call_sites == [site("param-ema", "__init__")] and f.bytes == 144


@pytest.mark.parametrize(
    "hand",
    [
        lambda c, p: c.load_state_dict(copy.deepcopy(p.state_dict())),
        lambda c, p: (c.load_state_dict(p.state_dict()), p.state.clear()),
    ],
    ids=["deepcopy", "source-lets-go"],
)
def test_copied_handover_or_a_source_that_lets_go_is_clean(hand: Callable) -> None:
    program = _optimizer_handover(_sgd, hand)
    _, findings = traced(program)
    assert findings == []


def test_module_load_without_assign_copies_and_is_clean() -> None:
    def program(t: Any) -> None:
        parent = nn.Linear(8, 4)
        opt = torch.optim.SGD(parent.parameters(), lr=0.1)
        child = nn.Linear(8, 4)
        child.load_state_dict(parent.state_dict())  # copy_ into the child's own storage
        _train(parent, opt, 2)
        program.keep = child  # type: ignore[attr-defined]

    _, findings = traced(program)
    assert findings == []


# --------------------------------------------------------------------------------------------
# lost in-place write into an advanced-indexing copy
# --------------------------------------------------------------------------------------------


def _reinit_rows(t: Any) -> None:
    # lost write: re-initialising embedding rows by writing into x[idx]
    torch.manual_seed(0)
    emb = nn.Embedding(100, 64)
    rows = torch.tensor([3, 17, 56, 99])
    before = emb.weight.detach().clone()
    with torch.no_grad():
        nn.init.zeros_(emb.weight[rows])  # site: init-rows
        emb.weight[rows].mul_(0.0)  # site: mul-rows
        emb.weight[range(0, 2), :].copy_(torch.ones(2, 64))  # site: copy-rows
        _reinit_rows.unchanged = torch.equal(before, emb.weight)  # type: ignore[attr-defined]
        emb.weight[rows] = 0.0  # index_put_: writes into the weight


def test_inplace_writes_into_advanced_index_copies_are_lost_writes() -> None:
    t, findings = traced(_reinit_rows)
    assert _reinit_rows.unchanged  # type: ignore[attr-defined]
    lost = [f for f in findings if f.code == "lost-inplace-write"]
    assert [f.code for f in findings] == ["lost-inplace-write"] * 3
    assert all(f.severity == "error" for f in lost)
    assert sorted(f.call_sites[0] for f in lost) == sorted(
        site(tag, "_reinit_rows") for tag in ("init-rows", "mul-rows", "copy-rows")
    )
    # gathered sizes: 4 rows x 64 x 4 B = 1024 B; range(0, 2) rows = 512 B
    gathers = [(e.op, e.bytes_allocated, e.line) for e in t.events if e.op == "index"]
    assert [b for _, b, _ in gathers] == [1024, 1024, 512]
    assert sorted(f.bytes for f in lost) == [512, 1024, 1024]
    assert "x[idx] = value" in lost[0].fix


def _other_gathers(t: Any) -> None:
    x = torch.arange(24.0).view(4, 6)
    idx = torch.tensor([0, 2])
    x.index_select(0, idx).fill_(-1.0)  # site: index-select
    x[x > 10].zero_()  # site: mask
    torch.gather(x, 1, torch.zeros(4, 1, dtype=torch.long)).add_(1)  # site: gather
    _other_gathers.x = x  # type: ignore[attr-defined]


def test_lost_writes_into_index_select_mask_and_gather_results() -> None:
    t, findings = traced(_other_gathers)
    assert torch.equal(_other_gathers.x, torch.arange(24.0).reshape(4, 6))  # type: ignore[attr-defined]
    assert sorted(f.call_sites[0] for f in findings) == sorted(
        site(tag, "_other_gathers") for tag in ("index-select", "mask", "gather")
    )
    by_op = {e.op: e.bytes_allocated for e in t.events}
    # 2 rows x 6 x 4 B; 13 elements > 10 (11..23) x 4 B; 4 x 1 x 4 B
    assert by_op == {"index_select": 48, "index": 52, "gather": 16}


def test_used_gathers_index_assignment_and_views_are_clean() -> None:
    def program(t: Any) -> None:
        x = torch.arange(24.0).view(4, 6)
        idx = torch.tensor([0, 2])
        rows = x[idx]
        rows.mul_(2)  # a working copy, used below
        program.total = rows.sum()  # type: ignore[attr-defined]
        x[idx] += 1  # gather, add_, then index_put_ writes it back
        x[idx] = 0.0
        x[1].zero_()  # basic indexing: a view, no copy
        x[:, 1:3].mul_(2)

    t, findings = traced(program)
    assert findings == []
    assert [e.op for e in t.events] == ["index", "index"]  # only the two gathers


# --------------------------------------------------------------------------------------------
# a graph kept alive through a tensor derived from a gone copy
# --------------------------------------------------------------------------------------------


def _logged_loss(accumulate: Callable[[Any, torch.Tensor], Any], backward: bool = False) -> Any:
    def program(t: Any) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        x = torch.randn(4, 8)
        total: Any = torch.zeros(())
        for _ in range(3):
            loss = model(x).pow(2).mean()
            if backward:
                loss.backward()
            total = accumulate(total, loss)
            t.step()
        program.total = total  # type: ignore[attr-defined]

    return program


def _add_clone(total: Any, loss: torch.Tensor) -> Any:
    return total + loss.clone()  # site: total-clone


def _stack_views(total: Any, loss: torch.Tensor) -> Any:
    row = loss.clone().unsqueeze(0)  # site: history-view
    return row if total.dim() == 0 else torch.cat([total, row])


def _ema_of_copy(total: Any, loss: torch.Tensor) -> Any:
    return 0.9 * total + 0.1 * loss.to(torch.float64)  # site: ema-copy


@pytest.mark.parametrize(
    "accumulate, tag, op",
    [(_add_clone, "total-clone", "clone"), (_stack_views, "history-view", "clone"),
     (_ema_of_copy, "ema-copy", "to")],
    ids=["running-total", "concatenated-history", "ema-of-converted"],
)  # fmt: skip
def test_gone_copy_whose_graph_a_derived_tensor_keeps(
    accumulate: Callable, tag: str, op: str
) -> None:
    t, findings = traced(_logged_loss(accumulate))
    f = only(findings, "graph-retaining-copy")
    assert [x.code for x in findings] == ["graph-retaining-copy"]
    assert f.call_sites == [site(tag, accumulate.__name__)]
    # per step: x (4x8 = 128 B) and the ReLU output (4x16 = 256 B) saved by the Linear
    # layers, and pow's input (4x1 = 16 B): 400 B, in each of the 3 steps
    assert f.bytes == 1200 and f.steps == [0, 1, 2]
    assert [e.retained_bytes for e in t.events if e.op == op] == [400, 400, 400]


def test_dead_attached_copies_are_dropped_and_a_derived_graph_still_found() -> None:
    # 1,100 throwaway attached clones per step (each gone with its node at once) pass the
    # watch's prune point (64 listed) again and again: the dead entries are dropped, and the
    # running total's gone clone, whose graph `total` keeps, is still found as above
    listed: list[int] = []

    def churn_then_add(total: Any, loss: torch.Tensor) -> Any:
        w = torch.ones(2, requires_grad=True)
        for _ in range(1100):
            w.clone()
        listed.append(len(program_t[0].session._rec.watch.attached))
        return _add_clone(total, loss)

    program = _logged_loss(churn_then_add)
    program_t: list[Any] = []

    def run(t: Any) -> None:
        program_t.append(t)
        program(t)

    t, findings = traced(run)
    f = only(findings, "graph-retaining-copy")  # (the churn itself is a redundant-copy)
    assert f.call_sites == [site("total-clone", "_add_clone")]
    assert f.bytes == 1200 and f.steps == [0, 1, 2]
    # each prune runs while the clone that fills the list to 64 is recorded (alive, so kept:
    # 1 left, 63 more to the next prune): prunes at the 64th, 127th, ... 1,072nd clone (17),
    # then 28 more: 29 listed in each step (the list starts empty at each step boundary);
    # unpruned it would hold 1,100. On the Python fallback (no weak pointer on a node) each
    # prune is a search of the heap, and the limit doubles at each search: the list is not
    # held to the C++ observer's sizes there.
    if t.session._rec.native is not None:
        assert listed == [29, 29, 29]
    else:
        assert listed[0] < 1100  # pruned at least once in the first step


@pytest.mark.parametrize(
    "accumulate, backward",
    [
        (lambda total, loss: total + loss.detach().clone(), False),
        (lambda total, loss: total + loss.item(), False),
        (_add_clone, True),  # backward through loss freed the saved tensors first
    ],
    ids=["detach-clone", "item", "after-backward"],
)
def test_detached_totals_or_backward_keep_no_graph(accumulate: Callable, backward: bool) -> None:
    _, findings = traced(_logged_loss(accumulate, backward))
    assert findings == []


# --------------------------------------------------------------------------------------------
# copies made under a TorchFunctionMode: the user's call, not the mode's
# --------------------------------------------------------------------------------------------


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return func(*args, **(kwargs or {}))  # a mode the program defines


def _ctor_under(mode: Callable[[], Any]) -> Any:
    def program(t: Any) -> None:
        src = torch.ones(4, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            with mode():
                program.a = torch.tensor(src, dtype=torch.float64)  # site: ctor-mode
                program.b = src.new_tensor(src)  # site: new-tensor-mode

    return program


@pytest.mark.parametrize(
    "mode", [lambda: torch.device("cpu"), _PassThrough], ids=["device-context", "user-mode"]
)
def test_tensor_ctor_under_a_mode_is_the_users_call(mode: Callable[[], Any]) -> None:
    # a copy through a mode: torch.tensor(t) inside `with torch.device(...)`
    t, findings = traced(_ctor_under(mode))
    ctor = [f for f in findings if f.code == "tensor-ctor-copy"]
    assert sorted(f.call_sites[0] for f in ctor) == sorted(
        [site("ctor-mode", "program"), site("new-tensor-mode", "program")]
    )
    assert sorted(f.bytes for f in ctor) == [48, 96]  # 12 x float32; 12 x float64
    assert all(e.via is None for e in t.events)


def test_as_tensor_under_a_mode_is_clean() -> None:
    src = torch.ones(4, 3)

    def program(t: Any) -> None:
        with torch.device("cpu"):
            program.a = torch.as_tensor(src)  # type: ignore[attr-defined]

    _, findings = traced(program)
    assert findings == []


# --------------------------------------------------------------------------------------------
# redundant-copy: a copy written in place is not redundant
# --------------------------------------------------------------------------------------------


def _scale_(t: torch.Tensor) -> torch.Tensor:
    t.mul_(2.0)
    return t.sum()


def _per_consumer_copies(t: Any) -> None:
    # near miss: one clone per consumer that modifies its argument
    x = torch.randn(1000)
    _per_consumer_copies.sums = (_scale_(x.clone()), _scale_(x.clone()))  # type: ignore[attr-defined]
    c = x.clone()  # site: unwritten-1
    d = x.clone()  # site: unwritten-2
    _per_consumer_copies.keep = (c, d)  # type: ignore[attr-defined]


def test_clones_written_in_place_are_not_redundant() -> None:
    t, findings = traced(_per_consumer_copies)
    f = only(findings, "redundant-copy")
    assert [x.code for x in findings] == ["redundant-copy"]
    assert f.call_sites == [
        site("unwritten-1", "_per_consumer_copies"), site("unwritten-2", "_per_consumer_copies")
    ]  # fmt: skip
    assert f.bytes == 4000  # the one extra copy
    assert [e.inplace_writes for e in t.events] == [1, 1, 0, 0]


def test_written_conversions_and_inplace_activations_are_not_redundant() -> None:
    def program(t: Any) -> None:
        x = torch.randn(100)
        a = x.to(torch.float64)
        a.add_(1)
        b = x.to(torch.float64)
        r1 = nn.functional.relu(x.clone(), inplace=True)
        r2 = nn.functional.relu(x.clone(), inplace=True)
        c = x.clone()
        c[0] = 5.0  # __setitem__ writes into the copy
        d = x.clone()
        program.keep = (a, b, r1, r2, c, d)  # type: ignore[attr-defined]

    _, findings = traced(program)
    assert findings == []


# --------------------------------------------------------------------------------------------
# call sites: installed packages are not the user's code
# --------------------------------------------------------------------------------------------


def test_copy_inside_a_third_party_wrapper_is_attributed_to_the_user() -> None:
    def program(t: Any) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            program.m = torch.nn.utils.weight_norm(nn.Linear(3, 2))  # site: weight-norm

    t, _ = traced(program)
    assert t.events and all(f"{e.file}:{e.line} {e.function}" == site("weight-norm", "program")
                            for e in t.events)  # fmt: skip
