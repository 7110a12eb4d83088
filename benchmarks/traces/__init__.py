"""Seeded, reproducible chat traces for the cache benchmarks (see docs/benchmarks.md)."""

from benchmarks.traces.families import FAMILIES, generate
from benchmarks.traces.model import Message, Request, Session, Trace
from benchmarks.traces.sizes import SIZES, Size

__all__ = ["FAMILIES", "SIZES", "Message", "Request", "Session", "Size", "Trace", "generate"]
