"""``copytrace export --parquet``: real values where the trace leaves an attribute out, each byte
counted once, ``--run N`` / ``--all``; and ``copytrace.trace()``'s own checks at its edges (an
unwritable output directory refused at start, ``report()`` from the events in memory).

The byte totals are checked against what a plain ``TorchDispatchMode`` sees: the storage of
every aten result that shares no storage with the op's tensor arguments (new memory).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import duckdb
import pandas as pd
import pytest
import torch
import torch.nn as nn
from _tracegen import trace_lines
from torch.utils._python_dispatch import TorchDispatchMode

import copytrace
from copytrace._errors import CopytraceError
from copytrace.cli import main
from copytrace.tracer.session import active_session

# the query docs/trace-format.md gives for the export
DOCUMENTED = ("SELECT file, line, op, sum(bytes_logical) FROM '{}' "
              "WHERE NOT noop AND NOT alias GROUP BY ALL ORDER BY 4 DESC LIMIT 5")  # fmt: skip


class NewStorage(TorchDispatchMode):
    """Ground truth: bytes of new storage made by ops that read a tensor (factories left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        ins = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if ins and isinstance(out, torch.Tensor):
            ptrs = {a.untyped_storage().data_ptr() for a in ins}
            if out.untyped_storage().data_ptr() not in ptrs:
                self.bytes += out.untyped_storage().nbytes()
        return out


def _program(x: torch.Tensor, model: nn.Module) -> None:
    x.clone()  # 4000 B
    x.to(torch.float32)  # no-op: x itself
    x.detach()  # alias
    x.to(torch.float64)  # 8000 B
    copy.deepcopy(model)  # a group over 2 tensors: 8x8 + 8 floats = 288 B


def _export(trace_dir: Path, out: Path, *extra: str) -> int:
    return main(["export", str(trace_dir), "--parquet", str(out), *extra])


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    tmp = tmp_path_factory.mktemp("export")
    x, model = torch.randn(1000), nn.Linear(8, 8)
    with NewStorage() as truth:
        _program(x, model)
    with copytrace.trace(tmp / "out"):
        _program(x, model)
    assert _export(tmp / "out", tmp / "events.parquet") == 0
    return tmp / "events.parquet", truth.bytes


def test_the_documented_duckdb_query_returns_the_copies(exported: tuple[Path, int]) -> None:
    path, truth = exported
    assert truth == 4000 + 8000 + 288
    rows = duckdb.sql(DOCUMENTED.format(path)).fetchall()
    # the clone, the float64 cast and the deepcopy rows (group 0 B + 256 + 32): no alias, no no-op
    assert sorted((op, n) for _, _, op, n in rows) == [("clone", 4000), ("deepcopy", 288),
                                                       ("to", 8000)]  # fmt: skip
    flags = duckdb.sql(f"SELECT count(*) FROM '{path}' WHERE alias IS NULL OR noop IS NULL OR "
                       '"group" IS NULL OR bytes_allocated IS NULL OR transfer IS NULL')  # fmt: skip
    assert flags.fetchall() == [(0,)]
    total = duckdb.sql(f"SELECT sum(bytes_allocated) FROM '{path}'").fetchall()[0]
    assert total == (truth,)  # the group row's 288 B are its children's: counted once


def test_pandas_reads_real_booleans_and_counts_each_byte_once(exported: tuple[Path, int]) -> None:
    path, truth = exported
    df = pd.read_parquet(path)
    assert {str(df[c].dtype) for c in ("alias", "noop", "group")} == {"bool"}
    copies = df[~df.noop & ~df.alias & ~df.group]
    assert sorted(copies.op) == ["clone", "deepcopy", "deepcopy", "to"]
    assert int(df.bytes_allocated.sum()) == truth
    (group,) = df[df.group].itertuples()
    children = df[df.parent_id == group.span_id]
    assert (group.bytes_allocated, group.tensors, len(children)) == (0, 2, 2)
    assert group.group_bytes_allocated == children.bytes_allocated.sum() == 288
    assert df[~df.group].group_bytes_allocated.isna().all()


def _launch(directory: Path, pid: int, hours: int) -> None:
    shift = hours * 3600 * 10**9

    def move(obj: object) -> object:
        if isinstance(obj, dict):
            return {k: str(int(v) + shift) if k.endswith("UnixNano") else move(v)
                    for k, v in obj.items()}  # fmt: skip
        return [move(v) for v in obj] if isinstance(obj, list) else obj

    lines = [json.dumps(move(json.loads(ln))) for ln in trace_lines(pid)]
    (directory / f"copytrace-h-{pid}.otlp.jsonl").write_text("\n".join(lines) + "\n")


def test_export_honours_run_and_all(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # two launches of the synthetic trace: 8 event rows each (a group with 2 children), and
    # 31000 B of new storage; its group row carries 3000 B that its children already hold
    _launch(tmp_path / ".", 11, 0)
    _launch(tmp_path / ".", 12, 1)
    out = tmp_path / "x.parquet"
    for argv, runs in ((["--run", "1"], 1), ([], 1), (["--all"], 2)):
        assert _export(tmp_path, out, *argv) == 0
        df = pd.read_parquet(out)
        assert df.run.nunique() == runs and len(df) == 8 * runs
        assert int(df.bytes_allocated.sum()) == 31000 * runs
        err = capsys.readouterr().err
        assert ("holds 2 runs; showing run 2" in err) == (not argv)
    assert _export(tmp_path, out, "--run", "3") == 2
    assert capsys.readouterr().err == f"copytrace: error: --run 3: {tmp_path} holds runs 1-2\n"


def test_an_unwritable_output_directory_is_refused_when_tracing_starts(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("")
    out = tmp_path / "blocker" / "out"  # cannot be created: a file is in the way
    with pytest.raises(CopytraceError) as err:
        with copytrace.trace(out):
            raise AssertionError("the body must not run")
    assert str(err.value) == f"output directory {out} is not writable (Not a directory)"
    assert active_session() is None  # nothing installed
    with copytrace.trace(out, write=False) as t:  # no file to write: nothing to refuse
        torch.ones(4).clone()
    assert [e.op for e in t.events] == ["clone"]


def test_report_after_the_block_from_the_events_in_memory(tmp_path: Path) -> None:
    with copytrace.trace(tmp_path / "never", write=False) as t:
        torch.randn(256).clone()
        with pytest.raises(CopytraceError, match="still running"):
            t.report(tmp_path / "early.html")
    written = t.report(tmp_path / "r.html", display=False)
    assert written == tmp_path / "r.html" and "clone" in written.read_text()
    assert not (tmp_path / "never").exists()  # write=False: no trace file anywhere of ours
