"""Check `compat`'s bends against a vLLM release's source, without importing it.

Run: `python -m vllm_hybridcache.compat_check 0.33.0` (downloads the release's wheel, once,
with `pip download --no-deps` into the wheel cache, and reads its Python files), or
`--root DIR` for an unpacked `vllm` source tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


class WheelUnavailable(RuntimeError):
    """pip could not get the wheel (no network and not in any local index or cache)."""


def wheel_cache() -> Path:
    """Where downloaded wheels are kept: $VLLM_HYBRIDCACHE_HOME/wheels, else the XDG cache."""
    env = os.environ.get("VLLM_HYBRIDCACHE_HOME")
    if env:
        return Path(env).expanduser() / "wheels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "vllm-hybridcache" / "wheels"


def fetch_wheel(requirement: str, folder: Path | None = None) -> Path:
    """The wheel for `requirement` (`name==version`, for this platform, no dependencies).

    Found in `folder` (the wheel cache by default) from an earlier call, else fetched with
    `pip download` and pip's own configuration (its index, find-links and cache). Raises
    WheelUnavailable with pip's last lines when neither has it.
    """
    name, sep, version = requirement.partition("==")
    if not sep or not version:
        raise ValueError(f"expected name==version, got {requirement!r}")
    folder = folder or wheel_cache()
    folder.mkdir(parents=True, exist_ok=True)
    prefix = f"{name.replace('-', '_').lower()}-{version}-"

    def found() -> list[Path]:
        return sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix))

    if not found():
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                              "--only-binary=:all:", "--disable-pip-version-check", "-q",
                              "-d", str(folder), requirement],
                             capture_output=True, text=True, timeout=1800, check=False)
        if res.returncode != 0 or not found():
            tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-5:])
            raise WheelUnavailable(f"`pip download --no-deps {requirement}` found no wheel "
                                   f"(no network, and no local index or cache has it):\n{tail}")
    return found()[0]
