"""Public alias of ``ftjax.research.traces`` (documented in README as ``ftjax.traces``)."""

from ftjax.research.traces import FORMAT, FORMAT_VERSION, Trace

__all__ = ["FORMAT", "FORMAT_VERSION", "Trace"]
