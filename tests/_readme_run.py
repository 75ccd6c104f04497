"""The README's commands, run once per test session and shared by ``tests/test_readme.py``
(every command works) and ``tests/test_fix_example.py`` (the example's fix end to end, a part
of the same sequence): each command of the sequence traces or reads the example, so running it
once saves a second copy of its traced runs, while each test still asserts its own facts on it.

The commands are read from README.md itself (its ``bash`` blocks, and the ``$ ...`` lines of
its sample output) and run verbatim with bash, in order, in a directory holding a copy of
``examples/``. ``CHARLM_STEPS`` shortens the example's run (it changes the default of
``--steps``) so that the tests stay fast; nothing else differs from a reader's run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: 12 steps with the default --eval-every 100: one evaluation, at the last step, which
#: therefore holds the most copies of any step (as in the full run's last step).
STEPS = 12
#: Set-up steps the tests do not repeat (they run inside an installed environment), and the
#: development commands, which .ci/run itself runs (the suite, the linter).
_SETUP = (
    "python3 -m venv", ". .venv/bin/activate", "pip install", "python -m pytest",
    "COPYTRACE_REQUIRE_INTEGRATION=1 python -m pytest", "ruff check",
)  # fmt: skip
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```\n", flags=re.M | re.S)


def readme() -> str:
    return README.read_text(encoding="utf-8")


def env() -> dict[str, str]:
    """The environment the README's commands run in: this interpreter's scripts first on
    ``PATH``, no copytrace or OpenTelemetry setting of the caller's, one torch thread."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    out["PATH"] = os.path.dirname(sys.executable) + os.pathsep + out.get("PATH", "")
    out["OMP_NUM_THREADS"] = "1"
    return out


def readme_commands(text: str) -> list[str]:
    """The shell commands README.md shows, in order, each once."""
    commands: list[str] = []
    for lang, body in BLOCK.findall(text):
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


@dataclass
class ReadmeRun:
    """One run of the README's commands: the folder they ran in, the example's text before
    them (``fix --apply`` patches the copy), and each command's completed process, in order.
    A failed command does not stop the run: a test of a later one (``tests/test_fix_example.py``)
    still sees it run, and fails on its own facts only."""

    cwd: Path
    env: dict[str, str]
    example_before: str
    commands: list[str]
    procs: dict[str, subprocess.CompletedProcess[str]] = field(default_factory=dict)

    @property
    def example(self) -> Path:
        return self.cwd / "examples" / "train_charlm.py"

    def failure(self) -> str | None:
        """The first command that failed (or was not run), with its output; None if none."""
        for command in self.commands:
            proc = self.procs.get(command)
            if proc is None:
                return f"{command}: not run"
            if proc.returncode != 0:
                return f"{command}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
        return None


_RUN: list[ReadmeRun] = []


def readme_run(factory: pytest.TempPathFactory) -> ReadmeRun:
    """The session's one run of the README's commands (made on first use)."""
    if not _RUN:
        cwd = factory.mktemp("readme")
        shutil.copytree(ROOT / "examples", cwd / "examples")
        run = ReadmeRun(
            cwd=cwd,
            env=dict(env(), CHARLM_STEPS=str(STEPS)),
            example_before=(cwd / "examples" / "train_charlm.py").read_text(encoding="utf-8"),
            commands=readme_commands(readme()),
        )
        _RUN.append(run)
        for command in run.commands:
            proc = subprocess.run(
                ["bash", "-c", command], cwd=cwd, env=run.env, capture_output=True, text=True,
                timeout=600,
            )  # fmt: skip
            run.procs[command] = proc  # on after a failure: later ones may not need it
    return _RUN[0]
