"""State layout: what one resumable point is made of, as the engine describes it.

The core knows no model. The adapter maps vLLM's KV-cache groups to *sections* (fixed-size state
copied whole at every cut: GDN recurrent state, conv tails, ...) and *views* (append-only rows
with a token axis: attention K/V, index keys, ...). Everything here is plain, frozen msgspec data
so the same layout can be shipped to the worker processes and compared for equality there.
"""

from __future__ import annotations

import math

import msgspec
import torch

__all__ = ["SectionSpec", "StateLayout", "ViewSpec", "dtype_itemsize", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a bare dtype name ("float32", "bfloat16", ...)."""
    dt = getattr(torch, name, None) if name and not name.startswith("_") else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype name {name!r} (use e.g. 'float32', 'bfloat16')")
    return dt


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a dtype name."""
    return torch_dtype(name).itemsize


def _check_shape(what: str, shape: tuple[int, ...]) -> None:
    if any((not isinstance(d, int)) or d < 0 for d in shape):
        raise ValueError(f"{what}: shape must be non-negative ints, got {shape!r}")


class SectionSpec(msgspec.Struct, frozen=True):
    """A fixed-size state part, copied whole at every cut (e.g. a GDN recurrent state)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        _check_shape(f"section {self.name!r}", self.shape)
        torch_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_itemsize(self.dtype)


class ViewSpec(msgspec.Struct, frozen=True):
    """An append-only state part with a token axis; one row per token (e.g. attention K/V)."""

    name: str
    row_shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        _check_shape(f"view {self.name!r}", self.row_shape)
        torch_dtype(self.dtype)

    @property
    def bytes_per_row(self) -> int:
        return math.prod(self.row_shape) * dtype_itemsize(self.dtype)


class StateLayout(msgspec.Struct, frozen=True):
    """All parts of one resumable point. Part names are unique across sections and views."""

    sections: tuple[SectionSpec, ...] = ()
    views: tuple[ViewSpec, ...] = ()
    # Tokens per stored view row. 1: one row per token. B > 1: a view row is a whole block of
    # B tokens (paged KV caches whose in-block layout is backend-packed, e.g. vLLM's CPU AMX
    # layout, can only be copied block by block); a link then holds every block overlapping
    # its token range, and a later link's copy of a shared boundary block supersedes it.
    view_block_tokens: int = 1

    def __post_init__(self) -> None:
        names = [s.name for s in self.sections] + [v.name for v in self.views]
        if len(set(names)) != len(names):
            raise ValueError(f"state part names must be unique, got {names}")
        if self.view_block_tokens < 1:
            raise ValueError("view_block_tokens must be >= 1")

    def view_rows(self, start: int, end: int) -> int:
        """Stored view rows for the token range [start, end): tokens, or overlapping blocks."""
        if end <= start:
            return 0
        b = self.view_block_tokens
        return -(-end // b) - start // b

    @property
    def part_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sections) + tuple(v.name for v in self.views)

    @property
    def section_bytes(self) -> int:
        """Bytes of all sections together: the fixed cost of every link."""
        return sum(s.nbytes for s in self.sections)

    @property
    def view_bytes_per_row(self) -> int:
        """Bytes of one token row across all views."""
        return sum(v.bytes_per_row for v in self.views)

    def link_bytes(self, rows: int) -> int:
        """Payload bytes of a link holding every section and `rows` view rows."""
        if rows < 0:
            raise ValueError("rows must be >= 0")
        return self.section_bytes + rows * self.view_bytes_per_row
