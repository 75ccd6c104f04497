"""A loaded trace typed at a terminal's REPL (``copytrace.load_trace(DIR)``) prints one line
of counts, not every span (the generated dataclass form printed hundreds of kilobytes for a
few hundred events)."""

from __future__ import annotations

from pathlib import Path

from _tracegen import write_trace

from copytrace.tracefile import load_trace


def test_a_loaded_trace_and_its_run_print_counts(tmp_path: Path) -> None:
    path = write_trace(tmp_path, pid=4242)
    data = load_trace(path)
    (run,) = data.runs
    # _tracegen's trace: clone, detach (step 0); to, a deepcopy group and its 2 children
    # (step 1); a no-op to, contiguous (step 2): 8 event spans; steps 0-2; one hazard
    assert repr(data) == (
        f"TraceData(runs=1, events=8, files=[{str(path)!r}], bad_lines=0, empty_files=[])"
    )
    assert repr(run) == (
        f"Run(trace_id={run.trace_id!r}, pid=4242, steps=3, events=8, hazards=1, "
        f"files=[{str(path)!r}])"
    )
