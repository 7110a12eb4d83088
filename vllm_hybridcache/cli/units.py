"""Sizes and durations as an operator writes and reads them (`32GiB`, `7d`), for the CLIs.

Why here: the operator commands take a budget and a TTL on the command line and print sizes;
raw byte counts (`34359738368`) are what issue 32 calls out as unreadable. Binary units (KiB,
MiB, GiB, TiB: powers of 1024) and decimal ones (KB, MB, GB, TB: powers of 1000) are both
accepted, as `ls -h` and disk vendors write them; a bare number is bytes.
"""

from __future__ import annotations

import re

__all__ = ["human_age", "human_bytes", "parse_duration", "parse_size"]

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
               "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_NUMBER = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes of `32GiB`, `512MiB`, `1.5TB`, `4096`; ValueError names what is accepted."""
    m = _NUMBER.fullmatch(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size: a number with an optional unit (B, KiB, MiB, "
                         "GiB, TiB, or KB, MB, GB, TB), e.g. 32GiB")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str) -> float:
    """Seconds of `7d`, `12h`, `30m`, `90s`, `3600`; ValueError names what is accepted."""
    m = _NUMBER.fullmatch(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _DURATION_UNITS:
        raise ValueError(f"{text!r} is not a duration: a number with an optional unit (s, m, "
                         "h, d, w), e.g. 7d")
    return float(m.group(1)) * _DURATION_UNITS[unit]


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
