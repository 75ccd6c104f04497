"""What the hazard rules share: the hot-loop test, and the evidence of one
finding (:class:`Acc` over event views, :class:`Group` over rows of a
:class:`~copytrace.analysis._columns.RunColumns`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from copytrace.analysis._dense import distinct
from copytrace.analysis._findings import HAZARDS, Finding, Ids
from copytrace.analysis._view import Ev

__all__ = ["Acc", "Group", "is_hot"]

#: Conversions whose no-op form is reported (``copytrace.op`` values).
CONVERSION_OPS = frozenset((
    "to", "cpu", "cuda", "type", "float", "double", "half", "bfloat16", "int", "long",
    "short", "char", "byte", "bool", "contiguous",
))  # fmt: skip
#: A site is "in a hot loop" when it fires in at least this many steps ...
HOT_MIN_STEPS = 3
#: ... and in at least this share of the steps between its first and last one.
HOT_DENSITY = 0.5


def is_hot(steps: Iterable[int]) -> bool:
    """Whether events in ``steps`` come from a loop that runs (about) every step."""
    distinct = sorted(set(steps))
    if len(distinct) < HOT_MIN_STEPS:
        return False
    return len(distinct) >= HOT_DENSITY * (distinct[-1] - distinct[0] + 1)


def what(e: Ev) -> str:
    shape = "x".join(str(d) for d in e.shape) if e.shape else "scalar"
    return f"{e.dtype or '?'} {shape}"


def plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word[:-1]}ies" if word.endswith("copy") else f"{n} {word}s"


class Acc:
    """Evidence for one finding, accumulated over events."""

    def __init__(self) -> None:
        self.events: list[Ev] = []
        self._ids: set[int] = set()
        self.sites: list[str] = []
        self.libs: list[str] = []  # the library call sites of the events
        self.bytes = 0
        self.count = 0
        self.extra = 0

    def add(self, e: Ev, nbytes: int = 0, *sites: str | None) -> None:
        if id(e) not in self._ids:
            self._ids.add(id(e))
            self.events.append(e)
        for site in sites or (e.site,):
            if site and site not in self.sites:
                self.sites.append(site)
        if e.lib_site and e.lib_site not in self.libs:
            self.libs.append(e.lib_site)
        self.bytes += nbytes
        self.count += 1

    def finding(self, code: str, message: str, fix: str, severity: str | None = None) -> Finding:
        events = sorted(self.events, key=lambda e: e.seq)
        return Finding(
            code=code,
            severity=severity or HAZARDS[code].severity,
            message=message,
            fix=fix,
            call_sites=_both(self.sites, self.libs),
            bytes=self.bytes,
            steps=sorted({e.step for e in events}),
            event_seqs=[e.seq for e in events],
            run=events[0].run if events else 0,
            span_ids=[e.span_id for e in events if e.span_id],
        )


def accs(keyed: Iterable[tuple[Any, Ev, int, tuple[str | None, ...]]]) -> dict[Any, Acc]:
    accs: dict[Any, Acc] = {}
    for key, e, nbytes, sites in keyed:
        accs.setdefault(key, Acc()).add(e, nbytes, *sites)
    return accs


def is_copy(e: Ev) -> bool:
    """A copy into new storage, with its storage facts recorded."""
    return (
        not e.group
        and e.error is None
        and not e.alias
        and not e.noop
        and e.bytes_allocated > 0
        and e.src_storage is not None
        and e.src_version is not None
        and e.op != "copy_"
    )


#: Copies another rule reports in full (tensor-ctor-copy): not reported again as redundant.
OWN_RULE = frozenset(("tensor_ctor", "new_tensor", "as_tensor", "legacy_ctor"))

#: dtype name -> the dtypes (names) that hold every one of its values exactly: a cast to one
#: of them is lossless (float32 -> float64); any other cast between two different dtypes
#: narrows (float32 -> bfloat16 rounds, float16 <-> bfloat16 loses range or precision,
#: int64 -> float32 rounds large integers). Sources: the IEEE 754 formats (float16: 11-bit
#: significand, bfloat16: 8-bit, float32: 24-bit, float64: 53-bit).
_WIDER: dict[str, frozenset[str]] = {
    "bool": frozenset(("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                       "float32", "float64", "complex64", "complex128")),
    "uint8": frozenset(("int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
                        "complex64", "complex128")),
    "int8": frozenset(("int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
                       "complex64", "complex128")),
    "int16": frozenset(("int32", "int64", "float32", "float64", "complex64", "complex128")),
    "int32": frozenset(("int64", "float64", "complex128")),
    "float16": frozenset(("float32", "float64", "complex64", "complex128")),
    "bfloat16": frozenset(("float32", "float64", "complex64", "complex128")),
    "float32": frozenset(("float64", "complex64", "complex128")),
    "float64": frozenset(("complex128",)),
    "complex64": frozenset(("complex128",)),
}  # fmt: skip


def narrows(src_dtype: str | None, dtype: str | None) -> bool:
    """Whether a cast from ``src_dtype`` to ``dtype`` can change a value (rounding, range or
    sign): False for the same dtype, for a lossless widening (:data:`_WIDER`) and when either
    dtype is unknown."""
    if not src_dtype or not dtype or src_dtype == dtype:
        return False
    return dtype not in _WIDER.get(src_dtype, frozenset())




#: At most this many library call sites are named beside a finding's own.
MAX_LIBRARY_SITES = 3


def _libs(rc: Any, rows: np.ndarray) -> list[str]:
    """The distinct library call sites of ``rows`` (first rows first)."""
    values = rc.values("lib_site", rows[:4096])
    return list(dict.fromkeys(v for v in values if v))[:MAX_LIBRARY_SITES]


def _both(sites: list[str], libs: list[str]) -> list[str]:
    """A finding's call sites: its own (the user's lines) first, then the library call sites
    its events were made at (transformers' ``sdpa_attention_forward``...)."""
    return [*sites, *(s for s in libs[:MAX_LIBRARY_SITES] if s not in sites)]


class _Row:
    """One row of a run's columns, read as an :class:`Ev` (each field read when asked for)."""

    def __init__(self, rc: Any, row: int) -> None:
        self._rc = rc
        self._row = row

    def __getattr__(self, name: str) -> Any:
        if name not in Ev.__slots__:
            raise AttributeError(name)
        value = self._rc.values(name, np.array([self._row]))[0]
        if isinstance(value, list):
            value = tuple(value)
        elif value is None and name in ("aten", "shape", "src_stride", "saved_by"):
            value = ()
        setattr(self, name, value)
        return value


class Group:
    """Evidence for one finding over rows of a run (see :class:`Acc`): each row added once.

    Args:
        rc: the run's columns.
        rows: the rows, ascending.
        nbytes: bytes at stake per row (aligned with ``rows``).
        sites: the call sites, most relevant first.
    """

    def __init__(self, rc: Any, rows: np.ndarray, nbytes: np.ndarray, sites: list[str]) -> None:
        self.rc = rc
        self.rows = rows
        self.count = len(rows)
        self.bytes = int(nbytes.sum())
        self.sites = sites
        self.first: Any = _Row(rc, int(rows[0]))
        steps = rc.np("step")[rows]
        self.steps: list[int] = distinct(steps).tolist()

    def finding(self, code: str, message: str, fix: str) -> Finding:
        seqs = self.rc.np("seq")[self.rows]
        order = np.argsort(seqs, kind="stable")
        return Finding(
            code=code,
            severity=HAZARDS[code].severity,
            message=message,
            fix=fix,
            call_sites=_both(self.sites, _libs(self.rc, self.rows)),
            bytes=self.bytes,
            steps=self.steps,
            event_seqs=Ids(seqs[order]),
            run=self.rc.run,
            span_ids=Ids(self.rc.span_ids(self.rows[order])),
        )
