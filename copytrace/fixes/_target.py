"""What a fix rule is given (:class:`Target`) and what it gives back (:class:`Edit`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libcst as cst

__all__ = ["Edit", "Target"]


@dataclass
class Target:
    """One finding pinned to one line of one file.

    Attributes:
        finding: the :class:`copytrace.analysis.Finding`.
        path: the file, absolute.
        rel: the file relative to the project root (the diff's path).
        line: the line the finding pins (1-based): the call site, or for ``data-inplace`` the
            in-place write.
        events: the finding's events (:class:`copytrace.analysis._view.Ev`), in event order.
        site_events: every event of the run recorded at the same call site (``file:line
            function``), whatever its op: a rule that drops a call checks them all.
    """

    finding: Any
    path: Path
    rel: str
    line: int
    events: list[Any] = field(default_factory=list)
    site_events: list[Any] = field(default_factory=list)

    @property
    def code(self) -> str:
        return str(self.finding.code)

    @property
    def ops(self) -> list[str]:
        """The ops of the finding's events, first seen first."""
        return list(dict.fromkeys(e.op for e in self.events))


@dataclass
class Edit:
    """A rule's rewrite of one file.

    Attributes:
        module: the rewritten module (LibCST); ``module.code`` is the new text.
        change: what changed, in a few words (``torch.tensor(loss)`` -> ``loss.detach().clone()``).
    """

    module: cst.Module
    change: str
