"""Reference hazard rules, shared part: the thresholds and the per-call-site accumulator of
the per-event rules (``tests/_reference_hazards.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from copytrace.analysis._findings import HAZARDS, Finding
from copytrace.analysis._view import Ev

#: Conversions whose no-op form is reported (``copytrace.op`` values).
CONVERSION_OPS = frozenset((
    "to", "cpu", "cuda", "type", "float", "double", "half", "bfloat16", "int", "long",
    "short", "char", "byte", "bool", "contiguous",
))  # fmt: skip
#: A site is "in a hot loop" when it fires in at least this many steps ...
HOT_MIN_STEPS = 3
#: ... and in at least this share of the steps between its first and last one.
HOT_DENSITY = 0.5


def format_bytes(n: int) -> str:
    """``4000`` -> ``4000 B``; ``123456`` -> ``123456 B (120.6 KiB)``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{n} B ({value:.1f} {unit})"
    return f"{n} B"  # pragma: no cover


def is_hot(steps: Iterable[int]) -> bool:
    """Whether events in ``steps`` come from a loop that runs (about) every step."""
    distinct = sorted(set(steps))
    if len(distinct) < HOT_MIN_STEPS:
        return False
    return len(distinct) >= HOT_DENSITY * (distinct[-1] - distinct[0] + 1)


def _what(e: Ev) -> str:
    shape = "x".join(str(d) for d in e.shape) if e.shape else "scalar"
    return f"{e.dtype or '?'} {shape}"


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word[:-1]}ies" if word.endswith("copy") else f"{n} {word}s"


class _Acc:
    """Evidence for one finding, accumulated over events."""

    def __init__(self) -> None:
        self.events: list[Ev] = []
        self._ids: set[int] = set()
        self.sites: list[str] = []
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
        self.bytes += nbytes
        self.count += 1

    def finding(self, code: str, message: str, fix: str, severity: str | None = None) -> Finding:
        events = sorted(self.events, key=lambda e: e.seq)
        return Finding(
            code=code,
            severity=severity or HAZARDS[code].severity,
            message=message,
            fix=fix,
            call_sites=list(self.sites),
            bytes=self.bytes,
            steps=sorted({e.step for e in events}),
            event_seqs=[e.seq for e in events],
            run=events[0].run if events else 0,
            span_ids=[e.span_id for e in events if e.span_id],
        )


def _accs(keyed: Iterable[tuple[Any, Ev, int, tuple[str | None, ...]]]) -> dict[Any, _Acc]:
    accs: dict[Any, _Acc] = {}
    for key, e, nbytes, sites in keyed:
        accs.setdefault(key, _Acc()).add(e, nbytes, *sites)
    return accs


def _is_copy(e: Ev) -> bool:
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
_OWN_RULE = frozenset(("tensor_ctor", "new_tensor", "as_tensor", "legacy_ctor"))
