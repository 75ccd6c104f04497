"""Armed and idle: step boundaries that only count.

While an armed session (:mod:`copytrace.tracer._trigger`) records nothing and nothing is
due (no window open or queued, no signal pending, nothing buffered), a step boundary has
nothing to do but count. The session then goes *idle*: the C++ observer counts the
optimizer steps itself (its ``set_step_idle``) and calls no Python at all, and an explicit
:meth:`~copytrace.Trace.step` only adds one. The observer counts them at torch's profiler
hook point, ``Optimizer._optimizer_step_code`` (:mod:`copytrace.tracer._stepcode`), with its
``RecordFunction`` callback taken off: a registered callback costs at every autograd node
(``tracer/_native/steps.cpp``). Python work at each optimizer step, then that callback,
were most of what an armed process paid (``benchmarks/instructions.py`` counts it).

The session leaves idle, adding the steps counted in C to its own, before anything that
needs the step number or may open a window: the trigger's signal (``Trigger.wake``, from
the signal handler, at any point of the program), an explicit step while the automatic
one is on, the end of tracing. Leaving puts the callback back; a step that was open then ends at its
``_optimizer_step_code`` call, where its callback would have ended it. It enters idle again
at the end of each boundary where the conditions hold. A signal that arrives while it enters is seen by the check that ends
:meth:`Idle.enter`, whichever bytecode it lands on.
"""

from __future__ import annotations

from typing import Any

from copytrace.tracer import _schedule as S

__all__ = ["Idle"]


def _can_idle(session: Any) -> bool:
    trig, buf, rec = session.trigger, session._buf, session._rec
    return (
        trig is not None and not trig.pending and session.running and not session.ring
        and session._action == S.NONE and not session._engagement.engaged
        and buf.discard_from is None and buf.calls_discard_from is None
        and not rec.events and not buf.step_log
    )  # fmt: skip


class Idle:
    """The idle state of one session.

    Attributes:
        on: the session is idle (its boundaries only count).
    """

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False

    def enter(self, session: Any) -> None:
        """Go idle where :func:`_can_idle` holds (at the end of a boundary, at start)."""
        if self.on or not _can_idle(session):
            return
        self.on = True
        native = session._step_native
        if native is not None:
            _add_steps(session, native.set_step_idle(True))
        if session.trigger.pending:  # a signal landed while entering
            self.leave(session)

    def leave(self, session: Any) -> None:
        """Stop counting in C; the steps counted there become the session's."""
        if not self.on:
            return
        self.on = False
        native = session._step_native
        if native is not None:
            _add_steps(session, native.set_step_idle(False))

    def sync(self, session: Any) -> None:
        """Add the steps counted in C so far to the session's, staying idle."""
        native = session._step_native
        if self.on and native is not None:
            _add_steps(session, native.set_step_idle(True))

    def wake(self, session: Any) -> None:
        """The trigger's signal (from its handler): leave, so that the next boundary runs
        in full and opens the window. Errors are counted, never raised."""
        try:
            self.leave(session)
        except Exception as err:
            session._rec.note_error(err)

    @staticmethod
    def step(session: Any) -> int:
        """An explicit step while idle (the automatic step is off): one more step."""
        rec = session._rec
        rec.step_index += 1
        return rec.step_index  # type: ignore[no-any-return]


def _add_steps(session: Any, steps: int) -> None:
    """Steps counted by the C callback: optimizer steps, which are the session's steps
    while the automatic step is on (untraced steps: nothing else to account for)."""
    rec = session._rec
    if steps and rec.auto_step:
        rec.step_index += steps
