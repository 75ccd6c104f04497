"""Facts of an API copy that no other test pinned down: the source of ``dst.copy_(src)``,
``non_blocking`` from keyword arguments, the forward call site a backward copy points back
to (``origin``), and a call with no positional tensor (nothing recorded, nothing counted as
an internal error)."""

from __future__ import annotations

from pathlib import Path

import torch

import copytrace

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
    assert [e.non_blocking for e in t.events] == [True, False, False]


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
