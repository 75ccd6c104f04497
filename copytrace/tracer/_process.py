"""The process around a recording session: the one active session, SIGTERM, fork, exit.

Only one session records at a time in a process (:func:`active`). While one does,
copytrace catches ``SIGTERM`` (unless the program handles or ignores it itself): the handler
writes the trace, runs the :data:`SIGNAL_HOOKS` (the launch's report, see
:mod:`copytrace.launch`), then lets the process die of the signal as it would have. A forked
child never writes into its parent's trace file: the fork handler abandons the inherited
export there. How the program ended (an uncaught exception seen from ``atexit``) is read
by :func:`uncaught_exit`.

The session object is duck-typed here (``pid``, ``finish_on_signal(signum)``,
``abandon_export()``): this module is below :mod:`copytrace.tracer.session`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from copytrace._threads import on_main_thread

__all__ = [
    "CLOSE_TIMEOUT_S",
    "SIGNAL_HOOKS",
    "SIGNAL_TIMEOUT_S",
    "active",
    "finishing",
    "install_signal_handlers",
    "restore_signal_handlers",
    "set_active",
    "set_finishing",
    "uncaught_exit",
]

_ACTIVE: list[Any] = [None]  # the session that records in this process
_FINISHING: list[Any] = [None]  # the session whose stop() is writing
CLOSE_TIMEOUT_S = 120.0  # stop() waits this long for the export thread
SIGNAL_TIMEOUT_S = 10.0  # the SIGTERM handler waits this long, then the process dies

_FATAL_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM",) if hasattr(signal, n))
_SAVED_HANDLERS: dict[int, Any] = {}

#: Called as ``hook(signum, monotonic time the signal arrived)`` after the trace is written
#: on a fatal signal (the launch's report, see :mod:`copytrace.launch`).
SIGNAL_HOOKS: list[Callable[[int, float], None]] = []


def active() -> Any:
    """The session recording in this process, or None."""
    return _ACTIVE[0]


def set_active(session: Any) -> None:
    _ACTIVE[0] = session


_NESTED_SAID: list[bool] = [False]


def say_nested(inner_dir: Any, outer: Any) -> None:
    """Say once per process that a trace to be written into ``inner_dir`` was started while
    ``outer`` (a session) records: it records into ``outer`` and writes no file of its own."""
    if _NESTED_SAID[0]:
        return
    _NESTED_SAID[0] = True
    sink = getattr(outer, "_file_sink", None)
    where = f"its file {sink.path}" if sink is not None else "which writes no file"
    print(
        f"copytrace: a trace for {inner_dir} was started inside a running trace: it writes "
        f"no file of its own, its events go to the running one ({where})",
        file=sys.stderr,
    )


def finishing() -> Any:
    """The session whose ``stop()`` is writing its trace, or None."""
    return _FINISHING[0]


def set_finishing(session: Any) -> None:
    _FINISHING[0] = session


def uncaught_exit() -> str | None:
    """The name of the exception the program died of, seen from ``atexit`` (Python sets
    ``sys.last_type`` before running the exit handlers), or None; None in an interactive
    session, where ``sys.last_type`` is the last error shown."""
    last = getattr(sys, "last_type", None)
    if last is None or hasattr(sys, "ps1"):
        return None
    return getattr(last, "__name__", str(last))


def _on_fatal_signal(signum: int, frame: Any) -> None:
    """Write the active trace, then die of the signal as the program would have."""
    arrived = time.monotonic()
    target = _ACTIVE[0] or _FINISHING[0]
    try:
        if target is not None and target.pid == os.getpid():
            target.finish_on_signal(signum)
    except BaseException as err:  # never keep a dying process alive
        print(f"copytrace: could not write the trace on signal {signum}: {err}", file=sys.stderr)
    for hook in list(SIGNAL_HOOKS):
        try:
            hook(signum, arrived)
        except BaseException as err:  # never keep a dying process alive
            print(f"copytrace: on signal {signum}: {err}", file=sys.stderr)
    try:
        sys.stderr.flush()
    except Exception:
        pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_SIGACTION: list[Any] = []  # libc's sigaction, looked up once (None where there is none)


def c_action_is_default(signum: int) -> bool:
    """Whether the process-level action of ``signum`` is ``SIG_DFL``, read with libc's
    ``sigaction(signum, NULL, &old)`` (a query: nothing is set).

    ``signal.getsignal`` answers from Python's own table of handlers, which a C handler set
    after Python started (``faulthandler.register``, a C extension's ``sigaction``) does not
    change: it keeps answering ``SIG_DFL`` over such a handler. ``struct sigaction`` opens
    with the handler's pointer on Linux (glibc, musl) and macOS; the buffer is larger than
    any of them. True (Python's answer stands) where libc cannot be asked.

    Args:
        signum: a signal number."""
    if not _SIGACTION:
        try:
            import ctypes

            # dlopen(NULL): the process's own symbols, libc's among them (find_library
            # would start ldconfig, a child process the program would see)
            _SIGACTION.append(ctypes.CDLL(None).sigaction)
        except (OSError, AttributeError, ImportError):
            _SIGACTION.append(None)
    call = _SIGACTION[0]
    if call is None:
        return True
    import ctypes

    old = ctypes.create_string_buffer(512)
    if call(int(signum), None, old) != 0:
        return True
    return not ctypes.c_void_p.from_buffer(old).value  # SIG_DFL is the null pointer


def install_signal_handlers() -> None:
    """Catch SIGTERM while tracing, unless the program handles or ignores it itself, in
    Python or in C (:func:`c_action_is_default`)."""
    if not on_main_thread():
        return
    for sig in _FATAL_SIGNALS:
        try:
            if signal.getsignal(sig) is signal.SIG_DFL and c_action_is_default(sig):
                signal.signal(sig, _on_fatal_signal)
                _SAVED_HANDLERS[sig] = signal.SIG_DFL
        except (ValueError, OSError):  # not the main interpreter
            pass


def restore_signal_handlers() -> None:
    """Put back the handlers :func:`install_signal_handlers` replaced (where still ours)."""
    if not on_main_thread():
        return
    for sig, previous in list(_SAVED_HANDLERS.items()):
        try:
            if signal.getsignal(sig) is _on_fatal_signal:
                signal.signal(sig, previous)
        except (ValueError, OSError):
            pass
        _SAVED_HANDLERS.pop(sig, None)


def _after_fork_in_child() -> None:
    """A forked child must never write into its parent's trace file."""
    session = _ACTIVE[0]
    if session is not None and session.pid != os.getpid():
        session.abandon_export()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
