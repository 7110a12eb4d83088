"""The CPU twin's build survives a builder killed mid-compile (a server stopped during its
first start): torch's own ``lock`` file left behind must not make the next load wait forever,
and a live builder still keeps others waiting instead of building beside it."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vllm_hybridcache.ops import csrc_build

pytestmark = pytest.mark.skipif(csrc_build.csrc_dir() is None, reason="needs csrc/ sources")

_LOAD = ("import sys; from pathlib import Path; from vllm_hybridcache.ops import csrc_build; "
         "m = csrc_build.load_cpu_twin(Path(sys.argv[1])); print(m.__file__)")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A build directory holding a finished CPU twin build."""
    out = tmp_path_factory.mktemp("twin")
    csrc_build.load_cpu_twin(out)
    return out


def test_stale_torch_lock_is_removed_and_load_finishes(built: Path) -> None:
    (built / "lock").touch()  # what a builder killed mid-compile leaves
    res = subprocess.run([sys.executable, "-c", _LOAD, str(built)], capture_output=True,
                         text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    assert str(built) in res.stdout
    assert not (built / "lock").exists()


def test_live_builder_is_waited_for(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "build.flock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process building right now
    entered = threading.Event()

    def enter() -> None:
        with csrc_build.build_lock(tmp_path, wait_s=30):
            entered.set()

    t = threading.Thread(target=enter)
    t.start()
    time.sleep(1.0)
    assert not entered.is_set()
    os.close(fd)  # the builder finishes (or dies): the kernel drops its lock
    t.join(timeout=30)
    assert entered.is_set()


def test_wait_for_a_live_builder_is_bounded(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "build.flock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(TimeoutError), csrc_build.build_lock(tmp_path, wait_s=0.5):
            pass
    finally:
        os.close(fd)


def test_checkouts_build_apart(tmp_path: Path) -> None:
    """Two source trees (two checkouts, or changed sources) never share a build directory."""
    src = csrc_build.csrc_dir()
    assert src is not None
    other = tmp_path / "csrc"
    other.mkdir()
    for p in src.iterdir():
        if p.is_file():
            (other / p.name).write_bytes(p.read_bytes())
    names = [p for p in src.iterdir() if p.suffix in (".h", ".cpp")]
    twin = [other / p.name for p in names]
    before = csrc_build._source_key(other, twin)
    assert csrc_build._source_key(src, names) != before  # same bytes, another checkout
    header = other / "snapshot_copy.h"
    header.write_bytes(b"// changed\n" + header.read_bytes())
    assert csrc_build._source_key(other, twin) != before  # same checkout, new sources
