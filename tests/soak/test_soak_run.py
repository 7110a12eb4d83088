"""`python -m benchmarks.soak` end to end, short: a real `vllm serve --plugin hybridcache`
(flash-next-tiny, float32) under three session workers (cache, another tenant's salt, and the
cache-off control arm), a churning budget, a small KV cache and every fault kind, including a
kill -9 and restart on the same disk folder. It must exit 0 (no wrong token, no unexpected
error, no budget overrun) and every fault must have fired and done what it exercises.

The proof that the check bites rides on the same run: the `restore_corruption` fault has the
worker corrupt restores after every check of their bytes passed, and every answer served from
one must have been flagged by the checker (caught == injected > 0). Negative control: the same
records, with the checker's verdicts on those answers blinded to `ok`, fail the verdict.
The workers also compare every block a restore took from vLLM's pool with the rows its links
stored (testing/in_place_check.py; its negative controls in test_in_place_check.py)."""

from __future__ import annotations

import json

import msgspec
import pytest

from benchmarks.soak.cli import main
from benchmarks.soak.faults import KINDS
from benchmarks.soak.ledger import FaultRecord, RequestRecord
from benchmarks.soak.report import summarize

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def soak(tmp_path_factory, embedded_model):
    embedded_model("flash-next-tiny")
    out = tmp_path_factory.mktemp("soak")
    status = main(["--duration", "120", "--seed", "3", "--concurrency", "3",
                   "--fault-every", "3", "--first-fault", "3", "--all-faults", "--out", str(out)])
    report = json.loads((out / "soak-flash-next-tiny-s3.json").read_text())
    assert (out / "soak-flash-next-tiny-s3.png").stat().st_size > 0
    return status, report


def test_exits_zero_with_no_wrong_token_or_unexpected_error(soak):
    status, report = soak
    summary = report["summary"]
    assert status == 0, summary["reasons"]
    assert summary["verdict"] == "pass"
    assert summary["failures"]["unexpected"] == {}
    # answers were really checked, in both arms, and positions compared
    assert summary["checks"]["cache_on"]["checked"] > 0
    assert summary["checks"]["cache_off_control"]["checked"] > 0
    assert summary["checks"]["cache_on"]["wrong"] == 0


def test_every_fault_kind_fired_and_did_its_job(soak):
    _, report = soak
    summary, cache = report["summary"], report["summary"]["cache"]
    for kind in KINDS:
        assert summary["faults"][kind]["fired"] >= 1, kind
        assert summary["faults"][kind]["unexpected"] == 0, kind
    assert summary["lives"] >= 2                           # the kill -9 restarted the server
    assert cache["restore_faults_fired"] >= 1              # a restore failed in the worker ...
    # ... and was counted as a failed restore, whichever tier and kind it hit (concurrent
    # sessions share the worker: the failed load may be another session's end anchor)
    assert sum(v for k, v in cache.items() if k.startswith("restores_failed.")) >= 1
    assert cache["cleared.ram.tree"] > 0                   # ... clears dropped links


def test_the_cache_worked_under_churn(soak):
    _, report = soak
    cache = report["summary"]["cache"]
    assert cache["hits.ram.tree"] > 0
    assert cache["evictions.ram.tree"] > 0                 # the budget churns
    assert report["summary"]["hit_requests"].get("tree", 0) > 0
    # resident memory was sampled (a sample taken while a life was being killed has none)
    assert sum(1 for s in report["samples"] if s["rss"]) >= len(report["samples"]) // 2 > 0


def test_every_injected_restore_corruption_was_caught(soak):
    _, report = soak
    summary = report["summary"]
    assert summary["corrupt_injected"] >= 1
    assert summary["corrupt_caught"] == summary["corrupt_injected"]
    assert summary["corruption"]["unflagged"] == []
    assert summary["cache"]["restore_corruptions"] >= 1     # the worker's own count
    injected = [r for r in report["requests"] if r["injected"]]
    assert len(injected) == summary["corrupt_injected"]
    assert all(r["arm"] == "fault:restore_corruption" and r["check"] in ("wrong", "same", "length")
               and r["cached_tokens"] and r["hit_kind"] == "tree" for r in injected)


def test_negative_control_a_blinded_check_fails_the_run(soak):
    """The run's own records, re-summarized as if the checker had passed the injected answers:
    the verdict fails, and only because of them."""
    _, report = soak
    reqs = msgspec.convert(report["requests"], list[RequestRecord])
    faults = msgspec.convert(report["faults"], list[FaultRecord])
    settings = report["settings"]

    def verdict(records: list[RequestRecord]) -> dict:
        return summarize(records, faults, report["samples"],
                         wall_s=report["summary"]["wall_s"],
                         startups=report["summary"]["startup_s"],
                         kinds=tuple(report["summary"]["faults"]),
                         rss_bound_mib_per_min=settings["rss_bound"],
                         min_window_s=settings["min_window"])

    assert verdict(reqs)["verdict"] == "pass"               # as the run itself said
    blind = [msgspec.structs.replace(r, outcome="ok", cause="", check="same") if r.injected
             else r for r in reqs]
    summary = verdict(blind)
    assert summary["verdict"] == "fail" and summary["corrupt_caught"] == 0
    assert summary["reasons"] == [f"{summary['corrupt_injected']} of "
                                  f"{summary['corrupt_injected']} answers served from an "
                                  "injected restore corruption not flagged by the check"]


def test_blocks_served_in_place_held_the_rows_their_links_stored(soak):
    """The workers' in-place check (testing/in_place_check.py) ran on the restores that took
    blocks from vLLM's pool, and none of those blocks held other rows than the links stored
    (a gross one fails the verdict above; rounding-level differences are counted, not failed:
    the soak's float32 engine runs in step mode, which is not batch-invariant)."""
    _, report = soak
    cache = report["summary"]["cache"]
    assert cache["in_place_restores"] > 0 and cache["in_place_blocks"] > 0
    assert cache["in_place_gross"] == 0
    assert cache["in_place_differing"] <= cache["in_place_blocks"]
