"""Check a plan by tracing again: the program runs traced (``copytrace run`` in a real
subprocess) in two scratch copies of the project, as it is and patched, and the two traces
and stdouts are compared. The user's files are never written.
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from copytrace.fixes._plan import _SITE, Plan

__all__ = ["Outcome", "Verification", "program_args", "verify_plan"]

#: Folders not copied into the scratch projects (version control, caches, environments,
#: earlier traces).
_SKIP = (".git", ".hg", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache",
         ".pytest_cache", ".ruff_cache", "copytrace-out*")  # fmt: skip


@dataclass
class Outcome:
    """One fix, checked: whether its finding was in the first run and is in the second, and
    the bytes per step of that finding's copies in each."""

    fix: Any
    before: bool
    gone: bool
    bytes_per_step_before: float
    bytes_per_step_after: float

    @property
    def confirmed(self) -> bool:
        """The finding was there before the patch and is gone after it."""
        return self.before and self.gone

    def state(self) -> str:
        """What the two runs say of this fix, in words."""
        if self.confirmed:
            return "fixed (found before the patch, not after)"
        if self.before:
            return "NOT fixed (still found after the patch)"
        if self.gone:
            return "not checked (found in neither run)"
        return "NOT fixed (found only after the patch)"


def _change(before: float, after: float) -> str:
    if round(after) == round(before):
        return "no change"
    return f"{abs(after - before):.0f} {'fewer' if after < before else 'more'}"


@dataclass
class Verification:
    """Both runs compared (bytes per step: copies' new storage, mean over traced steps)."""

    outcomes: list[Outcome] = field(default_factory=list)
    status_before: int = 0
    status_after: int = 0
    stdout_same: bool = True
    stdout_diff: str = ""
    bytes_per_step_before: float = 0.0
    bytes_per_step_after: float = 0.0

    @property
    def ok(self) -> bool:
        """Every fix confirmed, and the same stdout and exit status before and after."""
        same = self.stdout_same and self.status_before == self.status_after
        return same and all(o.confirmed for o in self.outcomes)

    def lines(self) -> list[str]:
        """The report, one line each: per fix, then the program's output, then the bytes."""
        out = []
        for o in self.outcomes:
            f = o.fix
            b, a = o.bytes_per_step_before, o.bytes_per_step_after
            out.append(f"{f.finding.code} at {f.rel}:{f.line}: {o.state()}; its copies: "
                       f"{b:.0f} -> {a:.0f} bytes per step")  # fmt: skip
        stdout = "the same" if self.stdout_same else "DIFFERENT (diff below)"
        status = "the same" if self.status_before == self.status_after else "DIFFERENT"
        out.append(f"program stdout: {stdout}; exit status: {status} "
                   f"({self.status_before} -> {self.status_after})")  # fmt: skip
        b, a = self.bytes_per_step_before, self.bytes_per_step_after
        out.append(f"all copies: {b:.0f} -> {a:.0f} bytes per step ({_change(b, a)})")
        return out


def program_args(command: list[str]) -> list[str]:
    """``copytrace run``'s program arguments from ``python train.py ...`` (or ``train.py``,
    ``-m pkg``): a leading Python interpreter is dropped."""
    if command and (Path(command[0]).name.startswith("python") or command[0] == sys.executable):
        command = command[1:]
    if not command:
        raise ValueError("--verify needs a program: --verify -- python train.py [args]")
    return command


def _run(root: Path, args: list[str], out: Path, timeout: float | None) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "copytrace", "run", "--no-report", "-o", str(out), "--", *args]
    env = dict(os.environ, PYTHONHASHSEED=os.environ.get("PYTHONHASHSEED", "0"))
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def _pins(findings: list[Any], root: Path) -> list[tuple[Any, str, int]]:
    out = []
    for f in findings:
        m = _SITE.match(f.call_sites[0]) if f.call_sites else None
        if m:
            p = Path(m["file"]).resolve()
            if p.is_relative_to(root):
                out.append((f, p.relative_to(root).as_posix(), int(m["line"])))
    return out


def _old_lines(old: str, new: str, line: int) -> set[int]:
    """The lines of ``old`` that line ``line`` of ``new`` comes from (a changed region: all)."""
    sm = difflib.SequenceMatcher(None, old.splitlines(), new.splitlines(), autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if j1 < line <= j2 or (j1 == j2 == line - 1):
            if tag == "equal":
                return {i1 + line - j1}
            return set(range(i1 + 1, i2 + 1)) | {max(i1, 1)}
    return set()


def _per_step(f: Any) -> float:
    return f.bytes / max(1, len(f.steps))


def _bytes_per_step(trace: Path) -> float:
    from copytrace.analysis import step_totals

    totals = step_totals(trace)
    return sum(t.bytes for t in totals) / len(totals) if totals else 0.0


def verify_plan(plan: Plan, command: list[str], timeout: float | None = None) -> Verification:
    """Run ``command`` traced before and after the plan's patch, each in a scratch copy of
    ``plan.root``, and compare.

    Args:
        plan: what :func:`copytrace.fixes.plan_fixes` returned.
        command: the program, ``python train.py args...`` (see :func:`program_args`).
        timeout: seconds allowed to each run.

    Raises:
        ValueError: without a program.
        subprocess.TimeoutExpired: when a run takes longer than ``timeout``.
    """
    from copytrace.analysis import analyze

    args = program_args(command)
    with tempfile.TemporaryDirectory(prefix="copytrace-fix-") as tmp:
        res = Verification()
        runs: dict[str, tuple[Path, Path]] = {}
        for side in ("before", "after"):
            proj = Path(tmp) / side / plan.root.name
            shutil.copytree(plan.root, proj, symlinks=True, ignore=shutil.ignore_patterns(*_SKIP))
            if side == "after":
                for rel, (_, new) in plan.files.items():
                    with open(proj / rel, "w", encoding="utf-8", newline="") as fh:
                        fh.write(new)
            here = [str(proj / Path(a).relative_to(plan.root)) if Path(a).is_absolute()
                    and Path(a).is_relative_to(plan.root) else a for a in args]  # fmt: skip
            status, stdout = _run(proj, here, Path(tmp) / f"trace-{side}", timeout)
            runs[side] = (proj.resolve(), Path(tmp) / f"trace-{side}")
            if side == "before":
                res.status_before, out_before = status, stdout
            else:
                res.status_after, out_after = status, stdout
        res.stdout_same = out_before == out_after
        if not res.stdout_same:
            res.stdout_diff = "".join(difflib.unified_diff(
                out_before.splitlines(True), out_after.splitlines(True), "before", "after"))
        found = {side: _pins(analyze(t), proj) for side, (proj, t) in runs.items()}
        for fix in plan.fixes:
            old, new = plan.files.get(fix.rel, ("", ""))
            before = [f for f, rel, line in found["before"]
                      if f.code == fix.finding.code and rel == fix.rel and line == fix.line]
            after = [f for f, rel, line in found["after"] if f.code == fix.finding.code
                     and rel == fix.rel and fix.line in _old_lines(old, new, line)]  # fmt: skip
            res.outcomes.append(Outcome(
                fix, bool(before), not after, sum(map(_per_step, before)), sum(map(_per_step, after))))
        res.bytes_per_step_before = _bytes_per_step(runs["before"][1])
        res.bytes_per_step_after = _bytes_per_step(runs["after"][1])
        return res
