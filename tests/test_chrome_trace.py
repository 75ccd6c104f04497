"""``copytrace export --chrome-trace`` (and ``--merge``): a real training loop traced by
copytrace inside torch.profiler; the copies land on the profiler's clock and main thread
track, each clone slice nested with the profiler's own ``aten::clone`` slice, and
HolisticTraceAnalysis loads the merged file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = """
import sys, torch, copytrace
from torch.profiler import profile, ProfilerActivity
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 64)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    with copytrace.trace(sys.argv[1]) as t:
        for _ in range(5):
            model(x.clone()).sum().backward()
            opt.step()
            w = torch.tensor(model.bias)  # a hazard: tensor-ctor-copy
prof.export_chrome_trace(sys.argv[1] + "/profiler.json")
"""

# copytrace times a clone around the call (the API level), torch.profiler around the aten op
# inside it; each converts its own clock to the Unix epoch once, so the two may disagree by a
# few microseconds.
CLOCKS_US = 5.0


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chrome")
    prog = tmp / "prog.py"
    prog.write_text(PROGRAM)
    run = subprocess.run([sys.executable, str(prog), str(tmp)], capture_output=True, text=True,
                         timeout=240)  # fmt: skip
    assert run.returncode == 0, run.stderr
    exe = Path(sys.executable).with_name("copytrace")
    out = tmp / "merged.json"
    proc = subprocess.run(
        [str(exe), "export", str(tmp), "--chrome-trace", str(out), "--merge",
         str(tmp / "profiler.json")], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    alone = tmp / "alone.json"
    proc = subprocess.run(
        [str(exe), "export", str(tmp), "--chrome-trace", str(alone)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out, alone


def _slices(doc: dict, name: str) -> list[dict]:
    return [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("name") == name]


def test_each_clone_nests_with_the_profilers_aten_clone(merged):
    doc = json.loads(merged[0].read_text())
    ours = _slices(doc, "copytrace::clone")
    aten = _slices(doc, "aten::clone")
    assert len(ours) == 5  # one x.clone() per iteration
    main_tids = {e["tid"] for e in aten}
    for s in ours:
        assert s["tid"] in main_tids and s["pid"] == aten[0]["pid"]  # the profiler's track
        assert s["args"]["op"] == "clone" and s["args"]["bytes_allocated"] == 32 * 64 * 4
        assert s["args"]["file"].endswith("prog.py") and s["args"]["line"] == 10
        lo, hi = s["ts"], s["ts"] + s["dur"]
        match = [a for a in aten if a["ts"] < hi and a["ts"] + a["dur"] > lo]
        assert match, s
        a = match[0]
        assert lo - CLOCKS_US <= a["ts"] and a["ts"] + a["dur"] <= hi + CLOCKS_US, (s, a)


def test_hazards_in_args(merged):
    doc = json.loads(merged[1].read_text())
    ctor = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["args"].get("line") == 12]
    assert len(ctor) == 5 and all(e["args"]["hazards"] == ["tensor-ctor-copy"] for e in ctor)


def test_alone_one_track_per_thread(merged):
    doc = json.loads(merged[1].read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in slices} >= {"copytrace::clone"}
    assert min(e["ts"] for e in slices) == 0  # its own base: the first event
    names = [e for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert {(e["pid"], e["tid"]) for e in names} == {(e["pid"], e["tid"]) for e in slices}


def test_hta_loads_the_merged_trace(merged, tmp_path):
    pytest.importorskip("hta")
    from hta.trace_analysis import TraceAnalysis

    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "merged.json").write_text(merged[0].read_text())
    analysis = TraceAnalysis(trace_dir=str(tmp_path / "rank0"))
    df = analysis.t.get_trace(0)
    names = set(analysis.t.symbol_table.get_sym_table())
    assert "copytrace::clone" in names and "aten::clone" in names
    assert len(df) > 0


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"{bad", "is not JSON (Expecting property name enclosed in double quotes: "
                  "line 1 column 2 (char 1))"),
        (b"\xff\xfe{}", "is not JSON ("),
        (b"[]", "is not a Chrome trace (no traceEvents)"),
        (b'{"traceEvents": 5, "baseTimeNanoseconds": 1}', "is not a Chrome trace (no traceEvents)"),
        (b'{"traceEvents": [1], "baseTimeNanoseconds": 1}',
         "is not a Chrome trace (no traceEvents)"),
        (b'{"traceEvents": []}', "has no baseTimeNanoseconds (not torch.profiler's?)"),
    ],
)  # fmt: skip
def test_a_bad_profiler_file_is_one_line_naming_it_before_the_trace_is_read(
    tmp_path, capsys, content, problem
):
    from copytrace.cli import main

    prof = tmp_path / "prof.json"
    prof.write_bytes(content)
    # the trace is unreadable too: an error about the profiler's file shows it was read first
    trace = tmp_path / "bad.otlp.jsonl"
    trace.write_bytes(b"not a trace\n")
    out = tmp_path / "m.json"
    assert main(["export", str(trace), "--chrome-trace", str(out), "--merge", str(prof)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"copytrace: error: --merge: {prof} {problem}"), err
    assert not out.exists()
