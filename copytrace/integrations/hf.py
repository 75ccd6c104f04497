"""Hugging Face ``transformers``: trace ``Trainer.train`` with a ``TrainerCallback``.

Usage::

    from copytrace.integrations.hf import CopytraceTrainerCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[CopytraceTrainerCallback("copytrace-out")])
    trainer.train()  # -> copytrace-out/report.html

Tracing starts at ``on_train_begin``, a step is marked at each ``on_step_end`` (one
optimizer step, after gradient accumulation), and the trace stops at ``on_train_end``; the
main process writes the report, after a barrier when ``torch.distributed`` is initialised.

Known limitations:
    With several processes the report covers every trace file in ``output_dir``: use a
    fresh directory per run. Only the thread that runs the training loop is traced.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as _err:
    raise ModuleNotFoundError(
        'copytrace.integrations.hf needs transformers: pip install "copytrace[hf]"'
    ) from _err

from copytrace.integrations._common import TrainingTrace

__all__ = ["CopytraceTrainerCallback"]


class CopytraceTrainerCallback(TrainerCallback):
    """Trace tensor copies and aliases during ``Trainer.train``.

    Args:
        output_dir: Trace files and ``report.html`` go here; default ``$COPYTRACE_OUTPUT``
            or ``./copytrace-out`` (not the Trainer's own ``output_dir``).
        report: Write the HTML report when training ends (main process).
        **trace_kwargs: More arguments for :class:`copytrace.Trace` (``max_events``,
            ``schedule``...).

    Attributes:
        report_path: The report written, once training has ended (main process), else None.
    """

    def __init__(
        self, output_dir: str | os.PathLike[str] | None = None, *, report: bool = True,
        **trace_kwargs: Any,
    ) -> None:  # fmt: skip
        self._tracing = TrainingTrace(output_dir, report, **trace_kwargs)

    @property
    def report_path(self) -> Path | None:
        return self._tracing.report_path

    @property
    def trace_path(self) -> Path | None:
        return self._tracing.trace_path

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._tracing.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._tracing.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        barrier = None
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                barrier = dist.barrier
        except Exception:
            barrier = None
        self._tracing.stop(main_process=bool(state.is_world_process_zero), barrier=barrier)
