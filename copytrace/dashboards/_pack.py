"""What the page's payload encoders share: the string table and number rounding."""

from __future__ import annotations

from typing import Any

__all__ = ["Strings", "rounded"]


class Strings:
    """A string table: each distinct string stored once, referred to by index (``S(s)``)."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.index: dict[str, int] = {}

    def __call__(self, s: Any) -> int:
        s = "" if s is None else str(s)
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.items)
            self.items.append(s)
        return i


def rounded(x: float, nd: int = 3) -> float:
    """Round for JSON size; keeps ints short (``1.0`` -> ``1``)."""
    v = round(float(x), nd)
    return int(v) if v.is_integer() else v
