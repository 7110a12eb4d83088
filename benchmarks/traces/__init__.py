"""Seeded, reproducible chat traces for the cache benchmarks (see docs/benchmarks.md)."""

from benchmarks.traces.families import FAMILIES, IMAGE_FAMILIES, TEXT_FAMILIES, generate
from benchmarks.traces.model import Message, Request, Session, Trace
from benchmarks.traces.sizes import SIZES, Size

__all__ = ["FAMILIES", "IMAGE_FAMILIES", "SIZES", "TEXT_FAMILIES", "Message", "Request",
           "Session", "Size", "Trace", "generate"]
