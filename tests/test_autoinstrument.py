"""No-code-change tracing (``COPYTRACE=1``, ``copytrace run``) across the ways programs start:
``python -m pkg``, ``multiprocessing`` fork and spawn, DataLoader workers; the hook's
failure mode; one report per launch; ``copytrace run``'s command line.

Each launcher runs in a real subprocess. Traces are read back with the report loader.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from copytrace import launch
from copytrace.cli import main
from copytrace.dashboards import load_trace
from copytrace.launch import _state
from copytrace.launch.markers import wait_for_launch

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _ops_by_pid(out: Path) -> dict[int, list[str]]:
    trace = load_trace(out)
    return {int(r.resource["process.pid"]): [e.op for e in r.events] for r in trace.runs}


def _copytrace_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("copytrace:")]


# --- the hook ------------------------------------------------------------------------------------
def test_hook_pth_is_installed_and_reads_only_the_variable():
    pth = [Path(d) / "copytrace_hook.pth" for d in site.getsitepackages()]
    installed = [p for p in pth if p.is_file()]
    assert installed, f"copytrace_hook.pth not in {site.getsitepackages()}"
    line = installed[0].read_text().strip()
    assert line == (ROOT / "copytrace_hook.pth").read_text().strip()
    assert line.startswith("import ") and "\n" not in line
    # Unset, the line is an expression that imports nothing new and returns None.
    saved = os.environ.pop("COPYTRACE", None)
    try:
        before = set(sys.modules)
        exec(line, {})  # noqa: S102 - the very line site.py executes
        assert set(sys.modules) == before
    finally:
        if saved is not None:
            os.environ["COPYTRACE"] = saved


def test_a_failing_hook_warns_once_and_the_program_runs_untraced(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import torch\nx = torch.ones(3).clone()\nprint('ran', float(x.sum()))\n")
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env(COPYTRACE="1", COPYTRACE_OUTPUT=str(tmp_path / "out"), COPYTRACE_MAX_EVENTS="lots"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "ran 3.0" in proc.stdout
    lines = _copytrace_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "tracing disabled" in lines[0] and "COPYTRACE_MAX_EVENTS" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("out/copytrace-*"))


_MP_PROGRAM = """
import multiprocessing as mp
import sys

import torch
from torch.utils.data import DataLoader, Dataset


class Numbers(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.full((3,), float(i)).clone()  # one clone per item, in the worker


def child(q):
    q.put(float(torch.ones(5).clone().sum()))


def main():
    torch.arange(4.0).clone()
    for method in ("fork", "spawn"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        print(method, q.get(timeout=120))
        p.join()
    loader = DataLoader(Numbers(), batch_size=2, num_workers=2)
    total = sum(float(batch.sum()) for batch in loader)
    print("loader", total)
    sys.exit(7)


if __name__ == "__main__":
    main()
"""


def test_python_dash_m_with_fork_spawn_and_dataloader_workers(tmp_path):
    # ``python -m pkg.module`` (spawn cannot re-import a package's ``__main__``, with or
    # without copytrace: a multiprocessing limitation).
    pkg = tmp_path / "mpdemo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(_MP_PROGRAM)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "mpdemo.train"],
        capture_output=True, text=True, cwd=tmp_path, timeout=240,
        env=_env(COPYTRACE="1", COPYTRACE_OUTPUT="out"),  # relative: made absolute for children
    )  # fmt: skip
    assert proc.returncode == 7, proc.stderr  # the program's own exit status
    assert "fork 5.0" in proc.stdout and "spawn 5.0" in proc.stdout
    assert "loader 18.0" in proc.stdout
    ops = _ops_by_pid(out)
    # parent + fork child + spawn child + 2 DataLoader workers, each in its own file
    assert len(list(out.glob("copytrace-*.otlp.jsonl*"))) == 5, sorted(out.iterdir())
    assert len(ops) == 5, ops
    clones = sorted(o.count("clone") for o in ops.values())
    assert clones == [1, 1, 1, 2, 2], ops  # workers: 2 items each; children: 1; parent: 1
    # One report, written once by the root after the others' traces existed.
    assert (out / "report.html").is_file()
    reports = [ln for ln in _copytrace_lines(proc.stderr) if "report" in ln]
    assert len(reports) == 1, proc.stderr
    assert not list(out.glob(".copytrace-launch-*")), "launch markers left behind"
    html = (out / "report.html").read_text(encoding="utf-8")
    assert all(f.name in html for f in out.glob("copytrace-*.otlp.jsonl*"))


# --- one report per launch -----------------------------------------------------------------------
def test_report_covers_this_launch_only(tmp_path):
    import _tracegen

    out = tmp_path / "out"
    old = _tracegen.write_trace(out, pid=111, gz=True)  # an earlier run's file
    mine = _tracegen.write_trace(out, pid=222, gz=True)
    markers = [("testhost", 222, "done", str(mine))]
    files = launch.launch_trace_files(out, markers)
    assert files == [mine]
    report = launch.write_report_for(out, files, out / "report.html")
    html = report.read_text(encoding="utf-8")
    assert str(mine) in html and old.name not in html


def test_root_waits_for_live_processes_only(tmp_path, monkeypatch, capsys):
    from copytrace.launch import markers

    # the wait's clock, moved only by its own polls: how long it waited is counted, not timed
    # (a loaded machine stretches a real wait by any amount); whole ms, so 10 x 0.05 s is 0.5 s
    clock = {"ms": 0, "polls": 0}

    def sleep(seconds):
        clock["ms"] += round(seconds * 1000)
        clock["polls"] += 1

    monkeypatch.setattr(
        markers, "time",
        types.SimpleNamespace(monotonic=lambda: clock["ms"] / 1000, sleep=sleep),
    )  # fmt: skip
    directory = tmp_path / "launch"
    directory.mkdir()
    host = _state.host()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        (directory / f"{host}-{dead.pid}").write_text("running\n")  # died without finishing
        (directory / f"{host}-{sleeper.pid}").write_text("running\n")
        capsys.readouterr()
        markers_read = wait_for_launch(directory, 0.5)
        # waited for the live one, polling every 0.05 s, up to the timeout and no longer
        assert clock == {"ms": 500, "polls": 10}
        assert capsys.readouterr().err == (
            "copytrace: report written without waiting longer for 1 process(es) still "
            f"tracing (pid {sleeper.pid})\n"
        )
        assert {pid for _, pid, _, _ in markers_read} == {dead.pid, sleeper.pid}
        (directory / f"{host}-{sleeper.pid}").write_text("done x\n")
        wait_for_launch(directory, 10)
        assert clock == {"ms": 500, "polls": 10}  # nothing live is still running: no wait
        assert capsys.readouterr().err == ""
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize(
    ("argv", "orig", "expected"),
    [
        (["/venv/bin/torchrun", "--nproc_per_node=2", "t.py"], None, True),
        (
            ["-m", "--nproc_per_node=2", "t.py"],
            ["py", "-m", "torch.distributed.run", "--nproc_per_node=2", "t.py"],
            True,
        ),  # fmt: skip
        (
            ["/x/torch/distributed/run.py", "t.py"],
            ["py", "-m", "torch.distributed.run", "t.py"],
            True,
        ),  # fmt: skip
        (["/venv/bin/accelerate", "launch", "t.py"], None, True),
        (["/venv/bin/copytrace", "run", "t.py"], None, True),
        (["train.py", "-m", "x"], ["py", "train.py", "-m", "x"], False),
        (["-c"], ["py", "-c", "import torch"], False),
        (["/x/mpdemo/__main__.py"], ["py", "-m", "mpdemo"], False),
    ],
)
def test_launchers_are_recognised(monkeypatch, argv, orig, expected):
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig or ["py", *argv], raising=False)
    assert launch.is_launcher() is expected


# --- copytrace run's command line ------------------------------------------------------------------
_ARGV_SCRIPT = "import sys, json, torch\ntorch.ones(2).clone()\nprint(json.dumps(sys.argv[1:]))\nsys.exit({code})\n"


@pytest.mark.parametrize(
    ("before", "after", "code"),
    [
        ([], ["a", "--", "-o", "x"], 0),  # everything after the script is the program's
        (["--"], ["--no-report", "-m", "y"], 5),  # -- ends copytrace's options
    ],
)
def test_run_passes_arguments_and_exit_status(tmp_path, capsys, before, after, code):
    script = tmp_path / "prog.py"
    script.write_text(_ARGV_SCRIPT.format(code=code))
    out = tmp_path / "out"
    status = main(["run", "--no-report", "-o", str(out), *before, str(script), *after])
    assert status == code
    captured = capsys.readouterr()
    assert captured.out.strip() == str(after).replace("'", '"')
    assert _ops_by_pid(out) == {os.getpid(): ["clone"]}
    assert "COPYTRACE" not in os.environ and "COPYTRACE_LAUNCH" not in os.environ


def test_run_module_with_its_own_options(tmp_path, capsys, monkeypatch):
    (tmp_path / "argmod.py").write_text(_ARGV_SCRIPT.format(code=0))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--no-report", "-o", "out", "-m", "argmod", "-o", "z", "--py-spy"]) == 0
    assert capsys.readouterr().out.strip() == '["-o", "z", "--py-spy"]'


def test_run_program_error_is_its_traceback_and_status_1(tmp_path, capsys):
    script = tmp_path / "boom.py"
    script.write_text("import torch\ntorch.ones(1).clone()\nraise ValueError('boom')\n")
    assert main(["run", "--no-report", "-o", str(tmp_path / "out"), str(script)]) == 1
    err = capsys.readouterr().err
    assert "ValueError: boom" in err and 'boom.py", line 3' in err
    assert "runpy" not in err and "copytrace/cli" not in err
    assert _ops_by_pid(tmp_path / "out") == {os.getpid(): ["clone"]}  # traced all the same


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run"], "nothing to run"),
        (["run", "-m"], "-m needs a module name"),
        (["run", "-m", "no_such_module_xyz"], "no module named no_such_module_xyz"),
    ],
)
def test_run_usage_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("copytrace: error: ") and message in err and "\n" not in err


def test_run_script_sees_itself_as_main_and_child_processes_are_traced(tmp_path):
    script = tmp_path / "forker.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, torch
            torch.ones(2).clone()
            pid = os.fork()
            if pid == 0:
                torch.ones(3).clone()
                torch.ones(3).clone()
                raise SystemExit(0)
            os.waitpid(pid, 0)
            print(__name__)
            """
        )
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", "run", "-o", str(out), str(script)],
        capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "__main__"
    counts = sorted(ops.count("clone") for ops in _ops_by_pid(out).values())
    assert counts == [1, 2]  # the parent and the bare os.fork() child, one report
    assert (out / "report.html").is_file()
