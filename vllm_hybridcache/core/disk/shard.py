"""Which rank's shard of a link a file holds at tensor parallel size N (sharded.py explains
the layout): the rank's folder name, the fingerprint its headers carry, and how a path of one
rank's file names the same link's file of another rank. Pure; no vLLM."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

__all__ = ["SHARD_PREFIX", "Shard", "relocate"]

SHARD_PREFIX = "shard-"


class Shard(msgspec.Struct, frozen=True):
    """Rank `rank` of `world` workers that each hold a shard of every link."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not (self.world >= 1 and 0 <= self.rank < self.world):
            raise ValueError(f"no rank {self.rank} of {self.world} workers")

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def folder(self) -> str:
        """This rank's folder below the fingerprint folder ("" when there is one worker)."""
        return f"{SHARD_PREFIX}{self.rank}-of-{self.world}" if self.sharded else ""

    def fingerprint(self, engine: bytes) -> bytes:
        """What this rank's headers carry: the engine's fingerprint itself with one worker,
        else a digest binding it to (rank, world)."""
        if not self.sharded:
            return engine
        return hashlib.sha256(b"hybridcache-shard\0" + engine
                              + f"\0{self.rank}/{self.world}".encode()).digest()


def relocate(path: str | Path, rank: int, world: int) -> Path:
    """The same link's file of rank `rank`: `path` with its shard folder (any rank's of
    `world`) replaced by rank `rank`'s. With one worker, `path` itself. A path without a shard
    folder of `world` is refused (ValueError): a plan naming it is not this engine's."""
    p = Path(path)
    if world <= 1:
        return p
    parts = list(p.parts)
    for i, part in enumerate(parts):
        if part.startswith(SHARD_PREFIX) and part.endswith(f"-of-{world}"):
            parts[i] = Shard(rank, world).folder
            return Path(*parts)
    raise ValueError(f"{p} is not in a shard folder of {world} workers")
