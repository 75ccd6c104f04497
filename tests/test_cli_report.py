"""Tests of ``copytrace report`` and ``copytrace summary`` (in process and as a subprocess)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _realtrace import BYTES_COPIED, CONTIGUOUS_SITE, HAZARD_CODE, write_real_trace
from _tracegen import SCRIPT_MODULE, write_many, write_trace

from copytrace.cli import main

REPO = Path(__file__).resolve().parents[1]
# 7 non-group events, 31000 bytes allocated (derivation in tests/test_dashboards.py)
SUMMARY_LINE = "({} events, {} bytes copied)"


@pytest.fixture
def no_progress_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """No progress lines on stderr: ``copytrace report`` prints them in a log when a stage
    takes over 5 s, which a loaded machine can make any stage take (the first report in a
    process imports DuckDB and Plotly's template there); tested apart below."""
    from copytrace.dashboards import _progress

    monkeypatch.setattr(_progress, "_PLAIN_DELAY_S", float("inf"))


def _error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("copytrace: error: ")
    return lines[0]


@pytest.mark.usefixtures("no_progress_lines")
def test_report_directory_default_output(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_trace(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    expected = tmp_path / "report.html"
    assert out == f"copytrace: report written to {expected} (7 events, 31000 bytes copied)\n"
    assert err == ""
    page = expected.read_text(encoding="utf-8")
    assert 'id="ct-data"' in page and 'id="ct-plotly"' in page and SCRIPT_MODULE not in page


def test_report_file_default_and_explicit_output(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = write_trace(tmp_path / "t", gz=True)
    assert main(["report", str(path)]) == 0
    expected = tmp_path / "t" / "copytrace-testhost-4242.report.html"
    assert expected.is_file()
    assert capsys.readouterr().out.endswith(f"{expected} (7 events, 31000 bytes copied)\n")

    out_html = tmp_path / "new" / "dir" / "x.html"
    assert main(["report", str(path), "-o", str(out_html)]) == 0
    assert out_html.is_file()
    assert str(out_html) in capsys.readouterr().out


@pytest.mark.usefixtures("no_progress_lines")
def test_report_truncated_line_warns(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_trace(tmp_path, truncated=True)
    assert main(["report", str(path), "-o", str(tmp_path / "r.html")]) == 0
    out, err = capsys.readouterr()
    assert "(7 events, 31000 bytes copied)" in out
    assert err.startswith("copytrace: warning: skipped 1 unreadable line(s)")


@pytest.mark.usefixtures("no_progress_lines")
def test_report_cdn_and_max_points(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_many(tmp_path / "t", 2000)
    out_html = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "t"), "-o", str(out_html), "--cdn",
                 "--max-points", "50"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    # 4 clones of 4 MiB (every 500th event) + 665 clones of 4000 B
    assert out.endswith(f"(2000 events, {4 * (4 << 20) + 665 * 4000} bytes copied)\n")
    assert err == ""
    page = out_html.read_text(encoding="utf-8")
    assert '<script src="https://cdn.plot.ly/' in page and out_html.stat().st_size < 200_000
    data = json.loads(page.split('id="ct-data">')[1].split("</script>")[0])
    assert data["sample"]["total"] == 2000 and data["sample"]["shown"] <= 50 + 8 + 4

    assert main(["report", str(tmp_path / "t"), "--max-points", "-1"]) == 2
    assert "--max-points must be >= 0" in _error_line(capsys.readouterr().err)


def test_progress_lines_only_when_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    from copytrace.dashboards import _progress

    stream = io.StringIO()
    with _progress.Progress("reading trace", 1000, "B", stream=stream) as bar:
        bar.update(500)
    assert stream.getvalue() == ""  # fast: nothing printed
    monkeypatch.setattr(_progress, "_PLAIN_DELAY_S", 0.0)
    monkeypatch.setattr(_progress, "_PLAIN_EVERY_S", 0.0)
    stream = io.StringIO()
    with _progress.Progress("aggregating", 4, "events", stream=stream) as bar:
        bar.set_done(2)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "copytrace: aggregating: 2 events of 4 events (50%)"
    assert lines[-1].startswith("copytrace: aggregating: done in ")


def test_summary(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_trace(tmp_path)
    assert main(["summary", str(tmp_path), "--top", "2", "--no-analysis"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert "command: train.py --epochs 1" in out
    assert "devices cpu, cuda:0" in out
    assert "tracer overhead 1.50 ms" in out
    assert (
        "copy time share of a step (steady state, 1 steps): 16.7% (median 16.7%), "
        "5.00 ms copy time per step; " in out
    )
    assert "events: 7 = 5 copies + 1 aliases + 1 no-ops (1 deepcopy groups)" in out
    assert "bytes copied 30.3 KiB (31000 B)" in out
    assert "cross-device 7.8 KiB in 1 events" in out
    top = lines[lines.index("top call sites by bytes copied:") + 3 :][:3]
    assert top[0].split()[:4] == ["1", "15.6", "KiB", "51.6%"]
    assert top[0].endswith("train.py:11 forward")
    assert top[1].split()[:3] == ["2", "7.8", "KiB"] and top[1].endswith("train.py:20 main")
    assert top[2] == ""  # --top 2
    assert "top modules by copy time:" in out
    assert SCRIPT_MODULE not in out  # third module by bytes: cut by --top 2
    by_op = lines[lines.index("by op:") + 3 :]
    assert by_op[0].split() == ["contiguous", "1", "1", "0", "0", "15.6", "KiB", "15.6", "KiB",
                                "4.00", "ms"]  # fmt: skip
    assert "cpu -> cuda:0" in out

    assert main(["summary", str(tmp_path)]) == 0  # default --top 10
    assert SCRIPT_MODULE in capsys.readouterr().out  # plain text: not escaped


@pytest.mark.parametrize(
    "argv",
    [
        ["/venv/bin/python", "-m", "copytrace", "run", "-o", "out", "--", "fit.py", "--lr", "1"],
        ["/venv/bin/python3.11", "-u", "/venv/bin/copytrace", "run", "--no-report",
         "fit.py", "--lr", "1"],
    ],
)  # fmt: skip
def test_summary_of_a_cut_short_copytrace_run_shows_the_program(
    tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str]
) -> None:
    # A process killed under ``copytrace run`` leaves no run span (which holds the program's
    # argv); its resource holds the process's own command, copytrace's.
    from _tracegen import trace_lines

    events, steps = (json.loads(line) for line in trace_lines()[:2])
    for doc in (events, steps):
        doc["resourceSpans"][0]["resource"]["attributes"].append({
            "key": "process.command_args",
            "value": {"arrayValue": {"values": [{"stringValue": a} for a in argv]}},
        })  # fmt: skip
    (tmp_path / "copytrace-testhost-4242.otlp.jsonl").write_text(
        json.dumps(events) + "\n" + json.dumps(steps) + "\n"
    )
    assert main(["summary", str(tmp_path), "--no-analysis"]) == 0
    out = capsys.readouterr().out
    assert "  command: fit.py --lr 1\n" in out
    assert "(no run span: trace incomplete)" in out


def test_summary_of_a_real_trace(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The program of tests/_realtrace.py, traced for real: counts, bytes and the hazard."""
    write_real_trace(tmp_path)
    capsys.readouterr()
    assert main(["summary", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert "events: 7 = 5 copies + 1 aliases + 1 no-ops (1 deepcopy groups)" in out
    assert f"bytes copied 23.9 KiB ({BYTES_COPIED} B)" in out  # 24440 B
    assert "cross-device 0 B in 0 events" in out and "hazards: 1" in out
    top = lines[lines.index("top call sites by bytes copied:") + 3]
    assert top.split()[:4] == ["1", "15.6", "KiB", "65.5%"]  # 16000 / 24440
    assert CONTIGUOUS_SITE in top
    hz = lines[lines.index("hazards:") + 3]
    assert hz.split()[:3] == ["warning", HAZARD_CODE, "1"]
    assert SCRIPT_MODULE in out  # a module, as plain text


def test_summary_no_analysis_shows_the_hazards_of_the_trace_file(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A real trace: ``--no-analysis`` shows the hazards the tracer wrote into the file."""
    write_real_trace(tmp_path)
    capsys.readouterr()
    assert main(["summary", str(tmp_path), "--no-analysis"]) == 0
    lines = capsys.readouterr().out.splitlines()
    hz = lines[lines.index("hazards:") + 3]
    assert hz.split()[:3] == ["warning", HAZARD_CODE, "1"], hz


@pytest.mark.parametrize("command", ["report", "summary"])
def test_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture, command: str) -> None:
    assert main([command, str(tmp_path / "missing")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "not found" in _error_line(err)


@pytest.mark.usefixtures("no_progress_lines")
@pytest.mark.parametrize("command", ["report", "summary"])
def test_corrupt_file(tmp_path: Path, capsys: pytest.CaptureFixture, command: str) -> None:
    bad = tmp_path / "bad.otlp.jsonl"
    bad.write_bytes(os.urandom(2048))
    assert main([command, str(bad)]) == 2
    out, err = capsys.readouterr()
    assert "no readable copytrace spans" in _error_line(err)
    assert not (tmp_path / "bad.report.html").exists()


def _drop_trace_ids(line: str) -> str:
    doc = json.loads(line)
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                del span["traceId"]
    return json.dumps(doc)


@pytest.mark.usefixtures("no_progress_lines")
def test_spans_without_trace_id_are_unreadable_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # OTLP requires a traceId (copytrace's run id): a line of spans without one is skipped
    # and counted like any unreadable line, never a traceback
    path = write_trace(tmp_path)
    lines = path.read_text().splitlines()
    cut = [_drop_trace_ids(lines[0]), *lines[1:]]  # lines[0]: the 7 events' spans
    path.write_text("\n".join(cut) + "\n")
    assert main(["report", str(path), "-o", str(tmp_path / "r.html")]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("(0 events, 0 bytes copied)\n")
    assert err.startswith(f"copytrace: warning: skipped 1 unreadable line(s) in {path}")

    path.write_text("\n".join(_drop_trace_ids(ln) for ln in lines) + "\n")
    assert main(["summary", str(path)]) == 2
    assert _error_line(capsys.readouterr().err) == (
        f"copytrace: error: no readable copytrace spans in {path} (4 unreadable line(s))"
    )


def test_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "no trace files" in _error_line(capsys.readouterr().err)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "copytrace", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # generous: this job takes about 70 s, and longer on a loaded machine
    )


def test_subprocess_report_and_errors(tmp_path: Path) -> None:
    write_trace(tmp_path / "t")
    out_html = tmp_path / "r.html"
    proc = _run("report", str(tmp_path / "t"), "-o", str(out_html))
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stdout == f"copytrace: report written to {out_html} (7 events, 31000 bytes copied)\n"
    )
    assert out_html.stat().st_size > 1_000_000  # plotly.js inlined

    bad = tmp_path / "bad.otlp.jsonl"
    bad.write_bytes(os.urandom(2048))
    proc = _run("report", str(bad))
    assert proc.returncode == 2
    assert "no readable copytrace spans" in _error_line(proc.stderr)


@pytest.mark.parametrize(
    "args, flag",
    [
        (("report", "{trace}", "-o", "{out}"), "-o"),
        (("diff", "{trace}", "{trace}", "-o", "{out}"), "-o"),
        (("export", "{trace}", "--parquet", "{out}"), "--parquet"),
        (("export", "{trace}", "--chrome-trace", "{out}"), "--chrome-trace"),
        (("export", "{trace}", "--dataset", "{folder}"), "--dataset"),
    ],
)
def test_unwritable_output_is_refused_before_any_work(
    tmp_path: Path, args: tuple[str, ...], flag: str
) -> None:
    # the output's folder lies under a file (ENOTDIR); the trace is unreadable, so an error
    # about the output shows it was checked before the trace was read
    (tmp_path / "blocker").write_text("")
    folder = tmp_path / "blocker" / "out"
    trace = tmp_path / "bad.otlp.jsonl"
    trace.write_bytes(os.urandom(2048))
    values = {"trace": str(trace), "out": str(folder / "x.out"), "folder": str(folder)}
    proc = _run(*(a.format(**values) for a in args))
    assert proc.returncode == 2
    given = values["folder" if flag == "--dataset" else "out"]
    assert _error_line(proc.stderr) == (
        f"copytrace: error: {flag} {given}: output directory {folder} is not writable "
        "(Not a directory)"
    )
