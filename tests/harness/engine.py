"""A no-model engine: vLLM's real scheduler and our connector over small fake KV tensors.

The exactness tests in tests/connector need a model and minutes. Most of what can go wrong in
the connector is protocol, not arithmetic: which step plans which copy, when a link becomes
visible, what a failed copy does, how worker reports merge. This harness runs those paths in
seconds with the real pieces and only the model faked:

- `SegmentedScheduler` (vLLM's `Scheduler` with our cut hook), built as `EngineCore` builds it,
  with our `HybridSnapshotConnector` as its KV connector (scheduler role, made by vLLM's
  factory from a real `KVTransferConfig`);
- one or more workers, each with its own `HybridSnapshotConnector` (worker role) and fake KV
  tensors: one Mamba-like group (two state tensors per block, like a conv tail and a recurrent
  state) and one full-attention group (paged K/V blocks);
- a fake model that, per scheduled step, reads the request's state and earlier K rows from
  those tensors and writes new ones: the state after a position is a deterministic function of
  every token before it, so a restored state that differs from the cold one in any byte shows
  in the final state digests and, through the sampled tokens, in the output;
- each step drives the worker connector in the order of vLLM's
  `KVConnectorModelRunnerMixin._get_kv_connector_output` (bind metadata, forward, start the
  asynchronous loads, wait for saves, transfer results, worker metadata, clear), merges the
  workers' outputs with vLLM's `KVOutputAggregator`, and hands a `ModelRunnerOutput` to
  `Scheduler.update_from_output`, as `EngineCore.step` does;
- or, with `async_scheduling`, the async flavour (`SegmentedAsyncScheduler`, over vLLM's
  `AsyncScheduler`) stepped as `EngineCore.step_with_batch_queue` steps it: step N + 1 is
  scheduled and run before step N's output is applied (one step in flight), and the fake model
  reads the tokens it sampled itself, as vLLM's model runner does, not the scheduler's (which
  holds placeholders for them until the output arrives).

Tests read the cache only through `cache_stats` (the connector's stats payload, the one place
that knows its layout) and through what a client sees: cached tokens, output tokens and the
state digests recorded by the connector's `Instrumentation`.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_hybridcache.testing.instrumentation import Instrumentation

BLOCK = 16                        # tokens per attention KV block
MAX_LEN = 1024                    # max model length (the Mamba group's block covers it)
VOCAB = 4000
SECTION_SHAPES = ((3, 8), (4, 8))  # per block: a conv-tail-like and a recurrent-state-like part
HEAD = 8                          # K/V row width (one KV head)
MAMBA_LAYER = "gdn.0"
ATTN_LAYER = "attn.1"


@functools.cache
def _model_dir() -> str:
    """A folder holding a config.json, enough for vLLM's `ModelConfig`, and one small weight
    file that only names the checkpoint by content (the disk tier's fingerprint); no tokenizer:
    the harness never loads a model. One per process, removed at exit."""
    d = Path(tempfile.mkdtemp(prefix="hc-harness-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_hidden_layers": 2, "vocab_size": VOCAB, "max_position_embeddings": MAX_LEN,
        "torch_dtype": "float32"}))
    from safetensors.torch import save_file

    save_file({"harness": torch.arange(8, dtype=torch.float32)}, str(d / "model.safetensors"))
    return str(d)


def kv_cache_config(num_blocks: int):
    """One Mamba-like group and one full-attention group, as a hybrid model's engine has."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    mamba = MambaSpec(block_size=MAX_LEN, shapes=SECTION_SHAPES,
                      dtypes=(torch.float32, torch.float32))
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layer_names=[MAMBA_LAYER], kv_cache_spec=mamba),
        KVCacheGroupSpec(layer_names=[ATTN_LAYER], kv_cache_spec=attn),
    ])


def vllm_config(settings: dict[str, Any], num_blocks: int, max_num_batched_tokens: int,
                max_num_seqs: int, tp: int, async_scheduling: bool = False):
    """A real `VllmConfig` with our connector and scheduler, as `--plugin hybridcache` sets."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    from vllm_hybridcache.serving.flags import CONNECTOR_CONFIG, SCHEDULER_CLS

    mc = ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="float32",
                     max_model_len=MAX_LEN, seed=0)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=MAX_LEN, enable_chunked_prefill=True,
                         is_encoder_decoder=False, scheduler_cls=SCHEDULER_CLS)
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    cc.num_gpu_blocks = num_blocks
    kv = KVTransferConfig(**CONNECTOR_CONFIG, kv_connector_extra_config=dict(settings))
    cfg = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                     kv_transfer_config=kv, device_config=DeviceConfig("cpu"))
    # domain field only: the connector keys links by TP size; no process group is built here
    cfg.parallel_config.tensor_parallel_size = tp
    # vLLM's CPU platform turns async scheduling off in its config hook; where it is on (a GPU
    # platform's default) the field is resolved to True by the time EngineCore builds the
    # scheduler, which is all the scheduler and the connector read
    cfg.scheduler_config.async_scheduling = async_scheduling
    return cfg


class HarnessInstrumentation(Instrumentation):
    """The connector's test hooks, plus a corrupted restore for the negative control."""

    def __init__(self, *, probe_states: bool) -> None:
        super().__init__(probe_states=probe_states)
        self.corrupt_loads = False
        self.worker: FakeWorker | None = None

    def after_load(self, job, seconds: float) -> None:
        super().after_load(job, seconds)
        if self.corrupt_loads and load_chain(job):
            self.worker.sections[1][job.block_ids[0][0]][0, 0] += 1.0


# ----------------------------------------------------------------------------- fake model
def _embed(token: int, rank: int) -> torch.Tensor:
    i = torch.arange(HEAD, dtype=torch.float32)
    return torch.sin((token + 1) * (i + 1) * 0.37 + rank)


class FakeWorker:
    """One worker: fake KV tensors, a worker-role connector, and the fake model's forward.

    `rank` shifts the model's arithmetic, so each worker's tensors hold a different shard (as
    tensor parallelism gives each rank different heads); only rank 0's samples count.
    `defer_save`: the order vLLM's model runner uses with a draft model (speculative decoding,
    `defer_finalize`): the step's connector output, worker metadata included, is built before
    `wait_for_save`, which runs after the draft, so a step's copies are reported with the next
    step's output.
    """

    def __init__(self, cfg, kv_config, rank: int,
                 instrumentation: HarnessInstrumentation, defer_save: bool = False) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from vllm_hybridcache.adapter.connector import HybridSnapshotConnector

        n = kv_config.num_blocks
        self.rank = rank
        self.defer_save = defer_save
        self.sections = [torch.zeros(n, *s) for s in SECTION_SHAPES]
        self.kv = torch.zeros(2, n, BLOCK, 1, HEAD)       # [K/V, blocks, tokens, heads, dim]
        self.connector = HybridSnapshotConnector(cfg, KVConnectorRole.WORKER, kv_config)
        self.connector._worker.rank = rank  # what vLLM's tensor-parallel group says in a worker
        # the worker side reads state tensors from the forward context, as in a model runner
        ctx = cfg.compilation_config.static_forward_context
        ctx[MAMBA_LAYER] = _Layer(self.sections)
        try:
            self.connector.register_kv_caches({MAMBA_LAYER: self.sections, ATTN_LAYER: self.kv})
        finally:
            ctx.pop(MAMBA_LAYER)
        self.connector._worker.instrumentation = instrumentation
        instrumentation.worker = self

    def _k_row(self, kv_blocks: list[int], p: int) -> torch.Tensor:
        return self.kv[0, kv_blocks[p // BLOCK], p % BLOCK, 0]

    def forward(self, tokens: list[int], start: int, n: int, block_ids) -> int:
        """Run positions [start, start + n); return the token sampled after the last one.

        Like a real hybrid model: a request starting at 0 ignores whatever its state block
        holds (vLLM's `has_initial_state` is false); one starting later reads its state from
        its Mamba block, and every position "attends" to the K rows at p - 1 and p // 2, read
        from the paged blocks (so restored early blocks matter as much as the last one). The
        arithmetic per position does not depend on where steps start, so any split of a
        prefill, or decode steps, give the same bytes: a restore is exact or visibly wrong.
        """
        mb = block_ids[0][0]
        kv_blocks = block_ids[1]
        if start == 0:
            conv, rec = torch.zeros(SECTION_SHAPES[0]), torch.zeros(SECTION_SHAPES[1])
        else:
            conv, rec = self.sections[0][mb].clone(), self.sections[1][mb].clone()
        gain = torch.linspace(0.25, 1.0, rec.shape[0])[:, None]
        for p in range(start, start + n):
            x = _embed(tokens[p], self.rank)
            ctx = (self._k_row(kv_blocks, p - 1) + self._k_row(kv_blocks, p // 2)
                   if p > 0 else torch.zeros(HEAD))
            k = torch.tanh(rec[p % rec.shape[0]] + x + 0.5 * ctx + conv.mean(0))
            b, o = kv_blocks[p // BLOCK], p % BLOCK
            self.kv[0, b, o, 0] = k
            self.kv[1, b, o, 0] = torch.cos(k)
            rec = torch.tanh(0.5 * rec + 0.5 * k * gain)
            conv = torch.cat([conv[1:], x[None]])
        self.sections[0][mb] = conv
        self.sections[1][mb] = rec
        return 10 + int(abs(float(rec.sum() + conv.sum())) * 1e4) % (VOCAB - 10)

    def execute(self, so, scheduler, tokens: dict[str, list[int]]):
        """One step on this worker: vLLM's model-runner order around the connector.

        `tokens`: each scheduled request's tokens as the model runner knows them (its prompt
        and every token sampled so far, also those whose output the scheduler has not applied
        yet under async scheduling)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        conn = self.connector
        conn.bind_connector_metadata(so.kv_connector_metadata)
        # a step with a synchronous load starts its loads before the forward (they feed it),
        # any other after it (vLLM's `_get_kv_connector_output`)
        if so.has_sync_kv_loads:
            conn.start_load_kv(None)
        req_ids, sampled = [], []
        for req_id, start in _scheduled(so):
            n = so.num_scheduled_tokens[req_id]
            toks = tokens[req_id]
            tok = self.forward(toks, start, n, scheduler.kv_cache_manager.get_block_ids(req_id))
            req_ids.append(req_id)
            # a partial prefill samples nothing (the model runner discards its sample)
            sampled.append([tok] if start + n >= len(toks) else [])
        if not so.has_sync_kv_loads:
            conn.start_load_kv(None)
        if not self.defer_save:
            conn.wait_for_save()
        res = conn.get_transfer_results(so.finished_req_ids)
        out = KVConnectorOutput(
            finished_sending=res.finished_sending, finished_recving=res.finished_recving,
            failed_recving=res.failed_recving,
            invalid_block_ids=conn.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=conn.build_connector_worker_meta())
        if self.defer_save:  # after the draft model's forward (vLLM's finalize_kv_connector)
            conn.wait_for_save()
        conn.clear_connector_metadata()
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=out)


@dataclass
class _Layer:
    kv_cache: list[torch.Tensor]


def _scheduled(so) -> list[tuple[str, int]]:
    """(request id, first position) of every request scheduled in this step."""
    out = [(d.req_id, d.num_computed_tokens) for d in so.scheduled_new_reqs]
    c = so.scheduled_cached_reqs
    out += list(zip(c.req_ids, c.num_computed_tokens, strict=True))
    return out


# ---------------------------------------------------------------------------- the engine
@dataclass
class Run:
    """What a client sees of one request, plus the state digests at its prefill's end."""

    req_id: str
    tokens: list[int] = field(default_factory=list)
    cached: int | None = None          # position its first forward step started at
    state: dict[str, str] | None = None
    finished: bool = False


class HarnessEngine:
    """vLLM's scheduler + our connector + `workers` fake workers, stepped like `EngineCore`.

    `settings`: the connector's settings (defaults: grid 64, no message-end cuts, no memory
    floor). One `Instrumentation` per worker (`instrumentation[rank]`); rank 0's is also the
    scheduler side's, with state probes on. `defer_save`: workers report a step's copies with
    the next step, as vLLM's runner does with a draft model (see `FakeWorker`).
    `async_scheduling`: vLLM's async scheduler and
    `EngineCore.step_with_batch_queue`'s order (see `step`).
    """

    BATCH_QUEUE = 2  # vLLM's max_concurrent_batches with async scheduling, no pipeline stages

    def __init__(self, settings: dict[str, Any] | None = None, *, workers: int = 1,
                 num_blocks: int = 160, max_num_batched_tokens: int = 256,
                 max_num_seqs: int = 8, defer_save: bool = False,
                 async_scheduling: bool = False) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        from vllm.v1.structured_output import StructuredOutputManager

        merged = {"grid": 64, "message_end_ids": [-1], "memory_floor_bytes": 0}
        merged.update(settings or {})
        self.vllm_config = cfg = vllm_config(merged, num_blocks, max_num_batched_tokens,
                                             max_num_seqs, workers, async_scheduling)
        kv_config = kv_cache_config(num_blocks)
        self.instrumentation = [HarnessInstrumentation(probe_states=r == 0)
                                for r in range(workers)]
        self.workers = [FakeWorker(cfg, kv_config, r, self.instrumentation[r], defer_save)
                        for r in range(workers)]
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, cfg)
        sched_cls = cfg.scheduler_config.get_scheduler_cls()
        self.scheduler = sched_cls(
            vllm_config=cfg, kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(cfg), block_size=block_size,
            hash_block_size=hash_block_size, log_stats=True)
        # The fake model "encodes" images for free: give the scheduler the encoder budget and
        # cache a multimodal model config would (the config.json names a text-only model).
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

        self.scheduler.max_num_encoder_input_tokens = max_num_batched_tokens
        self.scheduler.encoder_cache_manager = EncoderCacheManager(
            cache_size=max_num_batched_tokens)
        # EngineCore seeds the root of vLLM's block hashes when a connector is configured
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import init_none_hash

        init_none_hash(get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo))
        self.connector = self.scheduler.connector
        self.connector._sched.instrumentation = self.instrumentation[0]
        self.aggregator = KVOutputAggregator.from_connector(self.connector, workers)
        self.runs: dict[str, Run] = {}
        # the model runner's tokens per request: prompt + every token rank 0 sampled
        self.tokens: dict[str, list[int]] = {}
        # async scheduling: steps scheduled and run whose outputs are not applied yet, newest
        # first (EngineCore's batch queue); None when synchronous
        self.queue: deque | None = deque() if async_scheduling else None
        self.plans: list = []
        self._n = 0
        self.steps = 0

    # ------------------------------------------------------------------ requests
    def add(self, prompt: list[int], *, max_tokens: int = 3, req_id: str | None = None,
            cache_salt: str | None = None, image: str | None = None,
            uuid: str | None = None, embeds: bool = False,
            stop_token_ids: list[int] | None = None) -> str:
        """Queue a request; `image` adds one multimodal item (placeholder tokens at 8..40)
        whose processed tensors are a function of that string ("" = no content at the
        scheduler, no identifier), identified by the client's `uuid` when given, else by the
        string itself (as vLLM's own content hash would); `embeds` sends prompt embeddings
        along with the ids; `stop_token_ids` ends the request on one of these tokens (vLLM's
        FINISHED_STOPPED, before `max_tokens`)."""
        from vllm import SamplingParams
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.v1.request import Request

        if req_id is None:
            self._n += 1
            req_id = f"r{self._n}"
        mm = None
        if image is not None:
            from tests.adapter.test_unkeyed_inputs import pixels

            identifier = image if uuid is None else uuid
            mm = [MultiModalFeatureSpec(data=pixels(image) if image else None,
                                        modality="image", identifier=identifier,
                                        mm_position=PlaceholderRange(offset=8, length=32),
                                        mm_hash=identifier)]
        req = Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens,
                                                           ignore_eos=True,
                                                           stop_token_ids=stop_token_ids),
                      None, mm_features=mm, cache_salt=cache_salt,
                      prompt_embeds=torch.zeros(len(prompt), 8) if embeds else None)
        self.scheduler.add_request(req)
        self.runs[req_id] = Run(req_id)
        return req_id

    def schedule(self):
        """vLLM's `schedule()`: the step's `SchedulerOutput`, our `StepPlan` in its
        `kv_connector_metadata` (also appended to `plans`)."""
        so = self.scheduler.schedule()
        self.plans.append(so.kv_connector_metadata)
        resumed = set(so.scheduled_cached_reqs.resumed_req_ids)
        for req_id, start in _scheduled(so):
            run = self.runs.get(req_id)
            # where its first forward started; a request withdrawn before any output (a
            # failed synchronous load's step) counts from where it resumes
            if run is not None and (run.cached is None or (req_id in resumed
                                                           and not run.tokens)):
                run.cached = start
        return so

    def execute(self, so) -> list:
        """Every worker runs the step (forward and connector copies): their outputs. Rank 0's
        samples extend the model runner's tokens (what every rank forwards next, as vLLM's
        workers all get the same sampled tokens)."""
        tokens = {}
        # new and resumed requests come with the scheduler's tokens (a resumed one's output
        # in flight at its preemption is dropped or delivered stale, not forwarded)
        fresh = {d.req_id for d in so.scheduled_new_reqs}
        fresh |= set(so.scheduled_cached_reqs.resumed_req_ids)
        for req_id, _ in _scheduled(so):
            known = list(self.scheduler.requests[req_id].all_token_ids)
            mine = self.tokens.get(req_id)
            if (req_id not in fresh and mine is not None and len(mine) >= len(known)
                    and mine[:len(known)] == known):
                known = mine  # sampled tokens the scheduler does not hold yet (async)
            tokens[req_id] = self.tokens[req_id] = known
        outputs = [w.execute(so, self.scheduler, tokens) for w in self.workers]
        first = outputs[0]
        for req_id, sampled in zip(first.req_ids, first.sampled_token_ids, strict=True):
            tokens[req_id].extend(sampled)
        return outputs

    def update(self, so, outputs: list) -> None:
        """Merge the workers' outputs (vLLM's `KVOutputAggregator`) and hand them to vLLM's
        `update_from_output`, which calls the connector's `update_connector_output`."""
        merged = self.aggregator.aggregate(outputs)
        engine_outputs = self.scheduler.update_from_output(so, merged)
        for eco in engine_outputs.values():
            for o in eco.outputs:
                run = self.runs.get(o.request_id)
                if run is None:
                    continue
                run.tokens += list(o.new_token_ids)
                if o.finish_reason is not None:
                    run.finished = True
        from vllm.v1.request import RequestStatus

        for run in self.runs.values():
            if run.state is None:
                run.state = self.instrumentation[0].take_digests(run.req_id)
                req = self.scheduler.requests.get(run.req_id)
                if req is not None and req.status == RequestStatus.PREEMPTED:
                    run.state = None  # its step was withdrawn: the state of the rerun counts
        self.steps += 1

    def step(self) -> None:
        """One `EngineCore.step`: schedule, run every worker, merge, update. Under async
        scheduling one `EngineCore.step_with_batch_queue` instead (see `_step_async`)."""
        if self.queue is not None:
            self._step_async()
            return
        so = self.schedule()
        self.update(so, self.execute(so))

    def _step_async(self, force: bool = False) -> None:
        """`EngineCore.step_with_batch_queue` with a queue of `BATCH_QUEUE` (async scheduling):
        schedule a step while the queue has room and the scheduler has requests (`force`:
        also without, as the harness's synchronous `step` does, to deliver the last reports)
        and run it; return at once while the queue is not full and there is more to do,
        otherwise apply the oldest step's output. The workers run a step as soon as it is
        scheduled, before the outputs of steps before it are applied (vLLM's device executes
        steps in order; its scheduler learns of them later)."""
        q = self.queue
        if force or self.scheduler.has_requests():
            so = self.schedule()
            q.appendleft((so, self.execute(so)))
            if len(q) < self.BATCH_QUEUE and (so.total_num_scheduled_tokens > 0
                                              or self.scheduler.has_requests()):
                return
        if q:
            so, outputs = q.pop()
            self.update(so, outputs)

    def in_flight(self) -> int:
        """Steps scheduled whose outputs are not applied yet (0 when synchronous)."""
        return len(self.queue) if self.queue is not None else 0

    def step_until(self, done, limit: int = 200) -> None:
        for _ in range(limit):
            if done():
                return
            self.step()
        raise AssertionError(f"not done after {limit} steps")

    def drain(self) -> None:
        """Step until no request is left, then once more: the last step's reports (end
        anchors, finished sends) arrive with the step after it. Under async scheduling also
        until no step is in flight, and the last step is applied at once."""
        if self.queue is None:
            self.step_until(lambda: not self.scheduler.has_requests())
            self.step()
            return
        self.step_until(lambda: not self.scheduler.has_requests() and not self.queue)
        self._step_async(force=True)
        assert not self.queue

    def run(self, prompt: list[int], **kw: Any) -> Run:
        """One request from start to finish, alone in the engine."""
        req_id = self.add(prompt, **kw)
        self.drain()
        return self.runs[req_id]

    def peek(self, prompt: list[int]) -> int:
        """Tokens a new request with this prompt would be served from the cache now, asked
        through the connector's own API (`get_num_new_matched_tokens`, then
        `request_finished`, as vLLM does for a request that never runs). Counts a lookup."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self._n += 1
        req = Request(f"peek{self._n}", list(prompt), SamplingParams(max_tokens=1), None)
        n, _ = self.connector.get_num_new_matched_tokens(req, 0)
        self.connector.request_finished(req, [])
        return n or 0

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def preempt_running(self) -> None:
        """Preempt every running request through vLLM's own path (as memory pressure does)."""
        assert self.scheduler.reset_prefix_cache(reset_running_requests=True)

    def clear(self) -> None:
        """What `/v1/cache/clear` and `reset_prefix_cache(reset_connector=True)` call."""
        assert self.connector.reset_cache()

    def set_fault(self, fault, rank: int = 0) -> None:
        """Make copies on one worker fail: `fault(kind, job)` raises for the ones to fail."""
        self.instrumentation[rank].fault = fault

    def corrupt_restores(self, on: bool = True, rank: int = 0) -> None:
        """Negative control: every restore on a worker leaves one state value off by one."""
        self.instrumentation[rank].corrupt_loads = on


# ------------------------------------------------ the connector's data, read in one place
# Tests read cache state only through these helpers, so a change of the stats payload or of
# the plan's job layout is adapted here.

def cache_stats(engine: HarnessEngine, kind: str = "tree", tier: str = "ram") -> dict[str, Any]:
    """The connector's cumulative stats of one kind of cache: "tree" (the shared snapshot tree)
    or "anchor" (end anchors of finished requests), of one tier ("ram", "disk"), from the
    payload the scheduler side sends to vLLM's metrics (`get_kv_connector_stats`).
    """
    payload = engine.connector.get_kv_connector_stats()
    assert payload is not None, "the connector is inactive"
    return dict(payload.data["tiers"][tier][kind])   # {"tiers": {tier: {kind: stats}}}


def load_chain(job) -> list[int]:
    """Link ids a `LoadJob` restores, root first; empty for a load planned to fail."""
    return [] if job.fail is not None else [r.link_id for r in job.chain]


def dropped_ids(plan) -> set[int]:
    """Link ids a `StepPlan` tells the workers to drop."""
    return {addr.link_id for addr in plan.drops}


def in_place_stats(engine: HarnessEngine) -> dict[str, int]:
    """Attention K/V in place: tokens of restored hits served from vLLM's shared blocks and
    copied from links, and the view bytes not copied (the stats payload's `in_place`)."""
    payload = engine.connector.get_kv_connector_stats()
    assert payload is not None, "the connector is inactive"
    out = {"tokens_in_place": 0, "tokens_copied": 0, "bytes_saved": 0}
    for kinds in payload.data.get("in_place", {}).values():   # {tier: {kind: counts}}
        for counts in kinds.values():
            for key in out:
                out[key] += counts[key]
    return out


def load_jobs(engine: HarnessEngine, req_id: str) -> list:
    """Every `LoadJob` planned for a request so far."""
    return [job for plan in engine.plans for job in plan.loads if job.req_id == req_id]
