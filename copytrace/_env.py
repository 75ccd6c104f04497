"""Environment variables that configure copytrace, each with its default.

They are read by the start-up hook (``COPYTRACE=1``) and by ``copytrace run``. The
standard ``OTEL_*`` variables (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``...) are honoured by the OpenTelemetry SDK itself.

============================= ================= ============================================
variable                      default           meaning
============================= ================= ============================================
``COPYTRACE``                 unset (off)       ``1`` traces every Python process started
                                                with it in its environment (see below)
``COPYTRACE_OUTPUT``          ``copytrace-out`` output directory for trace files and the
                                                report
``COPYTRACE_REPORT``          ``1``             write ``report.html`` when the launch ends
``COPYTRACE_MAX_EVENTS``      ``1000000``       cap on records buffered between two flushes
                                                (beyond it: dropped and counted)
``COPYTRACE_AUTO_STEP``       ``1``             each ``optimizer.step()`` ends a step (until
                                                the program calls ``Trace.step()`` itself)
``COPYTRACE_REPORT_WAIT``     ``30``            seconds the report writer waits for other
                                                traced processes still writing their traces
``COPYTRACE_SCHEDULE``        unset (all)       steps traced, as ``torch.profiler.schedule``:
                                                ``wait=1,warmup=1,active=3,repeat=2``
``COPYTRACE_COMPRESSION``     ``gzip``          trace file compression: ``gzip`` or ``none``
``COPYTRACE_FLUSH_EVENTS``    ``4096``          flush records to the trace file at the first
                                                step boundary with this many buffered (0: at
                                                the end only)
``COPYTRACE_FLUSH_SECONDS``   ``5``             ... or this many seconds after the previous
                                                one
``COPYTRACE_LEVEL``           ``full``          ``full``: both torch modes; ``api``: the
                                                function mode only (cheaper, no implicit
                                                copies)
``COPYTRACE_PY_SPY``          (found)           the py-spy executable for ``copytrace run
                                                --py-spy``; default: beside the interpreter,
                                                else on ``PATH``
============================= ================= ============================================

Every process of a launch (the process started with ``COPYTRACE=1``, its ``torchrun``
ranks, ``multiprocessing`` children and DataLoader workers) writes its own trace file. The
first one, the *root*, writes the one merged report when it exits; see
:mod:`copytrace._bootstrap`. ``COPYTRACE_LAUNCH`` is set by the root for its descendants and
is not meant to be set by hand.
"""

from __future__ import annotations

import os

__all__ = [
    "COPYTRACE",
    "COPYTRACE_OUTPUT",
    "COPYTRACE_REPORT",
    "COPYTRACE_MAX_EVENTS",
    "COPYTRACE_AUTO_STEP",
    "COPYTRACE_REPORT_WAIT",
    "COPYTRACE_LAUNCH",
    "COPYTRACE_PY_SPY",
    "COPYTRACE_SCHEDULE",
    "COPYTRACE_LEVEL",
    "COPYTRACE_COMPRESSION",
    "COPYTRACE_FLUSH_EVENTS",
    "COPYTRACE_FLUSH_SECONDS",
    "DEFAULT_OUTPUT_DIR",
    "DEFAULT_MAX_EVENTS",
    "DEFAULT_REPORT_WAIT_S",
    "enabled",
    "output_dir",
    "flag",
    "number",
    "trace_options",
]

#: Set to 1 to trace any Python program with no code change (read by the start-up hook).
COPYTRACE = "COPYTRACE"
#: Output directory for trace files and the report. Default: ``./copytrace-out``.
COPYTRACE_OUTPUT = "COPYTRACE_OUTPUT"
#: Write ``report.html`` at exit under ``COPYTRACE=1`` (1, the default) or not (0).
COPYTRACE_REPORT = "COPYTRACE_REPORT"
#: Cap on records buffered between two flushes (beyond it they are dropped and counted).
#: Default: 1000000.
COPYTRACE_MAX_EVENTS = "COPYTRACE_MAX_EVENTS"
#: Let ``optimizer.step()`` mark step boundaries (1, the default) or not (0).
COPYTRACE_AUTO_STEP = "COPYTRACE_AUTO_STEP"
#: Seconds the process that writes the report waits for the other traced processes of the
#: launch to finish writing their traces. Default: 30.
COPYTRACE_REPORT_WAIT = "COPYTRACE_REPORT_WAIT"
#: Internal: the launch id, set by the root process for its descendants (``<pid>-<ns>``).
COPYTRACE_LAUNCH = "COPYTRACE_LAUNCH"
#: The py-spy executable for ``copytrace run --py-spy``. Default: ``py-spy`` beside the
#: Python interpreter, else on ``PATH``.
COPYTRACE_PY_SPY = "COPYTRACE_PY_SPY"
#: Steps traced, torch.profiler-style: ``wait=1,warmup=1,active=3,repeat=2,skip_first=10``.
#: Unset: every step.
COPYTRACE_SCHEDULE = "COPYTRACE_SCHEDULE"
#: ``full`` (both modes) or ``api`` (the function mode only). Default: ``full``.
COPYTRACE_LEVEL = "COPYTRACE_LEVEL"
#: Trace file compression: ``gzip`` (default) or ``none``.
COPYTRACE_COMPRESSION = "COPYTRACE_COMPRESSION"
#: Records buffered before they are flushed at a step boundary. Default: 4096 (0: at the end).
COPYTRACE_FLUSH_EVENTS = "COPYTRACE_FLUSH_EVENTS"
#: Seconds after which buffered records are flushed at the next step boundary. Default: 5.
COPYTRACE_FLUSH_SECONDS = "COPYTRACE_FLUSH_SECONDS"

DEFAULT_OUTPUT_DIR = "copytrace-out"
DEFAULT_MAX_EVENTS = 1_000_000
DEFAULT_REPORT_WAIT_S = 30.0

_FALSE = ("", "0", "false", "no", "off")


def flag(name: str, default: bool) -> bool:
    """Read a boolean variable: unset -> ``default``; ``0/false/no/off/""`` -> False."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in _FALSE


def number(name: str, default: float) -> float:
    """Read a number; unset or empty -> ``default``.

    Raises:
        ValueError: the value is not a number (the hook turns this into one warning).
    """
    value = (os.environ.get(name) or "").strip()
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


def enabled() -> bool:
    """True when ``COPYTRACE`` asks for tracing."""
    return flag(COPYTRACE, False)


def output_dir() -> str:
    """The output directory from ``COPYTRACE_OUTPUT`` or the default."""
    return os.environ.get(COPYTRACE_OUTPUT) or DEFAULT_OUTPUT_DIR


def trace_options() -> dict[str, object]:
    """Keyword arguments for :class:`copytrace.Trace` from the variables above.

    Raises:
        ValueError: a variable holds something that is not a valid value.
    """
    max_events = number(COPYTRACE_MAX_EVENTS, DEFAULT_MAX_EVENTS)
    if max_events < 0 or max_events != int(max_events):
        raise ValueError(f"{COPYTRACE_MAX_EVENTS} must be a whole number >= 0")
    return {"max_events": int(max_events), "auto_step": flag(COPYTRACE_AUTO_STEP, True)}
