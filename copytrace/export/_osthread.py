"""copytrace's own worker threads, started as bare OS threads the traced program cannot see.

A :class:`threading.Thread` is part of the program's world: ``threading.enumerate()`` and
``threading.active_count()`` list it, its bootstrap (``Thread._bootstrap_inner`` in CPython's
``Lib/threading.py``) installs the functions a program gave ``threading.settrace`` and
``threading.setprofile`` (coverage.py, debuggers, profilers), which then trace copytrace's
own code, and an exception it lets out goes to ``threading.excepthook``. A thread started with
``_thread.start_new_thread`` has none of this: it is in no table of :mod:`threading`, starts
with no trace or profile function, and :class:`OsThread` catches everything its target
raises (an exception let out of a bare thread would reach ``sys.unraisablehook``).

Two ways a program still reaches every thread are undone on the thread itself:

* ``threading.settrace_all_threads`` / ``setprofile_all_threads`` (Python 3.12+) set the
  function on every thread state of the interpreter: :func:`tidy` takes it off this one.
* ``threading.current_thread()`` called on a thread :mod:`threading` did not start (logging
  does, for each record) makes a ``threading._DummyThread`` and lists it in
  ``threading._active`` for good: :func:`tidy` takes out the one of this thread.

A worker calls :func:`tidy` each time it wakes; :class:`OsThread` also calls it when the
thread starts and ends.
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
from collections.abc import Callable

__all__ = ["OsThread", "tidy"]

#: Python 3.12+: a program can set a trace or profile function on every running thread.
_ALL_THREADS = hasattr(threading, "settrace_all_threads")


def tidy() -> None:
    """On a copytrace thread: drop a trace or profile function a program set on every thread
    (Python 3.12+), and the ``threading._DummyThread`` that code run here may have listed
    for this thread (``threading._active``, under ``threading._active_limbo_lock``; where a
    Python lacks these, nothing)."""
    if _ALL_THREADS:
        if sys.gettrace() is not None:
            sys.settrace(None)
        if sys.getprofile() is not None:
            sys.setprofile(None)
    ident = _thread.get_ident()
    dummy = getattr(threading, "_DummyThread", None)
    active = getattr(threading, "_active", None)
    lock = getattr(threading, "_active_limbo_lock", None)
    if dummy is None or active is None or lock is None or active.get(ident) is None:
        return
    with lock:
        if isinstance(active.get(ident), dummy):
            del active[ident]


class OsThread:
    """A worker on a bare OS thread (``_thread.start_new_thread``), with the part of
    :class:`threading.Thread`'s interface copytrace uses: :meth:`start`, :meth:`join`,
    :meth:`is_alive`. Like a daemon thread, the interpreter does not wait for it at exit.

    Args:
        target: the thread's work, called with no arguments.
        name: the worker's name (copytrace's own messages; the OS thread is not named).
        on_error: called on the thread with anything ``target`` (or :func:`tidy`) raises,
            ``BaseException`` included; an error it raises itself is dropped.
    """

    def __init__(
        self, target: Callable[[], object], name: str, on_error: Callable[[BaseException], object]
    ) -> None:
        self.name = name
        self._target = target
        self._on_error = on_error
        self._running = _thread.allocate_lock()  # held from start until the target returns
        self._pid: int | None = None
        #: The thread's identifier (``_thread.get_ident()`` on it) once started.
        self.ident: int | None = None

    def start(self) -> bool:
        """Start the thread. Returns False where none can start (``RuntimeError``: the
        interpreter is shutting down, or no more threads)."""
        self._running.acquire()
        self._pid = os.getpid()
        try:
            self.ident = _thread.start_new_thread(self._run, ())
        except RuntimeError:
            self._pid = None
            self._running.release()
            return False
        return True

    def is_alive(self) -> bool:
        """True from :meth:`start` until the target returns; False in a forked child (the
        thread is its parent's), as for :class:`threading.Thread`."""
        return self._pid == os.getpid() and self._running.locked()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the target returns, at most ``timeout`` seconds (None: no limit)."""
        if not self.is_alive():
            return
        if self._running.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._running.release()

    def _run(self) -> None:
        try:
            try:
                tidy()
                self._target()
            except BaseException as err:
                self._report(err)
            try:
                tidy()
            except BaseException as err:
                self._report(err)
        finally:
            self._running.release()

    def _report(self, err: BaseException) -> None:
        try:
            self._on_error(err)
        except BaseException:  # on_error could not say it (stderr closed): nowhere left
            pass
