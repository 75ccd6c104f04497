"""Facts of an API copy that no other test pinned down: the source of ``dst.copy_(src)``,
``non_blocking`` from keyword arguments, the forward call site a backward copy points back
to (``origin``), and a call with no positional tensor (nothing recorded, nothing counted as
an internal error)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

import copytrace
from copytrace.tracer._recorder import _storage_nbytes, _transfer

_SOURCE = Path(__file__).read_text(encoding="utf-8").splitlines()


def line_of(tag: str) -> int:
    (line,) = [i for i, text in enumerate(_SOURCE, 1) if text.rstrip().endswith(f"# site: {tag}")]
    return line


def test_copy_into_records_the_source_not_the_destination() -> None:
    src = torch.ones(4)  # float32, 16 B
    dst = torch.zeros(4, dtype=torch.float64)
    with copytrace.trace(write=False) as t:
        dst.copy_(src)
    (ev,) = t.events
    assert (ev.op, ev.src_dtype, ev.dtype) == ("copy_", "float32", "float64")
    assert (ev.bytes_allocated, ev.bytes_logical, ev.alias) == (0, 32, False)  # into dst


def test_non_blocking_comes_from_the_keyword() -> None:
    x = torch.ones(4)
    with copytrace.trace(write=False) as t:
        x.to(torch.float64, non_blocking=True)
        x.to(torch.float64)
        x.to(torch.float64, non_blocking=False)
        x.to(torch.float64, copy=True)  # keywords, but not non_blocking
    assert [e.non_blocking for e in t.events] == [True, False, False, False]


def test_backward_copy_points_at_its_forward_call() -> None:
    w = torch.ones(3, requires_grad=True)
    with copytrace.trace(write=False) as t:
        y = w.double()  # site: forward-cast
        y.sum().backward()  # ToCopyBackward0 casts the gradient back to float32
    cast, back = t.events
    assert (cast.op, cast.grad_fn, cast.origin) == ("double", "ToCopyBackward0", None)
    assert (back.op, back.phase, back.dtype) == ("implicit", "backward", "float32")
    assert back.origin == f"{__file__}:{line_of('forward-cast')}"


def test_call_without_a_positional_tensor_is_no_internal_error() -> None:
    x = torch.ones(4)
    with copytrace.trace(write=False) as t:
        y = torch.clone(input=x)
    assert torch.equal(y, x)
    assert t.stats["errors"] == 0


def test_transfer_kinds() -> None:
    pairs = [("cpu", "cpu"), ("cpu", "cuda:0"), ("cuda:0", "cpu"), ("cuda:0", "cuda:1"),
             ("cuda:0", "cuda:0"), ("cpu", "meta"), ("meta", "cuda:0")]  # fmt: skip
    # meta has no real storage: nothing moves to or from it
    assert [_transfer(a, b) for a, b in pairs] == [
        "none", "h2d", "d2h", "d2d", "none", "none", "none"
    ]


def test_storage_bytes_of_a_tensor_without_storage_are_its_logical_bytes() -> None:
    assert _storage_nbytes(torch.ones(3).to_sparse()) == 12  # 3 float32 values
    assert _storage_nbytes(torch.ones(10)[2:4]) == 40  # a view: its whole storage


def test_a_copy_to_meta_moves_nothing_and_a_failed_copy_records_its_source() -> None:
    x = torch.ones(4, requires_grad=True)
    t0 = time.perf_counter_ns()
    with copytrace.trace(write=False) as t:
        x.detach().to("meta")  # no real storage on meta: no transfer, nothing allocated
        try:
            x.to("no-such-device")
        except RuntimeError:
            pass
    t1 = time.perf_counter_ns()
    detach, meta, failed = t.events
    assert (meta.transfer, meta.pinned, meta.dst_device) == ("none", False, "meta")
    assert (meta.fake, meta.bytes_allocated, meta.bytes_logical) == (True, 0, 16)
    assert (failed.error, failed.requires_grad, failed.graph, failed.alias) == (
        "RuntimeError", False, "none", False)  # fmt: skip
    assert (failed.shape, failed.dtype, failed.dst_device) == ((4,), "float32", "cpu")
    for ev in t.events:
        assert t0 <= ev.start_ns <= ev.end_ns <= t1
