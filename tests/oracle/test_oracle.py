"""PyTorch's own test databases as the oracle, CI sample: a traced program cannot tell.

Runs, untraced and inside ``copytrace.trace`` at every level on the C++ observer (``lean``, the
default; ``full``; ``api``) and at the default level on the Python fallback, 400 ops of ``op_db`` (of those that support float32 on
the CPU) on their first float32 sample (with gradients and without), every module of ``module_db`` on
its first input and every optimizer of ``optim_db`` on its first input, and asserts that no
output, gradient, state, exception, warning, mode stack length, weakref count, reference count
or version counter differs, and that copytrace swallowed no internal error. See
docs/oracle.md; ``benchmarks/oracle.py`` runs every sample at every level.

Differences known and not fixed yet are listed in :data:`KNOWN`, each with its reason; one that
is no longer seen fails :func:`test_known_differences_still_seen`, so that the list empties as
the fixes land.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from . import _cases, _harness


def changes(a: Any, b: Any, where: str = "") -> list[str]:
    """Every path at which two fingerprints differ, in order (``_harness._first_change``
    gives the first): for a tensor each meta field that differs and ``.values`` when its
    bytes do, so that a known ``_version`` difference cannot hide other bytes behind it."""
    if a == b:
        return []
    if isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == b[:1] == ("tensor",):
        meta = [f"{where}.{n}" for n, x, y in zip(_harness.META, a[1], b[1], strict=False) if x != y]
        return meta + ([f"{where}.values"] if a[2:] != b[2:] else [])
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2 and a[0] == b[0]:
        if isinstance(a[1], tuple) and isinstance(b[1], tuple) and len(a[1]) == len(b[1]):
            out: list[str] = []
            for i, (x, y) in enumerate(zip(a[1], b[1], strict=True)):
                if x == y:
                    continue
                label = x[0] if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) else i
                if label != i and isinstance(y, tuple) and x[0] == y[0]:
                    out += changes(x[1], y[1], f"{where}[{label}]")
                else:
                    out += changes(x, y, f"{where}[{i}]")
            return out
    return [where]


@dataclass(frozen=True)
class Known:
    """Differences expected until a fix lands: fnmatch patterns on the config name, the case,
    the key and a path inside the fingerprint where it differs (:func:`changes`)."""

    config: str
    case: str
    key: str
    at: str
    reason: str

    def covers(self, d: _harness.Difference, where: str) -> bool:
        """Whether this entry explains ``d``'s change at path ``where``."""
        return all(
            fnmatch.fnmatchcase(value, pattern)
            for value, pattern in (
                (d.config, self.config),
                (d.case, self.case),
                (d.key, self.key),
                (where, self.at),
            )
        )

    def matches(self, d: _harness.Difference) -> bool:
        """Whether this entry explains one of ``d``'s changes (it is still seen)."""
        return any(self.covers(d, where) for where in changes(d.untraced, d.traced))


def is_known(d: _harness.Difference) -> bool:
    """Whether :data:`KNOWN` explains every change of ``d``: a difference with one change
    that no entry names (the bytes of a gradient whose ``_version`` also differs) is not."""
    return all(
        any(k.covers(d, where) for k in KNOWN) for where in changes(d.untraced, d.traced)
    )


# --- Known differences, grouped by the touch that causes them, one entry per line ---------------
# Each reason names the touch; an entry goes when its touch is fixed (a fixed touch whose entry
# stays fails test_known_differences_still_seen).

#: On the C++ observer (every level) nothing is known: every difference fails. On the
#: Python fallback (no compiler) only its dispatch mode's own effects are (docs/oracle.md).
#: by design: the Python fallback's dispatch mode is its mechanism (docs/oracle.md)
FALLBACK_VERSION = (
    "the Python fallback's dispatch mode makes autograd accumulate gradients out of place "
    "(isTensorSubclassLike is true for every tensor while any dispatch mode is on), so "
    "version counters differ"
)
FALLBACK_RESHAPE = (
    "the Python fallback's dispatch mode makes reshape a view (ViewBackward0) where untraced "
    "it is _reshape_alias (ReshapeAliasBackward0): torch's reshape checks "
    "isTensorSubclassLike, true for every tensor while any dispatch mode is on"
)

# fmt: off
#: Known differences: Known(config, case, key, at, reason), fnmatch patterns.
KNOWN: list[Known] = [
    # the Python fallback at lean and full (its dispatch mode is on for the whole trace; at
    # api it has none)
    Known("[lf]*/python", "*", "*", "*._version", FALLBACK_VERSION),
    Known("[lf]*/python", "*", "*", "*.grad_fn", FALLBACK_RESHAPE),
]
# fmt: on

#: the traced configurations: every level on the C++ observer, the default level on the
#: Python fallback (the fallback's other levels: ``benchmarks/oracle.py --observer python``)
CONFIGS = [
    _harness.Config("lean", "native"),
    _harness.Config("full", "native"),
    _harness.Config("api", "native"),
    _harness.Config("lean", "python"),
]
CONFIG_NAMES = [c.name for c in CONFIGS]
#: ops run on their first float32 sample: this many, evenly spaced over op_db ...
CI_OPS = 400
#: ... and these, whose differences were found and fixed (each names its root cause in git)
ALWAYS = ("linalg.svdvals", "linalg.eigvalsh", "linalg.cond", "linalg.matrix_rank", "norm.nuc")


def ci_ops() -> list:
    """The CI sample's ops: :data:`CI_OPS` of those supporting float32 on the CPU, evenly
    spaced in op_db's order, plus :data:`ALWAYS`."""
    ops = [op for op in _cases.op_db() if torch.float32 in op.supported_dtypes("cpu")]
    step = len(ops) / CI_OPS
    picked = {int(i * step) for i in range(min(CI_OPS, len(ops)))}
    return [op for i, op in enumerate(ops) if i in picked or _cases.op_name(op) in ALWAYS]


@pytest.fixture(scope="module")
def report() -> _harness.Report:
    report = _harness.Report(list(CONFIGS), known=is_known)
    ops = ci_ops()
    for op in ops:
        _harness.run_cases(report, f"op {_cases.op_name(op)}", _cases.op_cases(op))
    for info in _cases.module_db():
        _harness.run_cases(report, f"module {info.name}", _cases.module_cases(info))
    for info in _cases.optim_db():
        _harness.run_cases(report, f"optim {info.optim_cls.__name__}", _cases.optim_cases(info))
    report.op_groups = len(ops)  # type: ignore[attr-defined]
    return report


def test_sample_size(report: _harness.Report) -> None:
    assert report.op_groups >= CI_OPS  # type: ignore[attr-defined]
    groups = report.op_groups + len(_cases.module_db()) + len(_cases.optim_db())  # type: ignore[attr-defined]
    assert report.groups == groups
    # both paths really ran: the C++ observer and the Python fallback
    assert report.observer_paths == {(c.name, c.observer) for c in CONFIGS}


def _unexpected(report: _harness.Report, config: str) -> list[_harness.Difference]:
    return [
        d
        for d in report.differences
        if d.config == config and not is_known(d)
    ]


@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_no_difference(report: _harness.Report, config: str) -> None:
    unexpected = _unexpected(report, config)
    assert not unexpected, f"{len(unexpected)} difference(s):\n" + "\n".join(
        d.describe() for d in unexpected[:10]
    )


@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_no_internal_error(report: _harness.Report, config: str) -> None:
    errors = [d for d in report.differences if d.config == config and d.kind == "internal_error"]
    assert not errors, "\n".join(f"{d.case}: {d.traced}" for d in errors[:3])


def test_known_differences_still_seen(report: _harness.Report) -> None:
    stale = [k for k in KNOWN if not any(k.matches(d) for d in report.differences)]
    assert not stale, "fixed? remove from KNOWN: " + "; ".join(k.reason for k in stale)


def test_a_known_change_does_not_hide_another():
    """On the fallback a gradient summed out of place has another ``_version`` (KNOWN); had
    its bytes differed too, the first change alone (``_version`` comes before the values in
    a tensor's fingerprint) would have called the whole difference known."""
    grad = _harness.fingerprint([torch.ones(2, 3)])  # version 0
    bumped = torch.ones(2, 3).add_(0)  # version 1, same bytes
    other = torch.full((2, 3), 1.5).add_(0)  # version 1, other bytes

    def diff(traced):
        return _harness.Difference("lean/python", "op x", "s0/grad", "grad", grad, traced)

    version_only = diff(_harness.fingerprint([bumped]))
    both = diff(_harness.fingerprint([other]))
    assert changes(version_only.untraced, version_only.traced) == ["[0]._version"]
    assert changes(both.untraced, both.traced) == ["[0]._version", "[0].values"]
    assert _harness._first_change(both.untraced, both.traced, "")[0] == "[0]._version"
    assert is_known(version_only)
    assert not is_known(both)  # the values are not explained by the version's entry
    assert any(k.matches(both) for k in KNOWN)  # though the entry is still seen in it
