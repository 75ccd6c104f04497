"""Runtime facts for the hazard analyser that an event, once recorded, cannot carry by itself.

The recorder owns one :class:`Watch` per trace and calls it at five points:

* :meth:`Watch.event`, for every recorded event: storage identity as trace-unique ids (never
  addresses, which the allocator reuses), the input's view (offset, strides) and version
  counter, the result's storage id and version. It also starts the few watches below; no
  watch holds a reference, strong or weak, to a user tensor (identities, the C++ observer's
  handles on version counters and autograd nodes, torch's weak handles on storages; see
  ``docs/observer-effects.md``).
* :meth:`Watch.before_op` (dispatch mode) or :meth:`Watch.before_api` (C handler), **only
  while** a ``.data`` alias of a tensor that requires grad is alive: an in-place write into that
  alias is a write autograd cannot see (``watch/_writes.py``); on the Python fallback also
  while a ``state_dict()`` alias is followed (a write into it or its source makes it stale).
* :meth:`Watch.check_backward`, for ``Tensor.backward``, ``torch.autograd.backward`` and
  ``torch.autograd.grad``: the graph about to run, against the pending writes.
* :meth:`Watch.step_end` at each step boundary and :meth:`Watch.finish` when tracing stops:
  attached copies that retain a graph, stale ``state_dict()`` aliases (``watch/_retained.py``);
  attached copies kept together from one call site within a step are noted when that site's
  count doubles (``watch/_accumulate.py``) and committed there.

Two contracts, both typed:

* :class:`WatchHost`: all the watch asks of its recorder (it never reads the recorder's
  fields).
* :class:`HeldEvents` and :data:`LATE_FIELDS`: the checks above write a few fields on events
  already recorded (*late facts*). The session asks :meth:`HeldEvents.live_events` at each
  flush and holds those events back from the export until no check can change them; only the
  fields in :data:`LATE_FIELDS` change after an event is recorded.

Nothing here reads tensor data or syncs a device: storages, offsets, strides, version
counters, autograd node metadata only. Any error is counted by the recorder and swallowed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from copytrace.tracer.watch._ids import StorageIds
from copytrace.tracer.watch._watch import BACKWARD_FUNCTIONS, Watch

if TYPE_CHECKING:
    import torch

    from copytrace.schema import CopyEvent

__all__ = ["Watch", "WatchHost", "HeldEvents", "LATE_FIELDS", "BACKWARD_FUNCTIONS", "StorageIds"]

#: The event fields a watch may change after the event was recorded (and only these):
#: ``inplace_writes`` and ``write_site`` (writes through a ``.data`` alias or into a fresh
#: copy), ``saved_by``, ``src_name`` (a backward that read a written storage),
#: ``retained_bytes`` (an attached copy retaining its graph at a step boundary, or kept with
#: others from its line within a step), ``stale``
#: (a ``state_dict()`` alias whose source changed), ``load_site`` (the load that handed it over).
LATE_FIELDS = ("inplace_writes", "write_site", "saved_by", "src_name", "retained_bytes", "stale",
               "load_site")  # fmt: skip


class WatchHost(Protocol):
    """What a :class:`Watch` needs of its recorder."""

    def note_error(self, err: BaseException) -> None:
        """Count an internal error (never raised into the user's code)."""

    def watch_writes(self, on: bool) -> None:
        """Have every torch call checked for an in-place write (``on``) or not: the C handler
        calls :meth:`Watch.before_api`, level ``lean`` pushes its function mode."""

    def owner_name(self, t: torch.Tensor) -> str | None:
        """``Module.path.param`` of a parameter or buffer, or None."""

    def owner_name_by_identity(self, key: int, cdata: int) -> str | None:
        """:meth:`owner_name` of the live tensor with ``id`` ``key`` and TensorImpl address
        ``cdata``, or None."""


class HeldEvents(Protocol):
    """The hold-back contract between a watch and the session's flush."""

    def live_events(self) -> list[CopyEvent]:
        """Events whose :data:`LATE_FIELDS` a later check may still change."""
        ...
