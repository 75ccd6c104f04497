"""Where an armed process (``COPYTRACE_TRIGGER=signal``) leaves its *arm file*, and when a
process started: all that ``copytrace trigger`` needs to find the processes to signal.

Standard library only, so that ``copytrace trigger`` imports neither torch nor the readers
(:mod:`copytrace.tracer._trigger` writes the files; its package imports torch).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["arm_dir", "arm_file", "request_file", "start_time"]


def arm_dir() -> Path:
    """Where armed processes leave their arm files: ``<tempdir>/copytrace-armed``."""
    return Path(tempfile.gettempdir()) / "copytrace-armed"


def arm_file(pid: int) -> Path:
    """The arm file of process ``pid``: ``<arm_dir>/<pid>.json``."""
    return arm_dir() / f"{pid}.json"


def request_file(pid: int) -> Path:
    """Where ``copytrace trigger --steps N`` leaves ``{"steps": N}`` for process ``pid``."""
    return arm_dir() / f"{pid}.request.json"


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``'s 22nd
    field, see proc(5)), or None where there is no ``/proc``. An arm file records it, so
    that one left by a killed process is not taken for the process that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None
