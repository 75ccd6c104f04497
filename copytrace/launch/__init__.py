"""No-code-change tracing: the ``COPYTRACE=1`` start-up hook and the launch it belongs to.

``copytrace_hook.pth`` (installed into site-packages) imports :mod:`copytrace.launch.hook`
at interpreter start only when ``COPYTRACE`` is set; unset, the hook reads one environment
variable and imports nothing. Imported, the hook does not import torch either: it waits for the
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

Modules: :mod:`.hook` (what the ``.pth`` file runs), :mod:`.torch_hook` (the
``import torch`` finder), :mod:`.process` (this process in its launch: activation, its
trace, fork children, finishing at exit), :mod:`.markers` (the launch markers) and
:mod:`.report` (the root's report, also after SIGTERM).
"""

from copytrace.launch.markers import launch_trace_files
from copytrace.launch.process import (
    activate,
    finish,
    is_launcher,
    reset,
    session,
    start_session,
    stop_session,
)
from copytrace.launch.report import write_report_for

__all__ = [
    "activate",
    "start_session",
    "stop_session",
    "finish",
    "reset",
    "is_launcher",
    "session",
    "launch_trace_files",
    "write_report_for",
]
