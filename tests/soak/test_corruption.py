"""The soak run's proof that its checker bites, without an engine: the worker-side corruption
(`instrumentation.RestoreCorruption`), the check's rule at a flipped pick, and the summary's
`corrupt_injected` / `corrupt_caught` verdict, with the negative control: the same injected
answers, had the checker not flagged them, fail the run."""

from __future__ import annotations

import msgspec
import pytest
import torch

from benchmarks.soak.check import DRIFT_NATS, Generation, compare, judge
from benchmarks.soak.ledger import FaultRecord, RequestRecord
from benchmarks.soak.report import summarize
from vllm_hybridcache.adapter.plans import LoadJob
from vllm_hybridcache.core import LinkRef
from vllm_hybridcache.testing.instrumentation import (
    Instrumentation,
    RestoreCorruption,
    corrupt_state,
)


class FakeWorker:
    """What `corrupt_state` reads of a `WorkerSide`: its state sections by name, (group, tensor
    of every slot); one integer section, as Flash-Next's layers keep."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self._sections = {
            "l0#0": (0, torch.randn(4, 3, 5, generator=g)),
            "l0#1": (0, torch.randn(4, 2, 2, generator=g).to(torch.bfloat16)),
            "l1#2": (1, torch.arange(8, dtype=torch.int64).view(4, 2)),
        }

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, (_, t) in self._sections.items()}


def job(req_id: str, end: int, slots: tuple[int, int] = (1, 2)) -> LoadJob:
    return LoadJob(req_id=req_id, tier="ram", kind="tree",
                   chain=(LinkRef(7, 0, end // 2), LinkRef(8, end // 2, end)),
                   block_ids=[[slots[0]], [slots[1]]])


def test_corrupt_state_changes_every_float_section_of_the_slot_only():
    w = FakeWorker()
    before = w.snapshot()
    assert corrupt_state(w, job("r", 512)) == 2
    after = w.snapshot()
    # group 0's slot is block 1: every value there is 1 - x, nothing else moved
    assert torch.equal(after["l0#0"][1], 1 - before["l0#0"][1])
    assert torch.equal(after["l0#1"][1], 1 - before["l0#1"][1])
    for name in ("l0#0", "l0#1"):
        others = [i for i in range(4) if i != 1]
        assert torch.equal(after[name][others], before[name][others])
    assert torch.equal(after["l1#2"], before["l1#2"])      # integer section untouched
    # a zero state does not stay zero (a zeroed state would equal a fresh request's)
    w._sections["l0#0"][1][1].zero_()
    corrupt_state(w, job("r", 512))
    assert torch.equal(w._sections["l0#0"][1][1], torch.ones(3, 5))


def test_only_the_armed_request_at_the_armed_depth_is_corrupted():
    w = FakeWorker()
    c = RestoreCorruption(w)
    inst = Instrumentation(corruption=c)
    c.arm("soak-corrupt-aa", 512)
    before = w.snapshot()
    inst.after_load(job("cmpl-other-0-1234", 512), 0.01)     # another request: untouched
    assert torch.equal(w.snapshot()["l0#1"], before["l0#1"])
    inst.after_load(job("cmpl-soak-corrupt-aa-0-5678", 512), 0.01)
    assert not torch.equal(w.snapshot()["l0#1"], before["l0#1"])
    assert c.take("soak-corrupt-aa") == {"req_id": "cmpl-soak-corrupt-aa-0-5678", "tier": "ram",
                                         "kind": "tree", "tokens": 512, "corrupted": True,
                                         "sections": 2}
    assert c.corrupted == 1 and inst.totals["loads"] == 2
    # another depth (a shallower hit than the fault built its prompt for): recorded, left alone,
    # and the arm is used up
    c.arm("soak-corrupt-bb", 512)
    before = w.snapshot()
    inst.after_load(job("cmpl-soak-corrupt-bb-0-1", 256), 0.01)
    inst.after_load(job("cmpl-soak-corrupt-bb-0-1", 512), 0.01)   # a later restore: not armed
    assert torch.equal(w.snapshot()["l0#1"], before["l0#1"])
    assert c.take("soak-corrupt-bb")["corrupted"] is False and c.corrupted == 1
    # no restore at all (a miss): nothing to take, and the arm is dropped
    c.arm("soak-corrupt-cc")
    assert c.take("soak-corrupt-cc") is None and not c.armed
    with pytest.raises(ValueError):
        c.arm("")


COLD = [{1: -6.30, 2: -6.45, 3: -6.50, 4: -6.60, 5: -6.70}, {6: -6.2, 7: -6.9}]


def test_a_flip_inside_the_tie_margin_is_wrong_when_the_logprobs_moved():
    """The tiny models' flat distributions: in bf16 (tolerance 0.25 nats, ties up to 0.5) a
    corrupted state's pick can lie within the tie margin; it is a tie only if the logprobs
    both runs report at that position moved no more than the drift."""
    bf16 = 0.25
    # what corruption gave on qwen3-next-tiny: another pick, no token of the cold top 5
    corrupt = [{9: -6.0, 10: -6.1, 11: -6.2, 12: -6.3, 13: -6.35}, {6: -6.2, 7: -6.9}]
    v = compare(Generation(tokens=[9, 6], top=corrupt), Generation(tokens=[1, 6], top=COLD), bf16)
    assert v.margin == pytest.approx(0.40) and v.margin <= 2 * bf16
    assert v.outcome == "wrong" and v.flip_drift is None
    assert judge(v, "tree", bf16, None)[1] == "wrong_token"
    # shared tokens, but moved by a nat: wrong
    moved = [{2: -5.2, 1: -5.3}, {6: -6.2, 7: -6.9}]
    v = compare(Generation(tokens=[2, 6], top=moved), Generation(tokens=[1, 6], top=COLD), bf16)
    assert v.outcome == "wrong" and v.flip_drift == pytest.approx(1.25)
    # batching drift: the two leaders swapped, logprobs within the drift: a tie
    drift = [{2: -6.36, 1: -6.38, 3: -6.52}, {6: -6.2, 7: -6.9}]
    v = compare(Generation(tokens=[2, 6], top=drift), Generation(tokens=[1, 6], top=COLD), bf16)
    assert v.outcome == "tie" and v.flip_drift == pytest.approx(0.09)
    # float32: the same corrupted pick is far outside the 2e-3 tie margin
    v = compare(Generation(tokens=[9, 6], top=corrupt), Generation(tokens=[1, 6], top=COLD))
    assert v.outcome == "wrong" and v.margin > 2 * DRIFT_NATS


def _summary(requests: list[RequestRecord], faults: list[FaultRecord] | None = None) -> dict:
    return summarize(requests, faults or [], [], wall_s=60.0, startups=[30.0],
                     kinds=("restore_corruption",), rss_bound_mib_per_min=16.0,
                     min_window_s=300.0)


def _injected(cause: str, check: str) -> RequestRecord:
    return RequestRecord(t=5.0, life=1, arm="fault:restore_corruption", hit_kind="tree",
                         outcome="unexpected_error", cause=cause, check=check,
                         injected="restore_corruption", restore="ram/tree 1536 tokens")


def _plain(**kw) -> RequestRecord:
    return RequestRecord(t=1.0, life=1, arm="cache", hit_kind="tree", check="same", **kw)


FIRED = [FaultRecord(t=5.0, life=1, kind="restore_corruption", expected=True)]


def test_every_injected_corruption_flagged_passes_and_is_counted():
    reqs = [_plain(), _injected("wrong_token", "wrong"), _injected("drift_exceeded", "same")]
    s = _summary(reqs, FIRED)
    assert s["verdict"] == "pass", s["reasons"]
    assert (s["corrupt_injected"], s["corrupt_caught"]) == (2, 2)
    assert s["corruption"]["by_cause"] == {"wrong_token": 1, "drift_exceeded": 1}
    # the caught answers are the checker's proof, not failures of the cache
    assert s["failures"]["unexpected"] == {} and s["checks"]["cache_on"]["wrong"] == 0
    assert s["checks"]["corrupted_restores"]["checked"] == 2


def test_negative_control_an_unflagged_injection_fails_the_run():
    """The same run with a blinded checker (every verdict `ok`): the injected answers are no
    longer flagged, and that alone fails it."""
    reqs = [_plain(), _injected("wrong_token", "wrong"), _injected("drift_exceeded", "same")]
    blind = [msgspec.structs.replace(r, outcome="ok", cause="", check="same") for r in reqs]
    s = _summary(blind, FIRED)
    assert s["verdict"] == "fail"
    assert (s["corrupt_injected"], s["corrupt_caught"]) == (2, 0)
    assert any("2 of 2 answers served from an injected restore corruption not flagged" in r
               for r in s["reasons"])
    # one unflagged of two is enough; a tie (within the drift) is not a catch either
    s = _summary([_injected("wrong_token", "wrong"), _injected("", "tie")], FIRED)
    assert s["verdict"] == "fail" and (s["corrupt_injected"], s["corrupt_caught"]) == (2, 1)
    assert s["corruption"]["unflagged"][0]["check"] == "tie"
    # an injected answer lost to another error (here a 500) is not a catch
    s = _summary([_injected("http_500", "")], FIRED)
    assert s["verdict"] == "fail" and s["corrupt_caught"] == 0


def test_wrong_tokens_outside_the_injections_still_fail_the_run():
    s = _summary([_injected("wrong_token", "wrong"),
                  _plain(outcome="unexpected_error", cause="wrong_token")], FIRED)
    assert s["verdict"] == "fail" and s["corrupt_caught"] == 1
    assert s["failures"]["unexpected"] == {"wrong_token": 1}


def test_a_corruption_fault_that_never_injected_fails_the_run():
    s = _summary([_plain()], FIRED)
    assert s["verdict"] == "fail" and s["corrupt_injected"] == 0
    assert any("never injected" in r for r in s["reasons"])
    assert _summary([_plain()])["verdict"] == "pass"       # the kind did not fire: no proof due


def test_an_unjudged_bf16_anchor_divergence_is_recorded_not_failed():
    """In bf16 an end-anchor hit's answer is recorded without being judged (check.judge: its
    state descends from decode steps, and no bf16 tolerance is both safe and tight): a flipped
    pick there shows in the anchor hits' verdicts but fails nothing. The same flip on a tree
    hit, judged a wrong token, fails the run (control)."""
    anchor = RequestRecord(t=1.0, life=1, arm="cache", hit_kind="anchor", check="wrong",
                           outcome="ok")
    s = _summary([_plain(), anchor])
    assert s["checks"]["anchor_hits"]["wrong"] == 1 and s["checks"]["cache_on"]["wrong"] == 1
    assert not any("wrong token" in r for r in s["reasons"]), s["reasons"]
    tree = RequestRecord(t=1.0, life=1, arm="cache", hit_kind="tree", check="wrong",
                         outcome="unexpected_error", cause="wrong_token")
    assert "1 wrong token(s)" in _summary([_plain(), tree])["reasons"]
