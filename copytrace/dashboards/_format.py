"""Formatting and call-site helpers shared by the report model, the page and the CLI.

``format_bytes`` and ``format_ns`` are :mod:`copytrace._units`' (re-exported here).
"""

from __future__ import annotations

import linecache
import math
import os
from collections.abc import Iterable
from typing import Any

from copytrace._units import format_bytes, format_ns
from copytrace.dashboards._rows import UNKNOWN_SITE

__all__ = [
    "as_int",
    "as_str",
    "opt_int",
    "call_site_of", "format_bytes", "format_ns", "site_labels", "source_line", "top"]


def top(rows: Iterable[Any], by: str, n: int) -> list[Any]:
    """Return the ``n`` rows with the largest attribute ``by``; ties keep key order.

    Args:
        rows: Rows with the attribute ``by`` and a ``key`` or ``op`` attribute.
        by: Attribute name to sort on, e.g. ``bytes_copied`` (bytes) or ``time_ns`` (ns).
        n: Maximum number of rows returned.

    Returns:
        The rows, largest first.
    """

    def order(row: Any) -> tuple[Any, str]:
        return (-getattr(row, by), str(getattr(row, "key", getattr(row, "op", ""))))

    return sorted(rows, key=order)[: max(0, n)]


def as_int(value: Any, default: int = 0) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) else default
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return default
    return default


def opt_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def as_str(value: Any) -> str:
    return "" if value is None else str(value)


def call_site_of(attrs: dict[str, Any]) -> str:
    """Return the ``file:line function`` call-site key of an event's attributes.

    Args:
        attrs: Event span attributes (``code.file.path``, ``code.line.number``,
            ``code.function.name``).

    Returns:
        e.g. ``train.py:42 main``, or ``(unknown call site)`` without a file path.
    """
    path = attrs.get("code.file.path")
    if not path:
        return UNKNOWN_SITE
    line = attrs.get("code.line.number")
    func = attrs.get("code.function.name")
    site = f"{path}:{line}" if line is not None else str(path)
    return f"{site} {func}" if func else site


def _split_site(site: str) -> tuple[str, int | None, str]:
    """``/a/train.py:42 main`` -> (``/a/train.py``, 42, ``main``)."""
    head, _, func = site.partition(" ")
    path, sep, line = head.rpartition(":")
    if not sep or not line.isdigit():
        return head, None, func
    return path, int(line), func


def _package_depth(path: str) -> int:
    """Folders of ``path`` below ``site-packages`` / ``dist-packages`` (1 outside them): an
    installed library's file is labelled from its package (``transformers/trainer.py``)."""
    segs = path.replace("\\", "/").split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in segs:
            return max(1, len(segs) - 1 - segs.index(marker))
    return 1


def site_labels(keys: Iterable[str]) -> dict[str, str]:
    """Shortest unique labels: the file's base name (an installed library's file from its
    package folder on), more parent folders where names clash."""
    keys = list(keys)
    parts = {k: _split_site(k) for k in keys}
    labels: dict[str, str] = {}
    depth = {k: _package_depth(parts[k][0]) for k in keys}
    for _ in range(8):
        for k in keys:
            path, line, func = parts[k]
            if k == UNKNOWN_SITE or line is None:
                labels[k] = k
                continue
            segs = path.replace("\\", "/").split("/")
            short = "/".join(segs[-depth[k] :])
            labels[k] = f"{short}:{line}" + (f" {func}" if func else "")
        clashes: dict[str, list[str]] = {}
        for k, lab in labels.items():
            clashes.setdefault(lab, []).append(k)
        again = False
        for same in clashes.values():
            if len(same) > 1:
                for k in same:
                    depth[k] += 1
                again = True
        if not again:
            break
    return labels


def source_line(site: str, not_after_ns: int | None = None) -> str:
    """The stripped source line of a call site, if the file is readable here ('' if not).

    A file modified after ``not_after_ns`` (ns since the epoch: the start of the traced run)
    may no longer hold the traced line, so it is not read.
    """
    path, line, _ = _split_site(site)
    if line is None or not path or not os.path.isfile(path):
        return ""
    try:
        if not_after_ns and os.stat(path).st_mtime_ns > not_after_ns:
            return ""
    except OSError:
        return ""
    try:
        text = linecache.getline(path, line).strip()
    except (OSError, UnicodeDecodeError, MemoryError):  # pragma: no cover - odd files
        return ""
    return text if len(text) <= 200 else text[:197] + "..."
