"""The :class:`Finding` record and the catalogue of hazard codes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Finding", "Hazard", "HAZARDS", "Ids", "SEVERITIES", "normalize_codes"]


class Ids(Sequence[Any]):
    """The events a finding names (their ``seq`` or span ids) as one array, not one Python
    object per event: a finding can name every event of a 1M-event trace.

    It reads as the list it stands for (``len``, indexing, slices as lists, iteration,
    ``==`` with a list or tuple); :meth:`arrow` gives the array itself.

    Args:
        values: a numpy array (integers) or a pyarrow array (strings or integers).
    """

    __slots__ = ("_values",)

    def __init__(self, values: Any) -> None:
        self._values = values

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return _plain(self._values[i])
        value = self._values[i]
        return value.as_py() if hasattr(value, "as_py") else value.item()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Ids, list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        if len(self) <= 8:
            return repr(self.tolist())
        return f"Ids({self[:3]!r}... {len(self)} in all)"

    def tolist(self) -> list[Any]:
        """The values as a Python list."""
        return _plain(self._values)

    def arrow(self) -> Any:
        """The values as a pyarrow array."""
        import pyarrow as pa

        return self._values if isinstance(self._values, (pa.Array, pa.ChunkedArray)) \
            else pa.array(self._values)  # fmt: skip


def _plain(values: Any) -> list[Any]:
    return values.to_pylist() if hasattr(values, "to_pylist") else values.tolist()  # type: ignore[no-any-return]

#: Severities, most severe first.
SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Hazard:
    """One hazard code: what it means and how severe it is (see ``docs/hazards.md``)."""

    code: str
    severity: str
    title: str


#: Every hazard code, in report order. Codes are stable: CI configurations name them.
HAZARDS: dict[str, Hazard] = {
    h.code: h
    for h in (
        Hazard("data-inplace", "error",
               "in-place write through `.data` (or `.data =`) to a tensor saved for backward"),
        Hazard("lost-inplace-write", "error",
               "in-place write into the fresh copy advanced indexing returned, then dropped"),
        Hazard("graph-retaining-copy", "warning",
               "attached copy outlives its step, keeping its autograd graph alive"),
        Hazard("alias-write", "warning",
               "in-place write through a no-op `.to()`, a reshape view or `copy.copy`: "
               "the input changed too"),
        Hazard("aliasing-snapshot", "warning",
               "`state_dict()` kept as a snapshot without copying, then changed in place"),
        Hazard("stale-kept-copy", "error",
               "a copy of a parameter kept across optimizer steps, used after it changed"),
        Hazard("redundant-copy", "warning",
               "the same unchanged data copied more than once in a step, or a copy of a copy"),
        Hazard("round-trip", "warning",
               "data copied host->device->host (or device->host->device) unchanged"),
        Hazard("pageable-transfer", "warning",
               "host-to-device copy from pageable memory without non_blocking, every step"),
        Hazard("deepcopy-in-loop", "warning", "copy.deepcopy every step"),
        Hazard("deepcopy-nonleaf", "warning",
               "copy.deepcopy of an object holding a tensor still in the autograd graph"),
        Hazard("tensor-ctor-copy", "warning",
               "torch.tensor(t) / t.new_tensor(t) of a tensor, torch.as_tensor([t, ...]), "
               "torch.Tensor([t, ...])"),
        Hazard("clone-detach-order", "info", "clone().detach() instead of detach().clone()"),
        Hazard("noop-conversion", "info",
               "conversion that returns its input unchanged, every step"),
    )
}  # fmt: skip


@dataclass
class Finding:
    """One hazard found in a trace, with its evidence.

    Attributes:
        code: stable hazard code, a key of :data:`HAZARDS` (``redundant-copy``...).
        severity: ``error``, ``warning`` or ``info``.
        message: what happened, in one or two sentences, with the numbers.
        fix: the fix, in one sentence.
        call_sites: ``file:line function`` of the code involved, most relevant first.
        bytes: bytes at stake (copied, moved, written or kept alive; see ``docs/hazards.md``).
        steps: steps in which it happened, sorted.
        event_seqs: the events that show it (a list, or an :class:`Ids` that reads as one): ``CopyEvent.seq`` for in-memory events, the
            event's index in its run's ``events`` for a loaded trace.
        run: index of the run (traced process) in a loaded trace; 0 in memory.
        span_ids: span ids of those events in a loaded trace (empty in memory).
    """

    code: str
    severity: str
    message: str
    fix: str
    call_sites: list[str] = field(default_factory=list)
    bytes: int = 0
    steps: list[int] = field(default_factory=list)
    event_seqs: Sequence[int] = field(default_factory=list)
    run: int = 0
    span_ids: Sequence[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (JSON-ready; the lists are copies, :class:`Ids` become
        lists)."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), (list, Ids)) else v)
                for f in fields(self)}  # fmt: skip

    def one_line(self) -> str:
        """``severity code at site: message`` on one line."""
        where = f" at {self.call_sites[0]}" if self.call_sites else ""
        return f"{self.severity} {self.code}{where}: {self.message}"

    def __str__(self) -> str:
        return self.one_line()


def normalize_codes(codes: Any) -> list[str]:
    """Turn ``"data_inplace,redundant-copy"`` or a list of codes into valid hazard codes.

    Underscores are accepted for hyphens, case is ignored, ``all`` means every code and a
    severity name (``error``, ``warning``, ``info``) means every code of that severity.

    Raises:
        ValueError: for an unknown code (the message lists the valid ones).
    """
    if codes is None:
        return []
    if isinstance(codes, str):
        codes = codes.split(",")
    out: list[str] = []
    for raw in codes:
        name = str(raw).strip().lower().replace("_", "-")
        if not name:
            continue
        if name == "all":
            picked = list(HAZARDS)
        elif name in SEVERITIES:
            picked = [c for c, h in HAZARDS.items() if h.severity == name]
        elif name in HAZARDS:
            picked = [name]
        else:
            raise ValueError(
                f"unknown hazard code {raw!r}; valid codes: {', '.join(HAZARDS)} "
                "(or all, error, warning, info)"
            )
        out.extend(c for c in picked if c not in out)
    return out
