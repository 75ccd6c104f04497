"""No code change: ``copytrace run``, ``python -m copytrace run`` and ``COPYTRACE=1``,
each in a real subprocess on the example training script."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from copytrace.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_charlm.py"
FAST = ["--steps", "6", "--eval-every", "3"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(extra)
    return env


def _ops(trace_dir):
    files = sorted(Path(trace_dir).glob("*.otlp.jsonl*"))
    assert len(files) == 1, files
    ops = []
    opener = gzip.open if files[0].suffix == ".gz" else open  # gzip is the default
    for line in opener(files[0], "rt").read().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    attrs = {a["key"]: a["value"] for a in span["attributes"]}
                    if "copytrace.op" in attrs:
                        ops.append(attrs["copytrace.op"]["stringValue"])
    return ops


def _check_outputs(out_dir):
    ops = _ops(out_dir)
    # The example's idioms: batches moved with .to(), EMA made with deepcopy, EMA buffers
    # refreshed with copy_, loss.detach() for logging.
    assert {"to", "deepcopy", "copy_", "detach", "clone"} <= set(ops)
    html = (Path(out_dir) / "report.html").read_text()
    assert "plotly-graph-div" in html and "Plotly.newPlot" in html


def test_copytrace_run_console_script(tmp_path):
    exe = Path(sys.executable).with_name("copytrace")
    proc = subprocess.run(
        [str(exe), "run", "-o", str(tmp_path / "out"), str(EXAMPLE), *FAST],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "final: step=6" in proc.stdout  # the script's own output and arguments
    _check_outputs(tmp_path / "out")


def test_copytrace_env_var_with_no_wrapper(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *FAST],
        capture_output=True, text=True, cwd=tmp_path, timeout=240,
        env=_env(COPYTRACE="1", COPYTRACE_OUTPUT=str(tmp_path / "auto")),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "final: step=6" in proc.stdout
    _check_outputs(tmp_path / "auto")


def test_hook_is_inert_when_unset(tmp_path):
    code = "import sys; print('torch' in sys.modules, 'copytrace' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert proc.stdout.split() == ["False", "False"]
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env=_env(COPYTRACE="0"),
    )  # fmt: skip
    assert proc.stdout.split() == ["False", "False"]


def test_python_dash_m_run_passes_exit_status(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import sys, torch\nx = torch.ones(4)\ny = x.clone()\nprint(sys.argv[1:])\nsys.exit(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", "run", "--no-report", "-o", str(tmp_path / "o"),
         str(script), "--flag", "value"],
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 3
    assert "['--flag', 'value']" in proc.stdout
    assert _ops(tmp_path / "o") == ["clone"]


def test_run_missing_script_is_one_line_error(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.py")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"copytrace: error: no such script: {tmp_path / 'nope.py'}"


@pytest.mark.parametrize("argv", [["run"], ["run", "--bogus-flag", "x.py"], ["frobnicate"]])
def test_bad_flags_exit_nonzero_without_traceback(argv):
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", *argv], capture_output=True, text=True, timeout=60,
        env=_env(),
    )  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_run_gives_the_script_an_absolute_file_path(tmp_path):
    (tmp_path / "data.txt").write_text("42")
    script = tmp_path / "chd.py"
    script.write_text(
        "import os\nfrom pathlib import Path\n"
        "os.chdir('/')\n"  # a script that changes directory, then reads a file beside itself
        "print(Path(__file__).resolve().parent.joinpath('data.txt').read_text())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", "run", "--no-report", "-o", str(tmp_path / "o"),
         "chd.py"],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "42"


def test_run_gives_the_script_argv_and_main_module_as_python_does(tmp_path):
    script = tmp_path / "who.py"
    script.write_text(
        "import sys\n"
        "print(sys.argv)\n"
        "print(type(__loader__).__name__, __spec__, __file__ == sys.modules['__main__'].__file__)\n"
    )
    plain = subprocess.run(
        [sys.executable, "who.py", "--flag", "x"],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    traced = subprocess.run(
        [sys.executable, "-m", "copytrace", "run", "--no-report", "-o", str(tmp_path / "o"),
         "who.py", "--flag", "x"],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert plain.returncode == traced.returncode == 0, traced.stderr
    # python keeps argv[0] as typed while __file__ is absolute, and gives __main__ the
    # loader that read it.
    assert plain.stdout == "['who.py', '--flag', 'x']\nSourceFileLoader None True\n"
    assert traced.stdout == plain.stdout


@pytest.mark.parametrize("end, has_file", [("", False), ("sys.exit(0)\n", True)])
def test_run_leaves_the_script_as_main_for_its_atexit_handlers(tmp_path, end, has_file):
    script = tmp_path / "bye.py"
    script.write_text(
        "import atexit, pickle, sys\n"
        "class Config:\n    pass\n"
        "def save():\n"  # a handler that pickles an object of a class the script defines
        "    main = sys.modules['__main__']\n"
        "    print(hasattr(main, '__file__'), type(pickle.loads(pickle.dumps(Config()))) is Config)\n"
        "atexit.register(save)\n" + end
    )
    plain = subprocess.run(
        [sys.executable, "bye.py"],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    traced = subprocess.run(
        [sys.executable, "-m", "copytrace", "run", "--no-report", "-o", str(tmp_path / "o"),
         "bye.py"],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert plain.returncode == traced.returncode == 0, traced.stderr
    # python drops __main__.__file__ when the script ends, but not when it exits inside it
    # (SystemExit ends the process from within the run); pickle finds Config in __main__.
    assert plain.stdout == f"{has_file} True\n", plain.stderr
    assert traced.stdout == plain.stdout, traced.stderr


_SAVE_AT_EXIT = (
    "import atexit, pickle, sys\n"
    "class Config:\n    pass\n"
    "def save():\n"  # a handler that pickles an object of a class the module defines
    "    main = sys.modules['__main__']\n"
    "    print(main.__name__, type(pickle.loads(pickle.dumps(Config()))) is Config)\n"
    "atexit.register(save)\n"
    "print(sys.argv, __name__, __spec__.name, sys.modules['__main__'] is sys.modules[__name__])\n"
)


def _plain_and_traced(tmp_path, command):
    plain = subprocess.run(
        [sys.executable, *command],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    traced = subprocess.run(
        [sys.executable, "-m", "copytrace", "run", "--no-report", "-o", str(tmp_path / "o"),
         *command],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert plain.returncode == traced.returncode == 0, traced.stderr
    return plain, traced


def test_run_dash_m_leaves_the_module_as_main_for_its_atexit_handlers(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text(_SAVE_AT_EXIT)
    plain, traced = _plain_and_traced(tmp_path, ["-m", "pkg.job", "--flag"])
    # python -m runs the module in __main__'s globals and keeps it there until exit:
    # argv[0] is the module's file, and pickle finds Config in __main__ at exit.
    job = str(tmp_path / "pkg" / "job.py")
    assert plain.stdout == f"[{job!r}, '--flag'] __main__ pkg.job True\n__main__ True\n"
    assert traced.stdout == plain.stdout, traced.stderr
    assert "Exception ignored" not in traced.stderr


def test_run_zipapp_keeps_argv0_as_typed_and_its_main_for_atexit(tmp_path):
    import zipapp

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "__main__.py").write_text(
        _SAVE_AT_EXIT.replace("__spec__.name", "__file__") + "print(sys.path[0])\n"
    )
    zipapp.create_archive(tmp_path / "src", tmp_path / "app.pyz")
    plain, traced = _plain_and_traced(tmp_path, ["app.pyz", "x"])
    # argv[0] as typed, __file__ inside the archive, the archive (absolute) first on the path
    app = str(tmp_path / "app.pyz")
    assert plain.stdout == (
        f"['app.pyz', 'x'] __main__ {app}/__main__.py True\n{app}\n__main__ True\n"
    )
    assert traced.stdout == plain.stdout, traced.stderr


def test_ctrl_c_exit_status_is_the_same_traced(tmp_path):
    script = tmp_path / "ki.py"
    script.write_text("import torch\ntorch.ones(2).clone()\nraise KeyboardInterrupt\n")
    plain = subprocess.run(
        [sys.executable, str(script)], capture_output=True, env=_env(), timeout=120
    )
    traced = subprocess.run(
        [sys.executable, str(script)], capture_output=True, timeout=120,
        env=_env(COPYTRACE="1", COPYTRACE_OUTPUT=str(tmp_path / "out")),
    )  # fmt: skip
    # Python ends an unhandled KeyboardInterrupt by killing itself with SIGINT (-2 here,
    # 130 in a shell); writing the report at exit must not turn that into exit status 1.
    assert plain.returncode == traced.returncode == -2
    assert (tmp_path / "out" / "report.html").is_file()


def _interrupted(cmd, cwd, env):
    """Start ``cmd``, wait for its "ready" line, send SIGINT; return (status, stderr)."""
    import signal

    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.5)  # into the sleep that follows the print
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, err


def test_ctrl_c_under_copytrace_run_looks_untraced(tmp_path):
    # A real SIGINT while the program sleeps: the traceback is the program's alone (no
    # copytrace/cli/run.py, no runpy frames) and the status is python's own (killed by
    # SIGINT: -2 here, 130 in a shell).
    script = tmp_path / "sleepy.py"
    script.write_text(
        "import time\nimport torch\n\n\ndef wait():\n"
        "    print('ready', flush=True); time.sleep(60)  # one line: SIGINT lands on it\n\n\n"
        "torch.ones(2).clone()\nwait()\n"
    )
    plain_rc, plain = _interrupted([sys.executable, str(script)], tmp_path, _env())
    traced_rc, traced = _interrupted(
        [sys.executable, "-m", "copytrace", "run", "-o", "out", str(script)], tmp_path, _env()
    )
    assert plain_rc == traced_rc == -2

    def traceback_of(stderr):
        lines = stderr.splitlines()
        start = lines.index("Traceback (most recent call last):")
        end = lines.index("KeyboardInterrupt")
        # without the ^^^ markers, which depend on the instruction the signal interrupted
        return [ln for ln in lines[start : end + 1] if ln.strip(" ^~")]

    expected = traceback_of(plain)
    # 2 frames of the script (module level, wait()), each with its source line.
    frames = [ln.strip() for ln in expected if ln.startswith("  File ")]
    assert frames == [f'File "{script}", line 10, in <module>', f'File "{script}", line 6, in wait']
    assert traceback_of(traced) == expected
    assert "runpy" not in traced and "copytrace/cli" not in traced
    assert (tmp_path / "out" / "report.html").is_file()  # the trace and report still written


def test_run_honours_copytrace_report_0(tmp_path):
    # COPYTRACE_REPORT=0 means "traces only" under COPYTRACE=1; `copytrace run` reads the same
    # settings (it honours COPYTRACE_OUTPUT), so it writes the trace and no report.html.
    script = tmp_path / "one.py"
    script.write_text("import torch\ny = torch.ones(4).clone()\n")
    out = tmp_path / "o"
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", "run", "-o", str(out), str(script)],
        capture_output=True, text=True, env=_env(COPYTRACE_REPORT="0"), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert _ops(out) == ["clone"]
    assert not (out / "report.html").exists()
    assert "report written" not in proc.stderr
