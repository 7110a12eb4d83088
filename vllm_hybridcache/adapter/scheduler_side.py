"""Scheduler side of the connector: owns the cache (every tier) and plans every copy.

Runs in the EngineCore process, on the scheduler's thread only (the tiers are single-threaded by
contract). Each live request has one `RequestState` (adapter/request_state.py), and the hooks
touch only that object and the cache facade. Per step it (1) answers lookups for new requests
(or asks vLLM to ask again next step, while a deeper link of the prompt awaits its report:
adapter/inflight.py), (2) turns hits into load jobs once vLLM has allocated blocks, (3) reserves
a link for every prefill step that ends on a cut, and (4) commits or aborts links when the
workers report the step's copies. Nothing is published before the workers confirm (commit
gating), and a request whose steps left the segmentation (a step cut short by the token budget)
captures nothing after that point: its later states are not cold-exact.

Why it is over ~500 lines: it holds the connector's scheduler hooks, each a step of one
request's lifecycle (lookup, allocation, plan, report, finish) over `RequestState`; the
pieces that are not the lifecycle live beside it (composition.py, startup.py, request_state.py,
draft_tags.py, anchor_end.py, in_place_counts.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_hybridcache.adapter.anchor_end import anchor_end
from vllm_hybridcache.adapter.composition import build_cache
from vllm_hybridcache.adapter.domain import engine_fields, request_domain
from vllm_hybridcache.adapter.draft_rows import rebuild_input, with_draft_input
from vllm_hybridcache.adapter.draft_tags import (
    DRAFT_REBUILD,
    NextToken,
    RebuiltAnchor,
    draft_reads,
)
from vllm_hybridcache.adapter.in_place_counts import InPlaceCounts
from vllm_hybridcache.adapter.inflight import MAX_WAITS, InflightLinks
from vllm_hybridcache.adapter.lora_keys import AdapterBindings, lora_key
from vllm_hybridcache.adapter.mm_keys import (
    EncoderBindings,
    UnkeyableInput,
    keys_from_items,
    request_items,
    request_key_ids,
)
from vllm_hybridcache.adapter.overhead import Overhead
from vllm_hybridcache.adapter.parts import PartMap, UnsupportedModel, part_map
from vllm_hybridcache.adapter.plans import CaptureJob, LoadJob, StepPlan, StepReport
from vllm_hybridcache.adapter.request_state import RequestState
from vllm_hybridcache.adapter.segmentation_mode import inner_resume_floor, segmentation_mode
from vllm_hybridcache.adapter.startup import memory_headroom_warning, resolve_segmentation
from vllm_hybridcache.config import CacheSettings
from vllm_hybridcache.core import (
    EndAnchors,
    LinkAddr,
    LinkKind,
    LookupResult,
    MissReason,
    SnapshotCache,
    SnapshotTree,
    Tier,
)
from vllm_hybridcache.core.keys import tenant_tag
from vllm_hybridcache.core.linkformat.reader import SourceKey
from vllm_hybridcache.segmentation import (
    FINE,
    RecentPrompts,
    first_cut_after,
    floor_aligned,
    inner_positions,
)

if TYPE_CHECKING:
    from vllm_hybridcache.adapter.probes import StepProbes

logger = logging.getLogger("vllm_hybridcache")

def unkeyed_inputs(request) -> bool:
    """Whether the request carries inputs its key ids cannot name.

    Multimodal items (images, audio, video) sit in the prompt as placeholder tokens, the same
    ids for every picture: their rows are keyed by a digest of each item's processed content
    (`mm_keys.request_key_ids`). Prompt embeddings, items whose content is not at the
    scheduler, and LoRA adapters whose files cannot be found cannot be named: such a request
    is served without the cache, no lookup, no capture, no end anchor (a counted miss, reason
    `unkeyed_input`).
    """
    if request_key_ids(request, list(request.prompt_token_ids or ())) is None:
        return True
    try:
        lora_key(getattr(request, "lora_request", None))
    except UnkeyableInput:
        return True
    return False


class SchedulerSide:
    """The cache's scheduler half: one SnapshotCache, one RequestState entry per request."""

    def __init__(self, vllm_config, kv_cache_config, settings: CacheSettings) -> None:
        self.settings = settings
        self.overhead = Overhead()  # the plugin's own seconds in the engine's steps
        self.reason_inactive: str | None = None
        self.parts: PartMap | None = None
        rebuild = rebuild_input(vllm_config)  # MTP: boundary draft rows rebuilt on restore
        try:
            self.parts = with_draft_input(part_map(kv_cache_config), rebuild)
        except UnsupportedModel as e:
            self.reason_inactive = str(e)
        if self.parts is not None and not settings.enabled:
            self.reason_inactive = "disabled by settings (enabled=false)"
        elif self.parts is not None and settings.budget_bytes == 0:
            # Off means off: no lookups, no captures, and no segmentation either, so outputs
            # equal vLLM's without the plugin (design rule 5).
            self.reason_inactive = "budget_bytes=0"
        layout = self.parts.layout if self.parts is not None else None
        self.segmentation = resolve_segmentation(settings, vllm_config)
        self.segmentation_mode, self._mode_why = segmentation_mode(vllm_config,
                                                                   settings.inner_captures)
        self._recent = RecentPrompts() if self.segmentation_mode == FINE else None
        self._resume_floor = inner_resume_floor(vllm_config, self.segmentation_mode)
        anchors = settings.session_anchors
        self._speculative = vllm_config.speculative_config is not None
        # vLLM's AsyncScheduler runs (adapter/scheduler.py): a step may be in flight when a
        # request finishes (see anchor_end)
        self._async = bool(getattr(getattr(vllm_config, "scheduler_config", None),
                                   "async_scheduling", False))
        if self._speculative and anchors and self._async:
            # An end anchor copies the state block of the last accepted token of the request's
            # last verify step. Async scheduling has usually scheduled the request once more
            # (placeholders) before its finish is known, and that step overwrites the state
            # blocks: the state is gone, and what replaces it is not knowable here (on doubt,
            # miss). vLLM's CPU platform never runs async (docs/how-it-works.md).
            logger.info("hybridcache: end anchors off with speculative decoding and async "
                        "scheduling")
            anchors = 0
        self.cache: SnapshotCache | None = None
        # tiers asked for and left off, with why (an engine without a fingerprint: no tier
        # that outlives it)
        self.tiers_off: dict[str, str] = {}
        # what vLLM's encoder cache holds under each item identifier, and which adapter its
        # workers hold under each LoRA id: keys name content, these say whether the state a
        # prefill computes is that content's (adapter/mm_keys.py, adapter/lora_keys.py)
        self._encoded = EncoderBindings()
        self._adapters = AdapterBindings()
        if layout is not None:
            # every tier, the lower ones opened by name (adapter/composition.py)
            self.cache = build_cache(vllm_config, settings, layout, self.segmentation, anchors,
                                     self._speculative, self.reason_inactive is None,
                                     self.tiers_off, self.segmentation_mode)
        self.base_domain = engine_fields(vllm_config, layout) if layout is not None else {}
        # With MTP the draft head's K/V row at a step's last position p - 1 is computed from the
        # target's hidden state there and one more token, which vLLM takes from past the cut
        # (see draft_reads). A link at cut p therefore fits a prompt only if that token matches
        # the capturing prompt's: each link carries it as its tag, and the tree's lookup ends a
        # chain at the first link that does not fit. On vLLM's default path it is the prompt's
        # last token, and chat prompts all end in the same generation prompt. Where the draft
        # head can rebuild that row (Flash-Next's MTP head, adapter/draft_rows.py), links keep
        # its input instead and fit every prompt that shares their tokens.
        self._draft_reads = (None if self.base_domain.get("route") != "mtp"
                             else DRAFT_REBUILD if rebuild is not None
                             else draft_reads(vllm_config))
        self._live: dict[str, RequestState] = {}
        # attention K/V in place (docs/how-it-works.md): the attention block when the
        # segmentation scheduler installed it (0: off)
        self.in_place_block = 0
        # `share(request, start, end) -> end of the shared prefix`: the request's freshly
        # allocated blocks for [start, end) replaced by vLLM's cached ones (set with
        # in_place_block; compat.share_cached_blocks)
        self.share_blocks: Callable[[Any, int, int], int] | None = None
        # synchronous loads: RAM hits load in the step that runs them, not a step ahead (set
        # by the segmentation scheduler, which withdraws a failed one: adapter/scheduler.py)
        self.sync_loads = False
        # the captures of the last plan (a withdrawn request's are aborted: `withdrawn`)
        self._step_captures: list[CaptureJob] = []
        # restored hits by the (tier, kind) of their link: where their rows came from
        self.in_place_counts = InPlaceCounts()
        # tree links planned and not yet reported: a lookup may wait a step for one
        self._inflight = InflightLinks()
        # jobs for the next plan (loads planned at allocation, end anchors at finish)
        self._loads: list[LoadJob] = []
        self._finishing: list[CaptureJob] = []
        # tests only (vllm_hybridcache/testing/instrumentation.py): with `probe_states`, each
        # plan asks the workers for the state of every prefill that ends in its step. None in
        # production.
        self.instrumentation: StepProbes | None = None
        if self.active:
            import psutil

            warning = memory_headroom_warning(int(psutil.virtual_memory().available), settings)
            if warning:
                logger.warning(warning)
        if self.reason_inactive:
            logger.info("hybridcache: snapshot cache inactive: %s", self.reason_inactive)
        else:
            logger.info("hybridcache: snapshot cache on (grid %d, message-end ids %s, budget %d "
                        "bytes, %d sections / %d views)", self.segmentation.grid,
                        list(self.segmentation.message_end_ids), settings.budget_bytes,
                        len(layout.sections), len(layout.views))
            logger.info("hybridcache: segmentation mode %s (%s)", self.segmentation_mode,
                        self._mode_why)

    @property
    def active(self) -> bool:
        return self.cache is not None and self.reason_inactive is None

    @property
    def speculative(self) -> bool:
        """A draft model or MTP head proposes tokens (speculative decoding)."""
        return self._speculative

    @property
    def tree(self) -> SnapshotTree | None:
        """The RAM tier's tree links (introspection: tests, stats)."""
        return None if self.cache is None else self.cache.tier(Tier.RAM, LinkKind.TREE)

    @property
    def anchors(self) -> EndAnchors | None:
        """The RAM tier's end anchors (introspection: tests, stats)."""
        return None if self.cache is None else self.cache.tier(Tier.RAM, LinkKind.ANCHOR)

    # -------------------------------------------------------------- requests
    def _track(self, request) -> RequestState:
        entry = self._live.get(request.request_id)
        if entry is None:
            prompt = list(request.prompt_token_ids or ())
            cuts = self.segmentation.cuts(prompt)
            try:
                items = request_items(getattr(request, "mm_features", None))
            except UnkeyableInput:
                items = None
            key_ids = None  # images: content ids on their rows
            if items is not None:
                key_ids = request_key_ids(request, prompt, items)
            domain = self._request_domain(request)
            if domain is None or (items and any(self._encoded.conflicts(i) for i in items)):
                key_ids = None  # an adapter not named; an item whose embeddings are another's
            lora = getattr(request, "lora_request", None)
            entry = RequestState(domain=domain or b"",
                          keys=self.cache.keys(prompt if key_ids is None else key_ids),
                          cuts=cuts, cut_set=frozenset(cuts), unkeyed=key_ids is None,
                          draft_reads=self._draft_reads, items=items or (),
                          lora_id=None if lora is None else int(lora.lora_int_id))
            # requests with images keep step-aligned links: inner links inside an image's
            # rows were not tested (docs/split-invariance.md)
            if (self._recent is not None and not entry.unkeyed
                    and not getattr(request, "mm_features", None)):
                entry.wanted = self._fine_positions(entry)
            self._live[request.request_id] = entry
        return entry

    def _request_domain(self, request) -> bytes | None:
        """The request's domain, or None when its adapter cannot be named: files missing, or
        not the adapter this engine's workers hold under its id (adapter/lora_keys.py). An
        in-place reload rebinds the id: requests in flight on it capture nothing more."""
        try:
            domain = request_domain(self.base_domain, request)
            lora = getattr(request, "lora_request", None)
            key = lora_key(lora)
        except UnkeyableInput:
            return None
        if lora is None:
            return domain
        ok, rebound = self._adapters.admit(lora, key)
        if rebound:
            for req_id, other in self._live.items():
                if other.lora_id == int(lora.lora_int_id):
                    self._unbind(req_id, other, other.last_start)
        return domain if ok else None

    def _unbind(self, req_id: str, entry: RequestState, position: int) -> None:
        """The request's rows from `position` on are not the state its key names: no capture
        from here, no end anchor."""
        entry.unbound = True
        entry.canonical = False
        self._off_segmentation(req_id, entry, max(0, position))

    def cuts_for(self, request) -> list[int] | None:
        """The request's prompt cuts (for the scheduler hook); None when inactive."""
        if not self.active:
            return None
        entry = self._track(request)
        return None if entry.unkeyed else entry.cuts

    def waits_for_room(self, request) -> bool:
        """Whether a step that falls short of the request's next cut should give it nothing
        (the scheduler hook, `step_wait`): only while its steps so far all followed its cuts
        (a request off the segmentation loses nothing by a short step)."""
        entry = self._live.get(request.request_id)
        return (self.settings.step_wait and entry is not None and entry.canonical
                and not entry.unkeyed)

    def in_place_cap(self, request) -> int:
        """The deepest local prefix-cache hit vLLM may take for `request` (attention K/V in
        place): the whole attention blocks strictly below the link the cache restores for it
        (for an end anchor, also within its cold rows), so the connector always loads at least
        one token and with it the recurrent sections. 0 without such a link (a miss, a request
        that must stay cold).
        Computes the connector's answer, kept for `get_num_new_matched_tokens`."""
        entry = self._live.get(request.request_id)
        if entry is not None:
            entry.answer = None
        answer = self._answer(request)
        entry = self._live.get(request.request_id)
        if entry is None:
            return 0
        entry.answer = answer
        tokens, _ = answer
        res = entry.lookup
        if not tokens or res is None:
            return 0
        return self._in_place_rows(request, entry, res)

    def _in_place_rows(self, request, entry: RequestState, res: LookupResult) -> int:
        """The local hit vLLM may take for hit `res`: the whole attention blocks of its
        sharable rows (`_sharable_rows`) strictly below the link, so that the connector loads
        at least one token (0 for a miss, with in place off, or a request that must stay
        cold)."""
        b = self.in_place_block
        if not b or not res.hit:
            return 0
        return min((res.tokens - 1) // b * b, self._sharable_rows(request, entry, res))

    def _sharable_rows(self, request, entry: RequestState, res: LookupResult) -> int:
        """Tokens of hit `res` whose attention K/V vLLM's blocks may serve in place: the whole
        attention blocks up to a cold-exact tree link, or up to an end anchor's cold rows (0
        for a miss, with in place off, or a request that must stay cold). The local hit stops
        a block below the link when the link ends on a block boundary
        (`_in_place_rows`); the blocks from there up to these rows are shared after vLLM
        allocates them (`update_state_after_alloc`).

        An end anchor's state descends from its session's rows; below its cold rows those are
        the rows a cold prefill writes, bit for bit, which is what every block vLLM hashes
        without the provenance key holds (compat.provenance_block_hasher): so in place there
        the anchor's state meets the very rows it was computed over. Above them (decoded rows,
        rows off the segmentation) its own copy is restored."""
        if (not self.in_place_block or not res.hit or request.num_preemptions > 0
                or entry.lora_id is not None):
            # vLLM's block hashes name an adapter by its name and path, not its weights: no
            # block of a LoRA request is taken from vLLM's prefix cache beside our link
            return 0
        if self.cache.cold_exact(res):
            rows = res.tokens
        elif res.kind == LinkKind.ANCHOR:
            rows = min(res.cold_rows, res.tokens)
        else:
            return 0
        if entry.items:
            # vLLM's block hashes name an item by its identifier (a client's uuid, maybe):
            # only blocks before the first item are taken beside our content-keyed link
            rows = min(rows, min(i.start for i in entry.items))
        b = self.in_place_block
        return rows // b * b

    def _moved_bytes(self, res: LookupResult, in_place: int) -> int:
        """Bytes a hit moves before its prefill resumes (what the hit choice prices): the whole
        plan, less the view blocks served in place below `in_place` tokens for a RAM hit (a
        disk or cluster hit reads its files whole, whatever the copy then skips)."""
        if res.plan is None:
            return 0
        total = res.plan.total_bytes
        if in_place <= 0 or res.tier != Tier.RAM or self.parts is None:
            return total
        saved = in_place // self.parts.layout.view_block_tokens * sum(
            self.parts.block_bytes.values())
        return max(total - saved, sum(res.plan.part_bytes.get(s.name, 0)
                                      for s in self.parts.layout.sections))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        entry = self._live.get(request.request_id) if self.in_place_block else None
        if entry is not None and entry.answer is not None:
            (tokens, load), entry.answer = entry.answer, None
            entry.in_place = 0
            if tokens is None or not tokens:
                return tokens, False
            if num_computed_tokens >= tokens:  # cannot happen: the cap stays below the link
                entry.lookup = None
                return 0, False
            entry.in_place = num_computed_tokens
            return tokens - num_computed_tokens, load
        if num_computed_tokens > 0:
            return 0, False
        return self._answer(request)

    def _answer(self, request) -> tuple[int | None, bool]:
        """The connector's answer for a request with nothing computed locally."""
        if not self.active or request.prompt_token_ids is None:
            return 0, False
        if request.num_tokens > request.num_prompt_tokens:
            return 0, False  # resumed after preemption with output: recompute, never guess
        entry = self._track(request)
        if entry.cold_only:
            return 0, False
        limit = request.num_prompt_tokens - 1
        if not entry.unkeyed and any(self._encoded.conflicts(i) for i in entry.items):
            entry.unkeyed = True  # vLLM would read another content's embeddings for an item
        if entry.unkeyed:
            entry.lookup = self.cache.miss(MissReason.UNKEYED_INPUT, len(entry.keys), limit)
            return 0, False
        def moved(r: LookupResult) -> int:
            return self._moved_bytes(r, self._sharable_rows(request, entry, r))

        res = self.cache.lookup(entry.keys, entry.domain, limit,
                                entry.fits if entry.draft_route else None, moved)
        while (res.hit and self._short_resume(entry, res, request.num_prompt_tokens)
               and not res.pending):
            limit = res.tokens - 1          # a shallower link: its resumed step is longer
            res = self.cache.lookup(entry.keys, entry.domain, limit,
                                    entry.fits if entry.draft_route else None, moved)
        if res.pending:
            entry.lookup = None
            return None, False  # its copy lands with the next step: ask again then
        if entry.lookup_waits < MAX_WAITS and self._inflight.awaited(
                entry.keys, entry.domain, res.tokens, limit, self._tree_pending,
                entry.fits if entry.draft_route else None):
            # a deeper link of this prompt ran last step and its report lands with the next
            # one (a draft model defers it): wait a step rather than prefill what it serves
            entry.lookup_waits += 1
            entry.lookup = None
            return None, False
        entry.lookup = res
        if not entry.observed:
            entry.observed = True
            self.cache.observe(entry.keys, entry.domain, res)
        if not res.hit:
            return 0, False
        # a RAM hit's copy is a memcpy the worker cannot be denied (no file, no network):
        # loaded synchronously, the request runs in this step instead of waiting one in vLLM's
        # queue; disk and cluster hits (reads that can fail or take long) and the MTP route
        # (its draft rows) load a step ahead, as vLLM's asynchronous loads do
        entry.sync_load = (self.sync_loads and res.tier == Tier.RAM
                           and not entry.draft_route)
        return res.tokens, not entry.sync_load

    def _short_resume(self, entry: RequestState, res: LookupResult, prompt_len: int) -> bool:
        """A tree hit at a position that is not a cut whose resumed step would hold fewer than
        the floor's tokens (MIN_INNER_RESUME; 0 = no floor): not exact on this engine."""
        q = res.tokens
        if not self._resume_floor or res.kind != LinkKind.TREE or q in entry.cut_set:
            return False
        return first_cut_after(entry.cuts, q, prompt_len) - q < self._resume_floor

    def _tree_pending(self, addr: LinkAddr) -> bool:
        """Whether a RAM tree link is still reserved (neither committed nor dropped)."""
        tree = self.tree
        return tree is not None and tree.has(addr.link_id) and not tree.is_committed(
            addr.link_id)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        entry = self._live.get(request.request_id)
        if entry is None or entry.lookup is None:
            return
        res, entry.lookup = entry.lookup, None
        if num_external_tokens <= 0:
            self.cache.record_lookup(res)
            return
        in_place = entry.in_place  # vLLM's local hit
        restoring = (res.hit and res.tokens == in_place + num_external_tokens
                     and self.cache.begin_restore(res))
        if restoring and self.share_blocks is not None:
            # the loaded range's whole blocks that vLLM's cache holds: taken from it, so the
            # load copies the recurrent state and the rows past them only
            deeper = self._sharable_rows(request, entry, res)
            if deeper > in_place:
                in_place = entry.in_place = self.share_blocks(request, in_place, deeper)
        block_ids = [list(b) for b in blocks.get_block_ids()]
        if res.hit and not self.cache.cold_exact(res):
            entry.canonical = False  # session-exact state: never publish into the shared tree
            # the rows below `in_place` are vLLM's cold rows, shared; every row from there on
            # (the anchor's copy, what this request computes after) descends from the session
            self._off_segmentation(request.request_id, entry, in_place)
        if restoring:
            entry.resume_at = res.tokens
            if self.in_place_block:
                self.in_place_counts.count(res.tier, res.kind, res.tokens, in_place,
                                           self.parts.layout.view_block_tokens,
                                           sum(self.parts.block_bytes.values()))
            entry.restoring = res
            sources = self.cache.sources(res)
            origin = self.cache.origin(res.tier) if sources else None
            expect = tuple(SourceKey(res.kind, entry.domain, entry.keys.digest(ref.end))
                           for ref in res.plan.chain) if sources else ()
            draft = None
            if res.kind == LinkKind.TREE:
                draft = entry.draft_rebuild(res.plan.chain, int(request.prompt_token_ids[-1]))
            elif res.kind == LinkKind.ANCHOR:
                draft = entry.anchor_rebuild(int(request.prompt_token_ids[res.tokens]))
            self._loads.append(LoadJob(req_id=request.request_id, tier=res.tier, kind=res.kind,
                                       chain=res.plan.chain, block_ids=block_ids,
                                       sources=sources, origin=origin, expect=expect,
                                       draft=draft,
                                       in_place=in_place, sync=entry.sync_load))
        else:
            # vLLM already counts these tokens as loading: the chain changed since the lookup
            # (evicted or cleared), so report a failed load and let vLLM recompute.
            entry.cold_only = True
            self._loads.append(LoadJob(req_id=request.request_id, tier=res.tier, kind=res.kind,
                                       chain=(), block_ids=block_ids,
                                       fail="the chain changed between lookup and allocation",
                                       sync=entry.sync_load))

    def in_place_stats(self, tier: str | None = None,
                       kind: str | None = None) -> dict[str, int]:
        """Totals over the links' tiers and kinds (or of one): adapter/in_place_counts.py."""
        return self.in_place_counts.totals(tier, kind)

    def in_place_payload(self) -> dict[str, dict[str, dict[str, int]]]:
        """{tier: {kind: counts}} for the connector's stats payload."""
        return self.in_place_counts.payload()

    def _off_segmentation(self, req_id: str, entry: RequestState, position: int) -> None:
        """The request writes its rows off the segmentation from `position` on."""
        if not self.in_place_block:
            return
        if entry.off_from is None or position < entry.off_from:
            entry.off_from = position
            logger.debug("hybridcache: request %s writes off the segmentation from %d",
                         req_id, position)

    def take_off_segmentation(self) -> list[tuple[str, int]]:
        """Off-segmentation positions found since the last call (request id, position), one
        per live request whose `off_from` moved: the scheduler marks the blocks' hashes
        before vLLM registers them."""
        marks = []
        for req_id, entry in self._live.items():
            if entry.off_from != entry.off_taken:
                entry.off_taken = entry.off_from
                marks.append((req_id, entry.off_from))
        return marks

    def off_from(self, req_id: str) -> int | None:
        entry = self._live.get(req_id)
        return None if entry is None else entry.off_from

    # -------------------------------------------------------------- per step
    def build_plan(self, so) -> StepPlan:
        plan = StepPlan(loads=self._loads, captures=self._finishing)
        self._loads = []
        self._finishing = []
        if not self.active:
            return plan
        self._inflight.next_plan()
        self._observe_encoder(so)
        for data in so.scheduled_new_reqs:
            entry = self._live.get(data.req_id)
            if entry is None:
                continue
            entry.block_ids = [list(b) for b in data.block_ids]
            self._plan_step(entry, data.req_id, data.num_computed_tokens,
                            so.num_scheduled_tokens[data.req_id], plan)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            entry = self._live.get(req_id)
            if entry is None:
                continue
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                entry.block_ids = [list(b) for b in new] if new is not None else entry.block_ids
                if entry.withdrawn:
                    # its only step so far was withdrawn (`withdrawn`): it runs from token 0
                    # as any new request does, its links captured as usual
                    entry.withdrawn = False
                else:
                    entry.canonical = False  # resumed after preemption: recomputed, not captured
                    self._off_segmentation(req_id, entry, 0)
            elif new is not None:
                for g, ids in enumerate(new):
                    entry.block_ids[g].extend(ids)
            self._plan_step(entry, req_id, cached.num_computed_tokens[i],
                            so.num_scheduled_tokens[req_id], plan)
        for c in plan.captures:  # tree links this step fills: lookups may wait for them
            entry = self._live.get(c.req_id)
            if (entry is not None and not c.finishing
                    and (c.addr.tier, c.addr.kind) == (Tier.RAM, LinkKind.TREE)):
                self._inflight.planned(c.addr, entry.domain, entry.keys, c.row_end,
                                       entry.draft_tag(c.row_end) if not c.inner_offset
                                       else None)
        self._step_captures = plan.captures
        plan.drops = self.cache.drain_dropped()
        for c in plan.captures:  # the lower tiers hear of the tree links this step fills
            entry = self._live.get(c.req_id)
            if entry is not None and not c.finishing:
                self.cache.capture_planned(c.addr, entry.keys, entry.domain, c.row_start,
                                           c.row_end, entry.draft_tag(c.row_end))
        plan.tier_ops = self.cache.take_ops()
        return plan

    def _observe_encoder(self, so) -> None:
        """Tell the encoder book what vLLM's encoder cache freed and encodes this step (the
        workers drop the freed entries before they encode), with the digest of each encoded
        item's content. An encoding of a request this side does not know cannot be attributed:
        the book is lost and no item is bound any more (one warning)."""
        encoded: list[tuple[str, str | None]] = []
        for req_id, input_ids in (getattr(so, "scheduled_encoder_inputs", None) or {}).items():
            entry = self._live.get(req_id)
            for i in input_ids:
                if entry is None or not 0 <= i < len(entry.items):
                    if not self._encoded.lost:
                        logger.warning("hybridcache: vLLM encodes an item of request %s that "
                                       "the cache does not know; multimodal requests are served "
                                       "without the cache from now on", req_id)
                    self._encoded.lose()
                    return
                encoded.append((entry.items[i].identifier, entry.items[i].digest))
        self._encoded.observe(getattr(so, "free_encoder_mm_hashes", None) or (), encoded)

    def _check_items(self, req_id: str, entry: RequestState, start: int, end: int) -> None:
        """A prefill step over [start, end) reads the encoder output of every item it overlaps,
        which vLLM takes from its encoder cache by the item's identifier: unless that is an
        encoding of the item's own content (`EncoderBindings.bound`), the rows from the item on
        are not the state the key names."""
        for item in entry.items:
            if (item.start < end and start < item.start + item.length
                    and not self._encoded.bound(item)):
                self._unbind(req_id, entry, max(start, item.start))
                return

    def _plan_step(self, entry: RequestState, req_id: str, start: int, n: int,
                   plan: StepPlan) -> None:
        prompt_len = len(entry.keys)
        end = start + n
        if entry.items and not entry.unkeyed and not entry.unbound:
            self._check_items(req_id, entry, start, min(end, prompt_len))
        self._time_prefill(entry, start, n, prompt_len)
        entry.last_start, entry.last_len = start, n
        if (self.instrumentation is not None and self.instrumentation.probe_states
                and start < prompt_len <= end):
            plan.probes.append((req_id, prompt_len, [list(b) for b in entry.block_ids]))
        if entry.unkeyed and start < prompt_len:
            self._off_segmentation(req_id, entry, 0)
        if start >= prompt_len or not entry.canonical or entry.unkeyed:
            return
        if start != entry.resume_at and start not in entry.cut_set:
            entry.canonical = False
            self._off_segmentation(req_id, entry, start)
            return
        next_cut = first_cut_after(entry.cuts, start, prompt_len)
        if end < min(next_cut, prompt_len):
            entry.canonical = False  # step clipped by the token budget: off the segmentation
            self._off_segmentation(req_id, entry, start)
            return
        if entry.wanted:
            self._plan_inner(entry, req_id, start, end, plan)
        if end not in entry.cut_set:
            return
        r = self.cache.reserve(LinkKind.TREE, entry.keys, end, entry.domain,
                               tag=entry.draft_tag(end))
        if r.addr is None:
            return
        draft_step = -1
        if entry.draft_reads == DRAFT_REBUILD:
            if r.start != start or start != entry.prev_cut(end):
                # the link would span an earlier step's boundary row (a cut skipped before),
                # which read this prompt's last token and has no input kept: no link
                self.cache.abort(r.addr)
                return
            draft_step = start
        plan.captures.append(CaptureJob(addr=r.addr, req_id=req_id, row_start=r.start,
                                        row_end=r.end,
                                        block_ids=[list(b) for b in entry.block_ids],
                                        draft_step=draft_step))

    def _fine_positions(self, entry: RequestState) -> tuple[int, ...]:
        """Fine mode: the last 64-aligned position before the prompt's end (an identical
        resend prefills at most 64 tokens; on vLLM's GDN models the last one leaving
        MIN_INNER_RESUME tokens, so at most 127) and the last one at or before the point where the
        prompt parts from a recent prompt of its domain (a junction: the next prompt on that
        prefix resumes there). Any 64-aligned position is exact in this mode."""
        tokens = entry.keys.tokens
        n = len(entry.keys)
        # the last one that leaves the resumed step the floor's tokens (vLLM's GDN models)
        wanted = {floor_aligned(n - max(1, self._resume_floor))}
        junction = self._recent.junction(entry.domain, tokens)
        if junction:
            wanted.add(floor_aligned(junction))
        self._recent.remember(entry.domain, tokens)
        return tuple(sorted(q for q in wanted if q > 0))

    def _plan_inner(self, entry: RequestState, req_id: str, start: int, end: int,
                    plan: StepPlan) -> None:
        """Fine mode: reserve a link at every wanted position inside the step, in order (each
        the parent of the next, the step's own link last); the model hands their states over
        during the forward (CaptureJob.inner_offset). They commit or abort with the report."""
        for q in inner_positions(start, end, entry.wanted, entry.cut_set):
            r = self.cache.reserve(LinkKind.TREE, entry.keys, q, entry.domain)
            if r.addr is None:
                continue
            plan.captures.append(CaptureJob(addr=r.addr, req_id=req_id, row_start=r.start,
                                            row_end=r.end,
                                            block_ids=[list(b) for b in entry.block_ids],
                                            inner_offset=q - start))

    def _time_prefill(self, entry: RequestState, start: int, n: int, prompt_len: int) -> None:
        """Measure the prefill rate for the hit choice and the disk tier's cost check: a
        request's previous prefill step took until its next step is planned (steps of a
        request in flight follow each other). Batched with other requests, a step's tokens are
        only this request's, so the rate errs low, on the side of restoring deeper."""
        now = time.monotonic()
        if start == entry.prefill_next and entry.prefill_n > 0:
            seconds = now - entry.prefill_t
            if self.cache is not None:
                self.cache.observe_prefill(entry.prefill_n, seconds)
        prefill = max(0, min(start + n, prompt_len) - start)
        entry.prefill_t, entry.prefill_n, entry.prefill_next = now, prefill, start + n

    def apply_report(self, report: StepReport | None) -> None:
        if report is None or not self.active:
            return
        self.overhead.add_worker(report.seconds)
        self._inflight.reported(report.saved)
        self._inflight.reported(report.failed_saves)
        for addr in report.failed_saves:
            self.cache.abort(addr)
        for addr, seconds in report.saved.items():
            if addr in report.failed_saves:
                continue
            if report.saved_count.get(addr, 1) >= report.workers:
                self.cache.commit(addr, seconds)  # offered to the lower tiers
            else:
                self.cache.abort(addr)
        for req_id in report.failed_loads:
            entry = self._live.get(req_id)
            if entry is not None:
                entry.sync_load = False
                self._end_restore(req_id, entry, False, 0.0)
                entry.resume_at = 0  # vLLM recomputes the request from token 0
                entry.cold_only = True
        if report.lost_links:
            self.cache.invalidate(report.lost_links)
        for req_id, seconds in report.loaded.items():
            entry = self._live.get(req_id)
            if entry is not None:
                entry.sync_load = False
                self._end_restore(req_id, entry, True, seconds)
        self.cache.absorb(report.tier_reports)
        self.cache.absorb_shards(report.shard_reports)
        for (tier, kind), problems in report.refused.items():
            counter = getattr(self.cache.tier(tier, kind), "note_refused", None)
            if counter is not None:
                for problem, n in problems.items():
                    counter(problem, n)

    def failed_sync_loads(self, report: StepReport | None) -> dict[str, int]:
        """The synchronous loads `report` says failed: request id -> the tokens vLLM's blocks
        served in place below its load (what the load did not write). Read before the report
        is applied (`apply_report`), by the scheduler that withdraws them."""
        if report is None or not self.active:
            return {}
        out = {}
        for req_id in report.failed_loads:
            entry = self._live.get(req_id)
            if entry is not None and entry.sync_load:
                out[req_id] = entry.in_place
        return out

    def withdrawn(self, report: StepReport, outputs: dict[str, int]) -> None:
        """These requests' step is void (a synchronous load failed under one of them; request
        id -> the tokens it had output before): the links that step captured for them fail,
        so `apply_report` aborts them instead of committing states computed from a state that
        was never restored. One that had output nothing runs from token 0 as a new request
        (its links captured as usual); one that had is a preempted request as any other."""
        for c in self._step_captures:
            if c.req_id in outputs and c.addr in report.saved:
                report.failed_saves.add(c.addr)
        for req_id, n in outputs.items():
            entry = self._live.get(req_id)
            if entry is not None and n == 0:
                entry.withdrawn = True
                entry.resume_at = 0  # until a restore on its next lookup says otherwise

    def _end_restore(self, req_id: str, entry: RequestState, ok: bool, seconds: float) -> None:
        if entry.restoring is not None:
            res = entry.restoring
            self.cache.end_restore(res, ok, seconds)
            if ok and self.cache.cost is not None:  # the route's rate, for the hit choice
                self.cache.cost.observe_restore(res.tier, self._moved_bytes(res, entry.in_place),
                                                seconds)
            entry.restoring = None
        if entry.finished:
            del self._live[req_id]

    def request_finished(self, request, block_ids=None) -> bool:
        """Forget the request (once no restore of it is in flight); keep its end anchor.
        True: vLLM must keep its blocks until the workers have copied the anchor (reported
        back as a finished send)."""
        entry = self._live.get(request.request_id)
        last = (entry.last_start, entry.last_len) if entry is not None else (-1, 0)
        if entry is not None:
            if entry.lookup is not None and self.active:
                self.cache.record_lookup(entry.lookup)
                entry.lookup = None
            if entry.restoring is None:
                del self._live[request.request_id]
            else:
                entry.finished = True
        if not self.active or block_ids is None or not self.cache.admits(LinkKind.ANCHOR):
            return False
        from vllm.v1.request import RequestStatus

        if entry is None:
            # never tracked: what its prefill read of an item or an adapter is not known
            if (unkeyed_inputs(request) or getattr(request, "mm_features", None)
                    or getattr(request, "lora_request", None) is not None):
                return False
        elif entry.unkeyed or entry.unbound:
            return False
        if self._async and getattr(request, "num_preemptions", 0):
            # a preemption under async scheduling resets vLLM's counts while a step may be in
            # flight (its output is delivered stale): what the state holds is not read here
            return False
        all_tokens = list(request.all_token_ids)
        in_flight = int(request.num_output_placeholders) if self._async else None
        end = anchor_end(request.num_computed_tokens, len(all_tokens), request.num_prompt_tokens,
                         *last, self._speculative, in_flight)
        if end is None:
            return False
        n, section_block = end
        # the state block must exist in every section group (attention groups hold rows:
        # their block count says nothing about the section blocks)
        if (request.status == RequestStatus.FINISHED_ABORTED or n < request.num_prompt_tokens
                or not block_ids or any(len(block_ids[gid]) <= section_block
                                        for _, gid, _, _ in self.parts.sections)):
            return False
        if entry is None:
            domain, tokens = request_domain(self.base_domain, request), all_tokens[:n]
        else:  # the domain and item digests its prefill was checked against
            domain, tokens = entry.domain, keys_from_items(all_tokens[:n], entry.items)
        rebuilt = self._draft_reads == DRAFT_REBUILD
        tag = (RebuiltAnchor() if rebuilt else NextToken(int(all_tokens[n]))
               if self._speculative else None)
        r = self.cache.reserve(LinkKind.ANCHOR, tokens, n, domain, tag,
                               self._anchor_cold_rows(entry, request, n))
        if r.addr is None:
            return False
        # the lower tiers hear of it (session spill, the cluster's anchors)
        self.cache.anchor_reserved(r.addr, self.cache.keys(tokens), domain, n, tag)
        self._finishing.append(CaptureJob(addr=r.addr, req_id=request.request_id,
                                          row_start=r.start, row_end=r.end,
                                          block_ids=[list(b) for b in block_ids],
                                          finishing=True, section_block=section_block,
                                          draft_step=last[0] if rebuilt else -1,
                                          draft_len=last[1] if rebuilt else 0))
        return True

    def _anchor_cold_rows(self, entry: RequestState | None, request, n: int) -> int:
        """How many of a finishing request's first rows a cold prefill writes bit for bit:
        the rows before it left the segmentation (`off_from`: a step off the cuts, a
        session-exact resume above its shared rows, a preemption) and at most its prompt
        (decoded rows are never a prefill's). Known only where in place tracks provenance;
        0 (every row copied on a hit) with `anchor_in_place` off, for a request that was not
        tracked, runs under an adapter, or carries items."""
        if (not self.in_place_block or not self.settings.anchor_in_place or entry is None
                or entry.lora_id is not None or entry.items or entry.unkeyed or entry.unbound
                or getattr(request, "num_preemptions", 0)):
            return 0
        off = request.num_prompt_tokens if entry.off_from is None else entry.off_from
        return max(0, min(off, request.num_prompt_tokens, n))

    def clear(self, tier: str | None = None, kind: str | None = None,
              cache_salt: str | None = None) -> int:
        """Drop the links of `tier`/`kind` (None: all); payloads go to the workers as drops in
        the next plan. ValueError names a tier or kind this cache does not have.

        `cache_salt`: drop only the links of the tenant of that salt ("": requests without a
        salt), in every tier matching `tier`/`kind`; other tenants' links stay."""
        if self.cache is None:
            return 0
        if cache_salt is not None:
            return self.cache.clear_tenant(tenant_tag(cache_salt), tier, kind)
        return self.cache.clear(tier, kind)  # the lower tiers drop what they queued

    def tier_names(self) -> list[str]:
        """The tiers this engine's cache has (what a clear may name)."""
        return [] if self.cache is None else self.cache.tier_names()
