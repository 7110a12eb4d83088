"""The box smoke test: the shell script lints clean and does every step the issue lists, and
the client's report reads what its `ttft` runs write."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.deploy.checks import DEPLOY


def test_smoke_script_shellcheck_clean() -> None:
    exe = shutil.which("shellcheck")
    if exe is None:
        if shutil.which("apt-get") is None:
            pytest.skip("shellcheck is not installed and apt-get is unavailable here")
        pytest.fail("shellcheck missing although apt-get exists: run `make toolchain`")
    res = subprocess.run([exe, str(DEPLOY / "smoke.sh")], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0, res.stdout


def test_smoke_script_steps() -> None:
    text = (DEPLOY / "smoke.sh").read_text()
    for step in ("docker build -f Dockerfile.rocm", '--build-arg GPU_TARGET="${GPU_TARGET}"',
                 "vllm_hybridcache.ops.selfcheck", "make-model", "smoke_client.py exact",
                 "--label on", "serve cache-off 0 --no-enable-prefix-caching", "--label off",
                 "smoke_client.py report", "/dev/kfd", "/dev/dri"):
        assert step in text, step


def test_report_compares_on_and_off(tmp_path) -> None:
    def write(label: str, ttfts: list[float], cached: list[int]) -> str:
        rows = [{"turn": i + 1, "prompt_tokens": 1000 * (i + 1), "cached_tokens": c,
                 "ttft_s": t} for i, (t, c) in enumerate(zip(ttfts, cached, strict=True))]
        p = tmp_path / f"{label}.json"
        p.write_text(json.dumps({"label": label, "rows": rows}))
        return str(p)

    on = write("on", [1.0, 0.1, 0.1, 0.2], [0, 900, 1900, 2900])
    off = write("off", [1.0, 2.0, 3.0, 4.0], [0, 0, 0, 0])
    res = subprocess.run([sys.executable, str(DEPLOY / "smoke_client.py"), "report", on, off],
                         capture_output=True, text=True, check=True)
    lines = res.stdout.splitlines()
    assert len(lines) == 1 + 4 + 1
    assert lines[2].split()[:4] == ["2", "2000", "900", "100"]
    assert lines[-1].endswith("(30.00x)"), lines[-1]
