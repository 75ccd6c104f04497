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
