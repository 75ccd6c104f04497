"""copytrace's version: one place, below every room (``pyproject.toml`` holds the same)."""

__version__ = "0.1.0"
