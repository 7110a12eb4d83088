"""A client's image uuid plants no state, through the real server: `vllm serve
flash-next-vl-tiny --plugin hybridcache --mm-processor-cache-gb 0`, OpenAI chat with image
parts that carry a `uuid` (vLLM's `multi_modal_uuids`).

vLLM trusts a client's uuid in two caches: its processor cache (a later request with the uuid
is given the first request's processed pixels) and its encoder cache (the tower's output is
reused by identifier). The processor cache is off here on purpose: with it on, a second request
under the same uuid *computes* with the first one's pixels, so the scheduler sees (and the
cache keys) the first picture's content, and there is nothing to tell apart. With it off, the
second request's own pixels reach the scheduler while vLLM's encoder cache still hands it the
first picture's embeddings: the case the cache's encoder bindings (`adapter/mm_keys.py`) are
for. Checked: that request restores and captures nothing past the text before the image, and
a later request with its pixels under a fresh uuid equals its cold run bit for bit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from benchmarks.servers import SYSTEMS, ServerSettings, running_server
from tests.serving.conftest import KEY, cache_stats, clear_cache
from tests.serving.test_images import SYSTEM, _cold, _data_url, _pads, _png, _run, _same

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

GRID = 64


@pytest.fixture(scope="module")
def uuid_server(embedded_model, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_HYBRIDCACHE_GRID", str(GRID))
    mp.setenv("VLLM_HYBRIDCACHE_MESSAGE_END_MIN", "16")
    mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                            if p))
    settings = ServerSettings(model_path=str(embedded_model("flash-next-vl-tiny")),
                              served_name="vl", max_model_len=4096, port=8312,
                              extra_args=["--api-key", KEY, "--mm-processor-cache-gb", "0"])
    log = tmp_path_factory.mktemp("server") / "vl-uuids.log"
    with running_server(SYSTEMS["ours"], settings, log) as srv:
        yield srv
    mp.undo()


def _unkeyed(srv, wait_for: int | None = None) -> int:
    """Lookups missed as `unkeyed_input` (stats ride on step outputs: poll for `wait_for`)."""
    deadline = time.monotonic() + 30
    while True:
        n = cache_stats(srv)["tiers"].get("ram", {}).get("misses", {}).get("unkeyed_input", 0)
        if wait_for is None or n >= wait_for or time.monotonic() > deadline:
            return n
        time.sleep(0.5)


def _messages(png: bytes, uuid: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [
        {"type": "text", "text": "Here is the picture I took this morning in the garden: "},
        {"type": "image_url", "image_url": {"url": _data_url(png)}, "uuid": uuid},
        {"type": "text", "text": " What do you see, and where is the brightest spot?"}]}]


def test_a_reused_uuid_with_other_pixels_shares_no_state(uuid_server):
    srv = uuid_server
    a, b = _png(11), _png(12)
    cold_b = _cold(srv, _messages(b, "uuid-of-b-alone"))
    clear_cache(srv)
    first = _run(srv, _messages(a, "shared-uuid"))
    start, end = _pads(srv, first["prompt"])
    assert (end // GRID + 1) * GRID < len(first["prompt"]) - 1  # a cut after the image
    before = _unkeyed(srv)
    second = _run(srv, _messages(b, "shared-uuid"))  # vLLM's encoder cache: a's embeddings
    assert second["prompt"] == first["prompt"]
    assert second["cached"] <= start
    # sensitivity: vLLM itself computed the second request with a's embeddings (its trust in
    # the uuid), so its answer is not b's
    assert second["logprobs"] != cold_b["logprobs"]
    third = _run(srv, _messages(b, "a-fresh-uuid"))
    assert third["cached"] <= start  # nothing of the second request's state was kept
    _same(third, cold_b)
    assert _unkeyed(srv, wait_for=before + 1) == before + 1  # the second: its uuid held a's
    # and the first picture under another uuid still hits past the image (content keys)
    again = _run(srv, _messages(a, "yet-another-uuid"))
    assert again["cached"] > end
