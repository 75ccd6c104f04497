"""pytest plugin: copy budgets for tests (registered as the ``copytrace`` pytest11 plugin).

A marker traces a whole test body::

    @pytest.mark.copytrace(max_bytes=4096, max_copies=2, forbid=["graph-retaining-copy"])
    def test_step(model, batch):
        train_step(model, batch)

and the ``copy_budget`` fixture traces a block::

    def test_step(copy_budget, model, batch):
        prepare(model)                          # not counted
        with copy_budget(max_copies=0, fail_on="warning") as block:
            train_step(model, batch)
        assert block.findings == []

Limits (all optional): ``max_bytes`` / ``max_copies`` (whole body), ``max_bytes_per_step`` /
``max_copies_per_step`` (per ``optimizer.step()`` or ``t.step()``), ``forbid`` (hazard codes,
a list or a comma-separated string, ``"all"``), ``fail_on`` (``"error"``, ``"warning"``,
``"info"``: any hazard that severe or worse). A test fails when the code under it goes over
a limit or shows a forbidden hazard; the message names the call sites and the fix. A test
that fails by itself is reported as it is, without a budget check.

This module imports neither torch nor copytrace's tracer until a marked test or the
fixture runs, so installing copytrace costs other test suites nothing.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

__all__ = ["CopyBudget", "copy_budget"]

MARKER = "copytrace"
_LIMITS = (
    "max_bytes", "max_copies", "max_bytes_per_step", "max_copies_per_step", "forbid",
    "fail_on", "warmup_steps",
)  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(max_bytes=None, max_copies=None, max_bytes_per_step=None, "
        "max_copies_per_step=None, forbid=(), fail_on=None): trace the test body with "
        "copytrace; fail the test when its tensor copies exceed the budget or a forbidden "
        "hazard is found (see docs/hazards.md)",
    )


def _short(site: str, root: str | None) -> str:
    if root and site.startswith(root):
        return site[len(root) :]
    return site


def _verdict(events: list[Any], limits: dict[str, Any], where: str, root: str | None) -> str:
    """The failure message for ``events`` under ``limits``, or ``""`` within budget."""
    from copytrace.analysis import Budget, analyze, check, normalize_codes, severity_codes

    unknown = sorted(set(limits) - set(_LIMITS))
    if unknown:
        raise pytest.UsageError(
            f"copytrace budget: unknown limit(s) {', '.join(unknown)}; use {', '.join(_LIMITS)}"
        )
    try:
        forbid = normalize_codes(limits.get("forbid") or ())
        if limits.get("fail_on"):
            forbid += [c for c in severity_codes(limits["fail_on"]) if c not in forbid]
    except ValueError as err:
        raise pytest.UsageError(f"copytrace budget: {err}") from None
    budget = Budget(
        max_bytes_per_step=limits.get("max_bytes_per_step"),
        max_copies_per_step=limits.get("max_copies_per_step"),
        max_bytes=limits.get("max_bytes"),
        max_copies=limits.get("max_copies"),
        warmup_steps=limits.get("warmup_steps") or 0,
    )
    findings = analyze(events)
    lines, _ = check(events, budget, findings)
    for f in findings:
        if f.code in forbid:
            sites = ", ".join(_short(s, root) for s in f.call_sites[:3]) or "(unknown site)"
            lines.append(f"forbidden hazard {f.code} ({f.severity}) at {sites}: {f.message}")
            lines.append(f"  fix: {f.fix}")
    if not lines:
        return ""
    body = "\n".join("  " + _short_all(line, root) for line in lines)
    return f"copytrace budget exceeded in {where}:\n{body}"


def _short_all(line: str, root: str | None) -> str:
    return line.replace(root, "") if root else line


def _root(config: pytest.Config) -> str:
    return str(config.rootpath) + os.sep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return (yield)
    if marker.args:
        raise pytest.UsageError(
            f"@pytest.mark.{MARKER} takes keyword arguments only ({', '.join(_LIMITS)})"
        )
    import copytrace

    t = copytrace.trace(write=False)
    active = t.start()
    first = len(active.events)
    try:
        result = yield
    finally:
        t.stop()
    message = _verdict(active.events[first:], dict(marker.kwargs), item.nodeid, _root(item.config))
    if message:
        pytest.fail(message, pytrace=False)
    return result


class _Block:
    """One ``with copy_budget(...)`` block; ``events`` and ``findings`` are set on exit."""

    def __init__(self, limits: dict[str, Any], where: str, root: str | None) -> None:
        self.limits = limits
        self.where = where
        self.root = root
        self.events: list[Any] = []
        self.findings: list[Any] = []
        self._trace: Any = None
        self._first = 0

    def __enter__(self) -> _Block:
        import copytrace

        self._trace = copytrace.trace(write=False)
        active = self._trace.start()
        self._first = len(active.events)
        self._active = active
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._trace.stop()
        self.events = self._active.events[self._first :]
        if exc_type is not None:
            return  # the block's own failure is the test's result
        from copytrace.analysis import analyze

        self.findings = analyze(self.events)
        message = _verdict(self.events, self.limits, self.where, self.root)
        if message:
            pytest.fail(message, pytrace=False)


class CopyBudget:
    """What the ``copy_budget`` fixture returns: call it with limits to get a ``with`` block."""

    def __init__(self, where: str, root: str | None) -> None:
        self._where = where
        self._root = root

    def __call__(self, **limits: Any) -> _Block:
        return _Block(limits, self._where, self._root)


@pytest.fixture
def copy_budget(request: pytest.FixtureRequest) -> CopyBudget:
    """Trace a block and fail the test when it goes over budget:
    ``with copy_budget(max_bytes=4096, forbid="all") as block: ...``."""
    return CopyBudget(request.node.nodeid, _root(request.config))
