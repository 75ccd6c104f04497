"""Storage-level copies, checked against what a plain ``TorchDispatchMode`` sees (the
dispatch-level truth).

``share_memory_()`` moves a CPU tensor's storage into a new shared-memory segment
(``torch/storage.py``: ``_share_fd_cpu_`` allocates the segment, copies the whole storage
into it with ``aten::copy_`` and hands the segment to the same storage object). So it
allocates the storage's bytes, all of them even for a view, and the storage keeps its id. A
storage already shared is left alone. ``Module.share_memory()`` runs it on each parameter
through ``Module._apply``, whose ``param.data = param`` rebinds nothing. A storage's own
``clone()`` allocates a new storage of the same size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace

SETUPS = [
    pytest.param({"level": "lean"}, id="lean"),
    pytest.param({"level": "full"}, id="full"),
    pytest.param({"level": "full", "observer": "python"}, id="python"),
]


class StorageCopies(TorchDispatchMode):
    """Ground truth: the bytes each ``copy_`` a dispatch mode sees writes (its destination's
    storage bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.copied: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.overloadpacket.__name__ == "copy_":
            self.copied.append(args[0].untyped_storage().nbytes())
        return func(*args, **(kwargs or {}))


def _moves(events: list) -> list[tuple]:
    return [
        (e.op, e.bytes_allocated, e.bytes_logical, e.storage_move, e.noop)
        for e in events
        if e.op in ("share_memory_", "implicit")
    ]


@pytest.mark.parametrize("setup", SETUPS)
def test_share_memory_moves_the_whole_storage_once(setup: dict) -> None:
    def program() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(64, 64)  # 16384 B
        row = torch.randn(10, 100)[2]  # 400 B, a view of 4000 B
        x.share_memory_()
        x.share_memory_()  # already shared: nothing to do
        row.share_memory_()
        return x, row

    with StorageCopies() as truth:
        program()
    assert truth.copied == [16384, 4000]  # the whole storage, each once
    with copytrace.trace(write=False, **setup) as t:
        x, row = program()
    assert x.is_shared() and row.is_shared()
    assert _moves(t.events) == [
        ("share_memory_", 16384, 16384, True, False),
        ("share_memory_", 0, 16384, False, True),  # already shared: a no-op
        ("share_memory_", 4000, 400, True, False),  # the row's whole storage moved
    ]
    moved = [e for e in t.events if e.storage_move]
    assert all(e.src_storage == e.dst_storage is not None for e in moved)
    assert all(e.aten == ("aten::copy_",) and e.via is None for e in moved)
    assert t.stats["errors"] == 0


@pytest.mark.parametrize("setup", SETUPS)
def test_module_share_memory_moves_each_parameter_and_rebinds_nothing(setup: dict) -> None:
    lin = nn.Linear(4, 4)  # weight 64 B, bias 16 B
    with StorageCopies() as truth:
        nn.Linear(4, 4).share_memory()
    assert truth.copied == [64, 16]
    with copytrace.trace(write=False, **setup) as t:
        lin.share_memory()
    assert lin.weight.is_shared() and lin.weight.is_leaf
    assert [(e.op, e.bytes_allocated, e.storage_move, e.graph) for e in t.events] == [
        ("share_memory_", 64, True, "attached"),  # the parameter itself: still a leaf
        ("share_memory_", 16, True, "attached"),
    ]
    assert [e for e in t.events if e.op == "data_set"] == []


@pytest.mark.parametrize("setup", SETUPS)
def test_storage_level_clone_and_share(setup: dict) -> None:
    def program() -> torch.UntypedStorage:
        s = torch.randn(8).untyped_storage()  # 32 B
        copy = s.clone()
        s.share_memory_()
        return copy

    with StorageCopies() as truth:
        program()
    assert truth.copied == [32, 32]
    with copytrace.trace(write=False, **setup) as t:
        program()
    got = [(e.bytes_allocated, e.storage_move, e.src_storage == e.dst_storage) for e in t.events]
    assert got == [(32, False, False), (32, True, True)]


def test_the_new_facts_are_parquet_columns(tmp_path: Path) -> None:
    import duckdb

    from copytrace.cli import main

    x = torch.randn(16, 16)  # 1024 B

    def body(a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    with copytrace.trace(tmp_path / "trace"):
        x.share_memory_()
        torch.func.vmap(body)(torch.randn(3, 8))  # 3 members of 32 B
    out = tmp_path / "events.parquet"
    assert main(["export", str(tmp_path / "trace"), "--parquet", str(out)]) == 0
    rows = duckdb.sql(
        f"SELECT op, bytes_allocated, storage_move, batch_size, recompute FROM '{out}' "
        "WHERE storage_move OR batch_size IS NOT NULL ORDER BY start_ns"
    ).fetchall()
    assert rows == [("share_memory_", 1024, True, None, False), ("clone", 96, False, 3, False)]


class PinTruth(TorchDispatchMode):
    """Ground truth: the storage bytes of each ``_pin_memory`` result."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "_pin_memory":
            self.pinned.append(out.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("setup", SETUPS)
def test_pin_memory_is_a_copy_into_new_storage(setup: dict) -> None:
    row = torch.randn(10, 100)[2]  # 400 B of a 4000 B storage
    if not torch.accelerator.is_available():
        # no accelerator: torch refuses, and the failed call passes through unchanged
        with pytest.raises(RuntimeError) as untraced:
            row.pin_memory()
        with copytrace.trace(write=False, **setup) as t:
            with pytest.raises(RuntimeError) as traced:
                row.pin_memory()
        assert str(traced.value) == str(untraced.value)
        assert [(e.op, e.error, e.bytes_allocated) for e in t.events] == [
            ("pin_memory", "RuntimeError", 0)
        ]
        return
    with PinTruth() as truth:
        row.pin_memory()
    assert truth.pinned == [400]  # the view only, into new page-locked memory
    with copytrace.trace(write=False, **setup) as t:
        pinned = row.pin_memory()
    assert pinned.is_pinned()
    (ev,) = [e for e in t.events if e.op == "pin_memory"]
    assert (ev.bytes_allocated, ev.bytes_logical, ev.alias) == (400, 400, False)
    assert ev.src_storage != ev.dst_storage
