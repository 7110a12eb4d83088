"""Scheduler side of the connector: owns the snapshot tree and plans every copy.

Runs in the EngineCore process, on the scheduler's thread only (the tree is single-threaded by
contract). Per step it (1) answers lookups for new requests, (2) turns hits into load jobs once
vLLM has allocated blocks, (3) reserves a link for every prefill step that ends on a cut, and
(4) commits or aborts links when the workers report the step's copies. Nothing is published
before the workers confirm (commit gating), and a request whose steps left the segmentation
(a step cut short by the token budget) captures nothing after that point: its later states are
not cold-exact.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_hybridcache.adapter.domain import engine_fields, request_domain
from vllm_hybridcache.adapter.parts import PartMap, UnsupportedModel, part_map
from vllm_hybridcache.adapter.plans import CaptureJob, LoadJob, StepPlan, StepReport
from vllm_hybridcache.config import CacheSettings
from vllm_hybridcache.core import (
    ANCHOR_ID_BASE,
    AnchorHit,
    LinkRef,
    LookupResult,
    MissReason,
    PromptKeys,
    RestorePlan,
    SessionAnchors,
    SnapshotTree,
)
from vllm_hybridcache.segmentation import Segmentation, first_cut_after

if TYPE_CHECKING:
    from vllm_hybridcache.instrumentation import Instrumentation

logger = logging.getLogger("vllm_hybridcache")


@dataclass
class _Tracked:
    """What the scheduler side keeps per live request."""

    domain: bytes
    keys: PromptKeys
    cuts: list[int]
    cut_set: frozenset[int]
    block_ids: list[list[int]] = field(default_factory=list)
    resume_at: int = 0          # tokens restored (0 = cold)
    canonical: bool = True      # every step so far followed the segmentation
    cold_only: bool = False     # a restore failed: vLLM recomputes it, and we never retry
    unkeyed: bool = False       # inputs the token ids do not name: no lookup, no capture


def unkeyed_inputs(request) -> bool:
    """Whether the request carries inputs that its prompt token ids do not identify.

    Multimodal items (images, audio, video) sit in the prompt as placeholder tokens, the same
    ids for every picture; prompt embeddings replace token rows altogether. A key made of token
    ids would match another request's state for different inputs, so such a request is served
    without the cache: no lookup, no capture, no end anchor (a counted miss, reason
    `unkeyed_input`).
    """
    return bool(getattr(request, "mm_features", None)) or (
        getattr(request, "prompt_embeds", None) is not None)


def default_message_end_ids(vllm_config) -> tuple[int, ...]:
    """`<|im_end|>`'s id when the model's tokenizer has it (Qwen-style chat templates).

    Without it only grid cuts remain, and agent prompts, which diverge at message boundaries,
    lose most of their reuse. So when the ids cannot be found (the tokenizer fails to load, or
    has no `<|im_end|>`) we warn that message-end cuts are off, why, and how to set them.
    """
    model = getattr(getattr(vllm_config, "model_config", None), "tokenizer", None)
    fix = ("set message_end_ids (VLLM_HYBRIDCACHE_MESSAGE_END_IDS) to the token ids that end a "
           "chat message, or to -1 for grid cuts only")
    try:
        from transformers import AutoTokenizer

        mc = vllm_config.model_config
        tok = AutoTokenizer.from_pretrained(mc.tokenizer, revision=mc.tokenizer_revision,
                                            trust_remote_code=mc.trust_remote_code)
        tid = tok.convert_tokens_to_ids("<|im_end|>")
    except Exception as e:
        logger.warning("hybridcache: message-end cuts are off: the tokenizer of %s could not be "
                       "loaded to look up <|im_end|> (%s: %s); prefills are cut on the grid "
                       "only. To fix it, %s.", model, type(e).__name__, e, fix)
        return ()
    if isinstance(tid, int) and tid != tok.unk_token_id and tid >= 0:
        return (tid,)
    logger.warning("hybridcache: message-end cuts are off: the tokenizer of %s has no <|im_end|> "
                   "token; prefills are cut on the grid only. To fix it, %s.", model, fix)
    return ()


def resolve_segmentation(settings: CacheSettings, vllm_config) -> Segmentation:
    ids = settings.message_end_ids
    if ids == (-1,):
        ids = ()
    elif not ids:
        ids = default_message_end_ids(vllm_config)
    return Segmentation(grid=settings.grid, message_end_ids=tuple(ids),
                        message_end_min=settings.message_end_min)


def memory_headroom_warning(available: int, settings: CacheSettings) -> str | None:
    """A start-up warning when the memory guard will skip most captures, else None.

    Captures are skipped while host memory would fall below `memory_floor_bytes` (design rule
    6). On CPU, vLLM sizes its KV cache from the host memory unless told otherwise, which can
    leave nothing above the floor: the cache then silently stores nothing. Called once the KV
    cache is allocated (the scheduler is built after it).
    """
    GiB = 1 << 30
    headroom = available - settings.memory_floor_bytes
    if headroom >= min(settings.budget_bytes, GiB):
        return None
    return (f"hybridcache: only {max(headroom, 0) / GiB:.1f} GiB of host memory is available "
            f"above the memory floor ({settings.memory_floor_bytes / GiB:.1f} GiB), so most "
            "captures will be skipped (metric reason memory_guard). On CPU, give vLLM's KV cache "
            "an explicit size (VLLM_CPU_KVCACHE_SPACE in GiB, or --kv-cache-memory-bytes), or "
            "lower memory_floor_bytes.")


class SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config, settings: CacheSettings) -> None:
        self.settings = settings
        self.reason_inactive: str | None = None
        self.parts: PartMap | None = None
        try:
            self.parts = part_map(kv_cache_config)
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
        self.tree = SnapshotTree(layout, settings.tree_config()) if layout is not None else None
        anchors = settings.session_anchors
        if vllm_config.speculative_config is not None and anchors:
            # Decode with drafts leaves rejected rows and draft state behind; not gated yet.
            logger.info("hybridcache: end anchors off with speculative decoding")
            anchors = 0
        self.anchors = (SessionAnchors(layout, anchors, settings.session_budget_bytes)
                        if layout is not None else None)
        self._anchor_hits: dict[str, AnchorHit] = {}
        self._anchor_restoring: dict[str, int] = {}
        self._finishing: list[CaptureJob] = []
        self.base_domain = engine_fields(vllm_config, layout) if layout is not None else {}
        # With MTP the draft head's K/V row at a step's last position p - 1 is computed from the
        # target's hidden state there and one more token: in a partial prefill, vLLM feeds the
        # prompt token at p (`prepare_next_token_ids_cpu`) or, on its padded-batch path, the
        # prompt's last token (`prepare_next_token_ids_padded`). A link at cut p therefore fits a
        # prompt only if both tokens match the capturing prompt's: recorded per link, checked on
        # lookup. Chat prompts all end in the same generation prompt, so in practice only the
        # token after the cut costs reuse.
        self._draft_route = self.base_domain.get("route") == "mtp"
        self._draft_tokens: dict[int, tuple[int, int]] = {}
        self._reqs: dict[str, _Tracked] = {}
        self._lookups: dict[str, LookupResult] = {}
        self._restoring: dict[str, RestorePlan] = {}
        self._loads: list[LoadJob] = []
        # tests only (vllm_hybridcache/instrumentation.py): with `probe_states`, each plan asks
        # the workers for the state of every prefill that ends in its step. None in production.
        self.instrumentation: Instrumentation | None = None
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

    @property
    def active(self) -> bool:
        return self.tree is not None and self.reason_inactive is None

    # -------------------------------------------------------------- requests
    def _track(self, request) -> _Tracked:
        tr = self._reqs.get(request.request_id)
        if tr is None:
            prompt = list(request.prompt_token_ids or ())
            cuts = self.segmentation.cuts(prompt)
            tr = _Tracked(domain=request_domain(self.base_domain, request),
                          keys=self.tree.keys(prompt), cuts=cuts, cut_set=frozenset(cuts),
                          unkeyed=unkeyed_inputs(request))
            self._reqs[request.request_id] = tr
        return tr

    def cuts_for(self, request) -> list[int] | None:
        """The request's prompt cuts (for the scheduler hook); None when inactive."""
        if not self.active:
            return None
        tr = self._track(request)
        return None if tr.unkeyed else tr.cuts

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.active or num_computed_tokens > 0 or request.prompt_token_ids is None:
            return 0, False
        if request.num_tokens > request.num_prompt_tokens:
            return 0, False  # resumed after preemption with output: recompute, never guess
        tr = self._track(request)
        if tr.cold_only:
            return 0, False
        if tr.unkeyed:
            self._lookups[request.request_id] = LookupResult(
                False, 0, None, MissReason.UNKEYED_INPUT.value, len(tr.keys),
                request.num_prompt_tokens - 1)
            return 0, False
        limit = request.num_prompt_tokens - 1
        res = self._lookup(tr, limit)
        self._lookups[request.request_id] = res
        self._anchor_hits.pop(request.request_id, None)
        anchor = self.anchors.lookup(tr.keys.tokens, tr.domain, limit)
        if anchor is not None and anchor.tokens >= res.tokens:
            if anchor.pending:
                return None, False  # its copy lands with the next step: ask again then
            self._anchor_hits[request.request_id] = anchor
            return anchor.tokens, True
        return (res.tokens, True) if res.hit else (0, False)

    def _lookup(self, tr: _Tracked, limit: int) -> LookupResult:
        """The tree's deepest link, cut back (MTP route) to the deepest chain whose every link
        saw this prompt's draft-row tokens (the token after its cut, the prompt's last token)."""
        res = self.tree.lookup(tr.keys, tr.domain, limit)
        if not self._draft_route:
            return res
        tokens = tr.keys.tokens
        last = int(tokens[-1])
        while res.hit and res.plan is not None:
            bad = next((ref for ref in res.plan.chain
                        if self._draft_tokens.get(ref.link_id) != (int(tokens[ref.end]), last)),
                       None)
            if bad is None:
                break
            self.tree.record_shortened()
            res = self.tree.lookup(tr.keys, tr.domain, bad.end - 1)
        return res

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        res = self._lookups.pop(request.request_id, None)
        if res is None:
            return
        anchor = self._anchor_hits.pop(request.request_id, None)
        if num_external_tokens > 0 and anchor is not None:
            self._restore_anchor(request, anchor, num_external_tokens,
                                 [list(b) for b in blocks.get_block_ids()])
            return
        if num_external_tokens > 0:
            tr = self._track(request)
            block_ids = [list(b) for b in blocks.get_block_ids()]
            if res.hit and res.tokens == num_external_tokens and self.tree.begin_restore(res):
                tr.resume_at = num_external_tokens
                self._restoring[request.request_id] = res.plan
                self._loads.append(LoadJob(req_id=request.request_id, plan=res.plan,
                                           block_ids=block_ids))
            else:
                # vLLM already counts these tokens as loading: the chain changed since the
                # lookup (evicted or cleared), so report a failed load and let vLLM recompute.
                tr.cold_only = True
                self._loads.append(LoadJob(req_id=request.request_id, plan=None,
                                           block_ids=block_ids))
        else:
            self.tree.record_lookup(res)

    def _restore_anchor(self, request, anchor: AnchorHit, n: int,
                        block_ids: list[list[int]]) -> None:
        tr = self._track(request)
        # Session-exact state: this request never publishes into the shared tree.
        tr.canonical = False
        if anchor.tokens == n and self.anchors.begin_restore(anchor):
            tr.resume_at = n
            self._anchor_restoring[request.request_id] = anchor.anchor_id
            plan = RestorePlan(chain=(LinkRef(anchor.anchor_id, 0, n),), tokens=n,
                               part_bytes={}, total_bytes=self.anchors.nbytes(n))
            self._loads.append(LoadJob(req_id=request.request_id, plan=plan,
                                       block_ids=block_ids))
        else:
            tr.cold_only = True
            self._loads.append(LoadJob(req_id=request.request_id, plan=None,
                                       block_ids=block_ids))

    # -------------------------------------------------------------- per step
    def build_plan(self, so) -> StepPlan:
        plan = StepPlan(loads=self._loads, captures=self._finishing)
        self._loads = []
        self._finishing = []
        if not self.active:
            return plan
        for data in so.scheduled_new_reqs:
            tr = self._reqs.get(data.req_id)
            if tr is None:
                continue
            tr.block_ids = [list(b) for b in data.block_ids]
            self._plan_step(tr, data.req_id, data.num_computed_tokens,
                            so.num_scheduled_tokens[data.req_id], plan)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tr = self._reqs.get(req_id)
            if tr is None:
                continue
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tr.block_ids = [list(b) for b in new] if new is not None else tr.block_ids
                tr.canonical = False  # resumed after preemption: recomputed, not captured
            elif new is not None:
                for g, ids in enumerate(new):
                    tr.block_ids[g].extend(ids)
            self._plan_step(tr, req_id, cached.num_computed_tokens[i],
                            so.num_scheduled_tokens[req_id], plan)
        plan.drops = self.tree.drain_dropped() + self.anchors.drain_dropped()
        for link_id in plan.drops:
            self._draft_tokens.pop(link_id, None)
        return plan

    def _plan_step(self, tr: _Tracked, req_id: str, start: int, n: int, plan: StepPlan) -> None:
        prompt_len = len(tr.keys)
        end = start + n
        if (self.instrumentation is not None and self.instrumentation.probe_states
                and start < prompt_len <= end):
            plan.probes.append((req_id, prompt_len, [list(b) for b in tr.block_ids]))
        if start >= prompt_len or not tr.canonical or tr.unkeyed:
            return
        if start != tr.resume_at and start not in tr.cut_set:
            tr.canonical = False
            return
        next_cut = first_cut_after(tr.cuts, start, prompt_len)
        if end < min(next_cut, prompt_len):
            tr.canonical = False  # step clipped by the token budget: off the segmentation
            return
        if end not in tr.cut_set:
            return
        r = self.tree.reserve(tr.keys, end, tr.domain)
        if r.link_id is None:
            return
        if self._draft_route:  # at the prompt's end the draft row read the sampled token:
            toks = tr.keys.tokens  # -1 fits no prompt
            nxt = int(toks[end]) if end < prompt_len else -1
            self._draft_tokens[r.link_id] = (nxt, int(toks[prompt_len - 1]))
        plan.captures.append(CaptureJob(link_id=r.link_id, req_id=req_id, row_start=r.start,
                                        row_end=r.end, block_ids=[list(b) for b in tr.block_ids]))

    def apply_report(self, report: StepReport | None) -> None:
        if report is None or not self.active:
            return
        for link_id in report.failed_saves:
            self._abort(link_id)
        for link_id, seconds in report.saved.items():
            if link_id in report.failed_saves:
                continue
            if report.saved_count.get(link_id, 1) >= report.workers:
                if link_id >= ANCHOR_ID_BASE:
                    self.anchors.commit(link_id, seconds)
                else:
                    self.tree.commit(link_id, seconds)
            else:
                self._abort(link_id)
        for req_id in report.failed_loads:
            anchor_id = self._anchor_restoring.pop(req_id, None)
            if anchor_id is not None:
                self.anchors.end_restore(anchor_id, False, 0.0)
            plan = self._restoring.pop(req_id, None)
            if plan is not None:
                self.tree.end_restore(plan, False, 0.0)
            tr = self._reqs.get(req_id)
            if tr is not None:
                tr.resume_at = 0  # vLLM recomputes the request from token 0
                tr.cold_only = True
        if report.lost_links:
            self.tree.invalidate(sorted(report.lost_links))
        for req_id, seconds in report.loaded.items():
            anchor_id = self._anchor_restoring.pop(req_id, None)
            if anchor_id is not None:
                self.anchors.end_restore(anchor_id, True, seconds)
            plan = self._restoring.pop(req_id, None)
            if plan is not None:
                self.tree.end_restore(plan, True, seconds)

    def _abort(self, link_id: int) -> None:
        if link_id >= ANCHOR_ID_BASE:
            self.anchors.abort(link_id)
        else:
            self.tree.abort(link_id)

    def request_finished(self, request, block_ids=None) -> bool:
        """Forget the request; keep its end anchor. True: vLLM must keep its blocks until the
        workers have copied the anchor (reported back as a finished send)."""
        self._reqs.pop(request.request_id, None)
        self._anchor_hits.pop(request.request_id, None)
        res = self._lookups.pop(request.request_id, None)
        if res is not None and self.active:
            self.tree.record_lookup(res)
        if not self.active or block_ids is None or not self.anchors.enabled:
            return False
        from vllm.v1.request import RequestStatus

        n = request.num_computed_tokens
        if unkeyed_inputs(request):
            return False
        if (request.status == RequestStatus.FINISHED_ABORTED or n < request.num_prompt_tokens
                or not block_ids or any(len(b) == 0 for b in block_ids)):
            return False
        domain = request_domain(self.base_domain, request)
        anchor_id = self.anchors.reserve(list(request.all_token_ids)[:n], domain)
        if anchor_id is None:
            return False
        self._finishing.append(CaptureJob(link_id=anchor_id, req_id=request.request_id,
                                          row_start=0, row_end=n,
                                          block_ids=[list(b) for b in block_ids],
                                          finishing=True))
        return True

    def clear(self) -> int:
        if self.tree is None:
            return 0
        # payloads go to the workers as drops in the next plan
        return self.tree.clear() + self.anchors.clear()
