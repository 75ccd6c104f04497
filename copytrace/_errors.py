"""Errors that copytrace raises to its own callers (never into traced user code)."""

from __future__ import annotations

__all__ = ["CopytraceError", "SettingError", "TraceFileError"]


class CopytraceError(Exception):
    """A user-facing error: the CLI prints ``copytrace: error: <message>`` and exits 2."""


class TraceFileError(CopytraceError):
    """A trace path is missing, empty, or holds no readable copytrace spans."""


class SettingError(CopytraceError, ValueError):
    """A setting (a ``COPYTRACE_*`` variable or a :class:`copytrace.Trace` option) holds a
    value that is not accepted; the message names it and the accepted values."""
