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

import pytest
import torch

from . import _cases, _harness


@dataclass(frozen=True)
class Known:
    """Differences expected until a fix lands: fnmatch patterns on the config name, the case,
    the key and the path inside the fingerprint where it first differs."""

    config: str
    case: str
    key: str
    at: str
    reason: str

    def matches(self, d: _harness.Difference) -> bool:
        where = _harness._first_change(d.untraced, d.traced, "")[0]
        return all(
            fnmatch.fnmatchcase(value, pattern)
            for value, pattern in (
                (d.config, self.config),
                (d.case, self.case),
                (d.key, self.key),
                (where, self.at),
            )
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
    # the Python fallback (its dispatch mode is on for the whole trace)
    Known("lean/python", "*", "*", "*._version", FALLBACK_VERSION),
    Known("lean/python", "*", "*", "*.grad_fn", FALLBACK_RESHAPE),
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
    report = _harness.Report(list(CONFIGS))
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
        if d.config == config and not any(k.matches(d) for k in KNOWN)
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
