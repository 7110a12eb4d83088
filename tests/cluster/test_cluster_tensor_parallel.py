"""Two replicas at tensor parallel size 2 share links through the cluster tier (issue 30,
item 4): flash-next-tiny-w8a8 (this package's Flash-Next, W8A8 int8) with the RAM tree, the
disk tier and the cluster tier on, on a local Ray.

Each rank's worker of replica A publishes its own shard of every link it captures (its own
locator, a header carrying its shard tag); replica B serves a chain only when both ranks'
payloads of it are listed and verified, each of its workers reading its own rank's file
(core/tiers/cluster.py, `shards`). Checked: a turn moved to B resumes from A's links and
equals a cold prefill on B (a fresh cache_salt) in token ids and logprobs, bit for bit, and
the directory lists every link of A once per rank. Negative control: the same resume with
the restore corrupted on both ranks of B after every check passed differs from cold. (A
rank's payload missing, foreign or damaged: tests/cluster/test_cluster_shards.py.)
"""

from __future__ import annotations

import os
import uuid

import pytest
import ray

from tests.cluster.conftest import cluster_restores, conversation
from tests.cluster.directory_view import ask
from tests.keys import CLUSTER_SECRET_FILE
from vllm_hybridcache.cluster.directory import NAMESPACE
from vllm_hybridcache.testing.replica import replica_actor

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="TP = 2 on CPU binds one core per rank")]

GRID = 256
ENGINE = {"max_model_len": 4096, "max_num_batched_tokens": 2048, "enforce_eager": True,
          "seed": 0, "tensor_parallel_size": 2,
          "worker_extension_cls": "vllm_hybridcache.testing.instrumentation.FaultInjection"}


@pytest.fixture(scope="module")
def replicas(embedded_model, tmp_path_factory):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{first}|{second}")
    ray.init(num_cpus=2, object_store_memory=256 << 20, include_dashboard=False,
             namespace=NAMESPACE, log_to_driver=False)
    made = []
    try:
        Replica = replica_actor(num_cpus=1)
        model = str(embedded_model("flash-next-tiny-w8a8"))
        for name in ("A", "B"):
            disk = tmp_path_factory.mktemp(f"disk-{name}")
            settings = {"grid": GRID, "message_end_min": 64, "cluster_timeout_s": 60,
                        "cluster_secret_file": str(CLUSTER_SECRET_FILE),
                        "disk_dir": str(disk / "links"), "disk_key_file": str(disk / "key")}
            made.append(Replica.remote(model, name, settings, ENGINE))
        ray.get([r.stats.remote() for r in made])
        yield made
    finally:
        for r in made:
            try:
                ray.get(r.shutdown.remote(), timeout=120)
            except ray.exceptions.RayError:
                pass
        ray.shutdown()
        mp.undo()


def test_a_turn_on_the_other_replica_resumes_from_both_ranks_links_and_equals_cold(replicas):
    a, b = replicas
    turns = conversation(1, 3)
    for p in turns[:2]:
        ray.get(a.generate.remote(p))
    listed = ask("entries_of", "A")
    assert listed and len(listed) % 2 == 0  # every link once per rank
    before = cluster_restores(b)
    warm = ray.get(b.generate.remote(turns[2]))
    assert warm["cached"] >= GRID  # A's links, fetched through the cluster tier
    assert cluster_restores(b) == before + 1
    cold = ray.get(b.generate.remote(turns[2], salt=f"cold-{uuid.uuid4().hex}"))
    assert cold["cached"] == 0
    assert warm["tokens"] == cold["tokens"]
    assert warm["logprobs"] == cold["logprobs"]


def test_negative_control_a_corrupted_restore_on_both_ranks_differs_from_cold(replicas):
    a, b = replicas
    turns = conversation(2, 2)
    ray.get(a.generate.remote(turns[0]))
    tag, armed = ray.get(b.arm_corruption.remote())
    assert armed == [{"armed": True}, {"armed": True}]
    warm = ray.get(b.generate.remote(turns[1]))
    done = ray.get(b.corruption_result.remote(tag))
    assert warm["cached"] >= GRID
    assert all(d is not None and d["corrupted"] and d["tier"] == "cluster" for d in done), done
    cold = ray.get(b.generate.remote(turns[1], salt=f"cold-{uuid.uuid4().hex}"))
    assert warm["logprobs"] != cold["logprobs"]
