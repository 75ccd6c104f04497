"""Moved to :mod:`copytrace.tracer.compiled.stepaside`; the names read from here stay."""

from copytrace.tracer.compiled.stepaside import (
    DISPATCH_STACK,
    FUNCTION_STACK,
    hide_hooks,
    hook_dicts,
    lift,
    lower,
    show_hooks,
)

__all__ = [
    "DISPATCH_STACK", "FUNCTION_STACK", "hide_hooks", "hook_dicts", "lift", "lower", "show_hooks",
]  # fmt: skip
