"""The CRC-32 of link files: ISA-L's when it is installed, else zlib's.

Both compute the same CRC-32 (zlib's polynomial and conventions), so files written with one
verify with the other. Why ISA-L: a verified read is one copy into the store buffer plus a
CRC pass over it, and on the CI VM zlib's CRC-32 (1.1-1.7 GiB/s) took about as long as the
copy; ISA-L's, with carry-less multiply instructions, ran about 4x faster there
(docs/benchmarks/disk.md). `isal` is a dependency of the package (setup.py); the fallback
keeps an install without it working, only slower.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
    BACKEND = "isal"
except ImportError:  # pragma: no cover - depends on the install
    from zlib import crc32
    BACKEND = "zlib"

__all__ = ["BACKEND", "crc32"]
