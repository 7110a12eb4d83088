"""Sizes and durations on the operator commands' command lines (cli/units.py)."""

from __future__ import annotations

import pytest

from vllm_hybridcache.cli.units import human_age, human_bytes, parse_duration, parse_size


@pytest.mark.parametrize("text,expect", [
    ("32GiB", 32 << 30), ("512MiB", 512 << 20), ("1.5TB", 1_500_000_000_000), ("4096", 4096),
    ("8 gb", 8_000_000_000), ("64KiB", 65536), ("0", 0)])
def test_sizes(text, expect):
    assert parse_size(text) == expect


@pytest.mark.parametrize("text", ["", "32GiBs", "-1GiB", "GiB", "1e9", "12XB"])
def test_sizes_that_are_refused(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


@pytest.mark.parametrize("text,expect", [
    ("7d", 7 * 86400), ("12h", 43200), ("30m", 1800), ("90s", 90), ("3600", 3600),
    ("1.5h", 5400), ("2w", 14 * 86400)])
def test_durations(text, expect):
    assert parse_duration(text) == expect


@pytest.mark.parametrize("text", ["soon", "7 days", "-1d", ""])
def test_durations_that_are_refused(text):
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)


def test_human_figures():
    assert [human_bytes(n) for n in (0, 1023, 1024, 38 << 20, 3 << 40, 5 << 50)] == [
        "0 B", "1023 B", "1.0 KiB", "38.0 MiB", "3.0 TiB", "5120.0 TiB"]
    assert [human_age(s) for s in (0, 59, 60, 7200, 3 * 86400)] == [
        "0 s", "59 s", "1 min", "2 h", "3 d"]
