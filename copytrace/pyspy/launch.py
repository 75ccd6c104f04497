"""Recording py-spy's independent view of a traced run: the ``py-spy record`` process.

``copytrace run --py-spy`` starts ``py-spy record --pid <its own pid> --native --idle
--subprocesses`` before the program runs and stops it right after, so py-spy samples the
program while copytrace traces it; the profile lands beside the trace files as
``copytrace-<host>-<pid>.speedscope.json`` (or ``.pyspy.txt`` for raw). Reading and
classifying it is :mod:`copytrace.pyspy.profile`; the report's section is
:mod:`copytrace.dashboards.sections.pyspy`.

Known limitations:
    py-spy needs ptrace permission on the process (root, ``CAP_SYS_PTRACE``, or a Yama
    ``ptrace_scope`` of 0/1); without it, copytrace says so in one line and runs without it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from copytrace import _env
from copytrace.pyspy.profile import FORMATS

__all__ = ["FORMATS", "PYSPY_ENV", "PySpy", "find_py_spy", "profile_path", "start"]

#: The variable naming the py-spy executable (see :mod:`copytrace._env`).
PYSPY_ENV = _env.COPYTRACE_PY_SPY

def find_py_spy() -> str | None:
    """The py-spy executable: ``$COPYTRACE_PY_SPY``, next to ``sys.executable``, or on PATH."""
    env = _env.setting(PYSPY_ENV)
    if env:
        return str(env)
    here = Path(sys.executable).with_name("py-spy")
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("py-spy")


def profile_path(out_dir: str | os.PathLike[str], fmt: str, pid: int | None = None) -> Path:
    """``<out>/copytrace-<host>-<pid>.speedscope.json`` (or ``.pyspy.txt`` for raw)."""
    import socket

    pid = os.getpid() if pid is None else pid
    host = socket.gethostname() or "host"
    return Path(out_dir) / f"copytrace-{host}-{pid}{FORMATS[fmt]}"


class PySpy:
    """A running ``py-spy record`` attached to a process; see :func:`start`.

    py-spy's stdout and stderr go to ``log``, an unnamed file (no thread drains a pipe:
    the traced program runs in this process, and a ``threading.Thread`` here would be listed
    by its ``threading.enumerate()``, traced by its ``threading.settrace`` hooks and report
    to its ``threading.excepthook``); the file is read with ``os.pread`` (py-spy writes at
    the offset it shares with this process, which a read must not move) and closed by
    :meth:`stop`.
    """

    def __init__(self, proc: subprocess.Popen[bytes], path: Path, pid: int, log: int) -> None:
        self.proc = proc
        self.path = path
        self.pid = pid
        self._log: int | None = log

    @property
    def output(self) -> list[str]:
        """py-spy's lines so far (stdout and stderr, as written); [] once :meth:`stop` ran."""
        log = self._log
        if log is None:
            return []
        try:
            data = os.pread(log, os.fstat(log).st_size, 0)
        except OSError:
            return []
        return data.decode("utf-8", "replace").splitlines()

    def _sampling(self) -> bool:
        return any("Sampling process" in ln for ln in self.output)

    def wait_sampling(self, timeout_s: float) -> bool:
        """Wait until py-spy samples (True), or exits or times out (False)."""
        step = 0.02
        waited = 0.0
        while waited < timeout_s:
            if self._sampling():
                return True
            if self.proc.poll() is not None:
                return self._sampling()
            time.sleep(step)
            waited += step
        return self._sampling()

    def error_line(self) -> str:
        """py-spy's own explanation of a failure, in one line."""
        lines = [ln.strip() for ln in self.output if ln.strip()]
        for ln in lines:
            low = ln.lower()
            if "error" in low or "permission" in low or "denied" in low or "failed" in low:
                return ln.removeprefix("py-spy> ")
        return lines[-1].removeprefix("py-spy> ") if lines else f"exit status {self.proc.poll()}"

    def stop(self, timeout_s: float = 60.0) -> Path | None:
        """Stop sampling, let py-spy write its file, and return it (None if none written)."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGINT)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            except OSError:
                pass
        log, self._log = self._log, None
        if log is not None:
            os.close(log)
        return self.path if self.path.is_file() and self.path.stat().st_size > 0 else None


def _unnamed_file(directory: Path) -> int:
    """A file descriptor open for reading and writing on a file with no name in ``directory``
    (Linux ``O_TMPFILE``; elsewhere a file made there and unlinked at once), so that nothing
    is left on disk. Raises ``OSError`` where neither can be made."""
    flag = getattr(os, "O_TMPFILE", 0)
    if flag:
        try:
            return os.open(directory, flag | os.O_RDWR, 0o600)
        except OSError:  # a file system without O_TMPFILE support
            pass
    name = directory / f".copytrace-py-spy-{os.getpid()}.log"
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(name)
    return fd


def _allow_ptrace_by(pid: int) -> None:
    """Under Yama ``ptrace_scope=1`` only ancestors may ptrace a process: let ``pid`` in."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", encoding="ascii") as fh:
            if fh.read().strip() != "1":
                return
        import ctypes

        pr_set_ptracer = 0x59616D61
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_ptracer, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError, ValueError):
        pass


def start(
    out_dir: str | os.PathLike[str],
    *,
    pid: int | None = None,
    fmt: str = "speedscope",
    rate: int = 100,
    native: bool = True,
    subprocesses: bool = True,
    idle: bool = True,
    timeout_s: float = 20.0,
) -> PySpy | None:
    """Attach ``py-spy record`` to ``pid`` (default: this process) and wait until it samples.

    Args:
        out_dir: where the profile goes (:func:`profile_path`).
        pid: the process to sample; default this one.
        fmt: ``speedscope`` (JSON) or ``raw`` (collapsed stacks, flamegraph.pl input).
        rate: samples per second.
        native: sample native (C/C++) frames too, which name the copy kernels.
        subprocesses: also sample the process's children (DataLoader workers, ranks).
        idle: keep samples of idle threads, so that shares are of wall time.
        timeout_s: how long to wait for py-spy to start sampling.

    Returns:
        The running recorder, or None when py-spy is missing or cannot attach (no ptrace
        permission...): one ``copytrace:`` line on stderr says why, and the caller carries
        on without it.
    """
    if fmt not in FORMATS:
        raise ValueError(f"py-spy format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    pid = os.getpid() if pid is None else pid
    exe = find_py_spy()
    if exe is None:
        print("copytrace: py-spy not found; running without it", file=sys.stderr)
        return None
    path = profile_path(out_dir, fmt, pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "record", "--pid", str(pid), "--rate", str(int(rate)), "--format", fmt,
           "-o", str(path)]  # fmt: skip
    if native:
        cmd.append("--native")
    if subprocesses:
        cmd.append("--subprocesses")
    if idle:
        cmd.append("--idle")
    try:
        log = _unnamed_file(path.parent)
    except OSError as err:
        print(f"copytrace: cannot start py-spy ({err}); running without it", file=sys.stderr)
        return None
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # a Ctrl-C in the terminal stops the program, not py-spy
        )
    except OSError as err:
        os.close(log)
        print(f"copytrace: cannot start py-spy ({err}); running without it", file=sys.stderr)
        return None
    _allow_ptrace_by(proc.pid)
    spy = PySpy(proc, path, pid, log)
    if spy.wait_sampling(timeout_s):
        return spy
    reason = spy.error_line() if proc.poll() is not None else f"no sample after {timeout_s:g} s"
    if "no python processes found" in reason.lower():
        reason += " - no ptrace permission?"  # how py-spy --subprocesses words a refusal
    spy.stop(5.0)
    print(f"copytrace: py-spy cannot attach ({reason}); running without it", file=sys.stderr)
    return None


