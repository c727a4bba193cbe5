"""The tool version (the lowest layer: anything may read it)."""

__version__ = "0.1.0"
