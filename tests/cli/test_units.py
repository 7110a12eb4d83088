"""Sizes and ages in the operator commands' output (units.py), and the sizes and durations
their flags take: the settings' own parsers (config.parse_size, config.parse_duration)."""

from __future__ import annotations

import pytest

from vllm_hybridcache.cli.disk import _duration, _size
from vllm_hybridcache.units import human_age, human_bytes


def test_human_figures():
    assert [human_bytes(n) for n in (0, 1023, 1024, 38 << 20, 3 << 40, 5 << 50)] == [
        "0 B", "1023 B", "1.0 KiB", "38.0 MiB", "3.0 TiB", "5120.0 TiB"]
    assert [human_age(s) for s in (0, 59, 60, 7200, 3 * 86400)] == [
        "0 s", "59 s", "1 min", "2 h", "3 d"]


@pytest.mark.parametrize("text,expect", [
    ("32GiB", 32 << 30), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29), ("8GB", 8 * 10**9),
    ("4096", 4096)])
def test_a_budget_flag_takes_what_a_size_setting_takes(text, expect):
    assert _size(text) == expect


@pytest.mark.parametrize("text,message", [
    ("12G", "ambiguous"), ("12XB", "unknown unit"), ("-1GiB", "negative"), ("lots", "size")])
def test_a_budget_flag_refuses_what_a_size_setting_refuses(text, message):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match=message):
        _size(text)


def test_a_ttl_flag_takes_what_a_duration_setting_takes():
    import argparse

    assert [_duration(t) for t in ("7d", "12h", "30m", "90s", "3600")] == [
        7 * 86400, 43200, 1800, 90, 3600]
    with pytest.raises(argparse.ArgumentTypeError, match="duration"):
        _duration("soon")
