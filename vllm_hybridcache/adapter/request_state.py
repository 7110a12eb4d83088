"""The scheduler side's state of one live request (`RequestState`), and its invariants.

One object per request holds everything the hooks of adapter/scheduler_side.py know about it;
the hooks read and change only that object and the cache facade. The MTP route's per-prompt
tag and fit live here too (which links a prompt's draft rows admit), over the route's rule
from adapter/draft_tags.py.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from vllm_hybridcache.adapter.draft_rows import DraftRebuild
from vllm_hybridcache.adapter.draft_tags import (
    DRAFT_READS_LAST,
    DRAFT_REBUILD,
    DraftStep,
    NextToken,
    RebuiltAnchor,
)
from vllm_hybridcache.adapter.mm_keys import MMItem
from vllm_hybridcache.core import LookupResult, PromptKeys

__all__ = ["RequestState"]


@dataclass
class RequestState:
    """Everything the scheduler side knows about one live request, in one place.

    Created by the first hook that sees the request; removed by request_finished, or, when a
    restore is still in flight then, by the report that ends it (its pins must be released).
    Captures are not kept here: each CaptureJob carries the address of the link it fills, and
    the workers' report commits or aborts it by that address (an end anchor's capture is
    reserved as the request finishes and settles after the entry is gone).

    Invariants (kept by the hooks of adapter/scheduler_side.py, the only writer):
    - `cut_set == frozenset(cuts)`; `keys` names the whole prompt (its content digests for
      multimodal rows, adapter/mm_keys.py).
    - `unkeyed`: never looked up, never captured. Once `canonical` is False it stays False,
      and no tree link is reserved for the request from then on (`unbound` clears it too).
    - `lookup` is set only between get_num_new_matched_tokens and the allocation that acts on
      it; `restoring` only from that allocation's begin_restore to the report that ends the
      restore, so a request's pins are released exactly once.
    - `cold_only` never goes back to False: a failed restore is recomputed, never retried.
    - `finished`: the entry outlives request_finished only while `restoring` is set.
    - `off_from` only decreases; `off_taken` is the `off_from` last handed to the scheduler
      (`take_off_segmentation`), so the two differ exactly while a mark is pending.
    """

    domain: bytes
    keys: PromptKeys
    cuts: list[int]
    cut_set: frozenset[int]
    unkeyed: bool = False       # inputs the token ids do not name: no lookup, no capture
    # multimodal items (content digests, vLLM's identifiers, positions); () for text
    items: tuple[MMItem, ...] = ()
    # the LoRA id the request runs under (None without an adapter)
    lora_id: int | None = None
    # its prefill read state its key does not name (an item's embeddings of other content, an
    # adapter reloaded in place): no capture from then on, no end anchor
    unbound: bool = False
    # fine segmentation: 64-aligned positions captured inside a step (the prompt's last one,
    # a junction where it parts from a recent prompt); () in step mode
    wanted: tuple[int, ...] = ()
    # MTP route: which prompt tokens the draft head's row at a step's last position read
    # (see draft_reads); None off the route. A link fits another prompt only if they match.
    draft_reads: str | None = None
    block_ids: list[list[int]] = field(default_factory=list)
    # the answer given to vLLM by get_num_new_matched_tokens, until allocation acts on it
    lookup: LookupResult | None = None
    # the hit being restored (its tier and kind route the end of the restore); None when idle
    restoring: LookupResult | None = None
    resume_at: int = 0          # tokens restored (0 = cold)
    canonical: bool = True      # every step so far followed the segmentation from cold state
    cold_only: bool = False     # a restore failed: vLLM recomputes it, and we never retry
    finished: bool = False      # vLLM is done with it; kept only until `restoring` ends
    observed: bool = False      # the lower tiers have seen its prompt (the disk's admission)
    # its last planned prefill step (when, tokens, where the next step starts): the time to
    # the next planned step is that step's duration (the disk tier's prefill rate)
    prefill_t: float = 0.0
    prefill_n: int = 0
    prefill_next: int = -1
    # the request's latest scheduled step (first position, tokens): with speculative decoding
    # its end anchor copies the state block of the last accepted token (see anchor_end)
    last_start: int = -1
    last_len: int = 0
    # lookups answered "ask again next step" to wait for a link in flight (adapter/inflight.py)
    lookup_waits: int = 0
    # its hit loads in the step that first runs it (a synchronous load: `_answer`); a failed
    # one is withdrawn by the segmentation scheduler before that step's output is applied
    sync_load: bool = False
    # its step was withdrawn before it produced a token: vLLM resumes it from token 0 as if
    # new (not as a preempted request that recomputes its output)
    withdrawn: bool = False
    # attention K/V in place: the answer the cap computed for the connector's question that
    # follows it in the same scheduling pass, and the tokens vLLM's block pool serves in place
    answer: tuple[int | None, bool] | None = None
    in_place: int = 0
    # first position whose rows this request writes off the segmentation (None: its prompt's
    # end, where decoded rows start); their blocks get hashes no cold prompt computes
    off_from: int | None = None
    # attention K/V in place: the `off_from` whose blocks the scheduler was last told to mark
    off_taken: int | None = None

    @property
    def draft_route(self) -> bool:
        return self.draft_reads is not None

    def prev_cut(self, p: int) -> int:
        """The first position of this prompt's prefill step that ends at cut p (the cut
        before it, or 0): steps run from cut to cut (segmentation scheduler)."""
        i = bisect.bisect_left(self.cuts, p)
        return self.cuts[i - 1] if i > 0 else 0

    def draft_tag(self, end: int) -> object:
        """What the draft head's boundary row depends on beyond the tokens before `end`, for
        a link of this prompt at `end`; None off the MTP route. `rebuild`: the row is rebuilt
        for each prompt on restore (adapter/draft_rows.py), so only the step's shape matters
        (DraftStep). Otherwise the prompt tokens the row read: -1 at the prompt's end, where
        it read the sampled token and fits no prompt; `last`: the prompt's last token (vLLM's
        padded drafter batch, its default); `both`: the token after the cut and the last
        token (any other drafter path, kept conservative)."""
        if self.draft_reads is None:
            return None
        if self.draft_reads == DRAFT_REBUILD:
            return DraftStep(self.prev_cut(end))
        toks = self.keys.tokens
        n = len(self.keys)
        if end >= n:
            return -1
        if self.draft_reads == DRAFT_READS_LAST:
            return int(toks[n - 1])
        return (int(toks[end]), int(toks[n - 1]))

    def fits(self, p: int, tag: object) -> bool:
        """Whether a link ending at p, reserved with `tag`, fits this prompt's draft rows."""
        if isinstance(tag, NextToken):  # an end anchor: its last draft row read tag.token
            return p < len(self.keys) and int(self.keys.tokens[p]) == tag.token
        if isinstance(tag, RebuiltAnchor):  # its last draft row is rebuilt for keys[p]
            return p < len(self.keys)
        return tag == self.draft_tag(p)

    def draft_rebuild(self, chain, last_token: int) -> DraftRebuild | None:
        """The boundary rows a restore of `chain` (LinkRefs, root first) rebuilds for this
        prompt, whose cold prefill gives every partial step's last draft row its last token;
        None off the rebuild route."""
        if self.draft_reads != DRAFT_REBUILD:
            return None
        return DraftRebuild(last_token, tuple((r.end, self.prev_cut(r.end)) for r in chain))

    def anchor_rebuild(self, next_token: int) -> DraftRebuild | None:
        """The boundary row a restore of an end anchor rebuilds for this prompt: for the token
        that continues the session at the anchor's end (the row's geometry is the anchor's own,
        kept in its bytes); None off the rebuild route."""
        if self.draft_reads != DRAFT_REBUILD:
            return None
        return DraftRebuild(next_token, ())
