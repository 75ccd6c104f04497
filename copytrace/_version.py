"""The package version, a leaf module (pyproject.toml reads it from here)."""

__version__ = "0.1.0"
