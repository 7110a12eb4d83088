"""Tree links whose step has run but whose copy is not confirmed yet, for lookups to wait on.

A link is reserved when its step is planned and committed when the workers' report of that
step arrives (two-phase publication, docs/architecture.md). Without a draft model the report
comes back with the step's own output, so by the next `schedule()` every link of the previous
step is committed or aborted. With a draft model (speculative decoding) vLLM's model runner
builds the step's connector output before the draft runs and calls the connector's
`wait_for_save` after it (the capture must copy the rows the draft head wrote), so a step's
copies are reported with the next step's output: for one more step the link is pending and
invisible. Under async scheduling (vLLM's `AsyncScheduler`, adapter/scheduler.py) the next step
is planned before the previous step's output arrives, so a link is pending at the next plan
even without a draft model, and two plans on with one. A request that shares the prefix and
arrives right then (sessions in lockstep, a parent and its sub-agents) would prefill from the
root what the link serves a step later.

The scheduler side records every tree capture it plans here, and a lookup whose answer is
shallower than such a link on the same prompt (same domain, same tokens up to the link's cut,
and, on the MTP route, a link that fits the prompt's draft rows) asks vLLM to try again in the
next step instead (`get_num_new_matched_tokens` returns None: vLLM skips the request this step
and keeps it waiting). Waiting is bounded twice, so no request can starve: a link planned more
than `MAX_AGE` plans ago is not waited on (its report is overdue), and a request waits at most
`MAX_WAITS` times. Waiting changes only when a request starts and from where; what is restored
is decided by the lookup after the wait, exactly as for any other request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from vllm_hybridcache.core import LinkAddr, PromptKeys

MAX_AGE = 2    # plans: a report lands before the next plan, one plan later with a draft
               # model's deferred saves or under async scheduling, two with both
MAX_WAITS = 2  # steps one request may wait for links in flight, in all


@dataclass(frozen=True)
class _Flight:
    plan: int           # the plan (step) that reserved it
    domain: bytes
    keys: PromptKeys    # the capturing prompt's keys (its tokens up to `end` name the link)
    end: int            # the link's cut
    tag: object         # its draft tag (MTP route), for the new prompt's `fits`


class InflightLinks:
    """Tree links planned and not yet reported, by address (scheduler thread only)."""

    def __init__(self) -> None:
        self._flights: dict[LinkAddr, _Flight] = {}
        self._plan = 0

    def __len__(self) -> int:
        return len(self._flights)

    def next_plan(self) -> None:
        """A new step is being planned: links recorded from now on belong to it. Links whose
        report is overdue are forgotten (the map holds the last MAX_AGE plans' links)."""
        self._plan += 1
        for addr in [a for a, f in self._flights.items() if self._plan - f.plan > MAX_AGE]:
            del self._flights[addr]

    def planned(self, addr: LinkAddr, domain: bytes, keys: PromptKeys, end: int,
                tag: object) -> None:
        self._flights[addr] = _Flight(self._plan, domain, keys, end, tag)

    def reported(self, addrs: Iterable[LinkAddr]) -> None:
        """The workers reported these links (saved or failed): nothing to wait for."""
        for addr in addrs:
            self._flights.pop(addr, None)

    def clear(self) -> None:
        self._flights.clear()

    def awaited(self, keys: PromptKeys, domain: bytes, depth: int, limit: int,
                pending: Callable[[LinkAddr], bool],
                fits: Callable[[int, object], bool] | None = None) -> bool:
        """Whether a link in flight would serve this prompt deeper than `depth` (the lookup's
        answer), up to `limit` tokens. `pending(addr)`: the link is still reserved in its tier
        (a link committed, aborted or dropped since is forgotten here, as is one planned
        more than MAX_AGE plans ago)."""
        found = False
        for addr, f in list(self._flights.items()):
            if self._plan - f.plan > MAX_AGE or not pending(addr):
                del self._flights[addr]
                continue
            if (found or f.domain != domain or not depth < f.end <= min(limit, len(keys))
                    or len(f.keys) < f.end):
                continue
            if not np.array_equal(f.keys.tokens[:f.end], keys.tokens[:f.end]):
                continue
            if fits is not None and not fits(f.end, f.tag):
                continue
            found = True
        return found
