"""The tvmfuse version (written into every library's metadata and tuning database)."""

__version__ = "0.1.0"
