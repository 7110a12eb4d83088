"""The soak run's greedy check and its restore-failure hook, without an engine."""

from __future__ import annotations

import pytest

from benchmarks.soak.check import DRIFT_NATS, Generation, compare, parse_logprobs
from benchmarks.soak.report import slope_per_min, steady_rss
from vllm_hybridcache.testing.instrumentation import InjectedFault, LoadFailures


def gen(rows: list[dict[int, float]]) -> Generation:
    return Generation(tokens=[max(r, key=r.get) for r in rows], top=rows)


COLD = [{1: -0.1, 2: -2.5}, {3: -0.2, 4: -1.9}, {5: -0.3, 6: -0.3001}]


def test_identical_runs_are_same():
    v = compare(gen(COLD), gen(COLD))
    assert v.outcome == "same" and v.compared == 3 and v.max_drift == 0.0


def test_tie_flip_within_drift_is_a_tie_not_a_wrong_token():
    served = [dict(r) for r in COLD]
    served[2] = {5: -0.3002, 6: -0.3001}            # batching drift swaps a 1e-4 tie
    v = compare(Generation(tokens=[1, 3, 6], top=served), gen(COLD))
    assert v.outcome == "tie" and v.position == 2 and v.margin == pytest.approx(1e-4)


def test_negative_control_a_real_margin_flip_is_a_wrong_token():
    """What a bad restore looks like: another pick where the cold run's margin is 1.7 nats."""
    served = [dict(r) for r in COLD]
    served[1] = {4: -0.1, 3: -3.0}
    v = compare(Generation(tokens=[1, 4, 5], top=served), gen(COLD))
    assert v.outcome == "wrong" and v.position == 1 and v.margin > 2 * DRIFT_NATS


def test_a_pick_outside_the_cold_top_k_is_wrong():
    served = [dict(r) for r in COLD]
    served[0] = {9: -0.01}
    assert compare(Generation(tokens=[9, 3, 5], top=served), gen(COLD)).outcome == "wrong"


def test_drift_is_measured_while_tokens_agree():
    served = [{1: -0.1 + 5e-4, 2: -2.5}, *COLD[1:]]
    assert compare(gen(served), gen(COLD)).max_drift == pytest.approx(5e-4)


def test_parse_logprobs_reads_token_ids():
    content = [{"token": "token_id:7", "logprob": -0.5,
                "top_logprobs": [{"token": "token_id:7", "logprob": -0.5},
                                 {"token": "token_id:8", "logprob": -1.0}]}]
    g = parse_logprobs(content)
    assert g.tokens == [7] and g.top == [{7: -0.5, 8: -1.0}]
    with pytest.raises(ValueError, match="token_id"):
        parse_logprobs([{"token": "hello", "logprob": -0.1, "top_logprobs": []}])


def test_load_failures_fail_only_the_armed_loads():
    f = LoadFailures()
    f("load", None)                                   # not armed: nothing happens
    f.pending = 1
    f("capture", None)                                # captures are never failed by it
    with pytest.raises(InjectedFault):
        f("load", None)
    f("load", None)
    assert f.counts() == {"pending": 0, "fired": 1}


def test_rss_slope_is_judged_on_the_longest_life_second_half():
    flat = [{"t": t, "life": 1, "rss": 100 << 20} for t in range(0, 600, 10)]
    assert steady_rss(flat)["slope_mib_per_min"] == pytest.approx(0.0)
    leak = [{"t": t, "life": 2, "rss": (100 << 20) + t * (1 << 20) // 6} for t in range(0, 900, 10)]
    r = steady_rss(flat + leak)
    assert r["life"] == 2 and r["slope_mib_per_min"] == pytest.approx(10.0, rel=0.05)
    assert slope_per_min([(0, 1.0), (60, 2.0)]) is None


def test_parse_completion_logprobs_reads_token_ids():
    from benchmarks.soak.check import parse_completion_logprobs

    lp = {"tokens": ["token_id:4", "token_id:2"], "token_logprobs": [-0.2, -0.7],
          "top_logprobs": [{"token_id:4": -0.2, "token_id:5": -1.2}, {"token_id:9": -0.1}]}
    g = parse_completion_logprobs(lp)
    assert g.tokens == [4, 2]
    assert g.top == [{4: -0.2, 5: -1.2}, {9: -0.1, 2: -0.7}]


def test_judge_holds_tree_hits_and_anchor_hits_to_their_own_rule():
    from benchmarks.soak.check import Verdict, judge

    moved = Verdict(compared=8, outcome="same", max_drift=0.37)
    wrong = Verdict(compared=2, outcome="wrong", max_drift=0.0, margin=0.5, position=1)
    # bf16: cold-exact answers judged at the bf16 tolerance, anchors reported only
    assert judge(moved, "tree", 0.25, None)[:2] == ("unexpected_error", "drift_exceeded")
    assert judge(moved, None, 0.25, None)[:2] == ("unexpected_error", "drift_exceeded")
    assert judge(moved, "anchor", 0.25, None)[0] == "ok"
    assert judge(wrong, "anchor", 0.25, None)[0] == "ok"
    # float32: anchors held to the end-anchor gate like everything else
    assert judge(moved, "anchor", 1e-3, 1e-3)[:2] == ("unexpected_error", "drift_exceeded")
    assert judge(wrong, "anchor", 1e-3, 1e-3)[:2] == ("unexpected_error", "wrong_token")
    assert judge(Verdict(compared=8, outcome="same", max_drift=2e-6), "anchor", 1e-3,
                 1e-3)[0] == "ok"


def test_judge_reports_the_control_arm_without_failing_it():
    from benchmarks.soak.check import Verdict, judge

    moved = Verdict(compared=8, outcome="same", max_drift=0.69)
    wrong = Verdict(compared=2, outcome="wrong", max_drift=0.0, margin=0.5, position=1)
    for v in (moved, wrong):
        assert judge(v, None, 0.25, None, control=True)[0] == "ok"
        assert judge(v, None, 0.25, None)[0] == "unexpected_error"


def test_all_faults_also_waits_for_an_answered_tree_hit():
    """`--all-faults` runs past the duration until a cache-side tree hit was answered: misses,
    end-anchor hits, the control arm and failed requests do not count."""
    from benchmarks.soak.cli import tree_hit_answered
    from benchmarks.soak.ledger import Ledger, RequestRecord

    ledger = Ledger()
    for arm, kind, outcome in (("cache", "none", "ok"), ("cache", "anchor", "ok"),
                               ("control", "tree", "ok"), ("cache", "tree", "expected_error")):
        ledger.add(RequestRecord(t=0.0, life=1, arm=arm, hit_kind=kind, outcome=outcome))
        assert not tree_hit_answered(ledger)
    ledger.add(RequestRecord(t=1.0, life=1, arm="tenant", hit_kind="tree"))
    assert tree_hit_answered(ledger)
