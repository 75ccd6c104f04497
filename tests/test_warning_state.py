"""The program's warnings state under tracing: copytrace changes none of it.

Python shows a "default" warning once per location: each module's ``__warningregistry__``
remembers it, and any change of the filters (a filters-version bump) wipes those registries.
The program below warns from the same line every step, and torch warns its own "To copy
construct from a tensor" every step; untraced each shows once. The export thread flushes
every step (``COPYTRACE_FLUSH_EVENTS=1``), so whatever it does first (pyarrow looking for
pandas, pandas' import setting filters) happens in the middle of the run. The test compares,
traced against untraced: the count of each warning on stderr, ``warnings.filters`` as the
program reads it at every step, and a filter the program sets half-way through
(``docs/observer-effects.md``, "Warnings state").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

_PROGRAM = textwrap.dedent(
    """
    import contextlib, json, sys, time, warnings
    import torch

    how, out, steps = sys.argv[1], sys.argv[2], 12
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []


    def step(i):
        x = torch.randn(4, 8)
        for _ in range(20):  # copies for the trace (clone, dtype round trips)
            x = x.clone().to(torch.float64).to(torch.float32)
        model(x).sum().backward()
        opt.step()  # a step boundary: the export thread flushes here
        time.sleep(0.05)  # lets the flush run while the program goes on
        warnings.warn("my own warning")
        torch.tensor(x)  # torch warns: copy construct from a tensor
        if i == steps // 2:
            warnings.filterwarnings("ignore", message="late filter")
        warnings.warn("late filter" if i >= steps // 2 else "early")
        seen.append([(f[0], str(f[1]), f[2].__name__, str(f[3]), f[4]) for f in warnings.filters])


    if how == "block":  # an in-program trace, with steps before and after it
        import copytrace
        ctx = copytrace.trace(output_dir=out)
    else:
        ctx = contextlib.nullcontext()
    for i in range(steps // 3):
        step(i)
    with ctx:
        for i in range(steps // 3, 2 * steps // 3):
            step(i)
    for i in range(2 * steps // 3, steps):
        step(i)
    print(json.dumps(seen))
    """
)


def _run(tmp_path: Path, launch: str, how: str, env_extra: dict[str, str]) -> tuple[Any, ...]:
    """``(counts, filters, places)``: each warning's count on stderr, ``warnings.filters``
    as the program read it at each step, and the ``file:line: category`` of each shown
    warning in order."""
    prog = tmp_path / "warner.py"
    prog.write_text(_PROGRAM)
    out = tmp_path / f"out-{launch}-{how}-{len(env_extra)}"
    out.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "PYTHONWARN"))}
    env.update(COPYTRACE_FLUSH_EVENTS="1", COPYTRACE_OUTPUT=str(out), **env_extra)
    if launch == "cli":
        cmd = [sys.executable, "-m", "copytrace", "run", "-o", str(out), str(prog), how, str(out)]
    else:
        cmd = [sys.executable, str(prog), how, str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    counts = {
        w: res.stderr.count("UserWarning: " + w)
        for w in ("my own warning", "To copy construct", "early", "late filter")
    }
    places = re.findall(r"^(\S+:\d+: \w+Warning): ", res.stderr, re.M)
    return counts, json.loads(res.stdout.strip().splitlines()[-1]), places


def test_untraced_reference(tmp_path: Path) -> None:
    """The reference itself. The program's own ``filterwarnings`` half-way bumps the filters
    version, so its two per-step warnings show twice (steps 0 and 6); "early" once; the late
    filter hides "late filter"."""
    counts, seen, places = _run(tmp_path, "python", "plain", {})
    assert len(places) == 5 and all(p.startswith(str(tmp_path)) for p in places)
    assert counts == {"my own warning": 2, "To copy construct": 2, "early": 1, "late filter": 0}
    assert len(seen) == 12 and len(seen[-1]) == len(seen[0]) + 1


@pytest.mark.parametrize(
    "launch, env",
    [
        ("python", {"COPYTRACE": "1"}),
        ("python", {"COPYTRACE": "1", "COPYTRACE_LEVEL": "full"}),
        ("cli", {}),
    ],
    ids=["lean", "full", "copytrace-run"],
)
def test_traced_run_keeps_warnings_state(tmp_path: Path, launch: str, env: dict) -> None:
    plain = _run(tmp_path, "python", "plain", {})
    traced = _run(tmp_path, launch, "plain", env)
    assert traced == plain


def test_python_observer_keeps_warnings_state(tmp_path: Path) -> None:
    """The Python fallback: the same counts and filters."""
    plain = _run(tmp_path, "python", "plain", {})
    traced = _run(tmp_path, "python", "plain", {"COPYTRACE": "1", "COPYTRACE_OBSERVER": "python"})
    assert traced[:2] == plain[:2]


def test_python_observer_keeps_warning_places(tmp_path: Path) -> None:
    """The Python fallback: each shown warning names the same ``file:line`` as untraced,
    torch's C++ "To copy construct" (re-issued by copytrace's function mode,
    ``tracer/_warnplace.py``) and the program's own ``warnings.warn`` alike."""
    plain = _run(tmp_path, "python", "plain", {})
    traced = _run(tmp_path, "python", "plain", {"COPYTRACE": "1", "COPYTRACE_OBSERVER": "python"})
    assert traced[2] == plain[2]


def test_trace_block_keeps_warnings_state(tmp_path: Path) -> None:
    """A ``with copytrace.trace()`` block in the middle: the steps after it (stop's writing,
    the hazards read on the export thread) warn as untraced."""
    plain = _run(tmp_path, "python", "plain", {})
    block = _run(tmp_path, "python", "block", {})
    assert block == plain


def test_frozen_warnings_keeps_the_registries() -> None:
    """The registry test behind :func:`copytrace._warnstate.frozen_warnings`: a warning shown
    once per location, then ``catch_warnings``/``filterwarnings`` inside the block, then the
    same warning: not shown again (without the block it is: the version bump wipes the
    registry), and the block's ``catch_warnings`` filter is gone after it."""
    code = textwrap.dedent(
        """
        import warnings
        from copytrace._warnstate import frozen_warnings

        def warn():
            warnings.warn("once here")

        def touch():
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="x")

        before = list(warnings.filters)
        warn()
        with frozen_warnings():
            touch()
        warn()
        assert warnings.filters == before
        touch()
        warn()
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    # shown at the first call, not after the frozen touch, again after the plain touch
    assert res.stderr.count("UserWarning: once here") == 2
