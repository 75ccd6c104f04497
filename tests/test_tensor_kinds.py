"""Facts for tensors without real storage, for copies inside torch's own Python kernels and for
a tensor built from a list of tensors, each checked against what a plain ``TorchDispatchMode``
sees (the dispatch-level truth).

A meta tensor (and a FakeTensor) has no real memory: a copy into one allocates nothing and
moves nothing across devices, whatever the source's device. A copy that torch's Python
decomposition makes (``torch/_decomp/decompositions.py``'s ``uniform_`` writes
``self.copy_(...)`` when a meta tensor is initialised) runs below the level a mode sees, so it
is no event. ``torch.tensor([t1, t2])`` reads each tensor's value into a new tensor: one copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace
from copytrace.dashboards import build_model, load_trace

# lean: C wrappers, full: C observer and its function mode, python: the Python modes
SETUPS = [
    pytest.param({"level": "lean"}, id="lean"),
    pytest.param({"level": "full"}, id="full"),
    pytest.param({"level": "full", "observer": "python"}, id="python"),
]


class AtenLog(TorchDispatchMode):
    """Ground truth: every aten op a dispatch mode sees, with its result's device and the
    devices of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[str, ...], str | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        devices = tuple(str(a.device) for a in args if isinstance(a, torch.Tensor))
        entry = [str(func.overloadpacket.__name__), devices, None]
        self.ops.append(entry)  # type: ignore[arg-type]
        out = func(*args, **(kwargs or {}))  # a call that raises stays logged, with no result
        entry[2] = str(out.device) if isinstance(out, torch.Tensor) else None
        return out


def _copies(events: list) -> list:
    return [e for e in events if not e.alias and not e.group]


@pytest.mark.parametrize("setup", SETUPS)
def test_a_copy_into_meta_moves_and_allocates_nothing(setup: dict) -> None:
    x = torch.randn(32, 16)  # 2048 B
    with AtenLog() as truth:
        x.to("meta")
        torch.empty(32, 16, device="meta").copy_(x)
    # the dispatch level: _to_copy and copy_ whose results live on meta (no host memory)
    assert [(op, dst) for op, _, dst in truth.ops if op in ("_to_copy", "copy_")] == [
        ("_to_copy", "meta"),
        ("copy_", "meta"),
    ]
    assert [devs for op, devs, _ in truth.ops if op == "copy_"] == [("meta", "cpu")]
    with copytrace.trace(write=False, **setup) as t:
        a = x.to("meta")
        b = torch.empty(32, 16, device="meta")
        b.copy_(x)
        c = x.to(torch.device("meta"), torch.float16)
    assert a.is_meta and b.is_meta and c.is_meta
    got = [(e.op, e.src_device, e.dst_device, e.transfer, e.bytes_allocated, e.fake)
           for e in _copies(t.events)]  # fmt: skip
    assert got == [
        ("to", "cpu", "meta", "none", 0, True),
        ("copy_", "cpu", "meta", "none", 0, True),
        ("to", "cpu", "meta", "none", 0, True),
    ]
    assert [e.bytes_logical for e in _copies(t.events)] == [2048, 2048, 1024]


@pytest.mark.parametrize("setup", SETUPS)
def test_a_failed_load_from_meta_names_the_real_destination(setup: dict) -> None:
    with torch.device("meta"):
        src = nn.Linear(4, 3)
    dst = nn.Linear(4, 3)
    with AtenLog() as truth:
        try:
            dst.weight.data.copy_(src.weight)
        except NotImplementedError:
            pass
    # the dispatch level saw copy_(dst on cpu, src on meta), which raised
    assert ["copy_", ("cpu", "meta"), None] in truth.ops
    with copytrace.trace(write=False, **setup) as t:
        with pytest.raises((RuntimeError, NotImplementedError)):
            dst.load_state_dict(src.state_dict())
    failed = [e for e in t.events if e.op == "copy_"]
    assert [(e.src_device, e.dst_device, e.shape) for e in failed][:1] == [
        ("meta", "cpu", (3, 4))
    ]
    assert all(e.error and e.transfer == "none" and e.bytes_allocated == 0 for e in failed)


def test_meta_and_fake_copies_are_not_bytes_copied_nor_cross_device(tmp_path: Path) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(64, 64)  # 16384 B
    with copytrace.trace(tmp_path):
        x.clone()  # the one real copy: 16384 B
        x.to("meta")
        with FakeTensorMode() as mode:
            f = mode.from_tensor(x)
            f.clone()
    totals = build_model(load_trace(tmp_path)).totals
    assert totals.bytes_copied == 16384
    assert totals.bytes_allocated == 16384


@pytest.mark.parametrize("setup", SETUPS)
def test_copies_inside_torch_decompositions_are_no_events(setup: dict) -> None:
    with AtenLog() as truth:
        with torch.device("meta"):
            nn.Linear(8, 8)
    # a dispatch mode sees the in-place initialisers, never the copy_ their meta kernel makes
    ops = [op for op, _, _ in truth.ops]
    assert "uniform_" in ops and "copy_" not in ops
    with copytrace.trace(write=False, **setup) as t:
        with torch.device("meta"):
            lin = nn.Linear(8, 8)
            emb = nn.Embedding(10, 4)  # normal_ on meta
        conv = nn.Conv1d(2, 2, 3, device="meta")
    assert lin.weight.is_meta and emb.weight.is_meta and conv.weight.is_meta
    assert [e for e in t.events if e.op in ("copy_", "implicit")] == []


_LIST_PROGRAM = """\
import json, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import copytrace
from copytrace.analysis import analyze
from copytrace.tracefile import event_table

class Fresh(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.made = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and func.overloadpacket.__name__ in ("lift_fresh", "_to_copy"):
            self.made.append(out.untyped_storage().nbytes())
        return out

parts = [torch.tensor(float(i)) for i in range(3)]
with Fresh() as truth:
    torch.tensor(parts)
losses = torch.ones(4, requires_grad=True)
with copytrace.trace(sys.argv[1], level=sys.argv[2], observer=sys.argv[3]) as t:
    for _ in range(3):
        a = torch.tensor(parts)
        b = torch.tensor([[losses[0].detach(), losses[1].detach()]])
        c = torch.tensor([1.0, 2.0])
        t.step()
built = [(list(e.shape), e.bytes_allocated) for e in t.events if e.op == "tensor_ctor"]
codes = [f.code for f in analyze(event_table(t.trace_path))]
print(json.dumps({"truth": truth.made, "built": built, "codes": codes, "a": a.tolist()}))
"""


@pytest.mark.parametrize("setup", [p for p in SETUPS if p.id != "lean"])
def test_a_tensor_built_from_a_list_of_tensors_is_one_copy(setup: dict, tmp_path: Path) -> None:
    # A fresh process: level lean's Tensor.__getitem__ wrapper leaves torch.Tensor a
    # sequence type, so torch.tensor([0-d tensors]) raises after any lean trace in this one.
    import json
    import subprocess
    import sys

    script = tmp_path / "build.py"
    script.write_text(_LIST_PROGRAM)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out"), setup["level"],
         setup.get("observer", "auto")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # the dispatch level: one new tensor of 3 float32 values (12 B) built from the parts
    assert got["truth"] == [12]
    assert got["a"] == [0.0, 1.0, 2.0]
    # per step: torch.tensor(parts) 12 B and the nested [[l0, l1]] 8 B; numbers only: none
    assert got["built"] == [[[3], 12], [[1, 2], 8]] * 3
    assert got["codes"].count("tensor-ctor-copy") == 2  # one finding per line
