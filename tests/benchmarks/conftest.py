"""Make the repository's `benchmarks` package importable however pytest is started.

`python -m pytest` (what the Makefile runs) puts the repository root on sys.path; a bare
`pytest` does not, and `benchmarks` is not an installed package (it ships with the repository,
not the wheel), so the root is added here.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
