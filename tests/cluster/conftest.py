"""Fixtures of the cluster tests: the cache core's small layout."""

from __future__ import annotations

import pytest

from tests.core.conftest import SMALL_LAYOUT


@pytest.fixture
def layout():
    return SMALL_LAYOUT
