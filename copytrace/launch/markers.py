"""Launch markers: how the processes of one launch tell the root they are done.

Each traced process keeps a file ``<out>/.copytrace-launch-<id>/<host>-<pid>`` saying
``running`` while it traces and ``done <trace file>`` once its trace is written (written
atomically: a temporary file, then ``os.replace``). The root waits on them before it writes
the report (:func:`wait_for_launch`), and takes exactly the files they name
(:func:`launch_trace_files`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from copytrace.launch._state import S, host, warn

__all__ = [
    "LAUNCH_DIR_PREFIX",
    "alive",
    "is_trace_file",
    "launch_dir",
    "launch_trace_files",
    "mark",
    "read_markers",
    "remove_launch_dir",
    "wait_for_launch",
]

LAUNCH_DIR_PREFIX = ".copytrace-launch-"


# --- markers ---------------------------------------------------------------------------------
def launch_dir() -> Path | None:
    if not (S.report and S.launch and S.out):
        return None
    return S.out / f"{LAUNCH_DIR_PREFIX}{S.launch}"


def mark(state: str, detail: str = "") -> None:
    """Write this process's marker (atomically): ``running`` or ``done <trace file>``."""
    directory = launch_dir()
    if directory is None:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{host()}-{os.getpid()}"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(f"{state} {detail}".strip() + "\n", encoding="utf-8")
        os.replace(tmp, path)
        S.marker = path
    except OSError as err:
        if not S.marker_warned:
            S.marker_warned = True
            warn(f"cannot write launch marker in {directory}: {err}")


def alive(pid: int) -> bool:
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


def read_markers(directory: Path) -> list[tuple[str, int, str, str]]:
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


def wait_for_launch(directory: Path, timeout_s: float) -> list[tuple[str, int, str, str]]:
    """Wait while another process of this launch, on this host, is still tracing."""
    here = host()
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        markers = read_markers(directory)
        pending = [
            pid
            for h, pid, state, _ in markers
            if state == "running" and h == here and pid != os.getpid() and alive(pid)
        ]
        if not pending or time.monotonic() >= deadline:
            if pending:
                warn(
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


def is_trace_file(name: str) -> bool:
    return name.endswith((".otlp.jsonl", ".otlp.jsonl.gz"))



def remove_launch_dir(directory: Path) -> None:
    try:
        for entry in directory.iterdir():
            entry.unlink()
        directory.rmdir()
    except OSError:
        pass


