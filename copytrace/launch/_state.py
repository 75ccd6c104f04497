"""What this process knows about its launch: one module-level :data:`S`, and the stderr line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["ENV_NAMES", "S", "State", "host", "warn"]

#: The variables :func:`copytrace.launch.activate` sets (and :func:`~copytrace.launch.reset`
#: restores).
ENV_NAMES = ("COPYTRACE", "COPYTRACE_OUTPUT", "COPYTRACE_REPORT", "COPYTRACE_LAUNCH")


class State:
    """Everything this process knows about its launch (module-level singleton :data:`S`)."""

    def __init__(self) -> None:
        self.active = False  # activate() ran in this process
        self.root = False  # this process writes the report
        self.out: Path | None = None
        self.report = True
        self.launch: str | None = None
        self.session: Any = None  # the copytrace Trace of this process
        self.marker: Path | None = None
        self.finished = False
        self.import_hook: Any = None
        self.quiet = False  # no closing lines (copytrace run prints its own)
        self.saved_env: dict[str, str | None] = {}
        self.marker_warned = False
        self.stopped: dict[str, Any] | None = None  # what stop_session() returned


S = State()


def warn(message: str) -> None:
    """One ``copytrace:`` line on stderr (never raises)."""
    try:
        print(f"copytrace: {message}", file=sys.stderr, flush=True)
    except Exception:  # pragma: no cover - stderr closed
        pass


def host() -> str:
    """This machine's name, as the trace files and markers spell it."""
    import socket

    return socket.gethostname() or "host"
