"""The Triton copy kernel (the ROCm fallback) compiles ahead of time for gfx1151 and gfx1201 at
every word width, and its code objects pass the same ELF checks as csrc's (target in e_flags,
wave32, no unresolved symbols). In a subprocess: the interpreter must be off to compile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_hybridcache.ops import codeobj, triton_copy

out = Path(sys.argv[1])
sig = {"table_ptr": "*i64", "tile_row_ptr": "*i32", "tile_words": "i64", "WORD": "constexpr",
       "BLOCK": "constexpr"}
bad = 0
for target in ("gfx1151", "gfx1201"):
    for word in (16, 8, 4, 1):
        src = ASTSource(triton_copy._copy_kernel, signature=sig,
                        constexprs={"WORD": word, "BLOCK": triton_copy.BLOCK})
        c = triton.compile(src, target=GPUTarget("hip", target, 32),
                           options={"num_warps": 4, "num_stages": 1})
        path = out / f"copy-{target}-w{word}.hsaco"
        path.write_bytes(c.asm["hsaco"])
        problems = codeobj.check(path, target)
        print(target, word, "ok" if not problems else problems)
        bad += bool(problems)
sys.exit(1 if bad else 0)
"""


def test_triton_copy_compiles_for_rdna(tmp_path) -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(" ok") == 8, res.stdout
