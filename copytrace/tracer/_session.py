"""The public facade: ``copytrace.trace()`` and the :class:`Trace` session it returns."""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.optim.optimizer as _optim
from torch.nn.modules import module as _nn_module

from copytrace._env import DEFAULT_OUTPUT_DIR
from copytrace._errors import CopytraceError
from copytrace.tracer import _recorder
from copytrace.tracer._events import CopyEvent
from copytrace.tracer._otel import (
    OtlpJsonFileExporter,
    epoch_offset,
    export_events,
    make_resource,
    trace_file_name,
)

__all__ = ["Trace", "trace"]

F = TypeVar("F", bound=Callable[..., Any])


class Trace:
    """One tracing session: records every tensor copy and alias while it is active.

    Use it as a context manager (``with copytrace.trace() as t:``) or as a decorator. Inside,
    call :meth:`step` at each training step boundary; if it is never called, each
    ``optimizer.step()`` ends a step instead. On exit the trace is written to
    ``output_dir`` as OTLP/JSON lines (``docs/trace-format.md``).

    Only one trace records at a time in a process: entering a trace while another is active
    returns the active one (so a traced script run under ``COPYTRACE=1`` or
    ``copytrace run`` keeps working), and that inner exit does nothing.

    Args:
        output_dir: directory for the trace file (and the default report); created on
            write. Default ``./copytrace-out``.
        write: write the trace file on exit.
        max_events: events kept in memory; beyond it events are counted as dropped.
        auto_step: let ``optimizer.step()`` advance the step while :meth:`step` is unused.

    Known limitations:
        torch's mode stacks are thread-local: copies made on threads other than the one that
        entered the trace (and not by autograd's engine on its behalf) are not seen.
        ``torch.compile``d regions run eagerly while a dispatch mode is active.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        *,
        write: bool = True,
        max_events: int = 1_000_000,
        auto_step: bool = True,
    ) -> None:
        self.output_dir = Path(output_dir if output_dir is not None else DEFAULT_OUTPUT_DIR)
        self.write = write
        self._rec = _recorder.Recorder(max_events=max_events, auto_step=auto_step)
        self._modes: list[Any] = []
        self._hooks: list[Any] = []
        self._start_ns = 0
        self._end_ns = 0
        self._epoch_offset = 0
        self._delegate: Trace | None = None
        self._resource: Any = None
        self.trace_path: Path | None = None
        self.running = False

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> Trace:
        """Install the modes, hooks and patches; return the trace that records.

        Returns:
            ``self``, or the already active trace when another one is recording.
        """
        active = _ACTIVE_TRACE[0]
        if active is not None:
            self._delegate = active
            return active
        if self.running:
            return self
        rec = self._rec
        _recorder.warm_up()
        self._resource = make_resource()
        self._epoch_offset = epoch_offset()
        self._start_ns = time.perf_counter_ns()
        self._hooks = [
            _nn_module.register_module_forward_pre_hook(self._on_forward_pre),
            _nn_module.register_module_forward_hook(self._on_forward_post, always_call=True),
            _optim.register_optimizer_step_pre_hook(self._on_optim_pre),
            _optim.register_optimizer_step_post_hook(self._on_optim_post),
        ]
        _recorder.set_active(rec)
        _recorder.install_patches()
        fmode = _recorder.FunctionMode(rec)
        dmode = _recorder.DispatchMode(rec)
        fmode.__enter__()
        dmode.__enter__()
        self._modes = [fmode, dmode]
        self.running = True
        _ACTIVE_TRACE[0] = self
        return self

    def stop(self) -> Path | None:
        """Remove everything :meth:`start` installed and write the trace file.

        Returns:
            The trace file written, or ``None`` (``write=False``, nothing to write, or a
            delegating inner trace). A failure to write is reported on stderr, never raised.
        """
        if self._delegate is not None:
            self._delegate = None
            return None
        if not self.running:
            return self.trace_path
        self._end_ns = time.perf_counter_ns()
        for mode in reversed(self._modes):
            try:
                mode.__exit__(None, None, None)
            except Exception as err:  # the user's code left the mode stack unbalanced
                self._rec.note_error(err)
        self._modes = []
        _recorder.remove_patches()
        _recorder.set_active(None)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.running = False
        _ACTIVE_TRACE[0] = None
        if self.write:
            try:
                self.trace_path = self.export()
            except Exception as err:
                print(f"copytrace: could not write the trace: {err}", file=sys.stderr)
        if self._rec.errors:
            warnings.warn(
                f"copytrace: {self._rec.errors} internal error(s) while tracing "
                f"(last: {self._rec.last_error}); the traced program was not affected",
                RuntimeWarning,
                stacklevel=2,
            )
        return self.trace_path

    def __enter__(self) -> Trace:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __call__(self, fn: F) -> F:
        """Use the trace as a decorator: ``fn`` runs traced; each call writes the trace."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    # -- during tracing ---------------------------------------------------------------------------
    def step(self) -> int:
        """Mark a training step boundary; return the new step number (the first step is 0).

        Calling it turns off the automatic step on ``optimizer.step()``.
        """
        if self._delegate is not None:
            return self._delegate.step()
        rec = self._rec
        if rec.auto_step:
            rec.auto_step = False
            if rec.step_starts:
                # optimizer.step() already advanced steps before this first explicit call:
                # by the user's own marks, everything so far is step 0.
                rec.step_starts.clear()
                rec.step_index = 0
                for ev in rec.events:
                    ev.step = 0
        return rec.step()

    @property
    def events(self) -> list[CopyEvent]:
        """The events recorded so far (a copy of the list), oldest first."""
        target = self._delegate or self
        return list(target._rec.events)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: ``events``, ``dropped``, ``errors``, ``internal_detaches``, ``steps``."""
        rec = (self._delegate or self)._rec
        return {
            "events": len(rec.events),
            "dropped": rec.dropped,
            "errors": rec.errors,
            "internal_detaches": rec.internal_detaches,
            "steps": rec.step_index + 1,
        }

    # -- output -----------------------------------------------------------------------------------
    def export(self, exporter: Any = None) -> Path | None:
        """Write the recorded events as spans.

        Args:
            exporter: an OpenTelemetry ``SpanExporter``; default: an OTLP/JSON-lines file
                ``<output_dir>/copytrace-<host>-<pid>.otlp.jsonl`` (replaced if present).

        Returns:
            The file written, or ``None`` for a caller-supplied exporter.
        """
        rec = self._rec
        end = self._end_ns or time.perf_counter_ns()
        path = None
        if exporter is None:
            path = self.output_dir / trace_file_name()
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                path.unlink()
            exporter = OtlpJsonFileExporter(path)
        export_events(
            rec.events,
            rec.step_starts,
            self._start_ns,
            end,
            self._run_attributes(),
            exporter,
            epoch_offset_ns=self._epoch_offset,
            resource=self._resource,
        )
        return path

    def _run_attributes(self) -> dict[str, Any]:
        from copytrace import __version__

        stats = self.stats
        return {
            "copytrace.version": __version__,
            "copytrace.torch_version": torch.__version__,
            "process.command_args": [str(a) for a in sys.argv],
            "copytrace.events": stats["events"],
            "copytrace.events_dropped": stats["dropped"],
            "copytrace.errors": stats["errors"],
            "copytrace.internal_detaches": stats["internal_detaches"],
            "copytrace.steps": stats["steps"],
        }

    def report(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the interactive HTML report of this trace.

        Args:
            path: the HTML file; default ``<output_dir>/report.html``.

        Returns:
            The report path.

        Raises:
            CopytraceError: the trace has not been written (still running, or ``write=False``).
        """
        from copytrace.dashboards import write_report

        target = self._delegate or self
        if target.trace_path is None:
            raise CopytraceError(
                "the trace has not been written yet: call report() after the with block"
            )
        out = Path(path) if path is not None else target.output_dir / "report.html"
        return write_report(target.trace_path, out)

    # -- hooks ------------------------------------------------------------------------------------
    def _on_forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        rec = self._rec
        try:
            rec.module_stack.append(rec.module_name(module))
        except Exception as err:
            rec.module_stack.append("?")
            rec.note_error(err)

    def _on_forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._rec.module_stack
        if stack:
            stack.pop()

    def _on_optim_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._rec.in_optimizer += 1

    def _on_optim_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        rec = self._rec
        rec.in_optimizer = max(0, rec.in_optimizer - 1)
        if rec.auto_step and not rec.in_optimizer:
            rec.step()


_ACTIVE_TRACE: list[Trace | None] = [None]


def trace(
    output_dir: str | os.PathLike[str] | None = None,
    *,
    write: bool = True,
    max_events: int = 1_000_000,
    auto_step: bool = True,
) -> Trace:
    """Create a :class:`Trace`; use it as ``with copytrace.trace() as t:``.

    Args:
        output_dir: where the trace file goes (default ``./copytrace-out``, or
            ``$COPYTRACE_OUTPUT``).
        write: write the OTLP/JSON-lines trace file when the block exits.
        max_events: cap on events kept in memory (beyond it they are counted as dropped).
        auto_step: advance the step on each ``optimizer.step()`` until ``t.step()`` is called.

    Returns:
        An unstarted :class:`Trace`.
    """
    return Trace(output_dir, write=write, max_events=max_events, auto_step=auto_step)
