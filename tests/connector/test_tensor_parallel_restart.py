"""A restart from disk at tensor parallel size 2, on the quantized Flash-Next (issue 30, item 4).

One engine of `flash-next-tiny-fp8` (FP8 dynamic, the RDNA4 format; its routed experts vLLM's
fused MoE split over the ranks) at TP = 2 prefills a head: each rank's writer puts its own file
of each of the 5 links under the shared disk folder (core/disk/sharded.py). The engine shuts
down; a second engine of the same checkpoint and settings starts on the same folder, with an
empty RAM tier. Checked in the second engine:
- the next prompt resumes from both ranks' files: 5 links' tokens cached, and its greedy
  tokens, logprobs and, on each rank, the digests of every state section and complete K/V
  block equal a cold run of the same prompt in the same engine;
- one rank's file of the deepest link damaged on disk (a payload byte: its header still
  verifies) is a counted miss on every rank (a failed restore, the link invalidated): the
  request is recomputed and equals the cold run, never a restore mixed from one rank's file
  and the other's recomputation.
The sensitivity of the comparison itself (a corrupted restore fails it) is checked in
test_tensor_parallel.py.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.connector.conftest import connector_engine
from tests.connector.test_tensor_parallel import EXT, GRID, HEAD, _sched, cold, run, same
from vllm_hybridcache.testing.instrumentation import Instrumentation, probe_states_on_worker

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="TP = 2 on CPU binds one core per rank")]

MODEL = "flash-next-tiny-fp8"


def _engine(model_path, disk):
    return connector_engine(model_path, tensor_parallel_size=2, max_model_len=4096,
                            extra={"grid": GRID, "message_end_min": 64,
                                   "inner_captures": False, "disk_dir": str(disk / "links"),
                                   "disk_key_file": str(disk / "disk.key"),
                                   "disk_write_first_tokens": 0})


def _instrument(llm) -> None:
    _sched(llm).instrumentation = Instrumentation(probe_states=True)
    assert llm.collective_rpc(probe_states_on_worker) == [True, True]


def _rank_files(llm) -> list[dict[str, object]]:
    """Each rank's link files by name."""
    disk = _sched(llm).cache.tier("disk", "tree")
    return [{p.name: p for p in s.dir.rglob("*.link")} for s in disk.dir.shards]


def _wait_files(llm, n: int) -> list[int]:
    deadline = time.monotonic() + 120
    while min(len(f) for f in _rank_files(llm)) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    return [len(f) for f in _rank_files(llm)]


@pytest.fixture(scope="module")
def restarted(inproc, embedded_model, monkeypatch_module, tmp_path_factory):
    """The second engine, started on the first one's disk folder after it wrote the head's
    links and shut down."""
    first_core, second_core = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch_module.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{first_core}|{second_core}")
    disk = tmp_path_factory.mktemp("tp-restart")
    model = embedded_model(MODEL)
    with _engine(model, disk) as first:
        run(first, HEAD)
        assert _wait_files(first, 5) == [5, 5]
    with _engine(model, disk) as second:
        _instrument(second)
        yield second


def test_a_restarted_tp2_engine_resumes_from_every_rank_s_files(restarted):
    disk = _sched(restarted).cache.tier("disk", "tree")
    assert len(disk.dir.shards) == 2 and [len(f) for f in _rank_files(restarted)] == [5, 5]
    warm = run(restarted, EXT)
    assert warm["cached"] == 5 * GRID
    assert disk.stats().restores >= 1
    ext_cold = cold(restarted, EXT)
    assert ext_cold["states"][0] != ext_cold["states"][1]    # two different shards compared
    same(warm, ext_cold)


def test_a_damaged_rank_file_is_a_counted_miss_on_every_rank(restarted):
    sched = _sched(restarted)
    sched.clear()
    ext_cold = cold(restarted, EXT)          # its 6 links, written by both ranks
    assert _wait_files(restarted, 6) == [6, 6]
    sched.clear(tier="ram")
    files = _rank_files(restarted)[1]
    victim = files[max(files, key=lambda n: int(n.rsplit("-", 1)[1].split(".")[0]))]
    raw = bytearray(victim.read_bytes())
    raw[-10] ^= 0xFF                         # a payload byte of rank 1's deepest link
    victim.write_bytes(bytes(raw))
    before = sched.cache.tier("disk", "tree").stats()
    out = run(restarted, EXT)
    after = sched.cache.tier("disk", "tree").stats()
    same(out, ext_cold)                      # recomputed on both ranks, never mixed
    assert after.restores_failed == before.restores_failed + 1
    assert sum(after.misses.values()) > sum(before.misses.values())
    sched.clear()
