"""Moved to :mod:`copytrace.tracer.compiled` (a package); the names read from here stay."""

from copytrace.tracer.compiled import (
    Compiled,
    CompiledCall,
    CompiledGraphSpan,
    copy_patched,
    suspended,
)

__all__ = ["Compiled", "CompiledCall", "CompiledGraphSpan", "suspended", "copy_patched"]
