"""Bytes and durations for people: the one ``format_bytes`` and ``format_ns``.

A ground module (it imports nothing of copytrace), so that the analysis (hazard messages) and
the dashboards (report, summary, notebook) format with the same code.
"""

from __future__ import annotations

__all__ = ["format_bytes", "format_bytes_exact", "format_ns"]


def format_bytes(n: int | float) -> str:
    """Format a byte count for people, e.g. ``31000`` -> ``30.3 KiB``.

    Args:
        n: Bytes.

    Returns:
        The value in B, KiB, MiB, GiB or TiB (powers of 1024; no unit beyond TiB).
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_bytes_exact(n: int) -> str:
    """A byte count with its exact value first, as hazard messages give it: ``4000`` ->
    ``4000 B``; ``123456`` -> ``123456 B (120.6 KiB)`` (:func:`format_bytes` in brackets)."""
    if n < 1024:
        return f"{n} B"
    return f"{n} B ({format_bytes(n)})"


def format_ns(ns: int | float | None) -> str:
    """Format a duration for people, e.g. ``11600000`` -> ``11.60 ms``.

    Args:
        ns: Duration in ns, or None.

    Returns:
        The value in ns, us, ms or s; ``-`` for None.
    """
    if ns is None:
        return "-"
    value = float(ns)
    if abs(value) < 1e3:
        return f"{int(value)} ns"
    if abs(value) < 1e6:
        return f"{value / 1e3:.1f} us"
    if abs(value) < 1e9:
        return f"{value / 1e6:.2f} ms"
    return f"{value / 1e9:.3f} s"
