"""Work done without touching the program's warnings state.

Python's ``warnings`` module keeps one state per process: the ``filters`` list, a filters
version, ``defaultaction``, ``onceregistry``, ``showwarning``, and a ``__warningregistry__``
in each module that warned. Every change of the filters (``filterwarnings``,
``simplefilter``, entering or leaving ``catch_warnings``) bumps the version through
``warnings._filters_mutated``, and the next warning from a module whose registry holds an
older version clears that registry: a "default" or "once" warning the program already saw
is shown again (CPython's ``Python/_warnings.c``, ``already_warned``). The version only
grows; restoring the filters afterwards does not undo a bump.

:func:`frozen_warnings` runs copytrace's own work (starting and stopping a trace: torch's
``torch.overrides`` helpers enter ``catch_warnings`` on each call, modules import sympy or
pandas, which set filters while they load) with ``warnings._filters_mutated`` replaced by a
function that does nothing, so the program's registries stay valid. ``catch_warnings``
blocks inside put their own filters back as they leave. A filter a module adds for good
while it is imported stays, as it would when the program imported that module itself
(sympy's ``once`` filter for ``SymPyDeprecationWarning``: the program reads the same
``warnings.filters`` traced and untraced). The block runs on the thread that starts or stops
a trace, while the program waits in that call; never on a background thread
(``catch_warnings`` there would swap the filters under the program).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

__all__ = ["frozen_warnings"]


def _unchanged() -> None:
    """``warnings._filters_mutated`` inside :func:`frozen_warnings`: the version stays."""


@contextlib.contextmanager
def frozen_warnings() -> Iterator[None]:
    """Run the block without a filters-version bump (``warnings._filters_mutated`` does
    nothing inside it; the original is put back on exit, also on an exception). Not for
    background threads (see the module docstring)."""
    mutated = warnings._filters_mutated  # type: ignore[attr-defined]
    warnings._filters_mutated = _unchanged  # type: ignore[attr-defined]
    try:
        yield
    finally:
        warnings._filters_mutated = mutated  # type: ignore[attr-defined]
