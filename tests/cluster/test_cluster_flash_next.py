"""Two replicas of flash-next-tiny (Flash-Next: GDN and PLE states, QSA rows, fine segmentation)
on a local Ray: turns 1..k on replica A, turn k+1 forced to replica B resumes from A's links
through the cluster tier and equals a cold prefill on B (a fresh cache_salt) in token ids and
logprobs, bit for bit; negative control: a forged link of A's chain (state bytes altered,
checksums and MACs valid: made with the cluster secret) is restored on B and the logprobs then
differ from the cold ones. And the
deepest link of a request, committed by its last step, is in the directory once the request
returned, with no further step on its replica (the in-process engine steps only while it has
requests), so a turn moved right after it resumes from the full depth.

The replicas are the in-process engine actors of `vllm_hybridcache.testing.replica` (two Ray
actors, no HTTP front): the cheapest pair of engines with the cluster tier on. The qwen3-next-tiny
pair of test_cluster_serving.py covers the launcher, the front and routing.
"""

from __future__ import annotations

import time
import uuid

import pytest
import ray

from tests.cluster.conftest import cluster_restores, conversation
from tests.cluster.directory_view import entries_of
from tests.cluster.forgery import Ghost, forged_chain
from tests.keys import CLUSTER_KEY, CLUSTER_SECRET_FILE
from vllm_hybridcache.cluster.directory import NAMESPACE
from vllm_hybridcache.testing.replica import replica_actor

pytestmark = pytest.mark.slow

GRID = 256
SETTINGS = {"grid": GRID, "message_end_min": 64, "cluster_timeout_s": 60,
            "cluster_secret_file": str(CLUSTER_SECRET_FILE)}
ENGINE = {"max_model_len": 4096, "max_num_batched_tokens": 2048, "enforce_eager": True,
          "seed": 0}


@pytest.fixture(scope="module")
def replicas(embedded_model):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    ray.init(num_cpus=2, object_store_memory=256 << 20, include_dashboard=False,
             namespace=NAMESPACE, log_to_driver=False)
    made = []
    try:
        Replica = replica_actor(num_cpus=1)
        model = str(embedded_model("flash-next-tiny"))
        made = [Replica.remote(model, n, SETTINGS, ENGINE) for n in ("A", "B")]
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


def test_a_turn_on_the_other_replica_resumes_from_the_owners_links_and_equals_cold(replicas):
    a, b = replicas
    turns = conversation(1, 4)
    for p in turns[:3]:
        ray.get(a.generate.remote(p))
    assert entries_of("A", turns[2])
    before = cluster_restores(b)
    warm = ray.get(b.generate.remote(turns[3]))
    assert warm["cached"] >= GRID  # A's links, fetched through the cluster tier
    assert cluster_restores(b) == before + 1
    cold = ray.get(b.generate.remote(turns[3], salt=f"cold-{uuid.uuid4().hex}"))
    assert cold["cached"] == 0
    assert warm["tokens"] == cold["tokens"]
    assert warm["logprobs"] == cold["logprobs"]


def test_negative_control_a_forged_remote_link_changes_the_logprobs(replicas, tmp_path):
    a, b = replicas
    turns = conversation(2, 2)
    ray.get(a.generate.remote(turns[0]))
    entries = entries_of("A", turns[0])
    assert entries
    ghost = Ghost.remote(str(CLUSTER_SECRET_FILE))
    # the chain now names the ghost, its deepest link forged with the secret (what a bug in
    # a copy would produce: every check passes, only the comparison with cold can tell)
    ray.get(ghost.publish.remote(forged_chain(entries, tmp_path, CLUSTER_KEY)))
    try:
        out = ray.get(b.generate.remote(turns[1]))
        assert out["cached"] == entries[-1][1][2]  # the forged chain was restored
        cold = ray.get(b.generate.remote(turns[1], salt=f"cold-{uuid.uuid4().hex}"))
        assert cold["cached"] == 0
        assert out["logprobs"] != cold["logprobs"]
    finally:
        ray.kill(ghost)


def test_the_link_committed_by_a_requests_last_step_is_published_by_its_response(replicas):
    """A prompt of 3 grid cuts and one output token: its last prefill step [512, 768) is the
    request's last step and captures the deepest link, at 768. A's engine runs no step after
    `generate` returns, so that link is in the directory only if the worker published it in
    that step (before the fix it waited for A's next request). Ray delivers the call to the
    directory asynchronously: the loop waits only for that delivery. B then resumes a longer
    prompt from that depth and answers what a cold prefill answers."""
    a, b = replicas
    prompt = [(3 * 997 + 100 + i * 7) % 3000 + 10 for i in range(3 * GRID)]
    deepest = len(prompt)
    ray.get(a.generate.remote(prompt, max_tokens=1))
    for _ in range(600):
        ends = [e[2] for _, e in entries_of("A", prompt)]
        if deepest in ends:
            break
        time.sleep(0.1)
    assert deepest in ends, ends
    longer = prompt + [(i * 17) % 3000 + 10 for i in range(100)]
    warm = ray.get(b.generate.remote(longer))
    assert warm["cached"] == deepest
    cold = ray.get(b.generate.remote(longer, salt=f"cold-{uuid.uuid4().hex}"))
    assert warm["tokens"] == cold["tokens"] and warm["logprobs"] == cold["logprobs"]
