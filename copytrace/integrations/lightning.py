"""PyTorch Lightning: trace a ``Trainer.fit`` with a callback.

Usage::

    from copytrace.integrations.lightning import CopytraceCallback

    trainer = Trainer(..., callbacks=[CopytraceCallback("copytrace-out")])
    trainer.fit(model, datamodule)  # -> copytrace-out/report.html

Tracing starts in ``setup`` (before Lightning moves the model to its device, so that move is
traced too), a step is marked after each training batch (each optimizer step when
``accumulate_grad_batches`` is 1), and the trace stops in ``teardown``; rank 0 writes the
report after a barrier, so that every rank's trace file is there. Works with the
``lightning`` package (``lightning.pytorch``) or ``pytorch_lightning``.

Known limitations:
    With several ranks the report covers every trace file in ``output_dir``: use a fresh
    directory per run. Only the thread that runs the training loop is traced.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

try:  # the unified package first, then the standalone one
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError as _err:
        raise ModuleNotFoundError(
            "copytrace.integrations.lightning needs PyTorch Lightning: "
            'pip install "copytrace[lightning]"'
        ) from _err

from copytrace.integrations._common import TrainingTrace

__all__ = ["CopytraceCallback"]


class CopytraceCallback(pl.Callback):
    """Trace tensor copies and aliases during ``Trainer.fit``.

    Args:
        output_dir: Trace files and ``report.html`` go here; default ``$COPYTRACE_OUTPUT``
            or ``./copytrace-out``.
        report: Write the HTML report when fitting ends (rank 0).
        stages: Lightning stages to trace (``"fit"``, ``"validate"``, ``"test"``,
            ``"predict"``).
        **trace_kwargs: More arguments for :class:`copytrace.Trace` (``max_events``,
            ``schedule``...).

    Attributes:
        report_path: The report written, once fitting has ended (rank 0), else None.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        *,
        report: bool = True,
        stages: tuple[str, ...] = ("fit",),
        **trace_kwargs: Any,
    ) -> None:
        super().__init__()
        self._tracing = TrainingTrace(output_dir, report, **trace_kwargs)
        self.stages = tuple(stages)

    @property
    def report_path(self) -> Path | None:
        return self._tracing.report_path

    @property
    def trace_path(self) -> Path | None:
        return self._tracing.trace_path

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage in self.stages:
            self._tracing.start()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._tracing.step()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._finish(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish(trainer)

    def _finish(self, trainer: Any) -> None:
        if not self._tracing.active:
            return
        world = int(getattr(trainer, "world_size", 1) or 1)
        barrier = None
        if world > 1:
            strategy = trainer.strategy

            def barrier() -> None:
                strategy.barrier("copytrace-report")

        self._tracing.stop(main_process=bool(trainer.is_global_zero), barrier=barrier)
