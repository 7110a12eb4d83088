"""Fixtures of the cluster tests: the cache core's small layout, a wait on Ray, and the
replica tests' conversations."""

from __future__ import annotations

import time

import pytest

from tests.core.conftest import SMALL_LAYOUT


@pytest.fixture
def layout():
    return SMALL_LAYOUT


def wait_owner_dead(probe: object, what: str = "owner") -> None:
    """Wait until an object whose owner was killed reads as lost: Ray learns of an owner's
    death asynchronously, and a fetch before that would still find it."""
    import ray

    for _ in range(600):
        try:
            ray.get(probe, timeout=10)
        except ray.exceptions.OwnerDiedError:
            return
        time.sleep(0.05)
    pytest.fail(f"Ray never reported the {what} dead")


def conversation(seed: int, turns: int) -> list[list[int]]:
    """Prompts of turns 1..turns: 600 tokens, then 300 more per turn (the replica tests)."""
    out = [[(seed * 997 + 100 + i * 7) % 3000 + 10 for i in range(600)]]
    for t in range(1, turns):
        out.append(out[-1] + [(seed * 131 + t * 31 + i * 13) % 3000 + 10 for i in range(300)])
    return out


def cluster_restores(replica) -> int:
    """Restores a replica actor served from the cluster tier's tree links."""
    import ray

    return ray.get(replica.stats.remote())["cluster/tree"]["restores"]
