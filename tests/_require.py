"""Skips that CI must not take: with ``COPYTRACE_REQUIRE_INTEGRATION=1`` (``.ci/run`` sets it)
a missing tool, package or browser fails the test instead of skipping it, so that nothing the
docs promise goes untested in CI. GPU tests are the one exception: they skip on a machine
without a GPU whatever the variable says."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

REQUIRE_ENV = "COPYTRACE_REQUIRE_INTEGRATION"


def required() -> bool:
    """Whether ``COPYTRACE_REQUIRE_INTEGRATION`` is set to anything but empty or ``0``."""
    return os.environ.get(REQUIRE_ENV, "").strip() not in ("", "0")


def require_or_skip(reason: str, *, allow_module_level: bool = False) -> None:
    """Skip with ``reason``, or fail with it where CI says the test must run.

    Raises:
        pytest.fail.Exception: under ``COPYTRACE_REQUIRE_INTEGRATION=1``.
        pytest.skip.Exception: otherwise.
    """
    if required():
        pytest.fail(f"{reason} ({REQUIRE_ENV} is set)", pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)


def require_module(name: str, *, allow_module_level: bool = False) -> ModuleType:
    """Import ``name``, or :func:`require_or_skip` when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        require_or_skip(f"{name} is not installed ({err})", allow_module_level=allow_module_level)
        raise  # unreachable: require_or_skip always raises
