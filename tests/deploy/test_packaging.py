"""The package's own files (issue 32, item 3), without building anything: the licence, the
version written once, the changelog of that version, and the Makefile's torch index setting
(`TORCH_INDEX`), so `make test` works on a machine without this one's local torch wheel."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.deploy.checks import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
APACHE_2_SHA256 = "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4"
"""The Apache License 2.0 text as vLLM's wheel ships it (apache.org's file without its first
blank line): any edit to the text shows here."""


def test_the_licence_is_apache_2_in_full_and_in_the_metadata() -> None:
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256
    assert b"Version 2.0, January 2004" in text and b"END OF TERMS AND CONDITIONS" in text
    project = PROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    # PEP 639: a licence expression excludes licence classifiers
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


def test_the_version_is_written_once() -> None:
    """vllm_hybridcache.__version__ is the only place; pyproject.toml reads it (setuptools'
    static attr: no import at build time), and no setup.py or setup.cfg can disagree."""
    import vllm_hybridcache

    assert re.fullmatch(r"\d+\.\d+\.\d+", vllm_hybridcache.__version__)
    project = PROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "vllm_hybridcache.__version__"}
    assert not (ROOT / "setup.py").exists() and not (ROOT / "setup.cfg").exists()
    assert PROJECT["build-system"]["build-backend"] == "setuptools.build_meta"
    init = (ROOT / "vllm_hybridcache" / "__init__.py").read_text(encoding="utf-8")
    assert init.count(vllm_hybridcache.__version__) == 1


def test_the_changelog_has_this_version() -> None:
    """Keep a Changelog: a section per version, its changes under the standard headings."""
    import vllm_hybridcache

    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert text.startswith("# Changelog\n") and "keepachangelog.com" in text
    sections = re.findall(r"^## \[([^\]]+)\]", text, flags=re.MULTILINE)
    assert sections and sections[0] == vllm_hybridcache.__version__, sections
    headings = set(re.findall(r"^### (.+)$", text, flags=re.MULTILINE))
    assert "Added" in headings
    assert headings <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security",
                        "Known limitations"}, headings


def _make(*args: str) -> str:
    make = shutil.which("make")
    if make is None:
        pytest.fail("make is missing: the project's set-up runs through it")
    res = subprocess.run([make, "-s", "--no-print-directory", "-C", str(ROOT),
                          f"PY={sys.executable}", *args], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_the_makefile_takes_the_torch_index_as_a_setting() -> None:
    """auto (the default) adds PyTorch's CPU index only when pip cannot install the torch pin
    from what it already has; a URL is always used; empty never adds one."""
    cpu_index = "https://download.pytorch.org/whl/cpu"
    assert _make("torch-index", "TORCH_INDEX=https://mirror.example/whl/cpu").strip() == (
        "https://mirror.example/whl/cpu")
    assert _make("torch-index", "TORCH_INDEX=").strip() == ""
    # a pin nothing local holds: auto falls back to PyTorch's index
    assert _make("torch-index", "TORCH_PIN=torch==0.0.1+nonexistent").strip() == cpu_index
    # this environment holds the pin (the tests import torch): auto adds nothing, so machines
    # with a local wheel folder keep resolving offline
    assert _make("torch-index").strip() == ""
    assert "torch==" in (ROOT / "requirements-cpu.txt").read_text()
    # the set-up passes what it resolved to the install of requirements-cpu.txt
    recipe = _make("-n", "-B", ".stamps/env")
    assert re.search(r"install -q -r requirements-cpu\.txt \$\{idx:\+--extra-index-url "
                     r"\"\$idx\"\}", recipe), recipe
    assert "--dry-run --no-deps --no-index 'torch==" in recipe
