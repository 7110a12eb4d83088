"""The one-command cluster, end to end: two `vllm serve --plugin hybridcache` replicas of
qwen3-next-tiny placed by a local Ray, behind the front on Ray Serve's port (the launcher's own
`Cluster`, as `vllm-hybridcache cluster` runs it). One launch serves every test of the module:

- `/v1/cache/stats` on the front sums the replicas and lists each; `/metrics` labels every
  replica's series with `replica`;
- sessions (`x-session-id`) and, without one, prefix affinity land every turn of a conversation
  on the replica that served its previous turn, and the share is reported;
- a turn forced to the other replica resumes from the owner's links (cluster tier) and equals a
  cold prefill there (unique cache_salt) in tokens and logprobs;
- a link listed under another fingerprint is never used; links whose owner died before the
  fetch are a counted `owner_lost` miss with the cold output;
- a link forged without the cluster secret (valid CRCs and header fields, MACs under another
  key), listed in place of the owner's, is refused as `unauthenticated`: counted, nothing
  restored, the turn equal to a cold run; negative control: the same forgery made WITH the
  secret (what a bug in a copy would produce) is restored and the output then differs from
  cold, so the comparison still bites;
- end anchors move: a conversation with live history (each turn the previous prompt, its
  answer and a new message) on one replica, its next turn forced to the other resumes from the
  owner's end anchor (cached tokens = the anchor's depth), equal in tokens and logprobs to the
  same turn resumed from that anchor on the owner, and within the greedy gate of a cold run;
  an anchor with its true header and parts altered with their CRCs kept is refused by the
  worker as `unauthenticated` (the turn recomputed cold); negative control: an anchor forged
  with the secret is restored and caught; another salt's request never uses the anchor;

The tests hold the cluster secret the replicas get (tests/keys.py): they read and write the
directory as a replica does, and find a prompt's entries by locator (directory_view.py).
- last (it takes a replica away): one replica killed while a request runs on it loses nothing
  (the front retries it on the other one, output equal to a cold run there bit for bit), the
  conversation it owned moves, and its links leave the directory.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import uuid

import psutil
import pytest
import ray
import requests

from benchmarks.servers import free_port
from tests.cluster.conftest import wait_owner_dead
from tests.cluster.directory_view import IDS, anchors_of, ask, entries_of, identity_of
from tests.cluster.forgery import Ghost, forge, forge_keeping_header, forged_chain
from tests.keys import CLUSTER_KEY, CLUSTER_SECRET_FILE, other_key
from vllm_hybridcache.cluster.directory import NAMESPACE
from vllm_hybridcache.core.keys import PromptKeys
from vllm_hybridcache.core.tiers.cluster import locator
from vllm_hybridcache.fleet.launcher import Cluster

pytestmark = pytest.mark.slow

GRID = 256
# A replica learns of a dead owner when its fetch's RPC to that owner fails, which on a loaded
# 2-core box took longer than the default 10 s lookup timeout (the miss then read `timeout`, not
# `owner_lost`); 60 s leaves Ray room to answer, and only a failing lookup waits for it.
ENV = {"VLLM_HYBRIDCACHE_GRID": str(GRID), "VLLM_HYBRIDCACHE_MESSAGE_END_MIN": "64",
       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HYBRIDCACHE_CLUSTER_TIMEOUT_S": "60"}
SERVE_ARGS = ["--served-model-name", "tiny", "--max-model-len", "8192",
              "--enable-prompt-tokens-details", "--seed", "0", "--enforce-eager"]
SECRET = str(CLUSTER_SECRET_FILE)  # every replica's cluster_secret_file (through the launcher)


@pytest.fixture(scope="module")
def cluster(embedded_model):
    mp = pytest.MonkeyPatch()
    for k, v in ENV.items():
        mp.setenv(k, v)
    ray.init(num_cpus=2, object_store_memory=256 << 20, include_dashboard=False,
             namespace=NAMESPACE, log_to_driver=False)
    c = None
    try:
        c = Cluster(str(embedded_model("qwen3-next-tiny")), 2, SERVE_ARGS, secret_file=SECRET)
        c.serve_front("127.0.0.1", free_port("127.0.0.1", 8460), health_interval_s=0.5)
        yield c
    finally:
        if c is not None:
            c.stop()
        ray.shutdown()
        mp.undo()


def post(c: Cluster, path: str, body: dict, **headers) -> requests.Response:
    r = requests.post(c.url + path, json={"model": "tiny", **body}, headers=headers,
                      timeout=600)
    assert r.status_code == 200, r.text
    return r


def stats(c: Cluster) -> dict:
    return requests.get(c.url + "/v1/cache/stats", timeout=60).json()


def cached(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def words(seed: int, n: int) -> str:
    """`n` words of filler text, different for each seed."""
    return " ".join(f"w{(seed * 7919 + i * 104729) % 5000}" for i in range(n))


def test_one_port_sums_the_replicas_stats_and_labels_their_metrics(cluster):
    for i, name in enumerate(cluster.endpoints):
        post(cluster, "/v1/completions", {"prompt": words(i, 400),
                                          "max_tokens": 2, "temperature": 0},
             **{"x-hybridcache-replica": name})
    s = stats(cluster)
    assert set(s["replicas"]) == {"r0", "r1"} and s["engines"] == 2
    for field in ("lookups", "tokens_served"):
        assert s["tiers"]["ram"][field] == sum(
            r["tiers"]["ram"][field] for r in s["replicas"].values())
    assert all(r["tiers"]["ram"]["lookups"] >= 1 for r in s["replicas"].values())
    assert "cluster" in s["tiers"]
    text = requests.get(cluster.url + "/metrics", timeout=60).text
    lookups = [ln for ln in text.splitlines() if ln.startswith("vllm:hybridcache_lookups")]
    assert any('replica="r0"' in ln for ln in lookups)
    assert any('replica="r1"' in ln for ln in lookups)
    assert all("replica=" in ln for ln in lookups)
    assert 'vllm:hybridcache_cluster_routed_total{outcome="forced"}' in text


def test_turns_of_a_conversation_land_on_its_owner(cluster):
    """Two conversations with a session header and two without (prefix affinity), three turns
    each, interleaved: every turn after the first goes to the replica of the first turn."""
    before = stats(cluster)["routing"]["outcomes"].get("owner", 0)
    convs: list[dict] = []
    for i in range(4):
        convs.append({"messages": [{"role": "system", "content": words(100 + i, 300)},
                                   {"role": "user", "content": words(200 + i, 60)}],
                      "session": f"s-{uuid.uuid4().hex}" if i < 2 else None, "served": []})
    for turn in range(3):
        for i, cv in enumerate(convs):
            headers = {"x-session-id": cv["session"]} if cv["session"] else {}
            r = post(cluster, "/v1/chat/completions",
                     {"messages": cv["messages"], "max_tokens": 8, "temperature": 0}, **headers)
            cv["served"].append(r.headers["x-hybridcache-replica"])
            if turn:
                assert r.headers["x-hybridcache-route"] == "owner"
                assert cached(r.json()) > 0
            reply = r.json()["choices"][0]["message"]["content"]
            cv["messages"] += [{"role": "assistant", "content": reply},
                               {"role": "user", "content": words(300 + 10 * i + turn, 60)}]
    for cv in convs:
        assert len(set(cv["served"])) == 1, cv["served"]
    assert {cv["served"][0] for cv in convs} == {"r0", "r1"}  # first turns spread by load
    routing = stats(cluster)["routing"]
    assert routing["outcomes"]["owner"] - before == 8
    assert 0 < routing["owner_share"] <= 1


def _completion(cluster, prompt: list[int], **extra) -> dict:
    r = post(cluster, "/v1/completions",
             {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 5,
              "return_token_ids": True, **extra.pop("body", {})}, **extra)
    body = r.json()
    body["replica"] = r.headers["x-hybridcache-replica"]
    return body


def test_a_turn_on_the_other_replica_resumes_from_the_owners_links_and_equals_cold(cluster):
    session = f"x-{uuid.uuid4().hex}"
    turns = [[(17 + i * 7) % 3000 + 10 for i in range(600)]]
    for t in range(1, 4):
        turns.append(turns[-1] + [(t * 31 + i * 13) % 3000 + 10 for i in range(300)])
    owner = None
    for p in turns[:3]:
        owner = _completion(cluster, p, **{"x-session-id": session})["replica"]
    other = "r1" if owner == "r0" else "r0"
    restores = stats(cluster)["replicas"][other]["tiers"]["cluster"]["restores"]
    warm = _completion(cluster, turns[3], **{"x-hybridcache-replica": other})
    assert warm["replica"] == other
    assert cached(warm) >= GRID  # the owner's links, fetched through the cluster tier
    assert stats(cluster)["replicas"][other]["tiers"]["cluster"]["restores"] > restores
    cold = _completion(cluster, turns[3], body={"cache_salt": f"cold-{uuid.uuid4().hex}"},
                       **{"x-hybridcache-replica": other})
    assert cached(cold) == 0 and cold["replica"] == other
    w, c = warm["choices"][0], cold["choices"][0]
    assert w["token_ids"] == c["token_ids"]
    assert w["logprobs"]["token_logprobs"] == c["logprobs"]["token_logprobs"]
    assert w["logprobs"]["top_logprobs"] == c["logprobs"]["top_logprobs"]


def conversation(seed: int, turns: int) -> list[list[int]]:
    """Token-id prompts of turns 1..turns: each extends the previous by 300 tokens, the first
    is 600 tokens; `seed` keeps conversations of different tests apart."""
    out = [[(seed * 997 + 100 + i * 7) % 3000 + 10 for i in range(600)]]
    for t in range(1, turns):
        out.append(out[-1] + [(seed * 131 + t * 31 + i * 13) % 3000 + 10 for i in range(300)])
    return out


def cluster_tier(cluster, name: str) -> dict:
    return stats(cluster)["replicas"][name]["tiers"]["cluster"]


def directory_entries(owner: str, prompt: list[int]) -> list:
    """The directory's entries of `owner` on the 64-aligned positions of `prompt` (the
    request's domain), sorted by end: its grid cuts and, in fine segmentation (the CPU
    attention pin on), its links inside a step, which the owner publishes too."""
    return entries_of(owner, prompt)


def listed_as(owner: str, locators: list[bytes], anchors: bool = False) -> None:
    """Wait until every one of `locators` is listed as `owner`'s: a publication reaches the
    directory fire-and-forget, and a turn sent before would find the previous entries."""
    want = set(locators)
    for _ in range(1200):
        if want <= {k for k, _ in ask("anchors_of" if anchors else "entries_of", owner)}:
            return
        time.sleep(0.05)
    pytest.fail(f"{owner}'s entries never listed")


def engine_core_of(cluster, name: str) -> psutil.Process:
    """The engine-core process of replica `name`'s `vllm serve` (its server's only child
    running Python's vLLM engine), found from the actor's server pid."""
    pid = ray.get(cluster.actors[name].__ray_call__.remote(lambda replica: replica.proc.pid))
    cores = [p for p in psutil.Process(pid).children(recursive=True)
             if "EngineCore" in " ".join(p.cmdline()) + p.name()]
    assert len(cores) == 1, [(p.pid, p.name(), p.cmdline()) for p in
                             psutil.Process(pid).children(recursive=True)]
    return cores[0]


def pinned(name: str) -> dict:
    return {"x-hybridcache-replica": name}


def cold_on(cluster, name: str, prompt: list[int]) -> dict:
    out = _completion(cluster, prompt, body={"cache_salt": f"cold-{uuid.uuid4().hex}"},
                      **pinned(name))
    assert cached(out) == 0 and out["replica"] == name
    return out


def test_a_link_of_another_fingerprint_is_never_used(cluster):
    turns = conversation(2, 2)
    _completion(cluster, turns[0], **pinned("r0"))
    entries = directory_entries("r0", turns[0])
    assert entries
    keys = PromptKeys(turns[0])
    for loc, (_parent, start, end, nbytes, refs) in entries:
        fp, dom = identity_of(loc, turns[0], end)
        foreign = bytes(x ^ 0xFF for x in fp)
        parent = locator(CLUSTER_KEY, foreign, dom, keys.digest(start)) if start else b""
        ask("publish", locator(CLUSTER_KEY, foreign, dom, keys.digest(end)), parent, start,
            end, nbytes, "r0", refs=refs)
        ask("forget", [loc], None)
    restores = cluster_tier(cluster, "r1")["restores"]
    out = _completion(cluster, turns[1], **pinned("r1"))
    assert cached(out) == 0
    assert cluster_tier(cluster, "r1")["restores"] == restores
    assert out["choices"][0]["token_ids"] == cold_on(cluster, "r1", turns[1])["choices"][0][
        "token_ids"]


def test_owner_killed_before_the_fetch_is_a_counted_miss_with_the_cold_output(cluster):
    turns = conversation(3, 2)
    _completion(cluster, turns[0], **pinned("r0"))
    entries = directory_entries("r0", turns[0])
    assert entries
    ghost = Ghost.remote(SECRET)
    for _ in range(40):  # publications still on their way (Ray delivers them async): those too
        items = [(loc, parent, start, end, bytes(ray.get(refs[0])))
                 for loc, (parent, start, end, _, refs) in entries]
        probe = ray.get(ghost.publish.remote(items))[0]  # the entries now name the ghost
        time.sleep(0.25)
        entries = directory_entries("r0", turns[0])
        if not entries:
            break
    assert not entries
    ray.kill(ghost, no_restart=True)
    wait_owner_dead(probe, "ghost")
    lost = cluster_tier(cluster, "r1")["misses"].get("owner_lost", 0)
    out = _completion(cluster, turns[1], **pinned("r1"))
    assert cached(out) == 0
    assert cluster_tier(cluster, "r1")["misses"].get("owner_lost", 0) == lost + 1
    ref = cold_on(cluster, "r1", turns[1])
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert out["choices"][0]["logprobs"] == ref["choices"][0]["logprobs"]
    assert not directory_entries("ghost", turns[0])  # the dead owner's entries are gone


def test_a_link_forged_without_the_secret_is_refused_and_the_turn_is_cold(cluster, tmp_path):
    """Issue 29: the owner's chain listed again by a ghost (a member of the Ray cluster that
    got into the directory), its deepest link forged without the secret: state bytes
    altered, every CRC and header field valid, the MACs under another key. r1 refuses it at
    its header (`unauthenticated`, counted in its stats), restores nothing and answers what
    a cold run answers. On 1f3f6d5, with CRCs only, this forgery was restored."""
    turns = conversation(5, 2)
    _completion(cluster, turns[0], **pinned("r0"))
    entries = directory_entries("r0", turns[0])
    assert entries
    before = cluster_tier(cluster, "r1")
    ghost = Ghost.remote(SECRET)
    items = forged_chain(entries, tmp_path, CLUSTER_KEY, write_key=other_key("cluster"))
    ray.get(ghost.publish.remote(items))
    try:
        listed_as("ghost", [it[0] for it in items])
        out = _completion(cluster, turns[1], **pinned("r1"))
        assert cached(out) == 0  # nothing restored
        after = cluster_tier(cluster, "r1")
        assert after["misses"].get("unauthenticated", 0) == before["misses"].get(
            "unauthenticated", 0) + 1
        assert after["restores"] == before["restores"]
        ref = cold_on(cluster, "r1", turns[1])
        assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        assert out["choices"][0]["logprobs"] == ref["choices"][0]["logprobs"]
        # the refused chain left the directory
        assert not {it[0] for it in items} & {k for k, _ in ask("entries_of", "ghost")}
    finally:
        ray.kill(ghost)


def test_negative_control_a_wrong_remote_state_changes_the_output(cluster, tmp_path):
    """The comparison with a cold prefill catches a bad restore: a link forged WITH the
    secret (valid checksums and MACs, state bytes altered: what a bug in a copy would make)
    is restored and the output differs from the cold one."""
    turns = conversation(4, 2)
    _completion(cluster, turns[0], **pinned("r0"))
    entries = directory_entries("r0", turns[0])
    assert entries
    ghost = Ghost.remote(SECRET)
    items = forged_chain(entries, tmp_path, CLUSTER_KEY)
    ray.get(ghost.publish.remote(items))
    try:
        listed_as("ghost", [it[0] for it in items])
        out = _completion(cluster, turns[1], **pinned("r1"))
        assert cached(out) == entries[-1][1][2]  # the forged chain was restored
        ref = cold_on(cluster, "r1", turns[1])
        assert out["choices"][0]["logprobs"] != ref["choices"][0]["logprobs"]
    finally:
        ray.kill(ghost)


# Greedy gate tolerance for qwen3-next-tiny in bf16 (vLLM's CPU GDN has no float32 path): the
# decode-vs-prefill drift of an end anchor measured up to 0.033 nats with AVX-512/AMX kernels
# and up to 0.16 nats with AVX2 kernels (tests/connector/test_end_anchors.py). The exact check
# of a moved anchor is the comparison with the owner's own resume from it, bit for bit.
BF16_DRIFT_NATS = 0.25


def live_history(cluster, name: str, seed: int, turns: int) -> tuple[list[int], int]:
    """Turns 1..`turns` of a conversation with live history on replica `name` (each turn's
    prompt = the previous prompt + its answer's token ids + 200 new tokens; every turn after
    the first resumes from the previous turn's end anchor there). Returns the next turn's
    prompt and the depth of the end anchor it extends."""
    prompt = conversation(seed, 1)[0]
    depth = 0
    for t in range(turns):
        out = _completion(cluster, prompt, **pinned(name))
        assert out["replica"] == name
        if t:
            assert cached(out) == depth  # resumed from the previous turn's end anchor
        answer = out["choices"][0]["token_ids"]
        depth = len(prompt) + len(answer) - 1
        prompt = prompt + answer + [(seed * 53 + t * 17 + i * 11) % 3000 + 10
                                    for i in range(200)]
    return prompt, depth


def anchor_listed(owner: str, prompt: list[int], depth: int) -> list:
    """The directory's end anchor of `owner` that `prompt` extends at `depth` (default
    domain), waited for: a publication reaches the directory actor fire-and-forget."""
    for _ in range(1200):
        found = anchors_of(owner, prompt, depth)
        if found:
            return found
        time.sleep(0.05)
    return []


def anchor_kind(cluster, name: str) -> dict:
    return cluster_tier(cluster, name).get("kinds", {}).get("anchor", {})


def gate_view(out: dict) -> dict:
    """A completion in the greedy gate's terms: picked tokens and top logprobs by token."""
    lp = out["choices"][0]["logprobs"]
    return {"tokens": lp["tokens"], "logprobs": lp["top_logprobs"]}


def test_a_moved_turn_resumes_from_the_owners_end_anchor(cluster):
    """Turns 1-3 on r0 with live history (turns 2 and 3 resume from end anchors there); turn 4
    forced to r1 resumes from r0's end anchor (its depth cached, not the first turn's cuts),
    equals turn 4 resumed from the same anchor on r0 in token ids and logprobs (one
    fingerprint, one path: session-exact), and passes the greedy gate against a cold run on r1
    (another salt: that run finds no anchor, the anchor never crosses domains)."""
    from tests.connector.test_end_anchors import greedy_gate

    nxt, depth = live_history(cluster, "r0", 11, 3)
    assert anchor_listed("r0", nxt, depth)
    cold = cold_on(cluster, "r1", nxt)  # another salt: r0's anchor is never used
    before = anchor_kind(cluster, "r1").get("restores", 0)
    moved = _completion(cluster, nxt, **pinned("r1"))
    assert moved["replica"] == "r1"
    assert cached(moved) == depth  # the anchor's depth, far past the first turn's cuts
    assert anchor_kind(cluster, "r1")["restores"] == before + 1
    own = _completion(cluster, nxt, **pinned("r0"))  # the same turn from the same anchor
    assert own["replica"] == "r0" and cached(own) == depth
    m, o = moved["choices"][0], own["choices"][0]
    assert m["token_ids"] == o["token_ids"]
    assert m["logprobs"] == o["logprobs"]
    assert greedy_gate(gate_view(moved), gate_view(cold), BF16_DRIFT_NATS) >= 1


def test_an_end_anchor_forged_without_the_secret_is_refused_and_the_turn_is_cold(
        cluster, tmp_path):
    """Issue 29: r0's end anchor listed again by a ghost with its true header bytes (MAC
    valid) and every part altered so that each CRC-32 still matches. r1's scheduler accepts
    the header, its worker refuses the first part by its MAC (`unauthenticated`, counted in
    r1's anchor stats) before a byte reaches the engine; the restore fails, vLLM recomputes
    the turn, and it equals a cold run on r1. With CRCs only (1f3f6d5) it was restored."""
    nxt, depth = live_history(cluster, "r0", 14, 2)
    found = anchor_listed("r0", nxt, depth)
    assert found
    loc, (block, end, _, refs) = found[0]
    forged = forge_keeping_header(bytes(ray.get(refs[0])), tmp_path, CLUSTER_KEY)
    before = anchor_kind(cluster, "r1")
    ghost = Ghost.remote(SECRET)
    try:
        ray.get(ghost.publish_anchors.remote([(loc, block, end, forged)]))
        listed_as("ghost", [loc], anchors=True)
        out = _completion(cluster, nxt, **pinned("r1"))
        after = anchor_kind(cluster, "r1")
        assert after["misses"].get("unauthenticated", 0) == before.get("misses", {}).get(
            "unauthenticated", 0) + 1
        assert after.get("restores", 0) == before.get("restores", 0)
        assert after.get("restores_failed", 0) == before.get("restores_failed", 0) + 1
        ref = cold_on(cluster, "r1", nxt)
        assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        assert out["choices"][0]["logprobs"] == ref["choices"][0]["logprobs"]
        assert not [k for k, _ in ask("anchors_of", "ghost") if k == loc]  # invalidated
    finally:
        ray.kill(ghost)
        ask("forget_owner", "ghost")


def test_negative_control_a_forged_end_anchor_is_caught(cluster, tmp_path):
    """An end anchor forged WITH the secret (state bytes altered, kind, header, every CRC
    and MAC valid) listed in place of the owner's is restored on r1, and the comparison with
    the owner's own resume from the true anchor catches it."""
    nxt, depth = live_history(cluster, "r0", 12, 2)
    found = anchor_listed("r0", nxt, depth)
    assert found
    loc, (block, end, _, refs) = found[0]
    forged = forge(bytes(ray.get(refs[0])), tmp_path, CLUSTER_KEY)
    ghost = Ghost.remote(SECRET)
    try:
        ray.get(ghost.publish_anchors.remote([(loc, block, end, forged)]))
        for _ in range(1200):  # the ghost's entry replaced r0's
            if anchor_listed("ghost", nxt, depth):
                break
            time.sleep(0.05)
        bad = _completion(cluster, nxt, **pinned("r1"))
        assert cached(bad) == depth  # the forged anchor was restored
        own = _completion(cluster, nxt, **pinned("r0"))
        assert cached(own) == depth
        assert bad["choices"][0]["logprobs"] != own["choices"][0]["logprobs"]
    finally:
        ray.kill(ghost)
        ask("forget_owner", "ghost")


def test_cleared_end_anchors_leave_the_directory_before_the_clear_returns(cluster):
    """`POST /v1/cache/clear` with kind `anchor` (sent to every replica by the front): r0's
    end anchor is no longer listed once the clear has returned, and the turn moved to r1 then
    resumes from the first turn's tree links only, never from the cleared anchor."""
    nxt, depth = live_history(cluster, "r0", 13, 2)
    assert anchor_listed("r0", nxt, depth)
    r = requests.post(cluster.url + "/v1/cache/clear", params={"kind": "anchor"}, timeout=60)
    assert r.status_code == 200, r.text
    cleared = IDS.locators(PromptKeys(nxt).digest(depth))
    assert cleared and not [k for k, _ in ask("anchors_of", "r0") if k in cleared]
    before = anchor_kind(cluster, "r1").get("restores", 0)
    moved = _completion(cluster, nxt, **pinned("r1"))
    assert cached(moved) < depth and anchor_kind(cluster, "r1").get("restores", 0) == before


def test_zz_a_replica_killed_mid_trace_loses_no_request_and_its_links_leave(cluster):
    """Runs last in the module: it takes r1 away. A conversation lives on r1; a request is in
    flight on r1 when its server is SIGKILLed (engine and all): the front retries it on r0,
    which answers exactly what a cold run of it answers there (run alone, so bit for bit in
    token ids and logprobs); the conversation's next turn goes to r0; r1's links leave the
    directory; the front keeps serving."""
    victim, survivor = "r1", "r0"
    session = f"loss-{uuid.uuid4().hex}"
    messages = [{"role": "user", "content": words(498, 400)}]
    first = post(cluster, "/v1/chat/completions", {"messages": messages, "max_tokens": 4},
                 **{"x-session-id": session, **pinned(victim)})
    assert first.headers["x-hybridcache-replica"] == victim
    assert ask("entries_of", victim)  # r1 holds published links
    prompt = conversation(9, 3)[2]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 128, "temperature": 0,
            "logprobs": 5, "return_token_ids": True}
    retries = stats(cluster)["routing"]["retries"]
    # The victim's engine is frozen first, so the request is still running when the kill
    # lands: a fast host once finished all 128 tokens between the front's taking it and the
    # SIGKILL, and the answer then (rightly) came from the victim. The victim's API server
    # keeps answering (its stats need no engine), so the front sees it up and sends there.
    engine = engine_core_of(cluster, victim)
    engine.suspend()
    with cf.ThreadPoolExecutor(1) as pool:
        future = pool.submit(requests.post, cluster.url + "/v1/completions", json=body,
                             headers=pinned(victim), timeout=600)
        for _ in range(600):  # until the front has it on r1
            if stats(cluster)["routing"]["replicas"][victim]["inflight"] == 1:
                break
            time.sleep(0.05)
        assert stats(cluster)["routing"]["replicas"][victim]["inflight"] == 1
        assert engine.status() == psutil.STATUS_STOPPED  # nothing of it ran meanwhile
        ray.get(cluster.actors[victim].kill.remote())  # SIGKILL ends a stopped process too
        answer = future.result()
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-hybridcache-replica"] == survivor
    assert stats(cluster)["routing"]["retries"] == retries + 1
    got = answer.json()["choices"][0]
    ref = post(cluster, "/v1/completions", {**body, "cache_salt": f"cold-{uuid.uuid4().hex}"},
               **pinned(survivor))
    assert ref.headers["x-hybridcache-replica"] == survivor and cached(ref.json()) == 0
    ref = ref.json()["choices"][0]
    assert got["token_ids"] == ref["token_ids"]
    assert got["logprobs"] == ref["logprobs"]
    for _ in range(600):  # the front's liveness loop tells the directory
        if not ask("entries_of", victim):
            break
        time.sleep(0.05)
    assert not ask("entries_of", victim)
    s = stats(cluster)
    assert s["routing"]["replicas"][victim]["up"] is False
    assert "error" in s["replicas"][victim] and s["engines"] == 1
    reply = first.json()["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": words(497, 50)}]
    nxt = post(cluster, "/v1/chat/completions", {"messages": messages, "max_tokens": 4},
               **{"x-session-id": session})
    assert nxt.headers["x-hybridcache-replica"] == survivor
    assert nxt.headers["x-hybridcache-route"] == "owner_down"
