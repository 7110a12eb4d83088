"""Fixtures of the cache-core tests: a small layout, a manual clock, a controllable host."""

from __future__ import annotations

import pytest

from vllm_hybridcache.core import SectionSpec, SnapshotTree, StateLayout, TreeConfig, ViewSpec


class ManualClock:
    """A clock the test advances by hand (LRU order and ages become deterministic)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float = 1.0) -> float:
        self.t += dt
        return self.t


class Host:
    """Available host memory, settable by the test."""

    def __init__(self, available: int = 1 << 40) -> None:
        self.available = available

    def __call__(self) -> int:
        return self.available


SMALL_LAYOUT = StateLayout(
    sections=(SectionSpec("gdn", (2, 4), "float32"), SectionSpec("conv", (3,), "bfloat16")),
    views=(ViewSpec("kv", (2, 2), "bfloat16"), ViewSpec("idx", (1,), "float32")),
)
# section bytes = 2*4*4 + 3*2 = 38; bytes per row = 2*2*2 + 4 = 12


@pytest.fixture
def layout() -> StateLayout:
    return SMALL_LAYOUT


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def host() -> Host:
    return Host()


@pytest.fixture
def make_tree(layout, clock, host):
    """Factory: TreeConfig fields -> SnapshotTree on the small layout, manual clock and host."""

    def make(hasher=None, **cfg) -> SnapshotTree:
        cfg.setdefault("budget_bytes", 1 << 20)
        cfg.setdefault("memory_floor_bytes", 0)
        return SnapshotTree(
            layout, TreeConfig(**cfg), hasher=hasher, available_memory=host, clock=clock
        )

    return make
