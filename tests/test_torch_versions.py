"""The torch releases copytrace is tested on: one range (``copytrace._env.TORCH_TESTED``), the
one pyproject.toml admits, and ``copytrace doctor``'s warning for a torch outside it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from copytrace import _env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("version", "tested"),
    [
        ("2.13.0", True),
        ("2.13.0+cpu", True),
        ("2.14.1+cu130", True),
        ("2.14.0a0+git1234abc", True),  # a source build of the tested minor release
        ("2.12.1", False),
        ("2.9.1", False),  # no SavedTensor.data: two hazard kinds would be lost
        ("2.15.0.dev20260101+cpu", False),  # a nightly of the next release
        ("3.0.0", False),
        ("2.1", False),  # 2.1 < 2.13 (compared as numbers, not as text)
        ("unknown", False),
    ],
)
def test_torch_tested_compares_major_and_minor_as_numbers(version: str, tested: bool) -> None:
    assert _env.TORCH_TESTED == ((2, 13), (2, 14))
    assert _env.torch_tested(version) is tested


def test_the_running_torch_is_a_tested_release() -> None:
    # The suite itself runs only on tested releases (CI: 2.13.0 and 2.14.1).
    assert _env.torch_tested(torch.__version__), torch.__version__


def test_pyproject_admits_exactly_the_tested_releases() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (req,) = [d for d in project["dependencies"] if d.startswith("torch")]
    (old_major, old_minor), (new_major, new_minor) = _env.TORCH_TESTED
    assert req.replace(" ", "") == f"torch>={old_major}.{old_minor},<{new_major}.{new_minor + 1}"


_DOCTOR = """
import sys
import torch
torch.__version__ = sys.argv[1]  # what the doctor reads
from copytrace.cli import main
sys.exit(main(["doctor"]))
"""


@pytest.mark.parametrize("version", ["2.9.1", "2.15.0", torch.__version__])
def test_doctor_warns_on_a_torch_outside_the_tested_range(version: str, tmp_path: Path) -> None:
    # The Python path and an empty cache: the observer's build key holds torch.__version__, so
    # a faked version must not build (or find) an observer.
    env = dict(os.environ, COPYTRACE_OBSERVER="python", COPYTRACE_CACHE_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_DOCTOR), version],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"torch {version} (git ")
    assert "aten level: Python dispatch mode fallback" in proc.stdout
    assert not any(tmp_path.iterdir())  # nothing built
    warnings = [ln for ln in lines if ln.startswith("warning:")]
    if _env.torch_tested(version):
        assert warnings == []
    else:
        assert warnings == [
            f"warning: torch {version} is outside the releases copytrace is tested on "
            "(2.13 to 2.14): copies and hazards may be missed without an error"
        ]
