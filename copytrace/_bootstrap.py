"""No-code-change tracing: the ``COPYTRACE=1`` start-up hook and the launch it belongs to.

``copytrace_hook.pth`` (installed into site-packages) imports this module at interpreter
start only when ``COPYTRACE`` is set; unset, the hook reads one environment variable and
imports nothing. Imported, this module does not import torch either: it waits for the
program's own ``import torch`` and starts tracing right after it, so Python processes that
never use torch (launcher helpers, ``multiprocessing``'s resource tracker...) cost nothing
and write no empty trace. Nothing here ever raises into the program: a failure prints one
``copytrace:`` warning and the program runs untraced.

One *launch* is the process started with ``COPYTRACE=1`` (the *root*) and every process
started below it that inherits its environment: ``torchrun`` ranks, ``multiprocessing``
children (fork, spawn, forkserver) and DataLoader workers. Each traced process writes its
own trace file, ``copytrace-<host>-<pid>[-rank<N>].otlp.jsonl``, into the same output
directory (the root makes ``COPYTRACE_OUTPUT`` absolute for its descendants). The report is
written once, by the root, when it exits:

* each traced process leaves a marker ``<out>/.copytrace-launch-<id>/<host>-<pid>`` saying
  ``running`` while it traces and ``done <trace file>`` once its trace is written;
* the root, at exit, waits (at most ``COPYTRACE_REPORT_WAIT`` seconds) while a marker says
  ``running`` and its process is still alive, then writes ``<out>/report.html`` from the
  launch's own trace files (files from earlier runs in the same directory are left out:
  ``copytrace report DIR`` merges everything), and removes the markers.

Launcher processes (``torchrun``, ``python -m torch.distributed.run``, ``accelerate
launch``, ``deepspeed``, copytrace's own CLI) are not traced themselves: they only copy
tensors for their own bookkeeping, and the launcher is the natural root (it exits after its
workers).

``multiprocessing`` children started with *fork* (DataLoader workers by default on Linux)
inherit the parent's active trace: the fork hook replaces it in the child with a fresh one
(the parent's events stay the parent's), and the child writes it from ``multiprocessing``'s
own exit path (fork children leave with ``os._exit``, which skips ``atexit``).

Known limitations:
    A bare ``os.fork()`` child that leaves with ``os._exit`` writes no trace; a process
    killed by a signal writes none either (its marker then counts as finished). Only the
    thread that imported torch (normally the main thread) is traced, as for
    :class:`copytrace.Trace`.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = [
    "activate",
    "start_session",
    "stop_session",
    "finish",
    "reset",
    "is_launcher",
    "session",
    "launch_trace_files",
]

_LAUNCH_DIR_PREFIX = ".copytrace-launch-"
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


class _State:
    """Everything this process knows about its launch (module-level singleton)."""

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


_S = _State()
_ENV_NAMES = ("COPYTRACE", "COPYTRACE_OUTPUT", "COPYTRACE_REPORT", "COPYTRACE_LAUNCH")
_ATEXIT = [False]
_FORK_HOOK = [False]
_MP_TOKEN: Any = None  # keeps the multiprocessing after-fork registration alive


def _warn(message: str) -> None:
    try:
        print(f"copytrace: {message}", file=sys.stderr, flush=True)
    except Exception:  # pragma: no cover - stderr closed
        pass


def _host() -> str:
    import socket

    return socket.gethostname() or "host"


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
    directory and joins the same launch.

    Args:
        output: output directory; default ``$COPYTRACE_OUTPUT`` or ``./copytrace-out``.
        report: write the report at the end; default ``$COPYTRACE_REPORT`` (on).
        root: force this process to be (True) or not be (False) the launch's root; default:
            root when no launch is inherited from the environment.
        quiet: leave the closing lines to the caller (``copytrace run``).
        reconfigure: apply these arguments even when the hook already activated this
            process (as long as it has not started tracing yet).
    """
    from copytrace import _env

    if _S.active:
        if not reconfigure or _S.session is not None or _S.finished:
            return
        _remove_import_hook()
        saved = _S.saved_env
        _S.active = False
    else:
        saved = {name: os.environ.get(name) for name in _ENV_NAMES}
    out = Path(output if output is not None else _env.output_dir()).absolute()
    if report is None:
        report = bool(_env.setting(_env.COPYTRACE_REPORT))
    launch = os.environ.get(_env.COPYTRACE_LAUNCH) or None
    if root is None:
        root = launch is None
    if root:
        launch = f"{os.getpid()}-{time.time_ns()}"
    os.environ[_env.COPYTRACE] = "1"
    os.environ[_env.COPYTRACE_OUTPUT] = str(out)
    os.environ[_env.COPYTRACE_REPORT] = "1" if report else "0"
    if launch:
        os.environ[_env.COPYTRACE_LAUNCH] = launch
    _S.active, _S.root, _S.out, _S.report, _S.launch = True, bool(root), out, report, launch
    _S.finished, _S.quiet, _S.saved_env = False, quiet, saved
    if not _ATEXIT[0]:
        _ATEXIT[0] = True
        atexit.register(_at_exit)


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


def _unwritable(out_dir: Any) -> str | None:
    """Why the trace could not be written into ``out_dir`` (created as the trace would be,
    then probed with a temporary file), or None: checked before the program starts."""
    import tempfile
    from pathlib import Path

    try:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".copytrace-probe-"):
            pass
    except OSError as err:
        return f"output directory {out_dir} is not writable ({err.strerror or type(err).__name__})"
    return None


def _hook() -> None:
    """What the ``.pth`` hook runs under ``COPYTRACE=1``.

    Every ``COPYTRACE_*`` variable is checked first: with one not accepted, one line names
    it and the accepted values, and the program runs untraced. ``COPYTRACE`` is then set to
    ``0`` for the processes it starts, so that the line is printed once per launch.
    """
    from copytrace import _env

    errors = _env.check()
    if not errors:
        problem = _unwritable(_env.output_dir())
        if problem:
            errors = [problem]
    if errors:
        _warn(f"{errors[0]}; tracing disabled")
        os.environ[_env.COPYTRACE] = "0"
        return
    activate()
    if "torch" in sys.modules:  # imported by another start-up hook before ours
        start_session()
    else:
        _install_import_hook()


class _TorchImportHook:
    """A ``sys.meta_path`` finder that starts the trace right after ``import torch``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        _remove_import_hook()
        try:
            import importlib.util

            spec = importlib.util.find_spec("torch")
        except Exception:
            return None
        loader = getattr(spec, "loader", None) if spec is not None else None
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return None

        def exec_then_trace(module: Any) -> None:
            exec_module(module)
            try:
                del loader.exec_module  # back to the class's method
            except AttributeError:
                pass
            start_session()

        try:
            loader.exec_module = exec_then_trace
        except Exception:
            return None
        return spec

    # find_module is not needed: Python >= 3.4 uses find_spec.


def _install_import_hook() -> None:
    if _S.import_hook is None:
        _S.import_hook = _TorchImportHook()
        sys.meta_path.insert(0, _S.import_hook)


def _remove_import_hook() -> None:
    hook, _S.import_hook = _S.import_hook, None
    if hook is not None:
        try:
            sys.meta_path.remove(hook)
        except ValueError:
            pass


# --- the session of this process -----------------------------------------------------------
def session() -> Any:
    """The :class:`copytrace.Trace` this launch started in this process, or None."""
    return _S.session


def start_session(*, force: bool = False) -> Any:
    """Start tracing this process (idempotent); return the trace, or None.

    Launcher processes are not traced unless ``force``. A failure prints one warning and
    returns None: the program then runs untraced.
    """
    _remove_import_hook()
    if not _S.active or _S.session is not None or _S.finished:
        return _S.session
    if not force and is_launcher():
        return None
    try:
        from copytrace import _env
        from copytrace._trace import Trace

        options = _env.trace_options()
        _S.session = Trace(_S.out, **options).start()
        _register_signal_hook()
        _register_fork_hooks()
        _defer_process_group_destruction()
        _mark("running")
    except Exception as err:
        _S.session = None
        _warn(f"tracing disabled, start-up failed: {type(err).__name__}: {err}")
    return _S.session


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
    modules imported by then (``concurrent.futures``, used by OpenTelemetry's resource
    detectors) to have been re-initialised by their own fork handlers first.
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
        _warn(f"child trace will not be written: {err}")


def _after_fork_in_child() -> None:
    """``os.fork`` child: not the root; the inherited trace is the parent's, start anew."""
    if not _S.active:
        return
    _S.root = False
    old, _S.session = _S.session, None
    if old is None or _S.finished:
        return
    try:
        old.stop()  # in a child, the Trace removes itself without touching the parent's file
    except Exception as err:
        _warn(f"tracing disabled in child {os.getpid()}: {err}")
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


# --- a fatal signal (SIGTERM) ------------------------------------------------------------------
#: The shortest common grace period between SIGTERM and SIGKILL (``docker stop``: 10 s;
#: Kubernetes: 30 s): the report is written after SIGTERM only when it fits in it.
_SIGNAL_GRACE_S = 10.0
#: Measured cost of writing a report (2 shared CPU cores): about 1.1 s to import the
#: report code, then about 0.5 ms per event (3.8 s for 7120 events); with a margin.
_REPORT_FIXED_S = 1.5
_REPORT_PER_EVENT_S = 0.0007


def _register_signal_hook() -> None:
    from copytrace.tracer import _process as _session

    if _on_signal not in _session.SIGNAL_HOOKS:
        _session.SIGNAL_HOOKS.append(_on_signal)


def _on_signal(signum: int, arrived: float) -> None:
    """After the trace was written on a fatal signal: mark this process done and, as the
    root, write the report if it fits in the grace period (else say how to build it);
    never leave the launch directory behind."""
    if not _S.active or _S.finished:
        return
    _S.finished = True
    import signal as _signal

    session, _S.session = _S.session, None
    path = getattr(session, "trace_path", None)
    _mark("done", str(path) if path is not None else "")
    directory = _launch_dir()
    if not (_S.root and _S.report) or directory is None or _S.out is None:
        return
    name = _signal.Signals(signum).name
    try:
        events = int(session.stats["events"]) if session is not None else 0
    except Exception:
        events = 0
    estimate = _REPORT_FIXED_S + events * _REPORT_PER_EVENT_S
    left = _SIGNAL_GRACE_S - (time.monotonic() - arrived)
    report = None
    if estimate <= left:
        try:
            report = _write_launch_report(0.0)
        except Exception as err:
            _warn(f"could not write the report after {name}: {type(err).__name__}: {err}")
    else:
        _warn(
            f"report not written after {name} (about {estimate:.0f} s for {events} events, "
            f"{max(left, 0):.0f} s left before a kill is likely); build it with: "
            f"copytrace report {_S.out}"
        )
    _remove_launch_dir(directory)
    if report is not None:
        _warn(f"trace {path}; report {report}" if path is not None else f"report {report}")


# --- markers ---------------------------------------------------------------------------------
def _launch_dir() -> Path | None:
    if not (_S.report and _S.launch and _S.out):
        return None
    return _S.out / f"{_LAUNCH_DIR_PREFIX}{_S.launch}"


def _mark(state: str, detail: str = "") -> None:
    """Write this process's marker (atomically): ``running`` or ``done <trace file>``."""
    directory = _launch_dir()
    if directory is None:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{_host()}-{os.getpid()}"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(f"{state} {detail}".strip() + "\n", encoding="utf-8")
        os.replace(tmp, path)
        _S.marker = path
    except OSError as err:
        if not _S.marker_warned:
            _S.marker_warned = True
            _warn(f"cannot write launch marker in {directory}: {err}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    try:  # a zombie (exited, not yet reaped) is not alive
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _read_markers(directory: Path) -> list[tuple[str, int, str, str]]:
    """``(host, pid, state, detail)`` for each marker."""
    out = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return out
    for entry in entries:
        if entry.name.endswith(".tmp"):
            continue
        host, _, pid = entry.name.rpartition("-")
        if not pid.isdigit():
            continue
        try:
            text = entry.read_text(encoding="utf-8").strip()
        except OSError:
            continue
        state, _, detail = text.partition(" ")
        out.append((host, int(pid), state, detail))
    return out


def _wait_for_launch(directory: Path, timeout_s: float) -> list[tuple[str, int, str, str]]:
    """Wait while another process of this launch, on this host, is still tracing."""
    host = _host()
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        markers = _read_markers(directory)
        pending = [
            pid
            for h, pid, state, _ in markers
            if state == "running" and h == host and pid != os.getpid() and _alive(pid)
        ]
        if not pending or time.monotonic() >= deadline:
            if pending:
                _warn(
                    f"report written without waiting longer for {len(pending)} process(es) "
                    f"still tracing (pid {', '.join(map(str, pending[:5]))})"
                )
            return markers
        time.sleep(0.05)


def launch_trace_files(out: Path, markers: list[tuple[str, int, str, str]]) -> list[Path]:
    """The trace files (and py-spy profiles) in ``out`` written by the marked processes."""
    prefixes = tuple(f"copytrace-{h}-{pid}" for h, pid, _, _ in markers)
    named = {Path(d) for _, _, state, d in markers if state == "done" and d}
    files = set()
    try:
        entries = list(out.iterdir())
    except OSError:
        entries = []
    for entry in entries:
        name = entry.name
        if not entry.is_file() or not name.startswith(prefixes):
            continue
        rest = name[len("copytrace-") :]
        # copytrace-<host>-<pid> must be followed by "-", "." (not more digits of a pid)
        if any(
            rest.startswith(f"{h}-{pid}")
            and rest[len(f"{h}-{pid}") : len(f"{h}-{pid}") + 1] in ("-", ".")
            for h, pid, _, _ in markers
        ):
            files.add(entry)
    for path in named:
        if path.is_file():
            files.add(path)
    return sorted(files)


def _is_trace_file(name: str) -> bool:
    return name.endswith((".otlp.jsonl", ".otlp.jsonl.gz"))


# --- finishing ---------------------------------------------------------------------------------
def _at_exit() -> None:
    try:
        finish()
    except BaseException as err:  # pragma: no cover - finish() never raises
        _warn(f"could not finish: {err}")
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
    if not _S.active or _S.finished:
        return result
    _S.finished = True
    _remove_import_hook()
    result.update(stop_session())
    _KEPT_GROUPS.clear()  # see _defer_process_group_destruction
    if _S.root and _S.report:
        try:
            result["report"] = _write_launch_report(wait_s)
        except Exception as err:
            _warn(f"could not write the report: {type(err).__name__}: {err}")
    if not _S.quiet:
        # One line per launch, from the root; with COPYTRACE_REPORT=0 one per traced process.
        parts = []
        if result["trace"] is not None and (not _S.report or _S.root):
            parts.append(f"trace {result['trace']}")
        if result["report"] is not None:
            parts.append(f"report {result['report']}")
        if parts:
            _warn("; ".join(parts))
    return result


def stop_session(exc: BaseException | None = None) -> dict[str, Any]:
    """Stop and write this process's trace now (idempotent; never raises); :func:`finish`
    then writes the report. ``copytrace run`` calls it while the program's globals are
    still alive, as they are at ``atexit`` under ``COPYTRACE=1``, passing the exception
    the program ended with, if any (recorded as ``copytrace.exit``).

    Returns:
        ``{"trace": Path | None, "stats": dict | None}`` (the same on later calls).
    """
    if _S.stopped is not None:
        return _S.stopped
    result: dict[str, Any] = {"trace": None, "stats": None}
    session, _S.session = _S.session, None
    if session is not None:
        try:
            if exc is not None:
                session.note_exit(type(exc), exc)
            path = session.stop()
            result["trace"] = path
            result["stats"] = session.stats
            _mark("done", str(path) if path is not None else "")
        except Exception as err:
            _warn(f"could not finish the trace: {type(err).__name__}: {err}")
            _mark("done")
    _S.stopped = result
    return result


def _write_launch_report(wait_s: float | None) -> Path | None:
    from copytrace import _env

    directory = _launch_dir()
    if directory is None or _S.out is None:
        return None
    if not directory.is_dir():
        return None  # no process of this launch traced anything
    if wait_s is None:
        try:
            wait_s = float(_env.setting(_env.COPYTRACE_REPORT_WAIT))
        except _env.SettingError as err:  # checked at start; the program may have changed it
            _warn(str(err))
            wait_s = _env.DEFAULT_REPORT_WAIT_S
    markers = _wait_for_launch(directory, wait_s)
    out = _S.out
    files = launch_trace_files(out, markers)
    traces = [f for f in files if _is_trace_file(f.name)]
    report = out / "report.html"
    if traces:
        write_report_for(out, files, report)
    _remove_launch_dir(directory)
    return report if traces else None


def reset() -> None:
    """Forget this process's launch and restore the variables :func:`activate` set (for
    ``copytrace run`` called in-process, e.g. from tests). Call after :func:`finish`."""
    _remove_import_hook()
    _undo_process_group_patch()
    for name, value in _S.saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _S.__init__()  # type: ignore[misc]


def _remove_launch_dir(directory: Path) -> None:
    try:
        for entry in directory.iterdir():
            entry.unlink()
        directory.rmdir()
    except OSError:
        pass


def write_report_for(out: Path, files: list[Path], report: Path) -> Path:
    """Write ``report`` from exactly ``files`` (traces and py-spy profiles) of ``out``.

    When ``out`` holds no other trace file the directory itself is reported; otherwise the
    files are linked into a temporary directory first, so that traces from earlier runs are
    left out, and the report names the real files.
    """
    from copytrace.dashboards import build_model, render_html, write_report
    from copytrace.tracefile import event_table

    chosen = {f.resolve() for f in files}
    others = [
        e
        for e in out.iterdir()
        if e.is_file() and _is_trace_file(e.name) and e.resolve() not in chosen
    ]
    if not others:
        return write_report(out, report)
    import shutil
    import tempfile

    _warn(
        f"{len(others)} trace file(s) in {out} are from other runs and are left out of "
        f"{report.name} (copytrace report {out} --all merges them)"
    )
    with tempfile.TemporaryDirectory(prefix=".copytrace-report-", dir=out) as tmp:
        real: dict[str, Path] = {}
        for f in files:
            link = Path(tmp) / f.name
            real[str(link)] = f
            try:
                os.symlink(f.resolve(), link)
            except OSError:
                shutil.copyfile(f, link)
        trace = event_table(tmp, cache=False)
        trace.files = [Path(real.get(str(f), f)) for f in trace.files]
        for part in trace.parts:  # the report names the real files
            part.path = Path(real.get(str(part.path), part.path))
        return render_html(build_model(trace), report)


# --- the hook entry point ------------------------------------------------------------------------
def _hook_main() -> None:
    from copytrace import _env

    try:
        on = _env.enabled()
    except _env.SettingError as err:  # COPYTRACE itself is neither on nor off
        _warn(f"{err}; tracing disabled")
        return
    if on:
        _hook()


try:
    _hook_main()
except Exception as _err:  # pragma: no cover - the hook must never break start-up
    _warn(f"tracing disabled: {type(_err).__name__}: {_err}")
