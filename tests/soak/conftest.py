"""Make the repository's `benchmarks` package importable however pytest is started (it ships
with the repository, not the wheel)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
