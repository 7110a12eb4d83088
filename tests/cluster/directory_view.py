"""What the engine-level cluster tests read from the directory. They hold the cluster secret
(tests/keys.py) and call the directory as a replica does (`ask`); the directory holds only
locators, so a prompt's entries are found by computing its locators, which takes the engine's
fingerprint and the request's domain. The tests learn those from what the engine published:
the header of one of its payloads (verified under the secret) names both, and the pair is
then known for every later lookup (`Identities`)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import ray

from tests.cluster.forgery import payload_header
from tests.keys import CLUSTER_KEY
from vllm_hybridcache.cluster import DirectoryClient
from vllm_hybridcache.core.keys import PromptKeys
from vllm_hybridcache.core.tiers.cluster import locator

DIRECTORY = DirectoryClient(CLUSTER_KEY)


def ask(op: str, *args: Any, refs: list[Any] | None = None) -> Any:
    """A directory call's answer, under the tests' secret."""
    return ray.get(DIRECTORY.call(op, *args, refs=refs), timeout=60)


def positions(prompt: list[int]) -> list[int]:
    """The 64-aligned positions of `prompt`: its grid cuts and, in fine segmentation (the CPU
    attention pin on), its links inside a step (the prompt's last 64-aligned position)."""
    return list(range(64, len(prompt) + 1, 64))


class Identities:
    """The (fingerprint, domain) pairs seen in the engines' payloads, learnt on demand."""

    def __init__(self) -> None:
        self.known: list[tuple[bytes, bytes]] = []
        self._read: set[bytes] = set()  # locators whose payload header was read
        self._folder = Path(tempfile.mkdtemp(prefix="hybridcache-test-view-"))

    def close(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)

    def locators(self, digest: bytes) -> dict[bytes, tuple[bytes, bytes]]:
        """Where `digest`'s link is listed under each known pair."""
        return {locator(CLUSTER_KEY, fp, dom, digest): (fp, dom) for fp, dom in self.known}

    def learn(self, listed: list[tuple[bytes, tuple]], digests: set[bytes]) -> None:
        """Read payload headers of `listed` (not read before) until one is a link of
        `digests` under a pair not known yet, or none is left."""
        wanted = {loc for d in digests for loc in self.locators(d)}
        if any(loc in wanted for loc, _ in listed):
            return
        for loc, fields in listed:
            if loc in self._read:
                continue
            self._read.add(loc)
            header, _ = payload_header(bytes(ray.get(fields[-1][0], timeout=60)), CLUSTER_KEY,
                                       self._folder)
            pair = (header.fingerprint, header.domain)
            if pair not in self.known:
                self.known.append(pair)
            if header.digest in digests:
                return


IDS = Identities()
atexit.register(IDS.close)


def entries_of(owner: str, prompt: list[int]) -> list[tuple[bytes, tuple]]:
    """The directory's tree entries of `owner` on the 64-aligned positions of `prompt`, in
    any domain seen so far (the request's own included), sorted by end: (locator, (parent
    locator, start, end, nbytes, [payload ref]))."""
    keys = PromptKeys(prompt)
    digests = {keys.digest(c) for c in positions(prompt)}
    listed = ask("entries_of", owner)
    IDS.learn(listed, digests)
    wanted = {loc for d in digests for loc in IDS.locators(d)}
    return sorted(((k, e) for k, e in listed if k in wanted), key=lambda ke: ke[1][2])


def anchors_of(owner: str, prompt: list[int], depth: int) -> list[tuple[bytes, tuple]]:
    """The directory's end anchors of `owner` that `prompt` extends at `depth`: (locator,
    (block locator, end, nbytes, [payload ref]))."""
    digest = PromptKeys(prompt).digest(depth)
    listed = ask("anchors_of", owner)
    IDS.learn(listed, {digest})
    wanted = IDS.locators(digest)
    return [(k, e) for k, e in listed if k in wanted and e[1] == depth]


def identity_of(loc: bytes, prompt: list[int], end: int) -> tuple[bytes, bytes]:
    """The (fingerprint, domain) under which `loc` is the locator of `prompt`'s link ending
    at `end`."""
    return IDS.locators(PromptKeys(prompt).digest(end))[loc]
