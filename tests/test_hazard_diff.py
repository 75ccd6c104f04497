"""The columnar hazard analyser finds exactly what the per-event rules found: every finding's
code, severity, message, fix, call sites, bytes, steps, events, run and span ids.

The per-event rules are kept in ``tests/_reference_hazards.py``. The rules as SQL
(``copytrace.analysis._sql_hazards``: what ``summary``/``check --engine spark`` compute) give
one row per finding on DuckDB over the trace's dataset: its code, call sites, number of events
and bytes, checked against the columnar findings of every trace file below. All run over:

- real traced programs, one per hazard code and one near miss each (a trace file and the
  events in memory);
- random events (fields drawn from small pools, so that storages, versions, steps and sites
  collide: pairs, chains, repeats and hot loops happen by chance), in memory and written to a
  trace file by the tracer's own file writer;
- the synthetic traces of ``tests/_tracegen.py`` and ``benchmarks/report_size.py``.
"""

from __future__ import annotations

import copy
import random
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from _reference_hazards import analyze_reference
from _tracegen import write_many, write_trace

import copytrace
from copytrace import CopyEvent
from copytrace.analysis import HAZARDS, Budget, analyze, analyze_with_totals, step_totals
from copytrace.analysis._budget import check_budget
from copytrace.analysis._sql import duckdb_results
from copytrace.analysis._view import runs_of
from copytrace.export.file_sink import FileSink
from copytrace.export.pipeline import Chunk, ExportPipeline, RunEnd, RunIds
from copytrace.export.sdk_sink import make_resource
from copytrace.tracefile import event_table, load_trace
from copytrace.tracefile._dataset import write_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from report_size import generate_trace  # noqa: E402


def _same(source: Any, reference_source: Any = None) -> list[Any]:
    """Assert both analysers give the same findings of ``source``; return them."""
    new = analyze(source)
    old = analyze_reference(source if reference_source is None else reference_source)
    assert [f.as_dict() for f in new] == [f.as_dict() for f in old]
    return new


def _same_totals(source: Any) -> None:
    """Budgets' step totals column by column equal those over one view per event; and so do
    the budget checks' lines."""
    views = runs_of(source)
    by_columns = step_totals(source)
    assert by_columns == step_totals(views)
    budget = Budget(max_bytes_per_step=100, max_copies_per_step=2, max_bytes=1000, max_copies=5)
    assert check_budget(source, [], budget) == check_budget(views, [], budget)
    # `copytrace check` reads the columns once for both: the same findings, totals and runs
    findings, (totals, runs) = analyze_with_totals(source)
    assert [f.as_dict() for f in findings] == [f.as_dict() for f in analyze(source)]
    assert totals == by_columns
    assert runs == len(views)


def _same_sql(path: Path, found: list[Any]) -> None:
    """The SQL rules on DuckDB over the dataset of trace ``path`` give one row per finding of
    ``found``: ``(code, call sites joined by "; ", events, bytes)``."""
    with tempfile.TemporaryDirectory() as tmp:
        write_dataset(event_table(path, cache=False), Path(tmp))
        rows = duckdb_results(Path(tmp), ["hazards"])["hazards"]
    sql = sorted((code, site, n, nbytes) for code, _run, site, n, nbytes in rows)
    # (these traces name no library call sites: a finding's call sites are its own)
    assert sql == sorted((f.code, "; ".join(f.call_sites) or "(unknown call site)",
                          len(f.event_seqs), f.bytes) for f in found)  # fmt: skip


def _same_file(path: Path) -> list[Any]:
    """Both analysers over a trace file's event table (each its own table) and its loaded
    trace; the budgets' step totals too; and the SQL rules over its dataset."""
    found = _same(event_table(path, cache=False), event_table(path, cache=False))
    _same(load_trace(path))
    _same_totals(event_table(path, cache=False))
    _same_sql(path, found)
    return found


# --- real programs: each hazard, and a near miss ----------------------------------------------
def _programs() -> list[Any]:
    def data_inplace(t: Any) -> None:
        lin = nn.Linear(4, 2)
        for near in (False, True):
            loss = lin(torch.randn(3, 4, requires_grad=True)).sum()  # weight.t() saved
            if near:
                loss.backward()
            lin.weight.data.mul_(0.5)  # before the backward: data-inplace; after: clean
            if not near:
                loss.backward()
            t.step()

    def history(t: Any) -> None:
        lin = nn.Linear(4, 2)
        kept, clean = [], []
        for _ in range(3):
            loss = lin(torch.randn(3, 4)).sum()
            kept.append(loss.clone())  # graph-retaining-copy
            clean.append(loss.detach().clone())  # near miss: detach first
            t.step()
        del kept, clean

    def snapshot(t: Any) -> None:
        lin = nn.Linear(4, 2)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        best = lin.state_dict()  # aliasing-snapshot once the optimizer steps
        good = {k: v.detach().clone() for k, v in lin.state_dict().items()}  # near miss
        for _ in range(2):
            lin(torch.randn(3, 4)).sum().backward()
            opt.step()
            t.step()
        del best, good

    def copies(t: Any) -> None:
        x = torch.randn(64)
        for _ in range(4):
            a, b = x.clone(), x.clone()  # redundant-copy: the same source twice in a step
            c = x.float().clone()  # near miss: a no-op then one copy
            d = x.clone().clone()  # a copy of a fresh copy on one line
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns against this form
                tensor = torch.tensor(x)  # tensor-ctor-copy
            e = x.clone().detach()  # clone-detach-order (x does not require grad: no finding)
            w = torch.randn(8, requires_grad=True)
            f = (w * 2).clone().detach()  # clone-detach-order
            g = (w * 2).detach().clone()  # near miss
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's scalar-conversion warning
                cast = torch.as_tensor([w[0] * 2, w[1]])  # tensor-ctor-copy, its as_tensor fix
                legacy = torch.FloatTensor([w[0] * 2, w[1]])  # tensor-ctor-copy, legacy fix
            same = torch.as_tensor(x)  # near miss: x itself
            y = x.to(torch.float32).contiguous()  # noop-conversion every step
            x.add_(1)  # the source changes each step: no repeat across steps
            snap = copy.deepcopy(x)  # deepcopy-in-loop
            t.step()
            del a, b, c, d, tensor, e, f, g, y, snap, cast, same, legacy

    def lost_write(t: Any) -> None:
        x = torch.zeros(8)
        idx = torch.tensor([1, 3])
        for _ in range(2):
            x[idx].add_(1)  # lost-inplace-write
            x[idx] += 1  # near miss: index assignment
            t.step()

    def pageable(t: Any) -> None:
        for _ in range(4):
            torch.randn(16).to("meta")  # no finding: meta has no memory, nothing moves
            t.step()

    def kept_cast(t: Any) -> None:
        lin = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        w64 = lin.weight.double()  # stale-kept-copy once the optimizer steps
        for _ in range(3):
            (torch.ones(1, 4, dtype=torch.float64) @ w64.t()).sum().backward()
            opt.step()

    def alias_writes(t: Any) -> None:
        x = torch.zeros(8)
        for _ in range(2):
            staging = x.to("cpu")  # alias-write: the no-op result is x itself
            staging += 1.0
            view = x.reshape(2, 4)  # alias-write: a view of x, which is still held
            view[0].zero_()
            shallow = copy.copy(x)  # alias-write: a new tensor on x's storage
            shallow[0] = 2.0
            real = x.to("cpu", copy=True)  # near miss: a real copy
            real += 1.0
            t.step()

    def nonleaf_deepcopy(t: Any) -> None:
        lin = nn.Linear(4, 2)
        for cached in (lin(torch.randn(3, 4)), lin(torch.randn(3, 4)).detach()):
            lin.cache = cached  # a non-leaf (deepcopy-nonleaf), then a detached one (clean)
            try:
                copy.deepcopy(lin)
            except RuntimeError:
                pass
            t.step()

    return [data_inplace, history, snapshot, copies, lost_write, pageable, kept_cast,
            alias_writes, nonleaf_deepcopy]  # fmt: skip


def test_real_programs_file_and_memory(tmp_path: Path) -> None:
    found: set[str] = set()
    for i, program in enumerate(_programs()):
        out = tmp_path / str(i)
        # no flush by time either (every 5 s by default: a loaded machine can stretch a
        # program's steps that long), so memory holds every event the file has
        with copytrace.trace(out, flush_seconds=3600) as t:
            program(t)
        assert t.stats["flushes"] == 0
        from_memory = _same(t.events)
        from_file = _same_file(out)
        found |= {f.code for f in from_file}
        # the file and memory agree on everything but what only one of them knows
        assert [(f.code, f.message, f.bytes, f.steps, f.call_sites) for f in from_file] == [
            (f.code, f.message, f.bytes, f.steps, f.call_sites) for f in from_memory
        ]
    # what was compared covers most codes (round-trip needs a device, see the random events)
    assert found >= set(HAZARDS) - {"round-trip", "aliasing-snapshot", "pageable-transfer"}


# --- random events ------------------------------------------------------------------------------
_OPS = ("clone", "to", "cpu", "cuda", "contiguous", "float", "copy_", "detach", "detach_",
        "deepcopy", "tensor_ctor", "new_tensor", "index", "gather", "data_get", "data_set",
        "implicit", "reshape")  # fmt: skip


def _random_events(rng: random.Random, n: int) -> list[CopyEvent]:
    """``n`` random events: a third repeat a recent event (same source, site and step) or
    continue it (its result as the source, the transfer reversed), so that repeats, chains,
    round trips and clone-then-detach pairs happen."""

    def maybe(values: tuple, none: float = 0.2) -> Any:
        return None if rng.random() < none else rng.choice(values)

    rows: list[dict[str, Any]] = []
    group = -1
    for seq in range(n):
        op = rng.choice(_OPS)
        is_group = op == "deepcopy" and rng.random() < 0.3
        row = dict(
            op=op, step=seq // 60 if rng.random() < 0.9 else rng.randrange(9),
            file=rng.choice(("train.py", "")), line=rng.choice((10, 11)),
            function=rng.choice(("main", "")),
            bytes_allocated=rng.choice((0, 64, 4096)), bytes_logical=rng.choice((0, 64, 4096)),
            alias=rng.random() < 0.15, noop=rng.random() < 0.3, group=is_group,
            parent=group if op == "deepcopy" and not is_group and rng.random() < 0.6 else -1,
            error=maybe(("RuntimeError",), 0.93), via=maybe(("torch.nn.utils.clip",), 0.85),
            transfer=rng.choice(("none", "h2d", "d2h", "d2d")),
            non_blocking=rng.random() < 0.3, pinned=maybe((True, False)),
            src_storage=maybe((1, 2, 3, 4, 5, 6)), dst_storage=maybe((1, 2, 3, 4, 5, 6, 7)),
            src_offset=maybe((0, 8)), src_stride=rng.choice(((), (1,), (4, 1))),
            src_version=maybe((0, 1)), dst_version=maybe((0, 1)),
            shape=rng.choice(((), (16,), (4, 4))), dtype=maybe(("float32", "float16")),
            dst_device=rng.choice(("cpu", "cuda:0")), graph=rng.choice(("attached", "none")),
            grad_fn=maybe(("CloneBackward0",)), src_requires_grad=rng.random() < 0.5,
            inplace_writes=maybe((0, 1), 0.7), saved_by=rng.choice(((), ("MulBackward0.self",))),
            write_site=maybe(("train.py:99 main",), 0.6), src_name=maybe(("lin.weight",), 0.5),
            retained_bytes=maybe((0, 512), 0.6), snapshot=rng.random() < 0.2,
            stale=rng.random() < 0.5, object_type=maybe(("builtins.dict", "torch.nn.Linear")),
            load_site=maybe(("train.py:60 main",), 0.7), origin=maybe(("train.py:5",), 0.5),
            phase=rng.choice(("forward", "backward", "other")),
        )  # fmt: skip
        if rows and rng.random() < 0.35:
            prev = rng.choice(rows[-6:])
            keep = ("step", "file", "line", "function", "error", "via", "group", "alias", "noop")
            row.update({k: prev[k] for k in keep})
            if rng.random() < 0.5:  # the same source again
                row.update({k: prev[k] for k in ("src_storage", "src_offset", "src_stride",
                                                 "src_version", "shape", "dtype", "dst_device",
                                                 "op", "transfer", "inplace_writes")})  # fmt: skip
            else:  # the previous result as the source
                back = {"h2d": "d2h", "d2h": "h2d"}.get(prev["transfer"], prev["transfer"])
                row.update(src_storage=prev["dst_storage"], src_version=prev["dst_version"],
                           transfer=back, dst_storage=rng.randrange(8, 99),
                           op=rng.choice(("detach", "clone", "cpu", "cuda", prev["op"])))  # fmt: skip
        if is_group:
            group = seq
        rows.append(row)
    # every 5th event starts and ends with the one before it: the file's order then comes
    # from the span ids
    starts = [1000 * (i - 1 if i % 5 == 4 else i) for i in range(len(rows))]
    return [CopyEvent(seq=i, start_ns=starts[i], end_ns=starts[i] + 500, **row)
            for i, row in enumerate(rows)]  # fmt: skip


def _write(events: list[CopyEvent], path: Path) -> None:
    """Write ``events`` as a trace file with the tracer's own writer (one step span per
    step)."""
    run = RunIds(0, 1_700_000_000_000_000_000, make_resource())
    pipeline = ExportPipeline(run, [FileSink(path, compression=None)])
    pipeline.begin()
    last = max(e.step for e in events)
    steps = [(s, 60_000 * s, 60_000 * (s + 1)) for s in range(last + 1)]
    end = 1000 * len(events) + 1000
    pipeline.close(Chunk(events, steps, final=RunEnd(end, {"copytrace.events": len(events)})))


@pytest.mark.parametrize("seed", range(12))
def test_random_events(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    events = _random_events(rng, 500)
    found = _same(events)
    _same_totals(events)
    for code in HAZARDS:  # asking for one code runs its rule alone: the same findings
        assert analyze(events, codes=[code]) == [f for f in found if f.code == code]
    path = tmp_path / "copytrace-1.otlp.jsonl"
    _write(events, path)
    assert _same_file(path)
    assert found  # random events with these pools always show some hazard


def test_random_events_find_every_code(tmp_path: Path) -> None:
    """The random events exercise every rule (so the comparison above compares findings)."""
    found = {f.code for seed in range(12) for f in analyze(_random_events(random.Random(seed),
                                                                          500))}  # fmt: skip
    assert found == set(HAZARDS)


# --- the example ------------------------------------------------------------------------------
def test_example_trace(tmp_path: Path) -> None:
    """The example training script (3 steps), traced in this process; its trace file also
    holds the hazards span the tracer wrote at stop, which must be these findings."""
    import runpy

    example = Path(__file__).resolve().parents[1] / "examples" / "train_charlm.py"
    main = runpy.run_path(str(example))["main"]
    with warnings.catch_warnings(), copytrace.trace(tmp_path / "out"):
        warnings.simplefilter("ignore")  # the example's deliberate torch.tensor(loss)
        assert main(["--steps", "3", "--eval-every", "3"]) == 0
    found = _same_file(tmp_path / "out")
    assert "tensor-ctor-copy" in [f.code for f in found]  # the deliberate one
    (run,) = load_trace(tmp_path / "out").runs
    assert [h["copytrace.hazard.code"] for h in run.hazards] == [f.code for f in found]
    assert [h["copytrace.hazard.message"] for h in run.hazards] == [f.message for f in found]


# --- synthetic traces ---------------------------------------------------------------------------
def test_tracegen_traces(tmp_path: Path) -> None:
    write_trace(tmp_path / "a", truncated=True)
    write_trace(tmp_path / "b", pid=11)
    write_trace(tmp_path / "b", pid=12, gz=True)
    write_many(tmp_path / "c", 3000, large_every=7)
    for name in "abc":
        _same_file(tmp_path / name)


def test_benchmark_trace(tmp_path: Path) -> None:
    path = tmp_path / "copytrace-1.otlp.jsonl"
    generate_trace(path, 5000)
    found = _same_file(path)
    # 5000 events over 50 steps, 40 % of them a no-op .to() at one line: a hot no-op
    assert "noop-conversion" in [f.code for f in found]


@pytest.mark.parametrize("mix", ["pairs", "sites"])
def test_benchmark_adversarial_mixes(tmp_path: Path, mix: str) -> None:
    """The benchmark's adversarial mixes, small: every event a pair-rule candidate, and every
    event at a call site of its own."""
    path = tmp_path / "copytrace-1.otlp.jsonl"
    generate_trace(path, 2000, mix=mix)
    found = _same_file(path)
    codes = [f.code for f in found]
    if mix == "pairs":
        # 33 x (clone, detach, cast) per step on one line: the clones repeat one source, the
        # cast copies the fresh clone, the clone is detached
        assert codes.count("redundant-copy") == 2 and "clone-detach-order" in codes
    else:
        assert "noop-conversion" not in codes  # no site fires in 3 steps
