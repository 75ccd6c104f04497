"""The oracle tells copytrace's value differences from torch's reads of uninitialised memory.

Two synthetic cases run untraced and traced (default level, C++ observer):

- ``copytrace's``: its value depends on whether the trace is on, as a value copytrace changed
  would. It must stay a difference: the recheck must not explain it away.
- ``torch's``: its value is what ``torch.empty`` hands back, as a kernel that reads its own
  uninitialised workspace would see it. Which bytes the allocator hands back depends on what
  was allocated before (copytrace's allocations change that), and glibc's choice of block is
  not steady enough for a test, so the case writes the previous tenant's bytes itself: 3.0s
  untraced, 7.0s traced, unless torch fills uninitialised memory
  (``fill_uninitialized_memory`` under deterministic algorithms), where the block stays as
  torch filled it: NaN in every run. It must be counted as uninitialised, not as a
  difference.
"""

from __future__ import annotations

import torch

from . import _harness, _recheck

N = 16


def _copytraces(probe: _harness.Probe) -> None:
    traced = probe.config.level is not None
    probe.note("forward/output", torch.full((4,), 2.0 if traced else 1.0))


def _filled() -> bool:
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    return torch.are_deterministic_algorithms_enabled() and fill


def _torchs(probe: _harness.Probe) -> None:
    out = torch.empty(N)
    if not _filled():  # the previous tenant's bytes, which the trace's allocations change
        out.fill_(7.0 if probe.config.level is not None else 3.0)
    probe.note("forward/output", out)


def _build() -> list[_harness.Case]:
    return [("copytrace's", _copytraces), ("torch's", _torchs)]


CONFIG = _harness.Config("lean", "native")


def test_uninitialised_is_torchs_and_a_real_difference_stays() -> None:
    # without the recheck both cases differ: the classification below has something to do
    base, again = (_harness.observe(_harness.UNTRACED, _build) for _ in range(2))
    raw, _ = _harness.compare(base, again, _harness.observe(CONFIG, _build))
    assert {d.case for d in raw} == {"copytrace's", "torch's"}

    report = _harness.Report([CONFIG])
    _harness.run_cases(report, "synthetic", _build)
    assert [(d.case, d.kind) for d in report.differences] == [("copytrace's", "output")]
    assert [(d.case, d.kind) for d in report.uninitialised] == [("torch's", "output")]


def test_filled_memory_is_restored() -> None:
    det = torch.utils.deterministic
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        det.fill_uninitialized_memory,  # type: ignore[attr-defined]
    )
    with _recheck.FilledMemory():
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.empty(4).isnan().all()  # torch's documented fill for floats
    after = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        det.fill_uninitialized_memory,  # type: ignore[attr-defined]
    )
    assert after == before


def _recheck_runs(monkeypatch, known) -> tuple[_harness.Report, list]:
    """The synthetic group run with ``known`` as the report's predicate, and the configs of
    the runs the recheck made (``_recheck`` calls ``observe`` for each)."""
    runs: list = []

    def counting(config, build, group="synthetic"):
        runs.append(config.name)
        return _harness.observe(config, build, group)

    monkeypatch.setattr(_recheck, "observe", counting)
    report = _harness.Report([CONFIG], known=known)
    _harness.run_cases(report, "synthetic", lambda: [("copytrace's", _copytraces)])
    return report, runs


def test_a_known_difference_is_reported_without_a_recheck(monkeypatch) -> None:
    # unexplained: the recheck runs the group with memory filled (untraced twice, traced
    # once) and untraced RECHECK times more, and the difference stays
    report, runs = _recheck_runs(monkeypatch, None)
    assert runs == ["untraced", "untraced", CONFIG.name] + ["untraced"] * _recheck.RECHECK
    assert [d.case for d in report.differences] == ["copytrace's"]
    # explained by the caller (as KNOWN explains the fallback's version counters): reported
    # the same, and the group is not run again
    report, runs = _recheck_runs(monkeypatch, lambda d: d.case == "copytrace's")
    assert runs == []
    assert [(d.case, d.kind) for d in report.differences] == [("copytrace's", "output")]
