"""Unknown ``COPYTRACE_*`` variables: a misspelt setting (``COPYTRACE_LEVLE=full``) would
otherwise be ignored without a word.

:func:`warn_unknown` says once per process, in one line on stderr, which variables of the
environment look like copytrace's but are none it reads, each with the closest known name
(:func:`difflib.get_close_matches`). The known names are :data:`copytrace._env.SETTINGS`
and :data:`OTHER_NAMES` (docs/configuration.md lists them all).
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Mapping

from copytrace import _env

__all__ = ["OTHER_NAMES", "known_names", "unknown", "warn_unknown"]

#: Variables that are not settings of :data:`copytrace._env.SETTINGS` but are not unknown:
#: read by the file sink directly, or by the test suite and CI (``tests/``, ``.ci/run``).
OTHER_NAMES: dict[str, str] = {
    "COPYTRACE_SIDECAR": "0: no columnar sidecar beside the trace file (export/file_sink.py)",
    "COPYTRACE_REQUIRE_INTEGRATION": "tests: a missing integration service fails, not skips",
    "COPYTRACE_PHOENIX": "tests: the Phoenix executable (tests/test_otel_otlp.py)",
    "COPYTRACE_CHROMIUM": "tests: the Chromium executable of the browser tests",
    "COPYTRACE_SCREENSHOT": "tests: where the diff page's browser test saves a screenshot",
    "COPYTRACE_FUZZ_EXAMPLES": "tests: examples per run of tests/test_fuzz.py",
    "COPYTRACE_CI_CACHE": "CI: the cache directory of .ci/run",
}

_PREFIX = "COPYTRACE_"
_SAID = [False]


def known_names() -> frozenset[str]:
    """Every ``COPYTRACE*`` name copytrace, its tests or its CI read."""
    return frozenset(_env.SETTINGS) | frozenset(OTHER_NAMES)


def unknown(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """``[(name, closest known name or None)]`` for each variable of ``environ`` (default
    ``os.environ``) named ``COPYTRACE_*`` (any case) that copytrace does not know, sorted.
    The closest name is one a user sets (a setting or ``COPYTRACE_SIDECAR``), as
    :func:`difflib.get_close_matches` picks it among the parts after ``COPYTRACE_`` (ratio
    >= 0.6: ``LEVLE`` is close to ``LEVEL``, ``ZZZ`` to none)."""
    known = known_names()
    # compared after the shared ``COPYTRACE_``, which would make every name close to any
    settable = [n[10:] for n in (*_env.SETTINGS, "COPYTRACE_SIDECAR") if n.startswith(_PREFIX)]
    settable.remove(_env.COPYTRACE_LAUNCH[10:])  # set by copytrace, never by hand
    found = []
    for name in sorted((os.environ if environ is None else environ).keys()):
        if name.upper().startswith(_PREFIX) and name not in known:
            close = difflib.get_close_matches(name[10:].upper(), settable, n=1)
            found.append((name, _PREFIX + close[0] if close else None))
    return found


def warn_unknown(environ: Mapping[str, str] | None = None) -> str | None:
    """Say the unknown variables (:func:`unknown`) once per process, as one ``copytrace:``
    line on stderr; return that line (None: nothing said). Never raises."""
    if _SAID[0]:
        return None
    try:
        found = unknown(environ)
        if not found:
            return None
        _SAID[0] = True
        names = ", ".join(n + (f" (did you mean {c}?)" if c else "") for n, c in found)
        plural = "s" if len(found) > 1 else ""
        line = f"copytrace: unknown variable{plural} ignored: {names}"
        print(line, file=sys.stderr, flush=True)
        return line
    except Exception:  # pragma: no cover - stderr closed
        return None
