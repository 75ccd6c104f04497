"""What the framework callbacks share: one trace per training run, steps, the report."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["TrainingTrace"]


class TrainingTrace:
    """Start, step and stop a :class:`copytrace.Trace` around one training run.

    Args:
        output_dir: Where the trace files and ``report.html`` go; default
            ``$COPYTRACE_OUTPUT`` or ``./copytrace-out``.
        report: Write ``report.html`` when training ends (from the main process).
        trace_kwargs: More keyword arguments for :class:`copytrace.Trace` (``max_events``,
            ``schedule``...).
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        report: bool = True,
        **trace_kwargs: Any,
    ) -> None:
        from copytrace import _env

        self.output_dir = Path(output_dir if output_dir is not None else _env.output_dir())
        self.report = report
        self.trace_kwargs = trace_kwargs
        self.trace: Any = None
        self.owned = False  # False when another trace (COPYTRACE=1, copytrace run) records
        self.trace_path: Path | None = None
        self.report_path: Path | None = None

    @property
    def active(self) -> bool:
        return self.trace is not None

    def start(self) -> None:
        """Start tracing (idempotent); join the process's active trace if there is one."""
        if self.trace is not None:
            return
        from copytrace._trace import Trace

        trace = Trace(self.output_dir, **self.trace_kwargs)
        active = trace.start()
        self.owned = active is trace
        self.trace = trace

    def step(self) -> None:
        """Mark a training step boundary (after an optimizer step)."""
        if self.trace is not None:
            self.trace.step()

    def stop(
        self, *, main_process: bool = True, barrier: Callable[[], Any] | None = None
    ) -> Path | None:
        """Stop tracing and write the trace; the main process then writes the report.

        Args:
            main_process: Whether this process writes the report (rank 0).
            barrier: Called after this process's trace is written and before the report,
                so that every rank's trace exists (``None`` for one process).

        Returns:
            The report written, or None (not the main process, no report wanted, or the
            process's trace belongs to ``COPYTRACE=1`` / ``copytrace run``).
        """
        trace, self.trace = self.trace, None
        if trace is None:
            return None
        try:
            self.trace_path = trace.stop()
        except Exception as err:  # never break the training loop's teardown
            print(f"copytrace: could not write the trace: {err}", file=sys.stderr)
            return None
        if not self.owned or not self.report:
            return None
        if barrier is not None:
            try:
                barrier()
            except Exception as err:
                print(f"copytrace: barrier before the report failed: {err}", file=sys.stderr)
        if not main_process:
            return None
        try:
            from copytrace.dashboards import write_report

            # One process: its own trace file only; several: every trace in the directory.
            source = self.trace_path if barrier is None and self.trace_path else self.output_dir
            self.report_path = write_report(source, self.output_dir / "report.html")
            print(f"copytrace: report written to {self.report_path}", file=sys.stderr)
        except Exception as err:
            print(f"copytrace: could not write the report: {err}", file=sys.stderr)
        return self.report_path
