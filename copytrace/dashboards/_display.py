"""Notebook display of a loaded trace, registered on its type from the display layer.

:class:`copytrace.tracefile.TraceData` (what :func:`copytrace.load_trace` returns) is plain
data from the reader, which never imports the dashboards. :func:`register` gives the class
``_repr_html_`` and ``_repr_markdown_`` (the summary of :mod:`._notebook`), once, when
:mod:`copytrace.dashboards` is imported; the rendering modules are imported only when a
notebook asks for the display.
"""

from __future__ import annotations

from pathlib import Path

from copytrace.tracefile import TraceData

__all__ = ["register"]


def _where(files: list[Path]) -> str:
    return str(files[0]) if len(files) == 1 else f"{len(files)} trace files"


def _summary_html(data: TraceData) -> str:
    """The summary, as rich output in a notebook (HTML)."""
    from copytrace.dashboards._model import build_model
    from copytrace.dashboards._notebook import summary_html

    return summary_html(build_model(data, analyze=True, patches=False), _where(data.files))


def _summary_markdown(data: TraceData) -> str:
    """The summary, as rich output in a notebook (Markdown)."""
    from copytrace.dashboards._model import build_model
    from copytrace.dashboards._notebook import summary_markdown

    return summary_markdown(build_model(data, analyze=True, patches=False), _where(data.files))


def register() -> None:
    """Give :class:`TraceData` its notebook display (idempotent)."""
    TraceData._repr_html_ = _summary_html  # type: ignore[attr-defined]
    TraceData._repr_markdown_ = _summary_markdown  # type: ignore[attr-defined]
