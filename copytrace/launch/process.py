"""This process in its launch: joining it, starting and stopping its trace, fork children,
and finishing (the trace, then the root's report) at exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path
from typing import Any

from copytrace.launch import torch_hook
from copytrace.launch._state import ENV_NAMES, S, warn
from copytrace.launch.markers import mark
from copytrace.launch.report import register_signal_hook, write_launch_report

__all__ = [
    "activate",
    "finish",
    "is_launcher",
    "reset",
    "session",
    "start_session",
    "stop_session",
]

#: ``python -m <module>`` launchers: not traced, they are the root of their workers.
_LAUNCHER_MODULES = (
    "torch.distributed.run",
    "torch.distributed.launch",
    "accelerate.commands.launch",
    "deepspeed.launcher.runner",
    "copytrace",
    "copytrace.cli",
)
#: console scripts (``sys.argv[0]`` base names) that are launchers.
_LAUNCHER_SCRIPTS = ("torchrun", "deepspeed", "copytrace")
_ATEXIT = [False]
_FORK_HOOK = [False]
_EXEC_HOOK = [False]
_MP_TOKEN: Any = None  # keeps the multiprocessing after-fork registration alive


# --- activation ----------------------------------------------------------------------------
def activate(
    *,
    output: str | os.PathLike[str] | None = None,
    report: bool | None = None,
    root: bool | None = None,
    quiet: bool = False,
    reconfigure: bool = False,
) -> None:
    """Join (or, as the root, start) a launch in this process; idempotent.

    Sets ``COPYTRACE``, an absolute ``COPYTRACE_OUTPUT`` and ``COPYTRACE_LAUNCH`` in
    ``os.environ`` so that every process started below this one is traced into the same
    directory and joins the same launch. The root says unknown ``COPYTRACE_*`` variables
    once (:func:`copytrace._envcheck.warn_unknown`).

    Args:
        output: output directory; default ``$COPYTRACE_OUTPUT`` or ``./copytrace-out``.
        report: write the report at the end; default ``$COPYTRACE_REPORT`` (on).
        root: force this process to be (True) or not be (False) the launch's root; default:
            root when no launch is inherited from the environment.
        quiet: leave the closing lines to the caller (``copytrace run``).
        reconfigure: apply these arguments even when the hook already activated this
            process (as long as it has not started tracing yet).
    """
    from copytrace import _env, _envcheck

    if S.active:
        if not reconfigure or S.session is not None or S.finished:
            return
        torch_hook.remove()
        saved = S.saved_env
        S.active = False
    else:
        saved = {name: os.environ.get(name) for name in ENV_NAMES}
    out = Path(output if output is not None else _env.output_dir()).absolute()
    if report is None:
        report = bool(_env.setting(_env.COPYTRACE_REPORT))
    launch = os.environ.get(_env.COPYTRACE_LAUNCH) or None
    if root is None:
        root = launch is None or _image_of_root(launch)
    if root:
        launch = f"{os.getpid()}-{time.time_ns()}"
        _envcheck.warn_unknown()  # the launch's processes below inherit the same environment
    os.environ[_env.COPYTRACE] = "1"
    os.environ[_env.COPYTRACE_OUTPUT] = str(out)
    os.environ[_env.COPYTRACE_REPORT] = "1" if report else "0"
    if launch:
        os.environ[_env.COPYTRACE_LAUNCH] = launch
    S.active, S.root, S.out, S.report, S.launch = True, bool(root), out, report, launch
    S.finished, S.quiet, S.saved_env = False, quiet, saved
    if not _ATEXIT[0]:
        _ATEXIT[0] = True
        atexit.register(_at_exit)


def _image_of_root(launch: str) -> bool:
    """True when this process is the root of ``launch`` itself, replaced by an ``os.exec*``
    its trace did not see: a root that never imported torch has no exec hook, so
    ``COPYTRACE_LAUNCH`` stayed in the environment, and the new program, taking itself for
    a child, wrote neither the report nor its line. exec keeps the pid and the start time; a
    process that only reuses the pid of a root that died started after the launch began
    (``/proc``'s start time; whole seconds of boot time, hence the 1 s margin)."""
    pid, _, began_ns = launch.partition("-")
    if pid != str(os.getpid()):
        return False
    started = _started_s()
    if started is None or not began_ns.isdigit():
        return True
    return started <= int(began_ns) / 1e9 + 1.0


def _started_s() -> float | None:
    """When this process started, in seconds since the epoch, from ``/proc`` (proc(5): the
    22nd field of ``/proc/self/stat`` in clock ticks since boot, ``btime`` in
    ``/proc/stat``); None without ``/proc``."""
    from copytrace._armfile import start_time

    ticks = start_time(os.getpid())
    try:
        with open("/proc/stat", "rb") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith(b"btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK") if ticks is not None else None
    except (OSError, ValueError, StopIteration):
        return None


def is_launcher() -> bool:
    """True when this process is a launcher (torchrun, accelerate, copytrace's CLI...)."""
    argv = list(sys.argv)
    orig = list(getattr(sys, "orig_argv", []) or [])
    # ``python -m X args``: orig_argv ends with [..., "-m", X, *args]; while runpy is still
    # importing X's package, sys.argv[0] is "-m", later X's file.
    if "-m" in orig:
        i = orig.index("-m")
        if i + 1 < len(orig) and orig[i + 2 :] == argv[1:]:
            return orig[i + 1] in _LAUNCHER_MODULES
    script = (argv[0] if argv else "").replace("\\", "/")
    name = os.path.basename(script)
    if name.endswith(".py"):
        return script.endswith(("torch/distributed/run.py", "torch/distributed/launch.py"))
    if name == "accelerate":
        return len(argv) > 1 and argv[1] == "launch"
    return name in _LAUNCHER_SCRIPTS



# --- the session of this process -----------------------------------------------------------
def session() -> Any:
    """The :class:`copytrace.Trace` this launch started in this process, or None."""
    return S.session


def start_session(*, force: bool = False) -> Any:
    """Start tracing this process (idempotent); return the trace, or None.

    Launcher processes are not traced unless ``force``. A failure prints one warning and
    returns None: the program then runs untraced.
    """
    torch_hook.remove()
    if not S.active or S.session is not None or S.finished:
        return S.session
    if not force and is_launcher():
        return None
    try:
        from copytrace import _env
        from copytrace._trace import Trace

        options = _env.trace_options()
        S.session = Trace(S.out, **options).start()
        register_signal_hook()
        _register_fork_hooks()
        _register_exec_hook()
        _defer_process_group_destruction()
        mark("running")
    except Exception as err:
        S.session = None
        warn(f"tracing disabled, start-up failed: {type(err).__name__}: {err}")
    return S.session


_KEPT_GROUPS: list[Any] = []
_PATCHED_DESTROY: list[Any] = []  # [original, wrapper] of destroy_process_group


def _defer_process_group_destruction() -> None:
    """Keep destroyed process groups alive until this process's trace is written.

    A gloo work item captures the thread-local state of the thread that queued it, and with
    it copytrace's torch modes (Python objects). When ``destroy_process_group()`` has run and
    the last reference to the group is then dropped from C++ with the GIL held (DDP's
    ``Reducer`` being freed when the model goes), ``~ProcessGroupGloo`` joins its worker
    threads while one of them waits for the GIL to release such a mode: a deadlock at exit
    (seen in about one run in four of a 2-rank DDP job). Holding a Python reference to
    each destroyed group moves its destruction to :func:`finish`, where Python's own
    release of a process group lets go of the GIL first.
    """
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
        from torch.distributed import distributed_c10d as c10d
    except Exception:
        return
    original = c10d.destroy_process_group
    if getattr(original, "_copytrace_keeps_groups", False):
        return

    import functools

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> Any:
        try:
            if group is None:
                _KEPT_GROUPS.extend(list(getattr(c10d._world, "pg_map", {}) or {}))
            else:
                _KEPT_GROUPS.append(group)
        except Exception:  # never in the program's way
            pass
        return original(group)

    destroy_process_group._copytrace_keeps_groups = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    if getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group
    _PATCHED_DESTROY[:] = [original, destroy_process_group]


def _undo_process_group_patch() -> None:
    if not _PATCHED_DESTROY:
        return
    original, wrapper = _PATCHED_DESTROY
    _PATCHED_DESTROY.clear()
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except Exception:
        return
    if c10d.destroy_process_group is wrapper:
        c10d.destroy_process_group = original
    if getattr(dist, "destroy_process_group", None) is wrapper:
        dist.destroy_process_group = original


def _register_fork_hooks() -> None:
    """Give fork children a trace of their own, and make ``multiprocessing`` children write
    it: fork children leave with ``os._exit`` (no ``atexit``), after running
    ``multiprocessing``'s finalizers.

    Registered at the first trace start, not at interpreter start: ``after_in_child``
    handlers run in registration order, and ours starts a trace, which needs the locks of
    modules imported by then (``logging``'s, for one: a resource detector that fails logs)
    to have been re-initialised by their own fork handlers first.
    """
    global _MP_TOKEN
    if not _FORK_HOOK[0] and hasattr(os, "register_at_fork"):
        _FORK_HOOK[0] = True
        os.register_at_fork(after_in_child=_after_fork_in_child)
    if _MP_TOKEN is not None:
        return
    import multiprocessing.util as mp_util

    class _Token:
        pass

    _MP_TOKEN = _Token()
    mp_util.register_after_fork(_MP_TOKEN, _in_mp_child)


def _in_mp_child(_token: Any) -> None:
    # Runs in every multiprocessing child, after its finalizer registry was cleared.
    try:
        import multiprocessing.util as mp_util

        mp_util.Finalize(None, _at_exit, exitpriority=100)
    except Exception as err:  # pragma: no cover - defensive
        warn(f"child trace will not be written: {err}")


def _after_fork_in_child() -> None:
    """``os.fork`` child: not the root; the inherited trace is the parent's, start anew."""
    if not S.active:
        return
    S.root = False
    old, S.session = S.session, None
    if old is None or S.finished:
        return
    try:
        old.stop()  # in a child, the Trace removes itself without touching the parent's file
    except Exception as err:
        warn(f"tracing disabled in child {os.getpid()}: {err}")
        return
    if _in_subprocess_preexec():
        return  # about to exec: the new program is traced by the hook if it is Python
    start_session(force=True)


def _in_subprocess_preexec() -> bool:
    """True in the child of ``subprocess.Popen(preexec_fn=...)`` (it runs fork handlers, then
    execs): no trace to start there, and starting threads before exec is unsafe."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_execute_child" and code.co_filename.endswith("subprocess.py"):
            return True
        frame = frame.f_back
    return False


# --- exec ------------------------------------------------------------------------------------
def _register_exec_hook() -> None:
    """Finish this process's trace when it calls ``os.exec*``, which replaces the process
    without running ``atexit``: before, the trace recorded so far was lost and the launch's
    marker stayed "running" (the root's report waited for it, the launch folder stayed).

    An audit hook (PEP 578): CPython raises the ``os.exec`` audit event in every ``os.exec*``
    function just before the ``exec`` system call (``os_execv_impl``, ``os_execve_impl``);
    ``subprocess`` and ``os.posix_spawn`` raise other events and are not affected. A hook
    cannot be removed, so it stays for the interpreter's life and does nothing once this
    process has finished. CPython calls it on every audit event: where the C++ observer is
    loaded it is a C hook (``exec_hook``, ``_native/audit.cpp``) that compares the event's
    name in C and calls Python (:func:`_on_exec`) on ``os.exec`` only; elsewhere a Python
    hook (``sys.addaudithook``, :func:`_on_audit`), a Python call per event (about 25 a copy
    on the Python fallback: ``benchmarks/audit_hook.py``). Added at the first trace start
    (torch imported: see below). Nothing is done where adding it fails (an audit hook of the
    program's refused it with an error that is not a ``RuntimeError``, for the C hook, or not
    an ``Exception``, for the Python one; CPython drops the others silently): a warning says
    so.
    """
    if _EXEC_HOOK[0]:
        return
    _EXEC_HOOK[0] = True
    from copytrace.tracer import _native

    native = _native.loaded()
    try:
        if native is not None:
            native.exec_hook(_on_exec)
        else:
            sys.addaudithook(_on_audit)
    except Exception as err:  # a hook of the program's refused ours
        warn(f"os.exec* will not write this process's trace: {type(err).__name__}: {err}")
        return
    # The hook is called on any audit event, also inside a compiled region (``sys._getframe``,
    # ``object.__getattr__``), where dynamo would count its frame as one of the program's
    # (``counters["frames"]`` one higher): dynamo skips its code, and what it calls, from
    # its import on (nothing compiled runs before; copytrace does not import it).
    from copytrace.tracer import _dynamo_import

    _dynamo_import.wait(_skip_exec_hook)


def _skip_exec_hook() -> None:
    from copytrace.tracer.compiled import skip_codes

    try:
        skip_codes([_on_audit.__code__, _on_exec.__code__, _before_exec.__code__], recursive=True)
    except Exception as err:  # a torch whose private API changed: the frames are counted
        warn(f"compiled frames may count copytrace's audit hook: {type(err).__name__}: {err}")


def _on_audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "os.exec" and S.active and not S.finished:
        _before_exec()


def _on_exec() -> None:
    """The C hook's call at an ``os.exec`` audit event."""
    if S.active and not S.finished:
        _before_exec()


def _before_exec() -> None:
    """Write this process's trace (and, the root, the launch's report) as at exit, then set
    the trace file aside as ``copytrace-<host>-<pid>-exec<k>...`` with its sidecar, so that the
    new program, which keeps this pid and is traced too where it is Python (it inherits
    ``COPYTRACE=1``), cannot write over it. The new program of a root starts a launch of its
    own (``os.execv`` passes ``os.environ``; ``COPYTRACE_LAUNCH`` is taken out of it). Never
    raises: an exception here would refuse the program's ``exec``."""
    try:
        root, quiet, S.quiet = S.root, S.quiet, True
        try:
            result = finish()
        finally:
            S.quiet = quiet
        if result["trace"] is not None:
            result["trace"] = _set_aside(Path(result["trace"]))
        if not quiet:
            _say(result)
        if root:
            from copytrace import _env

            os.environ.pop(_env.COPYTRACE_LAUNCH, None)
    except BaseException as err:  # never into the program's exec
        try:
            warn(f"could not finish the trace before exec: {type(err).__name__}: {err}")
        except BaseException:
            pass


def _set_aside(path: Path) -> Path:
    """Rename trace file ``path`` (``copytrace-<host>-<pid>[-rank<N>].otlp.jsonl[.gz]``) and
    its sidecar folder to the first free ``...-<pid>-exec<k>...`` name (k = 1, 2, ...)."""
    import socket

    from copytrace.schema import sidecar_dir

    prefix = f"copytrace-{socket.gethostname() or 'host'}-{os.getpid()}"  # trace_file_name's
    if not path.name.startswith(prefix):
        return path
    k = 1
    while True:
        new = path.with_name(f"{prefix}-exec{k}{path.name[len(prefix) :]}")
        if not new.exists() and not sidecar_dir(new).exists():
            break
        k += 1
    path.rename(new)
    if sidecar_dir(path).exists():
        sidecar_dir(path).rename(sidecar_dir(new))
    return new


# --- finishing ---------------------------------------------------------------------------------
def _at_exit() -> None:
    try:
        finish()
    except BaseException as err:  # pragma: no cover - finish() never raises
        warn(f"could not finish: {err}")
    _keep_sigint_exit()


def _keep_sigint_exit() -> None:
    """After an unhandled KeyboardInterrupt, Python ends by killing itself with SIGINT (exit
    status 130 in a shell), but only while a C-level flag is still set: running Python code
    at exit that imports a new module (writing the report does) clears it, and the program
    would exit with status 1 instead. Set the flag again the way CPython itself does, by an
    uncaught KeyboardInterrupt in ``PyRun_SimpleString``, with its traceback silenced."""
    if not isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
        return
    try:
        import ctypes

        saved = sys.stderr, sys.last_type, sys.last_value, sys.last_traceback
        with open(os.devnull, "w") as devnull:
            sys.stderr = devnull
            try:
                ctypes.pythonapi.PyRun_SimpleString(b"raise KeyboardInterrupt")
            finally:
                sys.stderr, sys.last_type, sys.last_value, sys.last_traceback = saved
    except Exception:  # no ctypes, or an interpreter without the C API: keep status 1
        pass


def finish(*, wait_s: float | None = None) -> dict[str, Any]:
    """Stop this process's trace, write it, and (the root) write the launch's report.

    Idempotent; never raises.

    Args:
        wait_s: how long the root waits for other processes still tracing; default
            ``$COPYTRACE_REPORT_WAIT`` (30 s).

    Returns:
        ``{"trace": Path | None, "report": Path | None, "stats": dict | None}``.
    """
    result: dict[str, Any] = {"trace": None, "report": None, "stats": None}
    if not S.active or S.finished:
        return result
    S.finished = True
    torch_hook.remove()
    result.update(stop_session())
    _KEPT_GROUPS.clear()  # see _defer_process_group_destruction
    if S.root and S.report:
        try:
            result["report"] = write_launch_report(wait_s)
        except Exception as err:
            warn(f"could not write the report: {type(err).__name__}: {err}")
    if not S.quiet:
        _say(result)
    return result


def _say(result: dict[str, Any]) -> None:
    """One line per launch, from the root; with ``COPYTRACE_REPORT=0`` one per process."""
    parts = []
    if result["trace"] is not None and (not S.report or S.root):
        parts.append(f"trace {result['trace']}")
    if result["report"] is not None:
        parts.append(f"report {result['report']}")
    if parts:
        warn("; ".join(parts))


def stop_session(exc: BaseException | None = None) -> dict[str, Any]:
    """Stop and write this process's trace now (idempotent; never raises); :func:`finish`
    then writes the report. ``copytrace run`` calls it while the program's globals are
    still alive, as they are at ``atexit`` under ``COPYTRACE=1``, passing the exception
    the program ended with, if any (recorded as ``copytrace.exit``).

    Returns:
        ``{"trace": Path | None, "stats": dict | None}`` (the same on later calls).
    """
    if S.stopped is not None:
        return S.stopped
    result: dict[str, Any] = {"trace": None, "stats": None}
    session, S.session = S.session, None
    if session is not None:
        try:
            if exc is not None:
                session.note_exit(type(exc), exc)
            path = session.stop()
            result["trace"] = path
            result["stats"] = session.stats
            mark("done", str(path) if path is not None else "")
        except Exception as err:
            warn(f"could not finish the trace: {type(err).__name__}: {err}")
            mark("done")
    S.stopped = result
    return result



def reset() -> None:
    """Forget this process's launch and restore the variables :func:`activate` set (for
    ``copytrace run`` called in-process, e.g. from tests). Call after :func:`finish`."""
    torch_hook.remove()
    _undo_process_group_patch()
    for name, value in S.saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    S.__init__()  # type: ignore[misc]


