"""Armed and idle: windows of steps traced on a signal (``COPYTRACE_TRIGGER=signal``).

An armed session installs nothing that costs per op: its schedule (:class:`Windows`) says
``NONE`` for every step until a window is opened, so the modes, wrappers, patches and the
observer's kernels stay out (:mod:`copytrace.tracer._schedule`'s ``DISENGAGE``); only the
optimizer steps are followed, and while nothing is due they are only counted, in C, at
torch's ``Optimizer._optimizer_step_code`` (the session's *idle*: :mod:`._idle`,
:mod:`._stepcode`). The signal handler only counts the signal
(:attr:`Trigger.pending`); the next step boundary opens a window of ``steps`` steps starting
with the step that begins there (a window queued while one is open starts after it). The
last step of a window is ``RECORD_AND_SAVE``: its records are flushed and the modes removed.

The handler is installed only where the program has not made the signal its own: a Python
handler already there is chained to (it still gets every call); ``SIG_IGN`` or a handler
installed outside Python leaves copytrace's trigger off, said once on stderr; so does a
platform without the signal. A program that installs its own handler later simply replaces
copytrace's (said at the next window that does not come).

``copytrace trigger PID`` finds an armed process by its *arm file*,
``<tempdir>/copytrace-armed/<pid>.json`` (``{"pid", "ppid", "start", "signal", "steps",
"trace", "output_dir", "launch", "rank"}``), written when tracing starts and removed when
it stops; ``--steps N`` leaves ``<pid>.request.json`` (``{"steps": N}``) beside it, read at
the boundary that opens the window.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from copytrace._armfile import arm_dir, arm_file, request_file, start_time
from copytrace._threads import on_main_thread
from copytrace.tracer import _schedule as S
from copytrace.tracer._process import c_action_is_default

__all__ = [
    "Trigger", "Windows", "arm_dir", "arm_file", "request_file", "start_time", "window_written",
]  # fmt: skip


class Windows:
    """The schedule of an armed session: ``NONE`` outside the opened windows.

    Attributes:
        steps: steps per window by default.
        windows: ``(first step, last step + 1)`` of each window opened, in order.
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.windows: list[tuple[int, int]] = []

    def open(self, step: int, steps: int | None = None) -> tuple[int, int]:
        """Open a window of ``steps`` steps at ``step`` (after the last one if still open)."""
        start = max(step, self.windows[-1][1]) if self.windows else step
        window = (start, start + (steps or self.steps))
        self.windows.append(window)
        return window

    def __call__(self, step: int) -> str:
        for first, end in reversed(self.windows):
            if step >= end:
                return S.NONE
            if step >= first:
                return S.RECORD_AND_SAVE if step == end - 1 else S.RECORD
        return S.NONE

    def __repr__(self) -> str:
        return f"trigger=signal,steps={self.steps}"


_SAID: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        print(f"copytrace: {message}", file=sys.stderr)


class Trigger:
    """The trigger signal of one armed session.

    Attributes:
        signame: the signal's name (``SIGUSR2``).
        pending: signals arrived and not yet turned into a window.
        installed: copytrace's handler is in place.
        wake: called (no arguments, raising nothing) after each signal: the session stops
            counting its steps in C (idle) so that the next boundary opens the window.
    """

    def __init__(self, signame: str, steps: int, setting: str = "COPYTRACE_TRIGGER_SIGNAL") -> None:
        self.signame = signame
        #: the variable that named the signal, and what is lost when it cannot be armed
        self.setting = setting
        self._idle = (
            "the trigger stays idle"
            if setting == "COPYTRACE_TRIGGER_SIGNAL"
            else "the ring is written only on a failure, SIGTERM or the run's end"
        )
        self.windows = Windows(steps)
        self.pending = 0
        self.installed = False
        self.wake: Any = None
        self._previous: Any = None
        self._arm: Path | None = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.pending += 1
        if self.wake is not None:
            self.wake()
        previous = self._previous
        if callable(previous):
            previous(signum, frame)  # the program's own handler still gets its call

    def install(self, trace: Path | None, output_dir: Path, arm: bool = True) -> bool:
        """Install the handler (see the module docstring) and write the arm file (unless
        ``arm`` is False: the flight recorder's signal, :mod:`copytrace.tracer._ring`)."""
        sig = getattr(signal, self.signame, None)
        if sig is None:
            _say_once(
                self.signame,
                f"this platform has no {self.signame} ({self.setting}): {self._idle}",
            )
            return False
        if not on_main_thread():
            _say_once("thread", f"{self.setting} is armed only from the main thread: {self._idle}")
            return False
        try:
            current = signal.getsignal(sig)
            if current is signal.SIG_DFL and not c_action_is_default(sig):
                current = None  # a C handler set after Python started (faulthandler.register)
            if current is signal.SIG_IGN or current is None:
                _say_once(
                    self.signame,
                    f"the program handles {self.signame} itself: copytrace does not take it "
                    f"(choose another signal: COPYTRACE_TRIGGER_SIGNAL, COPYTRACE_RING_SIGNAL)",
                )  # fmt: skip
                return False
            self._previous = current if callable(current) else None
            signal.signal(sig, self._handler)
        except (ValueError, OSError) as err:
            _say_once(
                self.signame,
                f"cannot arm {self.signame} ({self.setting}: {err}): {self._idle}",
            )
            return False
        self.installed = True
        if arm:
            self._write_arm(trace, output_dir)
        return True

    def _write_arm(self, trace: Path | None, output_dir: Path) -> None:
        info = {
            "pid": os.getpid(),
            "ppid": os.getppid(),  # the launcher (torchrun) that ``trigger --all-ranks`` may name
            "start": start_time(os.getpid()),
            "signal": self.signame,
            "steps": self.windows.steps,
            "trace": str(trace.resolve()) if trace is not None else None,
            "output_dir": str(output_dir.resolve()),
            "launch": os.environ.get("COPYTRACE_LAUNCH") or os.environ.get("TORCHELASTIC_RUN_ID"),
            "rank": os.environ.get("RANK"),
        }
        try:
            path = arm_file(os.getpid())
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(info))
            tmp.replace(path)
            self._arm = path
        except OSError:
            self._arm = None

    def uninstall(self) -> None:
        """Put the previous handler back (where ours is still there); remove the arm file."""
        if self._arm is not None:
            for path in (self._arm, request_file(os.getpid())):
                try:
                    path.unlink()
                except OSError:
                    pass
            self._arm = None
        if not self.installed:
            return
        self.installed = False
        sig = getattr(signal, self.signame)
        try:
            if signal.getsignal(sig) == self._handler:
                previous = self._previous if self._previous is not None else signal.SIG_DFL
                signal.signal(sig, previous)
        except (ValueError, OSError):
            pass

    def open(self, step: int) -> tuple[int, int]:
        """Turn the pending signals into a window starting at ``step`` (its steps from a
        ``copytrace trigger --steps`` request when there is one)."""
        self.pending = 0
        steps = None
        req = request_file(os.getpid())
        try:
            steps = int(json.loads(req.read_text())["steps"])
            req.unlink()
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return self.windows.open(step, steps if steps and steps > 0 else None)


def window_written(session: Any, last: int) -> None:
    """On the export thread, once a trigger's window ending with step ``last`` is in
    ``session``'s trace file: say so, and run its ``on_window`` hook (the report)."""
    window = next((w for w in session.trigger.windows.windows if w[1] == last + 1), None)
    if window is None:
        return
    sink = session._file_sink
    path = sink.path if sink is not None else None
    print(
        f"copytrace: traced steps {window[0]}-{window[1] - 1}"
        + (f" -> {path}" if path is not None else ""),
        file=sys.stderr,
    )
    if session.on_window is not None:
        try:
            session.on_window(path, window)
        except Exception as err:
            session._rec.note_error(err)
