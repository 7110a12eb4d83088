"""The front's routing policy (no Ray, no HTTP): owners by session and by prefix, the load
bound, replicas going down, round robin, and the counts the front reports."""

from __future__ import annotations

import pytest

from vllm_hybridcache.fleet.routing import Outcome, Policy, Router, prefix_keys


def chat(*contents: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents],
            **extra}


def serve(router: Router, session=None, keys=(), forced=None):
    d = router.choose(session, keys, forced=forced)
    router.finished(d.replica, True, session, keys)
    return d


def test_prefix_keys_grow_with_the_conversation_and_respect_model_salt_and_tools():
    one, two = prefix_keys(chat("a")), prefix_keys(chat("a", "b"))
    assert len(one) == 1 and len(two) == 2 and two[0] == one[0]
    assert prefix_keys(chat("a", cache_salt="t"))[0] != one[0]
    assert prefix_keys(chat("a", tools=[{"x": 1}]))[0] != one[0]
    assert prefix_keys({**chat("a"), "model": "other"})[0] != one[0]
    text = prefix_keys({"model": "m", "prompt": "x" * 2500})
    assert len(text) == 3 and prefix_keys({"model": "m", "prompt": "x" * 1024})[0] == text[0]
    ids = prefix_keys({"model": "m", "prompt": list(range(600))})
    assert len(ids) == 3 and prefix_keys({"model": "m", "prompt": [list(range(600))]}) == ids
    assert prefix_keys({"model": "m", "prompt": ["a", "b"]}) == []  # a batch names no prefix
    assert prefix_keys(None) == [] and prefix_keys([1, 2]) == []


def test_a_session_and_a_prefix_stay_with_the_replica_that_served_them_last():
    r = Router(["a", "b"])
    first = serve(r, session="s1")
    assert first.outcome is Outcome.NO_OWNER
    assert serve(r, session="s1").replica == first.replica
    t1 = prefix_keys(chat("x"))
    d1 = serve(r, keys=t1)
    t2 = prefix_keys(chat("x", "reply", "y"))
    d2 = serve(r, keys=t2)
    assert d2.outcome is Outcome.OWNER and d2.replica == d1.replica
    snap = r.snapshot()
    assert snap["outcomes"] == {"no_owner": 2, "owner": 2}
    assert snap["with_owner"] == 2 and snap["owner_share"] == 1.0


def test_first_turns_spread_over_idle_replicas():
    r = Router(["a", "b", "c"])
    assert [serve(r, session=f"s{i}").replica for i in range(3)] == ["a", "b", "c"]


def test_an_owner_too_far_above_the_least_loaded_is_passed_over():
    r = Router(["a", "b"], max_imbalance=2)
    owner = serve(r, session="hot").replica
    held = [r.choose(session="hot") for _ in range(2)]  # two in flight on the owner
    assert all(d.replica == owner and d.outcome is Outcome.OWNER for d in held)
    d = r.choose(session="hot")  # owner has 2 more than the other: passed over
    assert d.outcome is Outcome.PASSED_OVER and d.replica != owner
    for x in (*held, d):
        r.finished(x.replica, True)
    snap = r.snapshot()
    assert snap["outcomes"]["passed_over"] == 1
    assert snap["owner_share"] == pytest.approx(2 / 3)
    assert all(s["inflight"] == 0 for s in snap["replicas"].values())


def test_a_down_replica_is_never_chosen_and_its_turns_move():
    r = Router(["a", "b"])
    owner = serve(r, session="s").replica
    other = "b" if owner == "a" else "a"
    assert r.set_up(owner, False) and not r.set_up(owner, False)
    d = serve(r, session="s")
    assert d.replica == other and d.outcome is Outcome.OWNER_DOWN
    assert serve(r, session="s").outcome is Outcome.OWNER  # the survivor owns it now
    assert r.choose(session="s", forced=owner).replica == other  # pinned to a dead one
    r.set_up(other, False)
    assert r.choose() is None and r.snapshot()["unavailable"] == 1


def test_a_retry_excludes_the_failed_replica_and_is_no_new_request():
    r = Router(["a", "b"])
    d = r.choose(session="s")
    r.finished(d.replica, False, "s")
    again = r.choose("s", exclude=[d.replica])
    assert again.replica != d.replica
    r.finished(again.replica, True, "s")
    snap = r.snapshot()
    assert snap["requests"] == 1 and snap["retries"] == 1
    assert r.owner("s", ()) == again.replica  # a failed attempt makes no owner
    assert r.choose("s", exclude=["a", "b"]) is None


def test_forced_and_round_robin():
    r = Router(["a", "b"], policy=Policy.ROUND_ROBIN)
    got = [serve(r, session="s").replica for _ in range(4)]
    assert got == ["a", "b", "a", "b"]
    assert serve(r, forced="b").outcome is Outcome.FORCED
    assert r.snapshot()["owner_share"] is None  # round robin knows no owners


def test_maps_are_bounded():
    r = Router(["a"], max_keys=3)
    for i in range(10):
        serve(r, session=f"s{i}", keys=[bytes([i])])
    assert r.owner("s0", ()) is None and r.owner("s9", ()) == "a"
    assert r.owner(None, [bytes([0])]) is None and r.owner(None, [bytes([9])]) == "a"


def test_bad_arguments():
    with pytest.raises(ValueError):
        Router([])
    with pytest.raises(ValueError):
        Router(["a"], max_imbalance=0)


def test_owners_written_to_the_book_route_a_restarted_front_like_the_old_one():
    """The front's Serve replica restarts with an empty Router: the owners it wrote to the
    OwnerBook behind each answered turn are read back, so the next turns go to their owners;
    without the book they would go by load (negative control)."""
    from vllm_hybridcache.fleet.owners import OwnerBook

    book = OwnerBook(max_keys=8)
    old = Router(["a", "b"], on_owner=book.remember)
    convs = [("s1", ()), (None, tuple(prefix_keys(chat("x", "y")))),
             ("s2", ()), (None, tuple(prefix_keys(chat("p"))))]
    owners = [serve(old, session=s, keys=k).replica for s, k in convs]
    assert set(owners) == {"a", "b"}
    failed = old.choose("s9")
    old.finished(failed.replica, False, "s9")  # a failed attempt owns nothing
    new = Router(["a", "b"])
    assert new.load(*book.dump()) == book.size()["sessions"] + book.size()["prefixes"]
    for (s, k), o in zip(convs, owners, strict=True):
        d = new.choose(s, k)
        assert (d.replica, d.outcome) == (o, Outcome.OWNER)
        new.finished(d.replica, True, s, k)
    assert new.choose("s9").outcome is Outcome.NO_OWNER
    fresh = Router(["a", "b"])
    assert [fresh.choose(s, k).outcome for s, k in convs] == [Outcome.NO_OWNER] * 4
    # owners of replicas the new router does not have are skipped; the book stays bounded
    assert Router(["c"]).load(*book.dump()) == 0
    for i in range(20):
        book.remember(f"t{i}", (), "a")
    assert book.size()["sessions"] == 8 and "t19" in dict(book.dump()[0])
