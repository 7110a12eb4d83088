"""WriteAdmission: which tree links are worth a disk write, decided before the prefill.

A link file costs a write (tens of MiB and an fsync on a large model) and disk budget; it pays
only when some later prompt, after a restart, needs that prefix again. The disk tier therefore
writes a tree link only when its prefix is likely to come back:

- **seen twice**: the link's prefix (domain, end, key digest) was part of at least two
  prompts. That covers a prefix prefilled more than once and every branch point (two prompts
  that share a prefix and then diverge both count its cuts). When the second prompt finds the
  link in RAM (no prefill, no commit), the adapter writes the RAM link then.
- **a session's first long prompt**: a prompt that does not continue a session (no end anchor
  served it) and is at least `first_prompt_tokens` long is written whole on first sight: an
  agent's 20-30K-token system prompt and tools are exactly what a restart must not lose, and
  its second sighting may come only after the restart.
- end anchors at spill (core/disk/spill.py) are admitted by construction.

Everything else (one-off prompts, the tails of continuing sessions) is not written. The counts
are kept per prefix key in a bounded LRU (`max_keys`): a prefix forgotten in between only
delays its write to the next sighting.

Pure and single-threaded (the scheduler thread); the decision for a prompt is made by
`observe` at its lookup, before vLLM schedules its prefill, and read at commit by `admitted`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from ..keys import PromptKeys

__all__ = ["WriteAdmission"]

Key = tuple[bytes, int, bytes]  # (domain, end, digest of the prefix [0, end))


class WriteAdmission:
    """Counts of prefix sightings and the admitted link keys (see the module docstring).

    first_prompt_tokens: a session's first prompt at least this long is written on first
    sight; 0 admits every prompt on first sight (every committed link is written).
    """

    def __init__(self, first_prompt_tokens: int = 4096, max_keys: int = 1 << 16) -> None:
        if first_prompt_tokens < 0 or max_keys <= 0:
            raise ValueError("first_prompt_tokens must be >= 0 and max_keys > 0")
        self.first_prompt_tokens = first_prompt_tokens
        self.max_keys = max_keys
        self._seen: OrderedDict[Key, int] = OrderedDict()  # key -> prompts that contained it
        self._admitted: OrderedDict[Key, None] = OrderedDict()
        self.reasons: dict[str, int] = {"seen_twice": 0, "first_long_prompt": 0}

    def observe(self, keys: PromptKeys, domain: bytes, cuts: Iterable[int],
                continues_session: bool) -> list[int]:
        """Count one prompt's cuts (`keys` is the prompt; cuts <= its length); returns the cuts
        admitted for writing from now on, shallowest first."""
        first_long = (not continues_session and len(keys) >= self.first_prompt_tokens)
        out = []
        for c in sorted(set(cuts)):
            if not 0 < c <= len(keys):
                continue
            key = (domain, c, keys.digest(c))
            n = self._seen.pop(key, 0) + 1
            self._seen[key] = n
            if key in self._admitted:
                self._admitted.move_to_end(key)
                out.append(c)
            elif n >= 2 or first_long:
                self.reasons["seen_twice" if n >= 2 else "first_long_prompt"] += 1
                self._admitted[key] = None
                out.append(c)
        self._trim()
        return out

    def admitted(self, domain: bytes, end: int, digest: bytes) -> bool:
        return (domain, end, digest) in self._admitted

    def sightings(self, domain: bytes, end: int, digest: bytes) -> int:
        return self._seen.get((domain, end, digest), 0)

    def _trim(self) -> None:
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        while len(self._admitted) > self.max_keys:
            self._admitted.popitem(last=False)

    def __len__(self) -> int:
        return len(self._admitted)
