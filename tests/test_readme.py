"""Every command the README shows works on its example.

The commands are read from README.md itself (its ``bash`` blocks, and the ``$ ...`` lines of
its sample output), and run verbatim with bash, in order, in a directory holding a copy of
``examples/``. ``CHARLM_STEPS`` shortens the example's run (it changes the default of
``--steps``) so that the test stays fast; nothing else differs from a reader's run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Set-up steps the test does not repeat (the test runs inside an installed environment), and
#: the development section's commands, which .ci/run itself runs (the suite, the linter).
_SETUP = (
    "python3 -m venv", ". .venv/bin/activate", "pip install", "python -m pytest",
    "COPYTRACE_REQUIRE_INTEGRATION=1 python -m pytest", "ruff check",
)  # fmt: skip


def readme_commands(text: str) -> list[str]:
    """The shell commands README.md shows, in order, each once."""
    commands: list[str] = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S):
        for line in body.splitlines():
            if lang == "bash":
                line = re.sub(r"\s+#.*$", "", line).strip()
            elif line.startswith("$ "):  # a command in sample output
                line = line[2:].strip()
            else:
                continue
            if not line or line.startswith("#"):
                continue
            for part in (p.strip() for p in line.split("&&")):
                if part and not part.startswith(_SETUP) and part not in commands:
                    commands.append(part)
    return commands


def test_readme_commands_are_found():
    commands = readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    # One of each kind the README shows (derived by reading it): the set-up's traced run,
    # the hook with and without an output directory, run with arguments and with py-spy,
    # report, summary and check.
    assert commands == [
        "copytrace run examples/train_charlm.py",
        "COPYTRACE=1 python examples/train_charlm.py",
        "COPYTRACE=1 COPYTRACE_OUTPUT=runs/ct python examples/train_charlm.py",
        "copytrace run examples/train_charlm.py --seed 1",
        "copytrace run --py-spy examples/train_charlm.py",
        "copytrace report copytrace-out -o report.html",
        "copytrace summary copytrace-out",
        "copytrace check copytrace-out --max-bytes-per-step 64MiB --max-copies-per-step 100 "
        "--forbid data-inplace",
    ]


def test_every_readme_command_works_on_the_example(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = "1"
    # 12 steps with the default --eval-every 100: one evaluation, at the last step, which
    # therefore holds the most copies of any step (as in the full run's last step).
    env["CHARLM_STEPS"] = "12"
    commands = readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    for command in commands:
        proc = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
        if command.startswith(("copytrace run", "COPYTRACE=1")):
            assert "final: step=12" in proc.stdout, command
    assert (tmp_path / "report.html").is_file()
    assert (tmp_path / "copytrace-out" / "report.html").is_file()
    assert list((tmp_path / "runs" / "ct").glob("copytrace-*.otlp.jsonl.gz"))
