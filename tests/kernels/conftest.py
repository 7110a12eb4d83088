"""Kernel tests run on the CPU through Triton's interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is decorated, so it must be set
before any kernel module is imported; this conftest is loaded before the test modules of this
folder are collected. A GPU run of the same tests (``TRITON_INTERPRET=0``) is what
``benchmarks/kernels_bench.py --check`` is for.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
