"""Moved to :mod:`copytrace.tracer.compiled.graphs`; the names read from here stay."""

from copytrace.tracer.compiled.graphs import (
    CompiledCall,
    CompiledGraphSpan,
    GraphCopy,
    GraphInfo,
    GraphLogHandler,
    parse_graph,
)

__all__ = [
    "CompiledCall", "CompiledGraphSpan", "GraphCopy", "GraphInfo", "GraphLogHandler",
    "parse_graph",
]  # fmt: skip
