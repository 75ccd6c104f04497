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

Limits (all optional): ``max_bytes`` / ``max_copies`` (whole body; bytes as ``4096`` or the
CLI's strings, ``"4KiB"``, ``"64MiB"``), ``max_bytes_per_step`` /
``max_copies_per_step`` (per ``optimizer.step()`` or ``t.step()``), ``forbid`` (hazard codes,
a list or a comma-separated string, ``"all"``), ``fail_on`` (``"error"``, ``"warning"``,
``"info"``: any hazard that severe or worse). A test fails when the code under it goes over
a limit or shows a forbidden hazard; the message names the call sites and the fix. A test
that fails by itself is reported as it is, without a budget check.

Baselines instead of guessed budgets: ``pytest --copytrace-baseline DIR
--copytrace-baseline-update`` records each marked test's copies into ``DIR`` (one small JSON
file per test, paths relative to the rootdir: commit it); ``pytest --copytrace-baseline DIR``
then compares each marked test with its baseline (``copytrace.analysis.diff``: the
comparison and the gate of ``copytrace check --baseline``) and fails a test whose copies or
bytes per step grew beyond ``--copytrace-max-increase`` (default ``0%``), or that shows a
hazard code its baseline did not, naming each call site that grew by ``file:line``.

This module imports neither torch nor copytrace's tracer until a marked test or the
fixture runs, so installing copytrace costs other test suites nothing.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

__all__ = ["CopyBudget", "copy_budget"]

MARKER = "copytrace"
_LIMITS = (
    "max_bytes", "max_copies", "max_bytes_per_step", "max_copies_per_step", "forbid",
    "fail_on", "warmup_steps",
)  # fmt: skip


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("copytrace", "copytrace: tensor copies of marked tests")
    group.addoption("--copytrace-baseline", metavar="DIR", default=None,
                    help="compare each @pytest.mark.copytrace test with its baseline in DIR")
    group.addoption("--copytrace-baseline-update", action="store_true", default=False,
                    help="record the marked tests' baselines into --copytrace-baseline DIR")
    group.addoption("--copytrace-max-increase", metavar="LIMIT", default="0%",
                    help="growth over the baseline allowed per step: a share (10%%) or a "
                    "size (64KiB); default 0%%")  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    _baseline_settings(config)
    config.addinivalue_line(
        "markers",
        f"{MARKER}(max_bytes=None, max_copies=None, max_bytes_per_step=None, "
        "max_copies_per_step=None, forbid=(), fail_on=None): trace the test body with "
        "copytrace; fail the test when its tensor copies exceed the budget or a forbidden "
        "hazard is found (see docs/hazards.md)",
    )


_SETTINGS = pytest.StashKey[Any]()


class _Baselines:
    """The ``--copytrace-baseline`` settings and what the session did with them."""

    def __init__(self, directory: Path, update: bool, limit: Any) -> None:
        self.directory = directory
        self.update = update
        self.limit = limit
        self.written = 0
        self.missing: list[str] = []

    def path(self, nodeid: str) -> Path:
        return self.directory / (re.sub(r"[^\w.\[\]-]+", "-", nodeid).strip("-") + ".json")


def _baseline_settings(config: pytest.Config) -> None:
    where = config.getoption("copytrace_baseline", None)
    update = config.getoption("copytrace_baseline_update", False)
    if where is None:
        if update:
            raise pytest.UsageError("--copytrace-baseline-update needs --copytrace-baseline DIR")
        return
    from copytrace.analysis.diff import parse_increase

    try:
        limit = parse_increase(config.getoption("copytrace_max_increase"))
    except ValueError as err:
        raise pytest.UsageError(f"--copytrace-max-increase: {err}") from None
    directory = Path(config.invocation_params.dir, where)
    config.stash[_SETTINGS] = _Baselines(directory, update, limit)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    b = config.stash.get(_SETTINGS, None)
    if b is None:
        return
    if b.update:
        terminalreporter.write_line(f"copytrace: wrote {b.written} baseline(s) to {b.directory}")
    elif b.missing:
        terminalreporter.write_line(
            f"copytrace: {len(b.missing)} marked test(s) have no baseline in {b.directory} "
            "(record with --copytrace-baseline-update): " + ", ".join(b.missing[:5])
        )


def _baseline_verdict(
    b: _Baselines, events: list[Any], start_ns: int, where: str, root: str
) -> str:
    """Record the test's baseline, or the failure message of its comparison with it."""
    from copytrace.analysis import analyze
    from copytrace.analysis.diff import (
        add_hazards,
        compare,
        gate,
        profile_events,
        read_baseline,
        read_sources,
        write_baseline,
    )  # fmt: skip

    new = profile_events(events, where, start_ns)
    add_hazards(new, analyze(events))
    new.sources = read_sources([], list(new.sites), start_ns, save=False)
    path = b.path(where)
    if b.update:
        write_baseline(path, new, where, root)
        b.written += 1
        return ""
    try:
        base = read_baseline(path, root)
    except ValueError as err:
        raise pytest.UsageError(f"copytrace baseline: {err}") from None
    if base is None:
        b.missing.append(where)
        return ""
    lines = gate(compare(base, new), b.limit)
    if not lines:
        return ""
    body = "\n".join("  " + _short_all(line, root) for line in lines)
    return (f"copytrace baseline exceeded in {where} (baseline {path}):\n{body}\n"
            "  accept with --copytrace-baseline-update")  # fmt: skip


def _short(site: str, root: str | None) -> str:
    if root and site.startswith(root):
        return site[len(root) :]
    return site


def _budget(limits: dict[str, Any], where: str) -> tuple[Any, list[str]]:
    """``(Budget, forbidden codes)`` of a marker's or a block's ``limits``.

    Byte limits take what the CLI takes (``4096``, ``"4KiB"``, ``"64MiB"``); counts take
    non-negative integers.

    Raises:
        pytest.UsageError: one line naming ``where`` and the bad limit.
    """
    from copytrace.analysis import Budget, normalize_codes, parse_bytes, severity_codes

    unknown = sorted(set(limits) - set(_LIMITS))
    if unknown:
        raise pytest.UsageError(
            f"copytrace budget of {where}: unknown limit(s) {', '.join(unknown)}; "
            f"use {', '.join(_LIMITS)}"
        )
    values: dict[str, Any] = {}
    try:
        for name in ("max_bytes", "max_bytes_per_step"):
            if limits.get(name) is not None:
                values[name] = parse_bytes(limits[name])
        for name in ("max_copies", "max_copies_per_step", "warmup_steps"):
            value = limits.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} takes a count >= 0, got {value!r}")
            values[name] = value
        forbid = normalize_codes(limits.get("forbid") or ())
        if limits.get("fail_on"):
            forbid += [c for c in severity_codes(limits["fail_on"]) if c not in forbid]
    except ValueError as err:
        raise pytest.UsageError(f"copytrace budget of {where}: {err}") from None
    values["warmup_steps"] = values.get("warmup_steps") or 0
    return Budget(**values), forbid


def _verdict(events: list[Any], limits: dict[str, Any], where: str, root: str | None) -> str:
    """The failure message for ``events`` under ``limits``, or ``""`` within budget."""
    from copytrace.analysis import analyze, check

    budget, forbid = _budget(limits, where)
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Check every marker's limits before any test runs (a bad one stops the session)."""
    for item in items:
        marker = item.get_closest_marker(MARKER)
        if marker is None:
            continue
        if marker.args:
            raise pytest.UsageError(
                f"@pytest.mark.{MARKER} of {item.nodeid} takes keyword arguments only "
                f"({', '.join(_LIMITS)})"
            )
        _budget(dict(marker.kwargs), item.nodeid)


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

    baselines = item.config.stash.get(_SETTINGS, None)
    start_ns = time.time_ns()
    t = copytrace.trace(write=False)
    active = t.start()
    first = len(active.events)
    try:
        result = yield
    finally:
        t.stop()
    events, root = active.events[first:], _root(item.config)
    messages = [_verdict(events, dict(marker.kwargs), item.nodeid, root)]
    if baselines is not None:
        messages.append(_baseline_verdict(baselines, events, start_ns, item.nodeid, root))
    message = "\n".join(m for m in messages if m)
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
        _budget(limits, self._where)  # a bad limit fails before the block runs
        return _Block(limits, self._where, self._root)


@pytest.fixture
def copy_budget(request: pytest.FixtureRequest) -> CopyBudget:
    """Trace a block and fail the test when it goes over budget:
    ``with copy_budget(max_bytes=4096, forbid="all") as block: ...``."""
    return CopyBudget(request.node.nodeid, _root(request.config))
