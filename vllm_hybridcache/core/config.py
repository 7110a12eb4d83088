"""Tree configuration, with defaults and the reasoning behind them (see docs/cache-core.md)."""

from __future__ import annotations

import msgspec

__all__ = ["POLICIES", "GiB", "TreeConfig"]

GiB = 1 << 30
POLICIES = ("lru", "cost")


class TreeConfig(msgspec.Struct):
    """Settings of a SnapshotTree.

    budget_bytes: payload bytes the tree may hold (committed + pending). 0 turns the cache off:
        every lookup is a `disabled` miss and nothing is captured (design rule 5). Default 8 GiB:
        a few hundred links of a mid-size hybrid model, small next to a serving host's RAM; the
        memory guard below still protects smaller hosts.
    max_link_bytes: cap on one link's payload; 0 = no cap beyond the budget. Links are bounded
        by the segmentation grid already, so the default adds no cap.
    memory_floor_bytes: a capture is skipped (`memory_guard`) when the host's available memory
        minus the link's size would fall under this floor. Default 4 GiB: room for the OS, the
        page cache of the weights and the other processes of the engine.
    policy: eviction policy, "lru" or "cost" (recompute-cost per byte held, decayed with age).
        The default is the winner of benchmarks/core_bench.py (docs/benchmarks/core.md).
    cost_half_life_s: age (seconds since last use) at which the cost policy halves a link's value.
    ghost_capacity: recently evicted keys remembered to classify misses as `evicted`.
    tombstone_capacity: recently refused/aborted keys remembered so that a child of a refused
        or aborted link is refused too (`parent_refused`).
    shards: processes that each hold their own shard of every link (the engine's tensor
        parallel ranks). A link's bytes, which the budget, the cap, the memory guard and the
        stats count, are the host bytes of all its shards: this times one shard's (the
        layout's), so `budget_bytes` bounds the host memory for links whatever the TP size.
    """

    budget_bytes: int = 8 * GiB
    max_link_bytes: int = 0
    memory_floor_bytes: int = 4 * GiB
    policy: str = "lru"
    cost_half_life_s: float = 600.0
    ghost_capacity: int = 4096
    tombstone_capacity: int = 4096
    shards: int = 1

    def __post_init__(self) -> None:
        if self.budget_bytes < 0 or self.max_link_bytes < 0 or self.memory_floor_bytes < 0:
            raise ValueError("byte settings must be >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.cost_half_life_s <= 0:
            raise ValueError("cost_half_life_s must be > 0")
        if self.ghost_capacity < 0 or self.tombstone_capacity < 0:
            raise ValueError("capacities must be >= 0")
        if self.shards < 1:
            raise ValueError("shards must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0
