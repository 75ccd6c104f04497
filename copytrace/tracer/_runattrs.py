"""The ``copytrace.run`` span's attributes, read from a session when it ends
(``docs/trace-format.md``), and the lines said on stderr about what was lost."""

from __future__ import annotations

import sys
from typing import Any

import torch

from copytrace import _env
from copytrace._redact import redact_args
from copytrace._version import __version__

__all__ = ["run_attributes", "say_losses", "session_stats"]


def _compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far (0 when dynamo is unused)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is None:
        return 0
    try:
        return int(dynamo.counters["frames"]["ok"])
    except Exception:
        return 0


def run_attributes(session: Any) -> dict[str, Any]:
    """The ``copytrace.run`` span's attributes (``docs/trace-format.md``)."""
    stats = session.stats
    target = session._target()
    observer = target._observer_path or "python"
    attrs: dict[str, Any] = {
        "copytrace.version": __version__,
        "copytrace.torch_version": torch.__version__,
        "process.command_args": redact_args(sys.argv),
        "copytrace.events": stats["events"],
        "copytrace.events_dropped": stats["dropped"],
        "copytrace.events_discarded": stats["discarded"],
        "copytrace.max_events": session._rec.max_events,
        "copytrace.errors": stats["errors"],
        "copytrace.internal_detaches": stats["internal_detaches"],
        "copytrace.overhead_ns": target._rec.overhead_ns,
        "copytrace.steps": stats["steps"],
        "copytrace.steps_traced": stats["steps_traced"],
        "copytrace.flushes": stats["flushes"],
        "copytrace.exit": session._exit or "normal",
        # the level in effect: lean needs the C++ observer, the Python fallback is full
        "copytrace.level": (
            "full" if session.level == "lean" and observer == "python" else session.level
        ),
        # the aten-level path: "native" (the C++ observer) or "python" (the fallback mode)
        "copytrace.observer": observer,
    }
    trigger = session.trigger
    if trigger is not None:
        # the windows traced on the trigger signal, "first-last" steps, in order
        attrs["copytrace.trigger"] = f"signal {trigger.signame}"
        attrs["copytrace.windows"] = [f"{a}-{b - 1}" for a, b in trigger.windows.windows]
    if session.ring:
        # the flight recorder: only the last N records, written because of ring_reason
        attrs["copytrace.ring"] = session.ring
        attrs["copytrace.ring_reason"] = session._exit_error or "the end of the run"
        attrs["copytrace.ring_skipped"] = session._buf.ring_skipped
    if session.schedule is not None:
        attrs["copytrace.schedule"] = repr(session.schedule)
    attrs.update(_compiled_attributes(session, target))
    return attrs


def _compiled_attributes(session: Any, target: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    frames = _compiled_frames()
    if frames:
        mode = session._engagement.compiled_mode
        attrs["copytrace.compiled_frames"] = frames
        # "compiled": compiled regions ran compiled, as spans of their own; "eager": this
        # torch offered no hook, so they ran eagerly (force_eager) and were traced op by op.
        attrs["copytrace.compiled_mode"] = mode or "compiled"
        attrs["copytrace.compiled_ran_eagerly"] = mode == "eager"
    if target._engagement.compiled is not None:
        attrs.update(target._engagement.compiled.run_attributes())
    return attrs


def say_losses(rec: Any) -> None:
    """One stderr line each for dropped records and internal errors (stderr, not
    warnings.warn: a program running with warnings as errors must not see them)."""
    if rec.dropped:
        print(
            f"copytrace: {rec.dropped} event(s) dropped: more than "
            f"max_events={rec.max_events} were buffered between two flushes (raise "
            f"max_events / ${_env.COPYTRACE_MAX_EVENTS}, or mark steps more often); the "
            f"count is in the trace (copytrace.events_dropped)",
            file=sys.stderr,
        )
    if rec.errors:
        print(
            f"copytrace: {rec.errors} internal error(s) while tracing "
            f"(last: {rec.last_error}); the traced program was not affected",
            file=sys.stderr,
        )


def session_stats(target: Any) -> dict[str, int]:
    """The counters of :attr:`Session.stats` for the session that records (``target``); the
    steps an idle armed session counted in C are added first."""
    target._idle.sync(target)
    rec, buf = target._rec, target._buf
    return {
        "events": buf.removed + len(rec.events),
        "dropped": rec.dropped,
        "errors": rec.errors,
        "internal_detaches": rec.internal_detaches,
        "steps": rec.step_index + 1,
        "steps_traced": buf.steps_traced,
        "discarded": buf.discarded,
        "flushes": buf.flushes,
    }
