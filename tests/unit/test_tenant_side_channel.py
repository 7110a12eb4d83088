"""The side channel (issue 29) on the adapter's outputs: tenant B asking for a prompt tenant A
holds must look, in the answer to vLLM, in the stats snapshot the connector ships, on
/metrics (the Prometheus export, unauthenticated even with --api-key) and in the aggregate of
/v1/cache/stats, exactly like tenant B asking for a prompt nobody holds.

Real scheduler sides with vLLM's `Request` objects, no model (tests/unit/test_tiered_cache_
adapter.py's harness); two sides built alike, one probed with A's prompt, one with an unknown
one of the same length.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from tests.adapter.test_lora_keys import _adapter, _lora
from tests.adapter.test_unkeyed_inputs import TOKENS, _commit_cuts, _request
from tests.prom_registry import private_prom
from tests.unit.test_tiered_cache_adapter import _side

UNKNOWN = [3 + (i * 13) % 900 for i in range(len(TOKENS))]
assert UNKNOWN[:64] != TOKENS[:64]


def _req(req_id: str, tokens: list[int], salt: str, lora: Path | None = None):
    req = _request(req_id, tokens)
    req.cache_salt = salt
    if lora is not None:  # a real adapter's files: the domain names them by content
        req.lora_request = _lora(_adapter(lora))
    return req


def _outputs(probe_tokens: list[int], asker: str = "tenant-b", lora: Path | None = None) -> dict:
    """Tenant A holds TOKENS; `asker` asks for `probe_tokens` + 3 tokens. Everything a
    tenant or anyone on /metrics could read afterwards."""
    from vllm_hybridcache.adapter.stats import encode
    from vllm_hybridcache.serving.http import aggregate, public_stats

    side = _side()
    assert _commit_cuts(side, _req("hold", TOKENS, "tenant-a"), TOKENS) == 1
    req = _req("ask", [*probe_tokens, 1, 2, 3], asker, lora)
    answer = side.get_num_new_matched_tokens(req, 0)
    side.request_finished(req)
    payload = encode(side.cache.stats(), 1, "epoch", side.segmentation_mode)
    prom, reg = private_prom()
    prom.observe(payload)
    metrics = [line for line in generate_latest(reg).decode().splitlines()
               if "_created{" not in line]  # when each series was created: a clock
    return {"answer": answer, "payload": payload, "metrics": "\n".join(metrics),
            "stats": public_stats(aggregate({0: payload}))}


def test_another_tenants_prefix_reads_as_an_unknown_prompt_everywhere():
    probe, blank = _outputs(TOKENS), _outputs(UNKNOWN)
    assert probe["answer"] == blank["answer"] == (0, False)
    assert probe["payload"] == blank["payload"]
    assert probe["metrics"] == blank["metrics"]
    assert probe["stats"] == blank["stats"]
    tree = probe["payload"]["tiers"]["ram"]["tree"]
    assert tree["misses"] == {"no_prefix": 2} and tree["lookups"] == 2  # A's first, B's
    assert 'reason="domain_mismatch"' in probe["metrics"]  # exported, at zero:
    assert 'reason="domain_mismatch",tier="ram"} 0.0' in probe["metrics"]


def test_the_comparison_sees_the_same_tenants_other_domain(tmp_path):
    """Negative control: tenant A asking for its own prompt under another domain (a LoRA
    adapter) is a `domain_mismatch`, and every output tells it from an unknown prompt."""
    adapter = tmp_path / "adapter"
    probe, blank = (_outputs(TOKENS, "tenant-a", lora=adapter),
                    _outputs(UNKNOWN, "tenant-a", lora=adapter))
    assert probe["answer"] == blank["answer"] == (0, False)
    assert probe["payload"]["tiers"]["ram"]["tree"]["misses"] == {"no_prefix": 1,
                                                                  "domain_mismatch": 1}
    assert probe["payload"] != blank["payload"]
    assert probe["metrics"] != blank["metrics"] and probe["stats"] != blank["stats"]
