"""The example's fix end to end, as the README shows it: trace ``examples/train_charlm.py``,
check the patch by tracing again (``fix --verify``), apply it, trace the patched example, and
gate on the finding (``check --forbid``). The patched example prints exactly what it printed.

These commands are a part of the README's sequence: they are read from the session's one run of
it (``tests/_readme_run.py``, in a folder that holds a copy of ``examples/``, the scratch copy
the patch is applied to), so the example is not traced a second time for this test."""

from __future__ import annotations

import subprocess

import pytest
from _readme_run import STEPS, readme_run

#: The commands of the README's "patch a finding" section, in its order.
SEQUENCE = [
    "copytrace run examples/train_charlm.py",
    "copytrace fix copytrace-out --verify -- python examples/train_charlm.py",
    "copytrace fix copytrace-out --apply",
    "COPYTRACE_OUTPUT=fixed-out copytrace run examples/train_charlm.py",
    "copytrace check fixed-out --forbid tensor-ctor-copy",
]
#: The example's deliberate hazard: line 193, ``loss_curve.append(torch.tensor(loss))``.
LINE = 193


def test_the_example_fixed_end_to_end(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = readme_run(tmp_path_factory)
    # the README shows these commands in this order (others between them)
    positions = [run.commands.index(c) if c in run.commands else -1 for c in SEQUENCE]
    assert -1 not in positions and positions == sorted(positions), positions
    original = run.example_before
    assert original.splitlines()[LINE - 1].strip() == "loss_curve.append(torch.tensor(loss))"
    procs = []
    for command in SEQUENCE:
        proc = run.procs.get(command)
        assert proc is not None, f"{command}: not run; {run.failure()}"
        assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr[-3000:]}"
        procs.append(proc)
    first, verify, apply, again, check = procs
    example = run.example

    # the program's stdout (copytrace's own lines go to stderr), before and after the patch
    assert f"final: step={STEPS}" in first.stdout
    assert again.stdout == first.stdout

    where = f"tensor-ctor-copy at examples/train_charlm.py:{LINE}"
    for proc in (verify, apply):  # the same diff both times; only --apply writes it
        assert f"# copytrace fix: {where}: `torch.tensor(loss)` -> `loss.detach().clone()` " \
               "(keeps values bit for bit" in proc.stdout  # fmt: skip
        assert "-        loss_curve.append(torch.tensor(loss))\n" \
               "+        loss_curve.append(loss.detach().clone())\n" in proc.stdout  # fmt: skip
    # a float32 scalar loss: 4 bytes per step, made outside autograd after the patch
    assert (f"copytrace fix --verify: {where}: fixed (found before the patch, not after); "
            "its copies: 4 -> 0 bytes per step") in verify.stderr  # fmt: skip
    assert ("copytrace fix --verify: program stdout: the same; "
            "exit status: the same (0 -> 0)") in verify.stderr  # fmt: skip
    assert f"copytrace fix: wrote {example}" in apply.stderr

    # only the pinned line changed, and the first trace had the finding the second has not
    patched = example.read_text(encoding="utf-8").splitlines()
    changed = [i + 1 for i, (a, b) in enumerate(zip(original.splitlines(), patched, strict=True))
               if a != b]  # fmt: skip
    assert changed == [LINE]
    assert "copytrace check: OK: 0 violation(s)" in check.stdout
    gate = subprocess.run(
        ["bash", "-c", "copytrace check copytrace-out --forbid tensor-ctor-copy"], cwd=run.cwd,
        env=run.env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert gate.returncode == 1, gate.stderr
    assert f"forbidden hazard tensor-ctor-copy (warning) at {example}:{LINE} main" in gate.stderr
