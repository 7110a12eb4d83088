"""Every kernel compiles for a real GPU target (RDNA4 gfx1201) at Flash-Next's dimensions.

The interpreter accepts programs the compiler rejects (it found one: a constexpr reassigned in
a ``static_range`` loop), so CI also compiles ahead of time. No GPU is needed; the compile runs
in a subprocess because this folder's conftest defines kernels for the interpreter. A private
Triton cache keeps the result honest (about 15 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_all_kernels_compile_for_rdna4(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels_compile", "--targets", "gfx1201"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("gfx1201")]
    assert len(lines) == 13 and not any("FAILED" in ln for ln in lines), res.stdout
