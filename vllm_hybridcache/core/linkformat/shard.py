"""Which rank's shard of a link a file holds at tensor parallel size N (sharded.py explains
the layout): the rank's folder name, the shard tag its headers carry, and how a path of one
rank's file names the same link's file of another rank. Pure; no vLLM."""

from __future__ import annotations

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

    @classmethod
    def from_folder(cls, name: str) -> Shard | None:
        """The rank whose folder `name` is (`shard-r-of-N`), or None for any other name."""
        body = name.removeprefix(SHARD_PREFIX)
        rank, sep, world = body.partition("-of-")
        if body == name or not sep or not rank.isdigit() or not world.isdigit():
            return None
        try:
            shard = cls(int(rank), int(world))
        except ValueError:
            return None
        return shard if shard.sharded and shard.folder == name else None

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def folder(self) -> str:
        """This rank's folder below the fingerprint folder ("" when there is one worker)."""
        return f"{SHARD_PREFIX}{self.rank}-of-{self.world}" if self.sharded else ""

    @property
    def tag(self) -> str:
        """What this rank's headers carry beside the engine's fingerprint (linkfile.py
        `shard`, authenticated with the header): "rank/world", "" with one worker."""
        return f"{self.rank}/{self.world}" if self.sharded else ""


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
