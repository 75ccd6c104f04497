"""Progress display on stderr while a large report is built.

On a terminal, a tqdm bar that appears only when a stage takes longer than half a second;
in a Jupyter notebook, the same bar in the notebook's own form (``tqdm.auto``: a widget).
Elsewhere (a pipe, a CI log), one plain line every ten seconds once a stage has taken more
than five, so short builds print nothing and long ones are not silent.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "in_notebook"]

_TTY_DELAY_S = 0.5
_PLAIN_DELAY_S = 5.0
_PLAIN_EVERY_S = 10.0


def in_notebook() -> bool:
    """True inside a Jupyter kernel (ipykernel), where output can be rich."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - ipykernel depends on IPython
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


class Progress:
    """One progress stage: ``update(n)`` adds ``n`` units of work done.

    Args:
        desc: What is being done, e.g. ``reading trace``.
        total: Units of work in all (bytes or events), or None if unknown.
        unit: ``B`` for bytes (shown in KiB/MiB), else a word such as ``events``.
        stream: Where to write (default ``sys.stderr``).
        enabled: Force on or off; default: on, as a bar on a TTY or in a notebook, as plain
            lines elsewhere.
    """

    def __init__(
        self,
        desc: str,
        total: float | None,
        unit: str = "B",
        stream: TextIO | None = None,
        enabled: bool = True,
    ) -> None:
        self.desc = desc
        self.total = total
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0.0
        self.start = time.monotonic()
        self._last_print = 0.0
        self._bar: Any = None
        self.enabled = enabled
        isatty = getattr(self.stream, "isatty", None)
        self.notebook = bool(enabled and stream is None and in_notebook())
        self.tty = bool(enabled and (self.notebook or (callable(isatty) and isatty())))
        if self.notebook:
            from tqdm.auto import tqdm as auto_tqdm  # the notebook widget, where it can be

            self._bar = auto_tqdm(
                total=total,
                desc=f"copytrace: {desc}",
                unit=unit,
                unit_scale=True,
                unit_divisor=1024 if unit == "B" else 1000,
                delay=_TTY_DELAY_S,
                leave=False,
            )
        elif self.tty:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is a dependency
                self.tty = False
            else:
                self._bar = tqdm(
                    total=total,
                    desc=f"copytrace: {desc}",
                    unit=unit,
                    unit_scale=True,
                    unit_divisor=1024 if unit == "B" else 1000,
                    file=self.stream,
                    delay=_TTY_DELAY_S,
                    leave=False,
                    ncols=min(100, shutil.get_terminal_size((80, 24)).columns or 80),
                )

    def update(self, n: float) -> None:
        """Record ``n`` more units of work done."""
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self.start < _PLAIN_DELAY_S or now - self._last_print < _PLAIN_EVERY_S:
            return
        self._last_print = now
        self.stream.write(f"copytrace: {self.desc}: {self._amount()}\n")
        self.stream.flush()

    def set_done(self, done: float) -> None:
        """Set the units of work done so far (for callers that count in totals)."""
        self.update(done - self.done)

    def _amount(self) -> str:
        fmt = _size if self.unit == "B" else (lambda n: f"{int(n):,} {self.unit}")
        if self.total:
            return f"{fmt(self.done)} of {fmt(self.total)} ({self.done / self.total:.0%})"
        return fmt(self.done)

    def close(self) -> None:
        """End the stage (removes the bar; prints a last line if plain lines were printed)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._last_print and self.enabled:
            took = time.monotonic() - self.start
            self.stream.write(f"copytrace: {self.desc}: done in {took:.1f} s\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
