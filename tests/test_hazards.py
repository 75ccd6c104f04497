"""Hazard analysis: for each hazard code, one program that must raise it and one near-miss
that must not (false positives matter as much as misses).

Programs run under ``copytrace.trace(write=False)`` and are analysed from memory
(``analyze(t.events)``); a few are also written to a trace file and analysed from it, which
must give the same findings. Call sites are located by ``# site: <name>`` comments, so the
assertions name the exact ``file:line function`` without hard-coding line numbers.

Round trips and pinned-memory transfers need a real device: those programs run only when
CUDA is available; on the CPU the round-trip rule is checked on recorded-event fixtures, and
pageable transfers on the ``meta`` device (which copytrace classifies as a device).
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import copytrace
from copytrace import CopyEvent
from copytrace.analysis import HAZARDS, Finding, analyze, format_findings
from copytrace.dashboards import load_trace

_SOURCE = Path(__file__).read_text().splitlines()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def site(name: str, function: str) -> str:
    """``file:line function`` of the line tagged ``# site: name`` in this file."""
    tag = f"# site: {name}"
    lines = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(tag)]
    assert len(lines) == 1, f"tag {tag!r} found {len(lines)} times"
    return f"{__file__}:{lines[0]} {function}"


def traced(fn: Callable[[Any], Any]) -> tuple[copytrace.Trace, list[Finding]]:
    """Run ``fn(t)`` under a non-writing trace; return the trace and its findings."""
    with copytrace.trace(write=False) as t:
        fn(t)
    assert t.stats["errors"] == 0
    return t, analyze(t.events)


def codes(findings: list[Finding]) -> list[str]:
    return [f.code for f in findings]


def only(findings: list[Finding], code: str) -> Finding:
    found = [f for f in findings if f.code == code]
    assert len(found) == 1, format_findings(findings)
    return found[0]


def test_every_code_is_documented_with_an_example() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "hazards.md").read_text()
    for code in HAZARDS:
        section = re.search(rf"^## `{code}`.*?(?=^## |\Z)", doc, re.M | re.S)
        assert section is not None, f"{code} has no section in docs/hazards.md"
        assert "```python" in section.group(0), f"{code} has no example"


# --------------------------------------------------------------------------------------------
# data-inplace: in-place write through `.data` of a tensor saved for a pending backward
# --------------------------------------------------------------------------------------------


def _edit_weight_through_data(t: Any) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    inp = torch.randn(3, 6, requires_grad=True)
    pending = layer(inp).sum()  # AddmmBackward0 saves weight.t() to compute d(inp)
    layer.weight.data[:, 2] -= 0.25  # site: data-write
    pending.backward()  # silently uses the edited weight


def test_data_inplace_write_to_saved_weight_is_an_error() -> None:
    t, findings = traced(_edit_weight_through_data)
    f = only(findings, "data-inplace")
    assert codes(findings) == ["data-inplace"]
    assert f.severity == "error"
    assert f.bytes == 96  # the 4x6 float32 weight
    assert f.call_sites == [site("data-write", "_edit_weight_through_data")]
    assert "`Linear.weight`" in f.message and "AddmmBackward0.mat2" in f.message
    (get,) = [e for e in t.events if e.op == "data_get"]
    assert f.event_seqs == [get.seq]
    assert get.saved_by == ("AddmmBackward0.mat2",)
    assert get.inplace_writes == 2  # sub_ on the slice, then __setitem__'s copy_
    assert get.src_name == "Linear.weight"


def _zero_saved_activation(t: Any) -> None:
    leaf = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    act = leaf.sigmoid()  # SigmoidBackward0 saves its output
    act.data.zero_()  # site: act-write
    act.sum().backward()


def _rebind_saved_leaf(t: Any) -> None:
    w = torch.ones(3, requires_grad=True)
    x = torch.ones(3, requires_grad=True)
    y = (x * w).sum()  # MulBackward0 saves w for d(x)
    w.data = torch.full((3,), 5.0)  # site: rebind
    y.backward()


@pytest.mark.parametrize(
    "program, tag, node, nbytes",
    [
        (_zero_saved_activation, "act-write", "SigmoidBackward0.result", 12),
        (_rebind_saved_leaf, "rebind", "MulBackward0.other", 12),
    ],
)
def test_data_inplace_on_saved_activation_and_rebinding(
    program: Callable[[Any], None], tag: str, node: str, nbytes: int
) -> None:
    _, findings = traced(program)
    f = only(findings, "data-inplace")
    assert codes(findings) == ["data-inplace"]
    assert f.call_sites == [site(tag, program.__name__)]
    assert node in f.message and f.bytes == nbytes


def _manual_sgd_and_ema_through_data(t: Any) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ema = copy.deepcopy(model)
    x = torch.randn(5, 4)
    for _ in range(3):
        loss = model(x).pow(2).mean()
        loss.backward()
        for p, e in zip(model.parameters(), ema.parameters(), strict=True):
            p.data.add_(p.grad, alpha=-0.1)  # after backward: nothing pending uses p
            e.data.mul_(0.9).add_(p.data, alpha=0.1)  # ema is in no graph
            p.grad = None
        t.step()
    model.double()  # `.data =` rebinding with no graph pending


def test_data_writes_after_backward_are_not_reported() -> None:
    t, findings = traced(_manual_sgd_and_ema_through_data)
    assert findings == []
    writes = [e.inplace_writes for e in t.events if e.op == "data_get" and e.inplace_writes]
    assert len(writes) == 6 * 2  # the writes were seen (p and e, 2 params, 3 steps) ...
    assert not any(e.saved_by for e in t.events)  # ... and found harmless


def test_no_grad_write_to_saved_weight_is_left_to_autograd() -> None:
    def program(t: Any) -> None:
        layer = nn.Linear(6, 4)
        pending = layer(torch.randn(3, 6, requires_grad=True)).sum()
        with torch.no_grad():
            layer.weight[:, 2] -= 0.25  # bumps the version counter: autograd raises
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            pending.backward()

    _, findings = traced(program)
    assert findings == []


# --------------------------------------------------------------------------------------------
# graph-retaining-copy: an attached copy kept past its step without a backward through it
# --------------------------------------------------------------------------------------------


def _eval_history(keep: Callable[[torch.Tensor], Any], backward: bool = False) -> Any:
    def program(t: Any) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        x = torch.randn(4, 8)
        history = []
        for _ in range(3):
            loss = model(x).pow(2).mean()
            history.append(keep(loss))
            if backward:
                loss.backward()
            t.step()
        program.history = history  # type: ignore[attr-defined]

    return program


def test_loss_clone_kept_without_backward_retains_its_graph() -> None:
    t, findings = traced(_eval_history(lambda loss: loss.clone()))  # site: keep-clone
    f = only(findings, "graph-retaining-copy")
    assert codes(findings) == ["graph-retaining-copy"]
    assert f.severity == "warning"
    assert f.call_sites == [site("keep-clone", "<lambda>")]
    # per step: the input x (4x8 = 128 B) and ReLU output (4x16 = 256 B) saved by the
    # Linear layers, and pow's input (4x1 = 16 B); the parameters do not count: 3 x 400 B
    assert f.bytes == 1200
    assert f.steps == [0, 1, 2]
    assert [e.retained_bytes for e in t.events] == [400, 400, 400]


@pytest.mark.parametrize(
    "keep, backward",
    [
        (lambda loss: loss.detach(), False),
        (lambda loss: loss.detach().clone(), False),
        (lambda loss: loss.item(), False),
        (lambda loss: loss.clone(), True),  # the backward through loss frees the graph
    ],
    ids=["detach", "detach-clone", "item", "clone-then-backward"],
)
def test_detached_history_or_backward_retains_nothing(
    keep: Callable[[torch.Tensor], Any], backward: bool
) -> None:
    _, findings = traced(_eval_history(keep, backward))
    assert findings == []


def test_one_forward_output_alive_when_tracing_stops_is_not_reported() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(t: Any) -> None:
        forward.out = net(torch.randn(2, 4)).t().contiguous()  # type: ignore[attr-defined]

    t, findings = traced(forward)
    assert findings == []
    assert [e.op for e in t.events] == ["contiguous"]


# --------------------------------------------------------------------------------------------
# aliasing-snapshot: state_dict() kept without copying, then changed by the optimizer
# --------------------------------------------------------------------------------------------


def _best_model(snapshot: Callable[[nn.Module], Any]) -> Any:
    def program(t: Any) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(5, 4)
        best = None
        for step in range(3):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 0:
                best = snapshot(model)
        program.best = best  # type: ignore[attr-defined]

    return program


def test_state_dict_snapshot_changed_by_optimizer_is_reported() -> None:
    t, findings = traced(_best_model(lambda m: m.state_dict()))  # site: keep-state-dict
    f = only(findings, "aliasing-snapshot")
    assert codes(findings) == ["aliasing-snapshot"]
    assert f.bytes == 40  # weight 2x4 + bias 2, float32
    assert f.call_sites == [site("keep-state-dict", "<lambda>")]
    assert f.steps == [1]  # taken after the first optimizer.step()
    assert [(e.op, e.snapshot, e.stale) for e in t.events] == [("detach", True, True)] * 2


@pytest.mark.parametrize(
    "snapshot",
    [
        lambda m: copy.deepcopy(m.state_dict()),
        lambda m: {k: v.detach().clone() for k, v in m.state_dict().items()},
    ],
    ids=["deepcopy", "detach-clone"],
)
def test_copied_snapshot_is_not_reported(snapshot: Callable[[nn.Module], Any]) -> None:
    t, findings = traced(_best_model(snapshot))
    assert findings == []
    assert any(e.snapshot and not e.stale for e in t.events)


def test_state_dict_taken_after_the_last_update_is_not_reported() -> None:
    model = nn.Linear(4, 2)

    def program(t: Any) -> None:
        program.sd = model.state_dict()  # type: ignore[attr-defined]

    _, findings = traced(program)
    assert findings == []


# --------------------------------------------------------------------------------------------
# redundant-copy: the same unchanged source copied twice in a step; a copy of a copy
# --------------------------------------------------------------------------------------------


def _copy_twice(t: Any) -> None:
    x = torch.arange(16.0)  # 64 B
    _copy_twice.a = x.clone()  # site: first-clone
    _copy_twice.b = x.clone()  # site: second-clone


def test_same_unchanged_source_copied_twice_is_redundant() -> None:
    _, findings = traced(_copy_twice)
    f = only(findings, "redundant-copy")
    assert codes(findings) == ["redundant-copy"]
    assert f.bytes == 64  # the second copy
    assert f.call_sites == [
        site("first-clone", "_copy_twice"),
        site("second-clone", "_copy_twice"),
    ]
    assert "1 extra copy" in f.message


def _copy_of_copy(t: Any) -> None:
    x = torch.arange(16.0)
    _copy_of_copy.y = x.double().clone()  # site: chain


def test_copy_of_a_fresh_copy_on_one_line_is_redundant() -> None:
    t, findings = traced(_copy_of_copy)
    f = only(findings, "redundant-copy")
    assert f.bytes == 128  # the float64 intermediate (16 x 8 B)
    assert f.call_sites == [site("chain", "_copy_of_copy")]
    assert f.event_seqs == [e.seq for e in t.events]


def _distinct_copies(t: Any) -> None:
    x = torch.arange(16.0)
    a = x.clone()
    x.add_(1)  # the source changed: copying it again is not redundant
    b = x.clone()
    halves = (x[:8].clone(), x[8:].clone())  # two different views of one storage
    y = x.double().mul_(2).clone()  # the intermediate was changed before the copy
    t.step()
    for _ in range(3):
        z = x.clone()  # once per step
        t.step()
    _distinct_copies.keep = (a, b, halves, y, z)


def test_changed_source_other_views_and_other_steps_are_not_redundant() -> None:
    t, findings = traced(_distinct_copies)
    assert findings == []
    assert sum(e.bytes_allocated for e in t.events) == 64 + 64 + 64 + 128 + 128 + 3 * 64


# --------------------------------------------------------------------------------------------
# round-trip and pageable-transfer
# --------------------------------------------------------------------------------------------


def _transfer(seq: int, op: str, transfer: str, src: int, dst: int, **kw: Any) -> CopyEvent:
    devices = {"h2d": ("cpu", "cuda:0"), "d2h": ("cuda:0", "cpu")}[transfer]
    return CopyEvent(
        seq=seq, op=op, transfer=transfer, src_device=devices[0], dst_device=devices[1],
        src_storage=src, dst_storage=dst, src_offset=0, src_stride=(1,),
        src_version=kw.pop("src_version", 0), dst_version=0, bytes_allocated=4000,
        bytes_logical=4000, shape=(1000,), dtype="float32", src_dtype="float32",
        file="train.py", line=kw.pop("line", 10 + seq), function="main", **kw,
    )  # fmt: skip


def test_round_trip_rule_on_recorded_events() -> None:
    there = _transfer(0, "cuda", "h2d", src=1, dst=2)
    back = _transfer(1, "cpu", "d2h", src=2, dst=3)
    f = only(analyze([there, back]), "round-trip")
    assert f.bytes == 4000 and f.call_sites == ["train.py:10 main", "train.py:11 main"]
    assert f.message.startswith("host->device->host")
    # near-misses: the device copy was changed before coming back; or it is other data
    changed = _transfer(1, "cpu", "d2h", src=2, dst=3, src_version=1)
    other = _transfer(1, "cpu", "d2h", src=9, dst=3)
    assert analyze([there, changed]) == [] and analyze([there, other]) == []


@needs_cuda
def test_round_trip_program_on_cuda() -> None:
    def program(t: Any) -> None:
        x = torch.randn(1000)
        y = x.cuda()
        program.back = y.cpu()  # site: cuda-back
        program.fine = (y * 2).cpu()  # a result, not the same data

    _, findings = traced(program)
    f = only(findings, "round-trip")
    assert f.bytes == 4000 and site("cuda-back", "program") in f.call_sites


def _move_batches(**to_kwargs: Any) -> Callable[[Any], None]:
    def program(t: Any) -> None:
        x = torch.randn(4, 8)
        for _ in range(3):
            program.y = x.to("cuda", **to_kwargs)  # site: batch-to-device
            t.step()

    return program


@needs_cuda
def test_pageable_transfer_every_step_is_reported() -> None:
    _, findings = traced(_move_batches())
    f = only(findings, "pageable-transfer")
    assert codes(findings) == ["pageable-transfer"]
    assert f.bytes == 3 * 128 and f.steps == [0, 1, 2]
    assert f.call_sites == [site("batch-to-device", "program")]


@needs_cuda
def test_non_blocking_or_one_time_transfers_are_not_reported() -> None:
    _, findings = traced(_move_batches(non_blocking=True))
    assert findings == []
    model = nn.Linear(4, 4)
    _, findings = traced(lambda t: model.to("cuda"))  # once, at set-up
    assert findings == []


def test_copies_to_meta_every_step_are_no_transfer() -> None:
    # meta has no memory: a copy to it moves nothing, so nothing is pageable
    def program(t: Any) -> None:
        x = torch.randn(4, 8)
        for _ in range(3):
            program.y = x.to("meta")
            t.step()

    t, findings = traced(program)
    assert findings == []
    assert [(e.transfer, e.fake) for e in t.events] == [("none", True)] * 3


@needs_cuda
def test_pinned_non_blocking_transfer_is_not_reported_on_cuda() -> None:
    def program(t: Any) -> None:
        x = torch.randn(4, 8).pin_memory()
        for _ in range(3):
            program.y = x.to("cuda", non_blocking=True)
            t.step()

    _, findings = traced(program)
    assert findings == []


# --------------------------------------------------------------------------------------------
# deepcopy-in-loop
# --------------------------------------------------------------------------------------------


def test_deepcopy_every_step_is_reported_with_the_in_place_fix() -> None:
    model = nn.Linear(4, 2)

    def program(t: Any) -> None:
        for _ in range(3):
            program.target = copy.deepcopy(model)  # site: deepcopy-loop
            t.step()

    _, findings = traced(program)
    f = only(findings, "deepcopy-in-loop")
    assert codes(findings) == ["deepcopy-in-loop"]
    assert f.bytes == 3 * 40  # weight 2x4 + bias 2, float32, per copy
    assert f.call_sites == [site("deepcopy-loop", "program")]
    assert "load_state_dict" in f.fix and "_foreach_lerp_" in f.fix
    assert "torch.nn.modules.linear.Linear" in f.message


def test_deepcopy_once_then_in_place_refresh_is_not_reported() -> None:
    model = nn.Linear(4, 2)

    def program(t: Any) -> None:
        target = copy.deepcopy(model)
        for step in range(9):
            target.load_state_dict(model.state_dict())
            if step % 4 == 0:  # an occasional snapshot is not a hot loop
                program.best = copy.deepcopy(model.state_dict())
            t.step()

    _, findings = traced(program)
    assert findings == []


# --------------------------------------------------------------------------------------------
# tensor-ctor-copy and clone-detach-order
# --------------------------------------------------------------------------------------------


def test_torch_tensor_of_a_tensor_is_reported() -> None:
    loss = torch.tensor(2.5, requires_grad=True) * 2

    def program(t: Any) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's own advice
            program.kept = torch.tensor(loss)  # site: tensor-ctor

    _, findings = traced(program)
    f = only(findings, "tensor-ctor-copy")
    assert codes(findings) == ["tensor-ctor-copy"]
    assert f.bytes == 4 and f.call_sites == [site("tensor-ctor", "program")]
    assert "detach().clone()" in f.fix


def test_tensor_from_data_or_as_tensor_is_not_reported() -> None:
    src = torch.randn(10)
    _, findings = traced(lambda t: (torch.tensor([1.0, 2.0]), torch.as_tensor(src)))
    assert findings == []


def test_clone_then_detach_is_info_and_detach_then_clone_is_clean() -> None:
    w = torch.randn(100, requires_grad=True)

    def program(t: Any) -> None:
        program.a = w.clone().detach()  # site: clone-detach

    _, findings = traced(program)
    f = only(findings, "clone-detach-order")
    assert f.severity == "info" and f.bytes == 400
    assert f.call_sites == [site("clone-detach", "program")]

    plain = torch.randn(100)  # no grad: clone().detach() costs autograd nothing
    _, findings = traced(lambda t: (w.detach().clone(), plain.clone().detach()))
    assert findings == []


# --------------------------------------------------------------------------------------------
# noop-conversion
# --------------------------------------------------------------------------------------------


def test_noop_conversion_every_step_is_info() -> None:
    x = torch.randn(4, 4)

    def program(t: Any) -> None:
        for _ in range(3):
            program.y = x.to("cpu")  # site: noop-to
            t.step()

    _, findings = traced(program)
    f = only(findings, "noop-conversion")
    assert codes(findings) == ["noop-conversion"] and f.severity == "info"
    assert f.bytes == 0 and f.call_sites == [site("noop-to", "program")]


def test_real_conversion_or_one_noop_is_not_reported() -> None:
    x = torch.randn(4, 4)

    def program(t: Any) -> None:
        x.contiguous()  # once
        for _ in range(3):
            program.y = x.t().contiguous()  # a real copy each step
            t.step()

    _, findings = traced(program)
    assert findings == []


# --------------------------------------------------------------------------------------------
# the same findings from a trace file; span events for the exporter
# --------------------------------------------------------------------------------------------


def test_findings_from_a_trace_file_match_memory(tmp_path: Path) -> None:
    programs = [  # each with the one finding the tests above derive
        (_edit_weight_through_data, "data-inplace"),
        (_eval_history(lambda loss: loss.clone()), "graph-retaining-copy"),
        (_best_model(lambda m: m.state_dict()), "aliasing-snapshot"),
        (_copy_twice, "redundant-copy"),
        (_copy_of_copy, "redundant-copy"),
    ]
    for i, (program, code) in enumerate(programs):
        with copytrace.trace(tmp_path / str(i)) as t:
            program(t)
        in_memory = analyze(t.events)
        from_file = analyze(load_trace(tmp_path / str(i)))
        assert codes(in_memory) == [code]
        assert [(f.code, f.bytes, f.call_sites, f.steps) for f in from_file] == [
            (f.code, f.bytes, f.call_sites, f.steps) for f in in_memory
        ]
        # as many span ids as the in-memory finding names events, each an event span's
        spans = {e.span_id for e in load_trace(tmp_path / str(i)).runs[0].events}
        (f,) = from_file
        assert len(f.span_ids) == len(in_memory[0].event_seqs) > 0
        assert set(f.span_ids) <= spans


def test_analyze_accepts_a_trace_and_filters_codes() -> None:
    t, findings = traced(_copy_twice)
    assert codes(analyze(t)) == codes(findings) == ["redundant-copy"]
    assert analyze(t.events, codes=["data_inplace"]) == []
    with pytest.raises(ValueError, match="unknown hazard code"):
        analyze(t.events, codes=["no-such-code"])
