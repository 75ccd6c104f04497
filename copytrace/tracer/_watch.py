"""Moved to :mod:`copytrace.tracer.watch` (a package); the names read from here stay."""

from copytrace.tracer.watch import BACKWARD_FUNCTIONS, StorageIds, Watch

__all__ = ["Watch", "BACKWARD_FUNCTIONS", "StorageIds"]
