"""Sizes and ages as an operator reads them (`38.0 MiB`, `3 d`), for the CLIs' output and the
progress lines of long start-up work (progress.py), which sits below the CLIs.

Why: raw byte counts (`34359738368`) are what issue 32 calls out as unreadable. Sizes and
durations an operator *writes* (`--budget 32GiB`, `--ttl 7d`) are parsed by the settings' own
parsers (config.parse_size, config.parse_duration), so a flag takes what a setting takes.
"""

from __future__ import annotations

__all__ = ["human_age", "human_bytes"]

def human_bytes(n: int | float) -> str:
    """`1.5 GiB`: the largest binary unit that keeps the number at or above 1."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def human_age(seconds: float) -> str:
    """`3 d`, `5 h`, `12 min`, `40 s`: how long ago, in the largest whole unit."""
    s = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit}"
    return f"{s:.0f} s"
