"""Secrets for the tests: a disk key file and a cluster secret file, made once per test
process in a private folder (0700, files 0600, as production creates them), and the LinkKeys
read from them. Tests that need "another installation" make their own (`other_key`)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from vllm_hybridcache.core.auth import LinkKey, key_from_file, new_secret

_DIR = Path(tempfile.mkdtemp(prefix="hybridcache-test-keys-"))
atexit.register(shutil.rmtree, _DIR, True)


def write_key_file(path: Path, secret: bytes | None = None) -> Path:
    """A key file at `path` holding `secret` (a fresh one by default), mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write((secret or new_secret()) + b"\n")
    return path


KEY_FILE = write_key_file(_DIR / "disk.key")
TEST_KEY: LinkKey = key_from_file(KEY_FILE, "disk")
CLUSTER_SECRET_FILE = write_key_file(_DIR / "cluster.secret")
CLUSTER_KEY: LinkKey = key_from_file(CLUSTER_SECRET_FILE, "cluster")


def other_key(purpose: str = "disk") -> LinkKey:
    """A key of another installation (a fresh secret)."""
    return LinkKey(new_secret(), purpose)
