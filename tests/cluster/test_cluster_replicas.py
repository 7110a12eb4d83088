"""Two replicas of qwen3-next-tiny on a local Ray, each an engine in a Ray actor with the cluster
tier on. Turns 1..k of a conversation run on replica A; turn k+1 is forced to replica B, which
resumes from A's links (fetched through Ray's object store, verified, staged) and must equal a
cold prefill of the same prompt on B in tokens and logprobs. A link listed under another
fingerprint is never used; a link whose owner died before the fetch is a counted miss and the
request prefills cold, with the cold output."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import ray  # the cluster extra: installed by make env

from vllm_hybridcache.cluster import RayTransport, directory_handle
from vllm_hybridcache.cluster.replica import replica_actor
from vllm_hybridcache.core.keys import PromptKeys

pytestmark = pytest.mark.slow

GRID = 256
SETTINGS = {"grid": GRID, "message_end_min": 64}
ENGINE = {"max_model_len": 8192, "max_num_batched_tokens": 2048, "enforce_eager": True,
          "seed": 0}


def conversation(seed: int, turns: int) -> list[list[int]]:
    """Prompts of turns 1..turns: each extends the previous by 300 tokens (a message and a
    reply), the first is 600 tokens; `seed` keeps conversations of different tests apart."""
    out = [[(seed * 997 + 100 + i * 7) % 3000 + 10 for i in range(600)]]
    for t in range(1, turns):
        out.append(out[-1] + [(seed * 131 + t * 31 + i * 13) % 3000 + 10 for i in range(300)])
    return out


@pytest.fixture(scope="module")
def replicas(embedded_model):
    model = str(embedded_model("qwen3-next-tiny"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ray.init(num_cpus=2, object_store_memory=256 << 20, include_dashboard=False,
             namespace="hybridcache", log_to_driver=False)
    actors = []
    try:
        Replica = replica_actor(num_cpus=1)
        actors = [Replica.remote(model, name, SETTINGS, ENGINE) for name in ("A", "B")]
        ray.get([a.stats.remote() for a in actors])  # both engines up
        yield dict(zip("AB", actors, strict=True))
    finally:
        for a in actors:
            try:
                ray.get(a.shutdown.remote(), timeout=120)
            except Exception:
                pass
            ray.kill(a)
        ray.shutdown()


def cold(replica, prompt) -> dict:
    """A cold prefill of `prompt` on `replica`: a fresh cache_salt is a domain nothing holds."""
    out = ray.get(replica.generate.remote(prompt, salt=f"cold-{uuid.uuid4().hex}"))
    assert out["cached"] == 0
    return out


def cluster_stats(replica) -> dict:
    return ray.get(replica.stats.remote())["cluster/tree"]


def directory_entries(owner: str, prompt: list[int]) -> list:
    """The directory's entries of `owner` on the cuts of `prompt` (default domain)."""
    keys = PromptKeys(prompt)
    digests = {keys.digest(c) for c in range(GRID, len(prompt) + 1, GRID)}
    d = directory_handle()
    return [(k, e) for k, e in ray.get(d.entries_of.remote(owner)) if k[2] in digests]


def test_turn_on_another_replica_resumes_from_the_owners_links(replicas):
    a, b = replicas["A"], replicas["B"]
    turns = conversation(1, 4)
    for p in turns[:3]:
        ray.get(a.generate.remote(p))
    last = turns[3]
    ref = cold(b, last)
    before = cluster_stats(b)
    out = ray.get(b.generate.remote(last))
    after = cluster_stats(b)
    deepest_on_a = (len(turns[2]) // GRID) * GRID
    assert out["cached"] == deepest_on_a  # A's deepest link of turn 3, fetched by B
    assert after["restores"] == before["restores"] + 1
    assert out["tokens"] == ref["tokens"]
    assert out["logprobs"] == ref["logprobs"]
    # promoted into B's RAM: the same turn again is a RAM hit at least as deep
    again = ray.get(b.generate.remote(last))
    assert again["cached"] >= deepest_on_a and again["tokens"] == ref["tokens"]
    assert cluster_stats(b)["restores"] == after["restores"]


def test_a_link_of_another_fingerprint_is_never_used(replicas):
    a, b = replicas["A"], replicas["B"]
    turns = conversation(2, 2)
    ray.get(a.generate.remote(turns[0]))
    entries = directory_entries("A", turns[0])
    assert entries
    d = directory_handle()
    for (fp, dom, digest), (parent, start, end, nbytes, refs) in entries:
        foreign = bytes(x ^ 0xFF for x in fp)
        ray.get(d.publish.remote(foreign, dom, digest, parent, start, end, nbytes, "A", refs))
        ray.get(d.forget.remote(fp, dom, [digest]))
    restores = cluster_stats(b)["restores"]
    out = ray.get(b.generate.remote(turns[1]))
    assert out["cached"] == 0
    assert cluster_stats(b)["restores"] == restores
    assert out["tokens"] == cold(b, turns[1])["tokens"]


@ray.remote(num_cpus=0)
class Ghost:
    """A replica stand-in that re-publishes payloads as their owner, then dies."""

    def __init__(self) -> None:
        self.t = RayTransport(ray.get_runtime_context().gcs_address, owner="ghost")

    def publish(self, items) -> list:
        for it in items:
            self.t.publish(*it)
        return [ray.put(b"probe")]


def test_owner_killed_before_the_fetch_is_a_counted_miss_with_the_cold_output(replicas):
    a, b = replicas["A"], replicas["B"]
    turns = conversation(3, 2)
    ray.get(a.generate.remote(turns[0]))
    entries = directory_entries("A", turns[0])
    assert entries
    items = [(fp, dom, digest, parent, start, end, bytes(ray.get(refs[0])))
             for (fp, dom, digest), (parent, start, end, _, refs) in entries]
    ghost = Ghost.remote()
    probe = ray.get(ghost.publish.remote(items))[0]  # the entries now name the ghost
    assert not directory_entries("A", turns[0])
    ray.kill(ghost, no_restart=True)
    for _ in range(600):  # Ray learns of an owner's death asynchronously
        try:
            ray.get(probe, timeout=10)
        except ray.exceptions.OwnerDiedError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("Ray never reported the ghost dead")
    lost = cluster_stats(b)["misses"].get("owner_lost", 0)
    out = ray.get(b.generate.remote(turns[1]))
    assert out["cached"] == 0
    assert cluster_stats(b)["misses"].get("owner_lost", 0) == lost + 1
    ref = cold(b, turns[1])
    assert out["tokens"] == ref["tokens"] and out["logprobs"] == ref["logprobs"]
    assert not directory_entries("ghost", turns[0])  # the dead owner's entries are gone


def _forge(payload: bytes, fingerprint: bytes, folder) -> bytes:
    """The same link with slightly different state bytes and valid checksums (what a bug in a
    copy would produce): every header check and CRC passes."""
    import numpy as np

    from vllm_hybridcache.core.disk.linkfile import read_header, write_link_file

    src, dst = folder / "src.link", folder / "forged.link"
    src.write_bytes(payload)
    h, base = read_header(src, fingerprint)
    parts = {}
    for e in h.parts:
        a = np.frombuffer(payload, np.uint8, e.nbytes, base + e.offset).copy()
        a[::16] ^= 0x04
        parts[e.name] = a
    write_link_file(dst, fingerprint=h.fingerprint, domain=h.domain, digest=h.digest,
                    parent_digest=h.parent_digest, start=h.start, end=h.end,
                    tokens=h.token_ids(), rows=h.rows, parts=parts)
    return dst.read_bytes()


def test_negative_control_a_wrong_remote_state_changes_the_output(replicas, tmp_path):
    """The comparison with a cold prefill catches a bad restore: a forged link (valid
    checksums, state bytes altered) is restored and the output differs from the cold one."""
    a, b = replicas["A"], replicas["B"]
    turns = conversation(4, 2)
    ray.get(a.generate.remote(turns[0]))
    entries = sorted(directory_entries("A", turns[0]), key=lambda ke: ke[1][2])
    assert entries
    items = []
    for i, ((fp, dom, digest), (parent, start, end, _, refs)) in enumerate(entries):
        data = bytes(ray.get(refs[0]))
        if i == len(entries) - 1:
            data = _forge(data, fp, tmp_path)
        items.append((fp, dom, digest, parent, start, end, data))
    ghost = Ghost.remote()
    ray.get(ghost.publish.remote(items))
    try:
        out = ray.get(b.generate.remote(turns[1]))
        assert out["cached"] == entries[-1][1][2]  # the forged chain was restored
        ref = cold(b, turns[1])
        assert out["logprobs"] != ref["logprobs"]
    finally:
        ray.kill(ghost)
