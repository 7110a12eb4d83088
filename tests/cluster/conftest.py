"""Fixtures of the cluster tests: the cache core's small layout, and a wait on Ray."""

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
