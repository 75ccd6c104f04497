"""Logical bytes and allocated bytes: two totals, each defined once, checked against what a
plain ``TorchDispatchMode`` sees (the dispatch-level truth).

``bytes_logical`` is numel x element size of a copy's result; ``bytes_allocated`` is the new
storage the copy really made. They differ where a copy copies more than its result shows: a
``deepcopy`` of a view copies the view's whole storage (``Tensor.__deepcopy__`` deep-copies
the storage, then views it), so a 16 KiB row of a 1 MiB tensor allocates 1 MiB. A ``clone``
of a view copies the view only: the two are equal.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace
from copytrace.cli.summary import format_summary
from copytrace.dashboards import build_model, load_trace
from copytrace.dashboards._rows import BYTES_DEFINITION
from copytrace.dashboards.sections.kinds import payload_totals


class NewStorage(TorchDispatchMode):
    """Ground truth: the storage bytes each ``copy_``/``clone`` a dispatch mode sees writes."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name == "copy_":
            self.written.append(args[0].untyped_storage().nbytes())
        elif name == "clone":
            self.written.append(out.untyped_storage().nbytes())
        return out


def _program(big: torch.Tensor) -> None:
    copy.deepcopy(big[3])  # a contiguous row: 4096 x 4 = 16 KiB of a 1 MiB storage
    big[3].clone()  # the same row, cloned: 16 KiB
    copy.deepcopy(big[:, 0])  # a non-contiguous column: 64 x 4 = 256 B of the storage


def test_each_copy_records_its_logical_and_its_allocated_bytes(tmp_path: Path) -> None:
    big = torch.randn(64, 4096)  # 1 MiB
    with NewStorage() as truth:
        _program(big)
    assert truth.written == [1 << 20, 16384, 1 << 20]
    with copytrace.trace(tmp_path) as t:
        _program(big)
    got = [(e.op, e.bytes_logical, e.bytes_allocated) for e in t.events]
    assert got == [
        ("deepcopy", 16384, 1 << 20),
        ("clone", 16384, 16384),
        ("deepcopy", 256, 1 << 20),
    ]
    model = build_model(load_trace(tmp_path))
    assert (model.totals.bytes_copied, model.totals.bytes_allocated) == (
        16384 + 16384 + 256, (1 << 20) * 2 + 16384,
    )  # fmt: skip
    assert payload_totals(model)["bytes_defs"] == BYTES_DEFINITION
    text = format_summary(model)
    assert "bytes copied 32.2 KiB (33024 B), allocated 2.0 MiB" in text
    assert f"({BYTES_DEFINITION})" in " ".join(text.split())  # wrapped at 100 columns
    # the deepcopy's call site shows both: 16 KiB of result, 1 MiB allocated
    row = next(line for line in text.splitlines() if "copy.deepcopy(big[3])" in line)
    assert "16.0 KiB" in row and "1.0 MiB" in row
