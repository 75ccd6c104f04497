"""Which thread copytrace runs on, read without adding to the :mod:`threading` module's tables.

``threading.current_thread()`` called on a thread :mod:`threading` did not start (a program's
``_thread.start_new_thread`` thread, a C extension's thread, torch's autograd engine threads)
makes a ``threading._DummyThread`` and lists it in ``threading._active`` for good (CPython
3.11 ``Lib/threading.py`` ``current_thread``): the program would then count one thread more
in ``threading.enumerate()`` and ``threading.active_count()`` than untraced, and its next
unnamed thread would be numbered one higher (the dummy takes a number from the counter that
names ``Thread-N``). The lookups here read ``threading._active`` and create nothing.

copytrace's own start and stop import modules lazily (the OpenTelemetry SDK's resources
import ``psutil``, whose import calls ``threading.current_thread()``): :func:`unlisted`
runs them with a stand-in listed for the calling thread, taken out after, so that a trace
started and stopped on such a thread leaves ``threading``'s tables and name counter as
untraced.
"""

from __future__ import annotations

import _thread
import contextlib
import threading
from collections.abc import Iterator

__all__ = ["NAMES", "current_name", "on_main_thread", "unlisted"]

#: Per thread, ``.name``: the thread's name as the recorder first read it
#: (:func:`current_name`), for the events made on it after. A ``_thread._local``: what it holds
#: for a thread goes when the thread ends, so a later thread given the same ident (the OS
#: reuses a finished thread's stack, which the ident is made from) reads its own name.
NAMES = _thread._local()

_get_ident = threading.get_ident
_get_native_id = threading.get_native_id


def current_name() -> str:
    """The name of the calling thread: its ``threading.Thread``'s ``name`` where
    :mod:`threading` lists it (``threading._active``), else ``os-thread-<native id>``, the
    thread's id in the OS (``threading.get_native_id()``: the ``tid`` of
    ``/proc/<pid>/task/<tid>``, which py-spy and ``top -H`` show), for a thread
    :mod:`threading` did not start. Never raises (where a Python has no ``threading._active``,
    every thread is named from its native id)."""
    active = getattr(threading, "_active", None)
    thread = active.get(_get_ident()) if isinstance(active, dict) else None
    if thread is not None:
        name = getattr(thread, "name", None)
        if isinstance(name, str):
            return name
    return f"os-thread-{_get_native_id()}"


def on_main_thread() -> bool:
    """True on the interpreter's main thread, the one thread where ``signal.signal`` works
    (``threading.main_thread()``, which returns the thread object made at start-up and
    creates nothing)."""
    return _get_ident() == threading.main_thread().ident


@contextlib.contextmanager
def unlisted() -> Iterator[None]:
    """Run the block (copytrace's own code, never the program's) so that a call of
    ``threading.current_thread()`` in it leaves no ``threading._DummyThread`` listed.

    On a thread :mod:`threading` lists, nothing is done. On another, a stand-in
    ``threading.Thread`` named ``os-thread-<native id>`` (made with its name given, so that it
    takes no number from ``Thread-N``'s counter, and ``daemon`` given, so that its
    ``__init__`` does not call ``current_thread()`` itself) is listed for the thread in
    ``threading._active`` while the block runs, and taken out after (under
    ``threading._active_limbo_lock``) where it is still the one listed. Another thread of the
    program that lists threads while the block runs sees it; nothing stays after."""
    active = getattr(threading, "_active", None)
    lock = getattr(threading, "_active_limbo_lock", None)
    ident = _get_ident()
    if not isinstance(active, dict) or lock is None or ident in active:
        yield
        return
    native = _get_native_id()
    stand_in = threading.Thread(name=f"os-thread-{native}", daemon=True)
    stand_in._ident = ident  # type: ignore[attr-defined]  # what current_thread().ident reads
    stand_in._native_id = native  # type: ignore[attr-defined]
    with lock:
        active.setdefault(ident, stand_in)
    try:
        yield
    finally:
        with lock:
            if active.get(ident) is stand_in:
                del active[ident]
