"""The RAM tree at tensor parallel size 2: warm equals cold, bit for bit, on every rank, for
qwen3-next-tiny in bf16 and as W8A8 int8 (`qwen3-next-tiny-w8a8`, tests/connector/
test_quantized.py), this package's Flash-Next as W8A8 int8 and as FP8 dynamic, the RDNA4
format (`flash-next-tiny-w8a8`, `flash-next-tiny-fp8`, flash_next/parallel.py; its routed
experts are vLLM's fused MoE, split over the ranks) and Flash-Next in bf16 with MTP
speculative decoding (2 draft tokens: the MTP route, the draft head's rows in every link).

(Tree links, with attention K/V in place below them, the default; and the disk tier, one file
per rank of every link, served back with the RAM tier cleared. End anchors are
session-exact, so their check is the float32 greedy gate of test_end_anchors.py, on
flash-next-tiny in float32 at TP = 2, with a restore corrupted on both ranks as its negative
control.)

vLLM's CPU backend runs TP = 2 with its multiprocessing executor (one worker process per rank,
threads bound one core each: `VLLM_CPU_OMP_THREADS_BIND=0|1`, the first two cores this process
may use). The engine core stays in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the scheduler side is reachable; each rank's
worker holds its own shard of every link (its GDN heads, its attention heads' K/V) in its own
store, and the scheduler side plans one link for both. Checked here: a warm run of a prompt
and a branch that shares its prefix give the greedy tokens, the logprobs and, on each rank,
the digests of every state section and complete K/V block of a cold run of the same prompt in
the same engine. Negative control: a restore corrupted on every rank after its checks passed
makes the same comparison fail.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.connector.conftest import connector_engine
from vllm_hybridcache.compat import inproc_scheduler_connector
from vllm_hybridcache.testing.instrumentation import (
    Instrumentation,
    probe_states_on_worker,
    take_worker_digests,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="TP = 2 on CPU binds one core per rank")]

GRID = 128
HEAD = [100 + (i * 7) % 3000 for i in range(5 * GRID + 60)]
EXT = HEAD + [50 + (i * 13) % 3000 for i in range(70)]
BRANCH = HEAD[: 3 * GRID + 10] + [9 + (i * 17) % 3000 for i in range(90)]


# (checkpoint, draft tokens of MTP speculative decoding: 0 = none, dtype: None = the
# checkpoint's)
ENGINES = {"qwen3-next-tiny": ("qwen3-next-tiny", 0, None),
           "qwen3-next-tiny-w8a8": ("qwen3-next-tiny-w8a8", 0, None),
           "flash-next-tiny-w8a8": ("flash-next-tiny-w8a8", 0, None),
           "flash-next-tiny-fp8": ("flash-next-tiny-fp8", 0, None),
           "flash-next-tiny-mtp2": ("flash-next-tiny", 2, None),
           "flash-next-tiny-f32": ("flash-next-tiny", 0, "float32")}  # the end-anchor gate


@pytest.fixture(scope="module", params=list(ENGINES))
def llm(request, inproc, embedded_model, monkeypatch_module, tmp_path_factory):
    first, second = sorted(os.sched_getaffinity(0))[:2]  # the cores this process may use
    disk = tmp_path_factory.mktemp("tp-disk")
    monkeypatch_module.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{first}|{second}")
    model, drafts, dtype = ENGINES[request.param]
    spec = ({"speculative_config": {"method": "mtp", "num_speculative_tokens": drafts}}
            if drafts else {})
    if dtype:
        spec["dtype"] = dtype
    with connector_engine(embedded_model(model), tensor_parallel_size=2, **spec,
                          max_model_len=4096, worker_extension_cls=(
                              "vllm_hybridcache.testing.instrumentation.FaultInjection"),
                          extra={"grid": GRID, "message_end_min": 64,
                                 "inner_captures": False, "disk_dir": str(disk / "links"),
                                 "disk_key_file": str(disk / "disk.key"),
                                 "disk_write_first_tokens": 0}) as engine:
        sched = inproc_scheduler_connector(engine)._sched
        sched.instrumentation = Instrumentation(probe_states=True)
        assert engine.collective_rpc(probe_states_on_worker) == [True, True]
        yield engine


def _sched(llm):
    return inproc_scheduler_connector(llm)._sched


def run(llm, prompt) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=5, detokenize=False)
    out = llm.generate([{"prompt_token_ids": list(prompt)}], sp, use_tqdm=False)[0]
    states = llm.collective_rpc(take_worker_digests, args=(out.request_id,))
    return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
            "logprobs": [{k: v.logprob for k, v in d.items()} for d in out.outputs[0].logprobs],
            "states": states}


def cold(llm, prompt) -> dict:
    _sched(llm).clear()
    out = run(llm, prompt)
    assert out["cached"] == 0
    assert len(out["states"]) == 2 and all(out["states"])  # one shard per rank
    return out


def same(warm: dict, cold_run: dict) -> None:
    assert warm["tokens"] == cold_run["tokens"]
    assert warm["logprobs"] == cold_run["logprobs"]
    assert warm["states"] == cold_run["states"]


def _quant_schemes(worker) -> set[str]:
    return {type(getattr(m, "scheme", None)).__name__
            for name, m in worker.model_runner.model.named_modules()
            if name.endswith(("in_proj_qkvz", "qkv_proj", "in_proj_qkv", "q_proj"))}


def test_the_engine_runs_two_ranks_with_the_cache_on(llm):
    assert llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
    assert _sched(llm).cache.tier_names()[0] == "ram"
    # both ranks hold a shard of every link: the budgets count both (host memory)
    from vllm_hybridcache.core import LinkKind, Tier

    cache = _sched(llm).cache
    assert cache.tier(Tier.RAM, LinkKind.TREE).config.shards == 2
    assert cache.tier(Tier.RAM, LinkKind.ANCHOR).shards == 2
    model_config = llm.llm_engine.vllm_config.model_config
    quantized = model_config.quantization is not None
    fp8 = quantized and model_config.hf_config.quantization_config["format"] == "float-quantized"
    # a quantized checkpoint runs vLLM's kernels of its format on both ranks (its own shards)
    expect = ({"CompressedTensorsW8A8Fp8" if fp8 else "CompressedTensorsW8A8Int8"}
              if quantized else {"NoneType"})
    assert llm.collective_rpc(_quant_schemes) == [expect, expect]
    # with MTP drafts the links are the MTP route's and carry the draft head's rows
    mtp = llm.llm_engine.vllm_config.speculative_config is not None
    assert _sched(llm).base_domain["route"] == ("mtp" if mtp else "ar")
    views = [v.name for v in _sched(llm).parts.layout.views]
    assert any(v.startswith("mtp.") for v in views) == mtp, views


def test_the_sizing_tool_counts_what_each_rank_holds(llm):
    """tools/sizing.py (docs/deploy-rocm.md, "Sizing") computes one rank's state of a request
    from the config alone: its recurrent sections and its K/V bytes a token, the draft head's
    rows on the MTP route. They are what this engine's layout holds on a rank (the boundary
    rows' sections of the MTP route aside: a link's, not a request's), given the SSM state
    dtype the engine runs (vLLM's CPU platform sets float32 where its GDN kernel is
    accelerated)."""
    from vllm_hybridcache.tools.sizing import load_config, state_bytes

    cfg = llm.llm_engine.vllm_config
    layout = _sched(llm).parts.layout
    st = state_bytes(load_config(cfg.model_config.model), 2, dtype=cfg.model_config.dtype,
                     mtp=cfg.speculative_config is not None,
                     ssm_dtype=cfg.cache_config.mamba_ssm_cache_dtype)
    sections = sum(s.nbytes for s in layout.sections if not s.name.startswith("draft#"))
    assert sections == st.sections
    assert sum(v.bytes_per_row for v in layout.views) == st.row * layout.view_block_tokens
    # negative control: one rank of TP = 1 (the whole heads) is another state
    whole = state_bytes(load_config(cfg.model_config.model), 1, dtype=cfg.model_config.dtype,
                        ssm_dtype=cfg.cache_config.mamba_ssm_cache_dtype)
    assert whole.sections != sections


def test_a_warm_prompt_and_a_branch_equal_their_cold_runs_on_every_rank(llm):
    ext_cold = cold(llm, EXT)
    branch_cold = cold(llm, BRANCH)
    # sensitivity: the two ranks hold different shards, and the prompts different states
    assert ext_cold["states"][0] != ext_cold["states"][1]
    assert ext_cold["states"] != branch_cold["states"]
    _sched(llm).clear()
    run(llm, HEAD)                       # links at every grid cut of the head
    ext = run(llm, EXT)
    branch = run(llm, BRANCH)
    assert ext["cached"] == 5 * GRID
    assert branch["cached"] == 3 * GRID
    same(ext, ext_cold)
    same(branch, branch_cold)


def _disk_files(llm) -> list[int]:
    disk = _sched(llm).cache.tier("disk", "tree")
    return [len(list(s.dir.rglob("*.link"))) for s in disk.dir.shards]


def _wait_files(llm, n: int) -> list[int]:
    """Until both ranks' writers have put `n` files (or 120 s)."""
    import time

    deadline = time.monotonic() + 120
    while min(_disk_files(llm)) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    return _disk_files(llm)


def test_a_disk_hit_equals_cold_on_every_rank(llm):
    """Each rank writes its own file of every link (core/disk/sharded.py); with the RAM tier
    cleared, the links come back from both ranks' files, exact on each rank."""
    ext_cold = cold(llm, EXT)
    # the cold run's 6 links landed before the clear deletes them: a write landing after it
    # would stand where the head's same links are about to be committed, and a link whose file
    # is there is not written again (the writer's own clear, queued behind, then deletes it)
    assert _wait_files(llm, 6) == [6, 6]
    _sched(llm).clear()
    run(llm, HEAD)                       # 5 links, written behind by both ranks' writers
    assert _wait_files(llm, 5) == [5, 5]
    _sched(llm).clear(tier="ram")
    ext = run(llm, EXT)
    assert ext["cached"] == 5 * GRID
    same(ext, ext_cold)
    assert _sched(llm).cache.tier("disk", "tree").stats().restores >= 1
    _sched(llm).clear()


def test_negative_control_a_restore_corrupted_on_every_rank_is_caught(llm):
    ext_cold = cold(llm, EXT)
    _sched(llm).clear()
    run(llm, HEAD)
    # the next request's id (LLM.generate numbers them; the engine's id contains it), and
    # only this one request runs until the result is taken
    tag = str(llm.request_counter.counter)
    armed = llm.collective_rpc("hybridcache_corrupt_restore", args=(tag,))
    assert armed == [{"armed": True}, {"armed": True}]
    warm = run(llm, EXT)
    done = llm.collective_rpc("hybridcache_corruption_result", args=(tag,))
    assert warm["cached"] == 5 * GRID
    assert all(d is not None and d["corrupted"] for d in done), done
    with pytest.raises(AssertionError):
        same(warm, ext_cold)
    _sched(llm).clear()


def test_an_end_anchor_passes_the_greedy_gate_on_two_ranks(llm):
    """Live continuation at TP = 2: each rank resumes from its own shard of the end anchor;
    the resumed turn agrees with a cold run of its prompt within the float32 drift, and the
    same resume with its state corrupted on both ranks fails the gate."""
    from tests.connector.test_end_anchors import greedy_gate

    if llm.llm_engine.vllm_config.model_config.dtype != torch.float32:
        pytest.skip("the greedy gate's drift bound is float32's (test_end_anchors.py)")
    if not _sched(llm).anchors.enabled:
        pytest.skip("end anchors are off in this engine")
    p = [200 + (i * 41) % 2500 for i in range(300)]
    _sched(llm).clear()
    first = run(llm, p)
    nxt = p + first["tokens"] + [11 + (i * 3) % 500 for i in range(30)]
    cold_run = cold(llm, nxt)
    for corrupt in (False, True):
        _sched(llm).clear()
        run(llm, p)
        run(llm, [1, 2, 3])  # one more step: the anchor's copy lands and is committed
        tag = str(llm.request_counter.counter)
        if corrupt:
            assert llm.collective_rpc("hybridcache_corrupt_restore", args=(tag,)) == [
                {"armed": True}, {"armed": True}]
        warm = run(llm, nxt)
        assert warm["cached"] == len(p) + len(first["tokens"]) - 1  # the end anchor
        if not corrupt:
            assert greedy_gate(warm, cold_run) == len(cold_run["tokens"])
            continue
        done = llm.collective_rpc("hybridcache_corruption_result", args=(tag,))
        assert all(d is not None and d["corrupted"] and d["kind"] == "anchor" for d in done)
        with pytest.raises(AssertionError, match=r"position \d: logprobs moved"):
            greedy_gate(warm, cold_run)
    _sched(llm).clear()
