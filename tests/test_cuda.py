"""Device facts on CUDA: transfers, non_blocking, pinned sources, device indices, autocast.

Skipped without a GPU. copytrace never synchronises a device: the timing of a CUDA copy is
its host-side launch, and the sync-debug mode of torch.cuda (which raises on any
synchronising call) is used to prove it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import copytrace

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_h2d_from_pinned_memory_non_blocking():
    src = torch.randn(256).pin_memory()  # 1 KiB
    with copytrace.trace(write=False) as t:
        out = src.to("cuda", non_blocking=True)
    (ev,) = t.events
    assert (ev.op, ev.src_device, ev.dst_device, ev.transfer) == ("to", "cpu", "cuda:0", "h2d")
    assert ev.non_blocking and ev.pinned
    assert ev.bytes_allocated == 1024 and not ev.alias
    assert out.device.type == "cuda"


def test_h2d_from_pageable_memory_is_not_pinned():
    src = torch.randn(256)
    with copytrace.trace(write=False) as t:
        src.cuda()
    (ev,) = t.events
    assert ev.op == "cuda" and ev.transfer == "h2d" and not ev.pinned and not ev.non_blocking


def test_d2h_and_noop_on_device():
    dev = torch.randn(64, device="cuda")
    with copytrace.trace(write=False) as t:
        host = dev.cpu()
        same = dev.to("cuda")
    back, noop = t.events
    assert (back.transfer, back.src_device, back.dst_device) == ("d2h", "cuda:0", "cpu")
    assert back.bytes_allocated == 256
    assert noop.noop and noop.bytes_allocated == 0 and same is dev
    assert host.device.type == "cpu"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_d2d_between_devices_names_both_indices():
    a = torch.randn(16, device="cuda:0")
    with copytrace.trace(write=False) as t:
        a.to("cuda:1")
    (ev,) = t.events
    assert (ev.src_device, ev.dst_device, ev.transfer) == ("cuda:0", "cuda:1", "d2d")


def test_autocast_casts_are_implicit_copies_in_forward():
    model = nn.Linear(32, 32).cuda()
    x = torch.randn(8, 32, device="cuda")
    with copytrace.trace(write=False) as t, torch.autocast("cuda", dtype=torch.float16):
        model(x)
    casts = [e for e in t.events if e.op == "implicit" and e.aten == ("aten::_to_copy",)]
    assert casts, t.events
    assert all(e.dtype == "float16" and e.phase == "forward" for e in casts)
    assert all(e.module == "Linear" for e in casts)


def test_tracing_never_synchronises_the_device():
    src = torch.randn(1024).pin_memory()
    dev = torch.randn(1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises from here on
    try:
        with copytrace.trace(write=False) as t:
            a = src.to("cuda", non_blocking=True)
            b = dev.clone()
            c = dev.detach()
            d = b.to(torch.float16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [e.op for e in t.events] == ["to", "clone", "detach", "to"]
    assert all(x.device.type == "cuda" for x in (a, b, c, d))


# A DataLoader's batches moved to the GPU from pageable memory every step (lines 13 and 14:
# pageable-transfer, fixed with pin_memory=True and non_blocking=True), and a tensor the
# program made moved the same way (line 15: the near miss, a non-DataLoader source).
PAGEABLE = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 32), torch.randn(64, 1))
loader = DataLoader(data, batch_size=8)
model = nn.Linear(32, 1).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
noise = torch.randn(8, 32)
for epoch in range(2):
    for xb, yb in loader:
        xb = xb.to("cuda")
        yb = yb.to("cuda")
        nb = noise.to("cuda")
        loss = (model(xb + 0 * nb) - yb).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
print(repr(model.weight.sum().item()), repr(loss.item()))
"""


def _line(finding):
    """The line of a finding's first call site (``file:line function``)."""
    return int(finding.call_sites[0].rsplit(":", 1)[1].split()[0])


def test_pageable_transfer_fix_pins_the_dataloader(tmp_path):
    """Traced, patched, run again: the same output and the batches' findings gone; the
    program's own tensor gets no patch. (Needs a GPU: the rule sees real host-to-device
    copies; tests/test_fix.py checks the rewrite itself on findings made by hand.)"""
    import subprocess
    import sys

    from copytrace.fixes import apply_plan, plan_fixes

    (tmp_path / "train.py").write_text(PAGEABLE)

    def trace(out):
        cmd = [sys.executable, "-m", "copytrace", "run", "--no-report", "-o", out, "train.py"]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    before = trace("out-before")
    plan = plan_fixes(tmp_path / "out-before", codes="pageable-transfer", root=tmp_path)
    assert sorted((_line(f.finding), f.exact) for f in plan.fixes) == [(13, True), (14, True)]
    refused = {_line(u.finding): u.reason for u in plan.unfixed}
    assert list(refused) == [15] and "not a loop variable over a DataLoader" in refused[15]
    apply_plan(plan)
    lines = (tmp_path / "train.py").read_text().splitlines()
    assert lines[6] == "loader = DataLoader(data, batch_size=8, pin_memory=True)"
    assert lines[12:14] == ['        xb = xb.to("cuda", non_blocking=True)',
                            '        yb = yb.to("cuda", non_blocking=True)']
    assert trace("out-after") == before
    again = plan_fixes(tmp_path / "out-after", codes="pageable-transfer", root=tmp_path)
    assert again.fixes == [] and [_line(u.finding) for u in again.unfixed] == [15]
