"""Typed settings: every ``COPYTRACE_*`` variable is parsed once, in ``copytrace._env``, and
its promise holds in a real run (``copytrace run``, ``COPYTRACE=1``, ``copytrace.trace()``)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import copytrace
from copytrace import _env

# A program whose first act is visible: if it ran at all, ran.txt exists.
_PROGRAM = "open('ran.txt', 'w').write('x')\nimport torch\ntorch.ones(2).clone()\n"


def _env_vars(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _spans(path: Path) -> list[dict]:
    """Every span of one trace file, attributes decoded to plain values."""
    opener = gzip.open if path.name.endswith(".gz") else open
    spans = []
    with opener(path, "rt") as fh:
        for line in fh:
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        attrs = {}
                        for a in span.get("attributes", []):
                            ((kind, value),) = a["value"].items()
                            attrs[a["key"]] = int(value) if kind == "intValue" else value
                        spans.append({"name": span["name"], "attrs": attrs})
    return spans


def _run_span(spans: list[dict]) -> dict:
    (run,) = [s for s in spans if "copytrace.flushes" in s["attrs"]]
    return run["attrs"]


# --- parsing: one message format naming the variable, the value and what is accepted ---------
@pytest.mark.parametrize(
    "name, value, message",
    [
        ("COPYTRACE_AUTO_STEP", "banana",
         "COPYTRACE_AUTO_STEP: not 'banana'; use 1 or 0 (or true/false, yes/no, on/off)"),
        ("COPYTRACE_LEVEL", "fast", "COPYTRACE_LEVEL: not 'fast'; use lean, full or api"),
        ("COPYTRACE_OBSERVER", "cuda",
         "COPYTRACE_OBSERVER: not 'cuda'; use auto, native or python"),
        ("COPYTRACE_COMPRESSION", "zstd", "COPYTRACE_COMPRESSION: not 'zstd'; use gzip or none"),
        ("COPYTRACE_MAX_EVENTS", "-5", "COPYTRACE_MAX_EVENTS: not '-5'; use a whole number >= 0"),
        ("COPYTRACE_FLUSH_EVENTS", "1.5",
         "COPYTRACE_FLUSH_EVENTS: not '1.5'; use a whole number >= 0"),
        ("COPYTRACE_FLUSH_SECONDS", "soon",
         "COPYTRACE_FLUSH_SECONDS: not 'soon'; use a number of seconds >= 0"),
        ("COPYTRACE_REPORT_WAIT", "nan",
         "COPYTRACE_REPORT_WAIT: not 'nan'; use a number of seconds >= 0"),
        ("COPYTRACE_REPORT", "maybe",
         "COPYTRACE_REPORT: not 'maybe'; use 1 or 0 (or true/false, yes/no, on/off)"),
    ],
)  # fmt: skip
def test_a_value_not_accepted_names_the_variable_and_the_accepted_values(name, value, message):
    with pytest.raises(copytrace.SettingError) as info:
        _env.setting(name, {name: value})
    assert str(info.value) == message
    assert [str(e) for e in _env.check({name: value})] == [message]


def test_schedule_errors_name_the_fields():
    with pytest.raises(copytrace.SettingError) as info:
        _env.setting("COPYTRACE_SCHEDULE", {"COPYTRACE_SCHEDULE": "garbage"})
    text = str(info.value)
    assert text.startswith("COPYTRACE_SCHEDULE: not 'garbage'; use e.g. wait=1,")
    assert "wait, warmup, active, repeat, skip_first" in text
    # active=0 would trace nothing at all: refused as well.
    with pytest.raises(copytrace.SettingError):
        _env.parse_schedule("active=0")


def test_accepted_values_are_typed_and_empty_means_unset():
    env = {
        "COPYTRACE_AUTO_STEP": "off", "COPYTRACE_LEVEL": " API ", "COPYTRACE_MAX_EVENTS": "5",
        "COPYTRACE_FLUSH_SECONDS": "0.5", "COPYTRACE_SCHEDULE": "wait=1; active=2",
        "COPYTRACE_COMPRESSION": "",
    }  # fmt: skip
    assert _env.trace_options(env) == {
        "max_events": 5, "auto_step": False, "schedule": {"wait": 1, "active": 2},
        "level": "api",
        "observer": "auto", "compression": "gzip", "flush_events": 4096, "flush_seconds": 0.5,
        "trigger": "none", "trigger_steps": 10, "ring": 0,
    }  # fmt: skip
    assert _env.check(env) == []


def test_trace_options_cover_every_option_trace_reads_from_the_environment():
    # Each option named by the docstring of Trace as defaulting to a COPYTRACE_* variable.
    doc = copytrace.Trace.__doc__
    options = (
        "schedule", "compression", "flush_events", "flush_seconds", "level", "observer",
        "trigger", "trigger_steps", "ring",
    )  # fmt: skip
    from_env = {opt for opt in options if f"$COPYTRACE_{opt.upper()}" in doc}
    assert from_env == set(options)
    assert from_env | {"max_events", "auto_step"} == set(_env.trace_options({}))


def test_level_constant_is_the_accepted_set(monkeypatch):
    # Trace accepts exactly LEVELS, and says which in its message.
    for level in _env.LEVELS:
        assert copytrace.Trace(write=False, level=level).level == level
    with pytest.raises(copytrace.SettingError, match="level: not 'fast'; use lean, full or api"):
        copytrace.Trace(write=False, level="fast")
    monkeypatch.setenv("COPYTRACE_COMPRESSION", "zstd")
    with pytest.raises(copytrace.SettingError, match="^COPYTRACE_COMPRESSION: not 'zstd'"):
        copytrace.Trace(write=False)


# --- copytrace run: exit 2 before the program starts -------------------------------------------
@pytest.mark.parametrize(
    "var, value",
    [("COPYTRACE_AUTO_STEP", "banana"), ("COPYTRACE_SCHEDULE", "garbage"),
     ("COPYTRACE_LEVEL", "fast"), ("COPYTRACE_MAX_EVENTS", "-5"),
     ("COPYTRACE_RING_SIGNAL", "SIGBOGUS"), ("COPYTRACE_RING_SIGNAL", "SIGKILL"),
     ("COPYTRACE_TRIGGER_SIGNAL", "SIGINT"), ("COPYTRACE_TRIGGER_SIGNAL", "stop")],
)  # fmt: skip
def test_copytrace_run_refuses_a_bad_setting_before_the_program_starts(tmp_path, var, value):
    (tmp_path / "prog.py").write_text(_PROGRAM)
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", "run", "prog.py"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env_vars(**{var: value}),
    )  # fmt: skip
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"copytrace: error: {var}: not {value!r}; use ")
    assert not (tmp_path / "ran.txt").exists()  # the program never started
    assert not (tmp_path / "copytrace-out").exists()


def test_copytrace_run_refuses_an_unwritable_output_directory(tmp_path):
    (tmp_path / "prog.py").write_text(_PROGRAM)
    (tmp_path / "a-file").write_text("")
    for out in ("/proc/x", str(tmp_path / "a-file" / "out")):
        proc = subprocess.run(
            [sys.executable, "-m", "copytrace", "run", "-o", out, "prog.py"],
            capture_output=True, text=True, cwd=tmp_path, timeout=120, env=_env_vars(),
        )  # fmt: skip
        assert proc.returncode == 2
        (line,) = proc.stderr.splitlines()
        assert line.startswith(f"copytrace: error: output directory {out} is not writable (")
        assert not (tmp_path / "ran.txt").exists()


def test_hook_says_it_once_per_launch_and_runs_the_program_untraced(tmp_path):
    # The root and a Python child it starts both inherit the bad value: one line in all.
    (tmp_path / "prog.py").write_text(
        _PROGRAM + "import subprocess, sys\n"
        "subprocess.run([sys.executable, '-c', 'import torch; torch.ones(1).clone()'])\n"
        "print('done')\n"
    )
    proc = subprocess.run(
        [sys.executable, "prog.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env_vars(COPYTRACE="1", COPYTRACE_COMPRESSION="zstd"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n"
    assert proc.stderr.splitlines() == [
        "copytrace: COPYTRACE_COMPRESSION: not 'zstd'; use gzip or none; tracing disabled"
    ]
    assert not (tmp_path / "copytrace-out").exists()


def test_hook_refuses_sigint_as_the_ring_signal_and_runs_untraced(tmp_path):
    (tmp_path / "prog.py").write_text(_PROGRAM)
    proc = subprocess.run(
        [sys.executable, "prog.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env_vars(COPYTRACE="1", COPYTRACE_RING="10", COPYTRACE_RING_SIGNAL="SIGINT"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ran.txt").exists()
    assert proc.stderr.splitlines() == [
        "copytrace: COPYTRACE_RING_SIGNAL: not 'SIGINT'; use another signal such as SIGUSR2 or "
        "SIGUSR1 (SIGINT is Ctrl-C: the program's KeyboardInterrupt); tracing disabled"
    ]


@pytest.mark.skipif(hasattr(__import__("signal"), "SIGINFO"), reason="this platform has SIGINFO")
def test_a_signal_this_platform_lacks_is_said_once_per_setting(tmp_path):
    # SIGINFO is BSD's and macOS's: a real signal name, absent on Linux
    (tmp_path / "prog.py").write_text(_PROGRAM)
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", "run", "--no-report", "prog.py"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env_vars(COPYTRACE_RING="10", COPYTRACE_RING_SIGNAL="info"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ran.txt").exists()
    said = [line for line in proc.stderr.splitlines() if "SIGINFO" in line]
    assert said == [
        "copytrace: this platform has no SIGINFO (COPYTRACE_RING_SIGNAL): the ring is written "
        "only on a failure, SIGTERM or the run's end"
    ]


def test_hook_refuses_an_unwritable_output_directory_before_the_program(tmp_path):
    # a file where the directory should be: it cannot be created (ENOTDIR / EEXIST)
    (tmp_path / "blocker").write_text("")
    out = tmp_path / "blocker" / "out"
    (tmp_path / "prog.py").write_text(_PROGRAM)
    proc = subprocess.run(
        [sys.executable, "prog.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env_vars(COPYTRACE="1", COPYTRACE_OUTPUT=str(out)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ran.txt").exists()  # the program ran, untraced
    assert proc.stderr.splitlines() == [
        f"copytrace: output directory {out} is not writable (Not a directory); tracing disabled"
    ]


def test_hook_refuses_a_copytrace_value_that_is_neither_on_nor_off(tmp_path):
    (tmp_path / "prog.py").write_text(_PROGRAM)
    proc = subprocess.run(
        [sys.executable, "prog.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env_vars(COPYTRACE="banana"),
    )  # fmt: skip
    assert proc.returncode == 0
    assert proc.stderr.splitlines() == [
        "copytrace: COPYTRACE: not 'banana'; use 1 or 0 (or true/false, yes/no, on/off); "
        "tracing disabled"
    ]


# --- each variable's promise, in a real run --------------------------------------------------
_STEPS_PROGRAM = """
import torch
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    x = torch.ones(3, 2).clone()
    model(x).sum().backward()
    opt.step()
"""


def test_bootstrap_passes_every_trace_setting(tmp_path):
    """COPYTRACE_LEVEL, _COMPRESSION, _FLUSH_EVENTS and _AUTO_STEP=0 under COPYTRACE=1."""
    (tmp_path / "prog.py").write_text(_STEPS_PROGRAM)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "prog.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env_vars(
            COPYTRACE="1", COPYTRACE_OUTPUT=str(out), COPYTRACE_REPORT="0",
            COPYTRACE_LEVEL="api", COPYTRACE_COMPRESSION="none", COPYTRACE_FLUSH_EVENTS="1",
            COPYTRACE_AUTO_STEP="0",
        ),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("copytrace-*")
    assert path.name.endswith(".otlp.jsonl")  # COMPRESSION=none: no .gz, plain JSON lines
    assert path.read_bytes()[:1] == b"{"
    spans = _spans(path)
    run = _run_span(spans)
    # AUTO_STEP=0: the 5 optimizer steps end no step; the whole run is step 0.
    assert run["copytrace.steps"] == 1
    # ... so there is no step boundary to flush at; FLUSH_EVENTS=1 reaches the flush by count
    # (4 x flush_events = 4 records in one step): at the 4th clone the first three copies are
    # dead (x reassigned), the 4th is the program's x, still watched, so one flush of 3 records
    # goes; the 5th makes 2 records, under 4 (the final write at stop is not counted).
    assert run["copytrace.flushes"] == 1
    clones = [s for s in spans if s["attrs"].get("copytrace.op") == "clone"]
    assert len(clones) == 5
    # LEVEL=api: the function mode alone, which names no aten op (full names aten::clone).
    assert all("copytrace.aten" not in s["attrs"] for s in clones)


def test_flush_events_and_max_events_from_the_environment(tmp_path):
    (tmp_path / "prog.py").write_text(_STEPS_PROGRAM)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "prog.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env_vars(
            COPYTRACE="1", COPYTRACE_OUTPUT=str(out), COPYTRACE_REPORT="0",
            COPYTRACE_FLUSH_EVENTS="1", COPYTRACE_MAX_EVENTS="3",
        ),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("copytrace-*.otlp.jsonl.gz")  # gzip, the default
    run = _run_span(_spans(path))
    assert run["copytrace.max_events"] == 3
    # 5 optimizer steps make 5 boundaries; the first (an optimizer step) never flushes, so
    # that a later explicit t.step() can still renumber; the 4 others each hold >= 1 record.
    assert run["copytrace.flushes"] == 4
    assert run["copytrace.steps"] == 6


def test_trace_reads_flush_seconds_level_and_compression_from_the_environment(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("COPYTRACE_FLUSH_EVENTS", "1000000")  # never by count
    monkeypatch.setenv("COPYTRACE_LEVEL", "api")
    monkeypatch.setenv("COPYTRACE_COMPRESSION", "none")
    flushes = {}
    for seconds in ("0", "3600"):
        monkeypatch.setenv("COPYTRACE_FLUSH_SECONDS", seconds)
        with copytrace.trace(tmp_path / seconds) as t:
            for _ in range(3):
                torch.ones(2).clone()
                t.step()
        assert (t.level, t.compression) == ("api", None)
        assert t.trace_path.name.endswith(".otlp.jsonl")
        flushes[seconds] = t.stats["flushes"]
    # 0 s: each of the 3 boundaries has a buffered record and is "due"; 3600 s: none is.
    assert flushes == {"0": 3, "3600": 0}


def test_report_wait_bounds_the_wait_for_a_process_still_tracing(tmp_path):
    # The root starts a traced child that keeps running; with COPYTRACE_REPORT_WAIT=0.5 the
    # root writes its report after half a second instead of the default 30.
    (tmp_path / "prog.py").write_text(
        "import subprocess, sys, torch\n"
        "torch.ones(2).clone()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import torch, time; "
        "torch.ones(1).clone(); print(1, flush=True); time.sleep(120)'],\n"
        "                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)\n"
        "child.stdout.readline()\n"
        "import time\n"
        "print(child.pid, time.monotonic(), flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "prog.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env_vars(COPYTRACE="1", COPYTRACE_OUTPUT=str(tmp_path / "out"),
                      COPYTRACE_REPORT_WAIT="0.5"),
    )  # fmt: skip
    # CLOCK_MONOTONIC is one clock for every process of the machine: the time from the
    # program's last line to its exit is the trace's stop, the wait and the report, without
    # the two processes' start-up (which a loaded machine stretches).
    elapsed = time.monotonic() - float(proc.stdout.split()[1])
    child = int(proc.stdout.split()[0])
    try:
        os.kill(child, 9)
    except ProcessLookupError:
        pass
    assert proc.returncode == 0, proc.stderr
    assert f"without waiting longer for 1 process(es) still tracing (pid {child})" in proc.stderr
    assert elapsed < 30  # the default wait would have taken 30 s at least
    assert (tmp_path / "out" / "report.html").is_file()


def test_production_settings_are_checked():
    # the trigger and flight recorder's variables: typed, and one line naming the variable
    env = {"COPYTRACE_TRIGGER_SIGNAL": "usr1", "COPYTRACE_RING": "1_000", "COPYTRACE_REDACT": "no"}
    assert _env.setting("COPYTRACE_TRIGGER_SIGNAL", env) == "SIGUSR1"
    assert _env.setting("COPYTRACE_RING", env) == 1000
    assert _env.setting("COPYTRACE_REDACT", env) is False
    bad = {
        "COPYTRACE_TRIGGER": "usr2", "COPYTRACE_TRIGGER_STEPS": "0",
        "COPYTRACE_TRIGGER_SIGNAL": "9", "COPYTRACE_REDACT_PATTERNS": "ok,(",
    }  # fmt: skip
    messages = sorted(str(e) for e in _env.check(bad))
    assert messages[0].startswith("COPYTRACE_REDACT_PATTERNS: not 'ok,('; use comma separated")
    assert messages[1] == "COPYTRACE_TRIGGER: not 'usr2'; use none or signal"
    assert messages[2] == (
        "COPYTRACE_TRIGGER_SIGNAL: not '9'; use a signal name such as SIGUSR2 or SIGUSR1"
    )
    assert messages[3] == "COPYTRACE_TRIGGER_STEPS: not '0'; use a whole number >= 1"
    assert all("\n" not in m for m in messages)


# --- unknown COPYTRACE_* variables ------------------------------------------------------------
def test_unknown_variables_are_named_with_the_closest_known_one():
    from copytrace import _envcheck

    environ = {
        "COPYTRACE_LEVLE": "full", "copytrace_outptu": "x", "COPYTRACE_ZZZ": "1",
        "COPYTRACE_LEVEL": "lean", "COPYTRACE_LAUNCH": "1-2", "COPYTRACE_SIDECAR": "0",
        "COPYTRACE_PHOENIX": "p", "COPYTRACE_REQUIRE_INTEGRATION": "1", "COPYTRACE": "1",
        "COPYTRACE_CI_CACHE": "c", "PATH": "/bin", "MY_COPYTRACE_LEVLE": "x",
    }  # fmt: skip
    # sorted by name (upper case first); COPYTRACE_ZZZ is close to no known name
    assert _envcheck.unknown(environ) == [
        ("COPYTRACE_LEVLE", "COPYTRACE_LEVEL"),
        ("COPYTRACE_ZZZ", None),
        ("copytrace_outptu", "COPYTRACE_OUTPUT"),
    ]
    assert _envcheck.unknown({"COPYTRACE_LAUNCH": "x", "COPYTRACE_FUZZ_EXAMPLES": "2"}) == []


def test_every_copytrace_name_the_repository_uses_is_known():
    # Python and shell files of the package, the tests and CI (C++ macros are not variables);
    # a name may also be a prefix of a known one (a regular expression's start)
    import re

    from copytrace import _envcheck

    root = Path(__file__).resolve().parent.parent
    files = [*root.glob("copytrace/**/*.py"), *root.glob("tests/**/*.py"),
             *root.glob("benchmarks/**/*.py"), *root.glob("examples/**/*.py"),
             *(root / ".ci").glob("*")]  # fmt: skip
    known = _envcheck.known_names()
    used = {
        (name, f.relative_to(root).as_posix())
        for f in files
        if f.is_file() and f.name not in ("test_settings.py", "_envcheck.py")  # typos named
        for name in re.findall(r"\bCOPYTRACE_[A-Z0-9_]*[A-Z0-9]", f.read_text(errors="replace"))
    }
    assert len({n for n, _ in used}) >= len(_envcheck.OTHER_NAMES)
    assert sorted((n, f) for n, f in used if not any(k.startswith(n) for k in known)) == []


_TYPO = "copytrace: unknown variable ignored: COPYTRACE_LEVLE (did you mean COPYTRACE_LEVEL?)"
# a child Python process: under COPYTRACE=1 it joins the launch (and must not say it again)
_CHILD = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'pass'], check=True)\n"


def test_a_launch_says_an_unknown_variable_once(tmp_path):
    (tmp_path / "prog.py").write_text(_PROGRAM + _CHILD)
    for cmd, extra in (
        ([sys.executable, "prog.py"], {"COPYTRACE": "1"}),
        ([sys.executable, "-m", "copytrace", "run", "--no-report", "prog.py"], {}),
    ):
        proc = subprocess.run(
            cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120,
            env=_env_vars(COPYTRACE_LEVLE="full", COPYTRACE_REPORT="0", **extra),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        said = [line for line in proc.stderr.splitlines() if "unknown variable" in line]
        assert said == [_TYPO], proc.stderr
        assert proc.stderr.startswith(_TYPO)  # before the program's run


def test_a_trace_says_an_unknown_variable_once_per_process(tmp_path):
    code = (
        "import torch, copytrace\n"
        "for _ in range(2):\n"
        "    with copytrace.trace(write=False):\n"
        "        torch.ones(2).clone()\n"
    )
    env = _env_vars(COPYTRACE_LEVLE="full", COPYTRACE_SIDECAR="0", COPYTRACE_PHOENIX="x")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if "unknown variable" in ln] == [_TYPO]


@pytest.mark.parametrize(
    "option, message",
    [
        ({"max_events": -1}, "max_events: not -1; use a whole number >= 0"),
        # 2.5 once reached the C++ observer's callback, whose slice failed on every event
        ({"max_events": 2.5}, "max_events: not 2.5; use a whole number >= 0"),
        ({"max_events": True}, "max_events: not True; use a whole number >= 0"),
        ({"flush_events": -3}, "flush_events: not -3; use a whole number >= 0"),
        ({"flush_events": "9"}, "flush_events: not '9'; use a whole number >= 0"),
        ({"flush_seconds": -5}, "flush_seconds: not -5; use a number of seconds >= 0"),
        ({"flush_seconds": float("nan")}, "flush_seconds: not nan; use a number of seconds >= 0"),
        ({"ring": -2}, "ring: not -2; use a whole number >= 0"),
        ({"trigger": "signal", "trigger_steps": 0},
         "trigger_steps: not 0; use a whole number >= 1"),
    ],
)  # fmt: skip
def test_trace_options_are_checked_as_their_variables_are(option, message):
    # the variables refuse these values (COPYTRACE_MAX_EVENTS=-1 ...); the options given to
    # trace() must too, before anything is installed, not drop or break every event
    with pytest.raises(copytrace.SettingError) as err:
        copytrace.trace(write=False, **option)
    assert str(err.value) == message


def test_trace_options_accept_whole_numbers_of_any_integer_type():
    np = pytest.importorskip("numpy")
    t = copytrace.trace(write=False, max_events=np.int64(3), flush_events=0, flush_seconds=1)
    assert (t.session._rec.max_events, t.flush_events, t.flush_seconds) == (3, 0, 1.0)
    with t:
        for _ in range(5):
            torch.ones(2).clone()  # 5 copies, the cap keeps 3: the rest are counted dropped
    assert (len(t.events), t.stats["dropped"]) == (3, 2)


def test_an_output_directory_that_is_a_file_is_said_so(tmp_path):
    # mkdir's own reason, "File exists", read as if the directory existed and were writable
    (tmp_path / "a-file").write_text("")
    assert _env.unwritable(tmp_path / "a-file") == (
        f"output directory {tmp_path / 'a-file'} is not writable (a file is there)"
    )
    # a path under a file keeps the system's reason
    assert _env.unwritable(tmp_path / "a-file" / "out") == (
        f"output directory {tmp_path / 'a-file' / 'out'} is not writable (Not a directory)"
    )
    assert _env.unwritable(tmp_path / "new") is None and (tmp_path / "new").is_dir()


def test_the_hook_probe_leaves_nothing_on_disk(tmp_path):
    # create=False (the COPYTRACE=1 hook's check): the same verdicts, and no directory made
    (tmp_path / "a-file").write_text("")
    for create in (True, False):
        assert _env.unwritable(tmp_path / "a-file", create=create) == (
            f"output directory {tmp_path / 'a-file'} is not writable (a file is there)"
        )
        assert _env.unwritable(tmp_path / "a-file" / "out", create=create) == (
            f"output directory {tmp_path / 'a-file' / 'out'} is not writable (Not a directory)"
        )
    assert _env.unwritable(tmp_path / "x" / "y", create=False) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no x/, no probe file


def test_a_launched_process_that_never_imports_torch_leaves_no_directory(tmp_path):
    # under COPYTRACE=1 every Python process of a launch runs the hook (pip, a shell tool);
    # one that never imports torch traces nothing and must write nothing: no copytrace-out/
    proc = subprocess.run(
        [sys.executable, "-c", "print('plain')"], capture_output=True, text=True,
        cwd=tmp_path, timeout=120, env=_env_vars(COPYTRACE="1"),
    )  # fmt: skip
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "plain\n", "")
    assert list(tmp_path.iterdir()) == []
    # the near miss: a process that imports torch and copies writes its trace there
    (tmp_path / "prog.py").write_text(_PROGRAM)
    proc = subprocess.run(
        [sys.executable, "prog.py"], capture_output=True, text=True, cwd=tmp_path,
        timeout=300, env=_env_vars(COPYTRACE="1", COPYTRACE_REPORT="0"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert any(p.name.endswith(".otlp.jsonl.gz") or p.name.endswith(".otlp.jsonl")
               for p in (tmp_path / "copytrace-out").iterdir())  # fmt: skip
