"""LoRA adapters are keyed by their files' digest, never by the client's name and id.

The old domain keyed an adapter as `f"{lora_name}:{lora_int_id}"`: a new adapter published
under an old name was served the old adapter's states after a restart (disk) or on another
replica. Here: the domain's `lora` field is the digest of `adapter_config.json` and the weight
files where vLLM loads them; an adapter whose files cannot be found is served without the
cache (`unkeyed_input`); inside one engine, an id whose files changed is not keyed (vLLM's
worker still holds the old weights under it) unless the request reloads it in place.
Scheduler side and worker side for real, vLLM's own `Request` and `LoRARequest`; no engine.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from tests.adapter.test_unkeyed_inputs import TOKENS, _commit_cuts
from tests.unit.test_disk_tier_adapter import _side as _disk_side
from tests.unit.test_disk_tier_adapter import _worker
from tests.unit.test_tiered_cache_adapter import _no_steps, _report
from vllm_hybridcache.adapter import lora_keys
from vllm_hybridcache.adapter.domain import request_domain
from vllm_hybridcache.adapter.mm_keys import UnkeyableInput
from vllm_hybridcache.core import LinkKind

BASE = {"weights": "w", "route": "ar"}


def _adapter(folder, weights: bytes = b"lora A", config: str = '{"r": 8}'):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(config)
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def _lora(folder, name: str = "support-bot", int_id: int = 1, **kw):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=str(folder), **kw)


def _request(req_id: str, tokens: list[int], lora=None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, lora_request=lora)


def _domain(lora) -> bytes:
    return request_domain(BASE, SimpleNamespace(cache_salt=None, lora_request=lora))


def test_same_name_and_id_with_other_weights_is_another_domain(tmp_path):
    v1 = _domain(_lora(_adapter(tmp_path / "v1", b"lora A")))
    v2 = _domain(_lora(_adapter(tmp_path / "v2", b"lora B, retrained")))
    assert v1 != v2  # same name "support-bot", same id 1
    conf = _domain(_lora(_adapter(tmp_path / "v3", b"lora A", config='{"r": 16}')))
    assert conf not in (v1, v2)  # the config (rank, alpha, targets) counts too
    assert _domain(None) not in (v1, v2)


def test_same_files_are_the_same_domain_whatever_their_name_or_path(tmp_path):
    a = _adapter(tmp_path / "a")
    shutil.copytree(a, tmp_path / "copy")
    d = _domain(_lora(a))
    assert _domain(_lora(a)) == d
    assert _domain(_lora(tmp_path / "copy", name="other-name", int_id=7)) == d


def test_files_replaced_in_place_change_the_domain(tmp_path):
    a = _adapter(tmp_path / "a", b"lora A")
    before = _domain(_lora(a))
    (a / "adapter_model.safetensors").write_bytes(b"lora A, retrained longer")
    assert _domain(_lora(a)) != before


@pytest.mark.parametrize("case", ["missing_path", "no_config", "no_weights"])
def test_an_adapter_whose_files_cannot_be_found_is_unkeyed(tmp_path, monkeypatch, case):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = tmp_path / "adapter"
    folder.mkdir()
    if case != "no_config":
        (folder / "adapter_config.json").write_text("{}")
    if case != "no_weights":
        (folder / "adapter_model.bin").write_bytes(b"w")
    path = "org/some-adapter" if case == "missing_path" else str(folder)
    with pytest.raises(UnkeyableInput):
        _domain(_lora(path))


def test_a_hub_adapter_is_found_in_the_hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from tests.adapter.test_fingerprint_sources import _hub_cache

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"lora A"}
    _hub_cache(tmp_path / "hub", files, repo="org/adapter")
    local = tmp_path / "local"
    local.mkdir()
    for name, content in files.items():
        (local / name).write_bytes(content)
    assert _domain(_lora("org/adapter")) == _domain(_lora(local))


def test_a_request_lists_the_folder_and_reads_nothing_again(tmp_path, monkeypatch):
    a = _adapter(tmp_path / "a")
    reads = []
    real = lora_keys.file_digest
    monkeypatch.setattr(lora_keys, "file_digest", lambda p: reads.append(p) or real(p))
    first = lora_keys.lora_key(_lora(a))
    assert len(reads) == 2
    for _ in range(3):
        assert lora_keys.lora_key(_lora(a)) == first
    assert len(reads) == 2


def test_the_scheduler_serves_an_unfound_adapter_without_the_cache(tmp_path):
    from tests.adapter.test_unkeyed_inputs import _scheduler_side

    side = _scheduler_side()
    req = _request("a", TOKENS, _lora(tmp_path / "gone"))
    assert side.cuts_for(req) is None
    assert _commit_cuts(side, req, TOKENS) == 0
    assert side.get_num_new_matched_tokens(_request("b", [*TOKENS, 1],
                                                    _lora(tmp_path / "gone")), 0) == (0, False)
    assert side.tree.stats().misses.get("unkeyed_input") == 1
    assert len(side.tree) == 0


def _write_link(side, worker, req) -> None:
    """Commit the tree link of TOKENS at cut 128 for `req` and let the worker write its file."""
    entry = side._track(req)
    r = side.cache.reserve(LinkKind.TREE, entry.keys, 128, entry.domain)
    bufs = worker.store.allocate(r.link_id, side.parts.layout.view_rows(r.start, r.end))
    for t in (*bufs.sections.values(), *bufs.views.values()):
        t.fill_(1)
    worker.store.seal(r.link_id)
    side.apply_report(_report(saved={r.addr: 0.0}, saved_count={r.addr: 1}))
    worker.save(side.build_plan(_no_steps()))
    assert worker.handlers["disk"].writer.close(30)


def test_after_a_restart_a_new_adapter_under_the_old_name_misses_the_old_files(tmp_path):
    """The restart case the name-keyed domain got wrong: engine 1 wrote a link for adapter
    "support-bot" (id 1); the adapter is retrained and republished under the same name and id;
    engine 2 on the same disk folder must not restore it. With the files unchanged it does
    (control)."""
    adapter = _adapter(tmp_path / "adapter", b"lora A")
    side, worker = _disk_side(tmp_path / "disk"), _worker()
    _write_link(side, worker, _request("w", TOKENS, _lora(adapter)))
    assert len(list((tmp_path / "disk").rglob("*-128.link"))) == 1

    same = _disk_side(tmp_path / "disk")
    assert same.get_num_new_matched_tokens(_request("b", [*TOKENS, 1], _lora(adapter)),
                                           0) == (128, True)
    (adapter / "adapter_model.safetensors").write_bytes(b"lora B, retrained")
    restarted = _disk_side(tmp_path / "disk")
    assert restarted.get_num_new_matched_tokens(_request("c", [*TOKENS, 1], _lora(adapter)),
                                                0) == (0, False)


def test_an_id_whose_files_changed_in_a_running_engine_is_not_keyed(tmp_path):
    """vLLM's worker keeps the adapter it loaded under an id: after the files change, a
    request with that id may still run on the old weights, so it is not keyed. An in-place
    reload (`load_inplace`) is keyed by the new files, and a request in flight on the old
    ones captures nothing more and leaves no end anchor."""
    from vllm.v1.request import RequestStatus

    from tests.adapter.test_unkeyed_inputs import _scheduler_side

    adapter = _adapter(tmp_path / "adapter", b"lora A")
    side = _scheduler_side()
    old = _request("old", TOKENS, _lora(adapter))
    assert _commit_cuts(side, old, TOKENS) == 1
    in_flight = _request("in-flight", [*TOKENS, 7], _lora(adapter))
    side._track(in_flight)
    (adapter / "adapter_model.safetensors").write_bytes(b"lora B, retrained")
    stale = _request("stale", [*TOKENS, 1], _lora(adapter))
    assert side.get_num_new_matched_tokens(stale, 0) == (0, False)
    assert side._live["stale"].unkeyed
    assert not side._live["in-flight"].unbound
    reload = _request("reload", [*TOKENS, 2], _lora(adapter, load_inplace=True))
    assert side.get_num_new_matched_tokens(reload, 0) == (0, False)  # new weights: no link
    assert not side._live["reload"].unkeyed
    assert side._live["in-flight"].unbound and not side._live["in-flight"].canonical
    in_flight.status = RequestStatus.FINISHED_LENGTH_CAPPED
    in_flight.num_computed_tokens = len(TOKENS) + 1
    assert side.request_finished(in_flight, ([0], [1, 2])) is False
