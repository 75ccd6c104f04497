"""Environment variables that configure copytrace, each with its default.

They are read by the start-up hook (``COPYTRACE=1``) and by ``copytrace run``. The
standard ``OTEL_*`` variables (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``...) are honoured by the OpenTelemetry SDK itself.
"""

from __future__ import annotations

import os

__all__ = [
    "COPYTRACE",
    "COPYTRACE_OUTPUT",
    "COPYTRACE_REPORT",
    "COPYTRACE_MAX_EVENTS",
    "DEFAULT_OUTPUT_DIR",
    "enabled",
    "output_dir",
    "flag",
]

#: Set to 1 to trace any Python program with no code change (read by the start-up hook).
COPYTRACE = "COPYTRACE"
#: Output directory for trace files and the report. Default: ``./copytrace-out``.
COPYTRACE_OUTPUT = "COPYTRACE_OUTPUT"
#: Write ``report.html`` at exit under ``COPYTRACE=1`` (1, the default) or not (0).
COPYTRACE_REPORT = "COPYTRACE_REPORT"
#: Cap on events kept in memory per process. Default: 1000000.
COPYTRACE_MAX_EVENTS = "COPYTRACE_MAX_EVENTS"

DEFAULT_OUTPUT_DIR = "copytrace-out"

_FALSE = ("", "0", "false", "no", "off")


def flag(name: str, default: bool) -> bool:
    """Read a boolean variable: unset -> ``default``; ``0/false/no/off/""`` -> False."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in _FALSE


def enabled() -> bool:
    """True when ``COPYTRACE`` asks for tracing."""
    return flag(COPYTRACE, False)


def output_dir() -> str:
    """The output directory from ``COPYTRACE_OUTPUT`` or the default."""
    return os.environ.get(COPYTRACE_OUTPUT) or DEFAULT_OUTPUT_DIR
