"""Which steps are traced: the schedule as a pure function, and its transitions as a table.

Modelled on ``torch.profiler``: a schedule maps a step number to one of four actions
(``NONE``, ``WARMUP``, ``RECORD``, ``RECORD_AND_SAVE``, named as
``torch.profiler.ProfilerAction``'s members), and what the session does at a step boundary
is looked up in :data:`TRANSITIONS` by ``(action of the step that ended, action of the next
step)``, as ``torch.profiler.profile.action_map`` does. Nothing here touches torch or the
recorder: the session (:mod:`copytrace.tracer.session`) carries the steps out.

Transition steps (:data:`TRANSITIONS`' values, in the order they run):

* ``SAVE``: the traced window ended: flush the buffered records to the export thread;
* ``ENGAGE``: install the modes, hooks and patches (no-op when installed);
* ``DISENGAGE``: remove them; where the program pushed modes of its own above copytrace's,
  they stay and the step's records are discarded instead;
* ``DISCARD``: the next step is a warmup step: its records are recorded, then discarded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from copytrace import _env

__all__ = [
    "NONE",
    "WARMUP",
    "RECORD",
    "RECORD_AND_SAVE",
    "RECORDING",
    "TRANSITIONS",
    "Schedule",
    "action_at",
    "action_name",
    "schedule_from",
    "transition",
]

# Schedule actions, named as torch.profiler.ProfilerAction's members.
NONE, WARMUP, RECORD, RECORD_AND_SAVE = "NONE", "WARMUP", "RECORD", "RECORD_AND_SAVE"
ACTIONS = (NONE, WARMUP, RECORD, RECORD_AND_SAVE)
#: The actions whose steps are kept (exported).
RECORDING = (RECORD, RECORD_AND_SAVE)

# Transition steps (see the module docstring).
SAVE, ENGAGE, DISENGAGE, DISCARD = "save", "engage", "disengage", "discard"

#: ``(action of the step that ended, action of the next step) -> steps``, in order.
#: A window ends (``SAVE``) after a ``RECORD_AND_SAVE`` step, and after a ``RECORD`` step
#: followed by an untraced one. ``(NONE, NONE)`` disengages again: where the program's own
#: modes kept copytrace's on the stack, the next step tries once more.
TRANSITIONS: dict[tuple[str, str], tuple[str, ...]] = {
    (NONE, NONE): (DISENGAGE,),
    (NONE, WARMUP): (ENGAGE, DISCARD),
    (NONE, RECORD): (ENGAGE,),
    (NONE, RECORD_AND_SAVE): (ENGAGE,),
    (WARMUP, NONE): (DISENGAGE,),
    (WARMUP, WARMUP): (ENGAGE, DISCARD),
    (WARMUP, RECORD): (ENGAGE,),
    (WARMUP, RECORD_AND_SAVE): (ENGAGE,),
    (RECORD, NONE): (SAVE, DISENGAGE),
    (RECORD, WARMUP): (SAVE, DISCARD),
    (RECORD, RECORD): (),
    (RECORD, RECORD_AND_SAVE): (),
    (RECORD_AND_SAVE, NONE): (SAVE, DISENGAGE),
    (RECORD_AND_SAVE, WARMUP): (SAVE, DISCARD),
    (RECORD_AND_SAVE, RECORD): (SAVE,),
    (RECORD_AND_SAVE, RECORD_AND_SAVE): (SAVE,),
}

#: The transitions that end a traced window (``SAVE`` among their steps).
SAVES: frozenset[tuple[str, str]] = frozenset(k for k, v in TRANSITIONS.items() if SAVE in v)

#: What entering a step with this action does when tracing starts (no step ended before).
START: dict[str, tuple[str, ...]] = {
    NONE: (DISENGAGE,),
    WARMUP: (ENGAGE, DISCARD),
    RECORD: (ENGAGE,),
    RECORD_AND_SAVE: (ENGAGE,),
}


def transition(prev: str, cur: str) -> tuple[str, ...]:
    """The steps to run at the boundary between a ``prev`` step and a ``cur`` step."""
    return TRANSITIONS[(prev, cur)]


def action_at(
    step: int, *, wait: int = 0, warmup: int = 0, active: int = 1, repeat: int = 0,
    skip_first: int = 0,
) -> str:  # fmt: skip
    """The action of ``step`` (from 0) under torch.profiler's schedule.

    The first ``skip_first`` steps are ``NONE``; then each cycle of ``wait + warmup +
    active`` steps has ``wait`` ``NONE`` steps, ``warmup`` ``WARMUP`` steps and ``active``
    ``RECORD`` steps, the last one ``RECORD_AND_SAVE``; after ``repeat`` cycles (0: never)
    every step is ``NONE``. For instance ``wait=1, warmup=1, active=2``: steps 0-3 are
    NONE, WARMUP, RECORD, RECORD_AND_SAVE, then again from step 4.
    """
    if step < skip_first:
        return NONE
    step -= skip_first
    cycle = wait + warmup + active
    if repeat > 0 and step // cycle >= repeat:
        return NONE
    pos = step % cycle
    if pos < wait:
        return NONE
    if pos < wait + warmup:
        return WARMUP
    return RECORD_AND_SAVE if pos == cycle - 1 else RECORD


def action_name(action: Any) -> str:
    """One of :data:`ACTIONS` for a schedule's answer: a string or a
    ``torch.profiler.ProfilerAction``; anything else records."""
    name = str(getattr(action, "name", action)).upper()
    for known in ACTIONS:  # the constant itself
        if name == known:
            return known
    return RECORD


class Schedule:
    """Which steps are traced: torch.profiler's schedule, driven by :meth:`Trace.step`
    (or by ``optimizer.step()`` while ``auto_step`` is on).

    The first ``skip_first`` steps are not traced; then each cycle has ``wait`` untraced
    steps, ``warmup`` steps traced but not kept, and ``active`` traced steps, the last of
    which flushes the trace; ``repeat`` cycles (0: cycles until the end). Outside warmup and
    active steps the modes, hooks and patches are removed, so untraced steps cost nearly
    nothing. Any callable ``step -> torch.profiler.ProfilerAction`` (for instance
    ``torch.profiler.schedule(...)``) is accepted in its place.

    In the environment: ``COPYTRACE_SCHEDULE="wait=1,warmup=1,active=3,repeat=2,skip_first=10"``.

    Raises:
        ValueError: a field that is not a whole number >= 0, or ``active`` < 1.
    """

    _FIELDS = _env.SCHEDULE_FIELDS

    def __init__(
        self,
        *,
        wait: int = 0,
        warmup: int = 0,
        active: int = 1,
        repeat: int = 0,
        skip_first: int = 0,
    ) -> None:
        for name, value in zip(
            self._FIELDS, (wait, warmup, active, repeat, skip_first), strict=True
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"schedule {name} must be a whole number >= 0, not {value!r}")
        if active < 1:
            raise ValueError("schedule active must be >= 1")
        self.wait, self.warmup, self.active = wait, warmup, active
        self.repeat, self.skip_first = repeat, skip_first

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """``"wait=1,warmup=1,active=3,repeat=2,skip_first=10"`` (any subset, any order).

        Raises:
            copytrace.SettingError: (a ``ValueError``) a field or value not accepted.
        """
        return cls(**_env.parse_schedule(text))

    def __call__(self, step: int) -> str:
        return action_at(
            step, wait=self.wait, warmup=self.warmup, active=self.active,
            repeat=self.repeat, skip_first=self.skip_first,
        )  # fmt: skip

    def __repr__(self) -> str:
        return ",".join(f"{n}={getattr(self, n)}" for n in self._FIELDS)


def schedule_from(value: Any) -> Callable[[int], Any] | None:
    """A schedule from a trace option: ``None`` (``$COPYTRACE_SCHEDULE``, else every step),
    a :class:`Schedule`, a callable, a dict of fields or a ``"wait=1,..."`` string.

    Raises:
        copytrace.SettingError: a string or variable not accepted.
        TypeError: any other type.
    """
    if value is None:
        value = _env.setting(_env.COPYTRACE_SCHEDULE)
        if value is None:
            return None
    if isinstance(value, str):
        return Schedule.parse(value)
    if isinstance(value, dict):
        return Schedule(**value)
    if callable(value):
        return value
    raise TypeError(f"schedule must be a Schedule, a callable, a dict or a string, not {value!r}")
