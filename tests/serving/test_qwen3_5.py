"""Qwen3.5 through the real server: `vllm serve qwen3.5-vl-tiny --plugin hybridcache`.

Every Qwen3.5 checkpoint is `Qwen3_5ForConditionalGeneration`, a vision-language class served
by vLLM's own model file, whose import needs transformers' torchvision image processor and whose
processor needs a video processor; neither loads here (no torchvision beside torch 2.13.0+cpu),
so this file also shows the compat stand-ins at work (compat/vision_imports.py): the server
starts, text and images are served, a video is refused with vLLM's own limit error.

Every hit is checked against a cold run of the same request in the same server (cache
cleared): same prompt ids, tokens and logprobs, bit for bit. The sensitivity of the check is
shown on this model too: a restored state corrupted after every check of its bytes passed
(the fault injection) makes the same comparison fail.
"""

from __future__ import annotations

import uuid

import pytest
import requests

from benchmarks.servers import SYSTEMS, ServerSettings, running_server
from tests.serving import test_images as images
from tests.serving.conftest import KEY, cache_stats, clear_cache
from tests.serving.test_images import SYSTEM, _same, _user
from tests.serving.test_images import _data_url as _url
from tests.serving.worker_extensions import corrupt_next_restore, corruption_result

pytestmark = pytest.mark.slow

GRID = 64
MODEL = "qwen35"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def q35_server(embedded_model, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_HYBRIDCACHE_GRID", str(GRID))
    mp.setenv("VLLM_HYBRIDCACHE_MESSAGE_END_MIN", "16")
    settings = ServerSettings(
        model_path=str(embedded_model("qwen3.5-vl-tiny")), served_name=MODEL,
        max_model_len=8192, port=8320,
        extra_args=["--api-key", KEY, "--worker-extension-cls",
                    "vllm_hybridcache.testing.instrumentation.FaultInjection"])
    log = tmp_path_factory.mktemp("server") / "qwen35.log"
    with running_server(SYSTEMS["ours"], settings, log) as srv:
        yield srv, log
    mp.undo()


def _png(seed: int, w: int = 320, h: int = 256, **save) -> bytes:
    return images._png(seed, w, h, **save)


def _post(srv, messages, **extra) -> requests.Response:
    return images._post(srv, messages, model=MODEL, **extra)


def _run(srv, messages, **extra) -> dict:
    return images._run(srv, messages, model=MODEL, **extra)


def _cold(srv, messages) -> dict:
    return images._cold(srv, messages, model=MODEL)


def _pads(prompt: list[int]) -> tuple[int, int]:
    return images._pads(None, prompt)


def test_the_server_starts_with_the_stand_ins_and_says_so(q35_server):
    _, log = q35_server
    text = log.read_text(errors="replace")
    assert "snapshot cache on" in text
    assert "videos are off for this model" in text


def test_a_text_conversation_hits_and_equals_cold(q35_server):
    srv, _ = q35_server
    turn1 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "List three things a garden needs in spring. " * 4}]
    turn2 = [*turn1, {"role": "assistant", "content": "Water, light and good soil."},
             {"role": "user", "content": "Which of them matters most for tomatoes, and why?"}]
    cold = _cold(srv, turn2)
    clear_cache(srv)
    first = _run(srv, turn1)
    warm = _run(srv, turn2)
    assert warm["prompt"][:len(first["prompt"])] == first["prompt"]
    assert warm["cached"] >= GRID * (len(first["prompt"]) // GRID) - GRID > 0
    _same(warm, cold)


def test_the_same_picture_resent_with_other_png_bytes_hits_past_it(q35_server):
    """The issue's case: the same pixels in another PNG encoding (vLLM hashes both to one
    identifier, the cache keys both by one processed content), sent first in the conversation
    (no text before it to share), must serve the links past the picture and equal the cold
    run; so must a later turn of that conversation."""
    srv, _ = q35_server
    first, again = _png(3, w=640, h=480), _png(3, w=640, h=480, compress_level=1)
    assert first != again
    question = " What is in it? Name every colour you can see, from left to right. " * 3

    def conversation(png: bytes) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(png)}},
                                             {"type": "text", "text": question}]}]

    cold = _cold(srv, conversation(again))
    clear_cache(srv)
    _run(srv, conversation(first))
    warm = _run(srv, conversation(again))
    start, end = _pads(warm["prompt"])
    assert start < GRID and end - start > 2 * GRID  # nothing before it, several cuts inside it
    assert warm["cached"] > end  # restored past the picture
    _same(warm, cold)
    later = [*conversation(again), {"role": "assistant", "content": "Many colours, no order."},
             {"role": "user", "content": "Which one covers most of it?"}]
    cold_later = _cold(srv, later)
    clear_cache(srv)
    _run(srv, conversation(first))
    warm_later = _run(srv, later)
    assert warm_later["cached"] >= warm["cached"]
    _same(warm_later, cold_later)


def test_another_picture_under_the_same_text_shares_only_the_text_before_it(q35_server):
    srv, _ = q35_server
    question = " What do you see, and where is the brightest spot?" * 4
    msgs_x = [{"role": "system", "content": SYSTEM}, _user(_url(_png(1)), question)]
    msgs_y = [{"role": "system", "content": SYSTEM}, _user(_url(_png(2)), question)]
    cold_y = _cold(srv, msgs_y)
    clear_cache(srv)
    x = _run(srv, msgs_x)
    y = _run(srv, msgs_y)
    start, end = _pads(y["prompt"])
    # sensitivity: same token ids through and past the picture, and a cut after it
    assert x["prompt"] == y["prompt"] and (end // GRID + 1) * GRID < len(y["prompt"]) - 1
    assert 0 < y["cached"] <= start
    _same(y, cold_y)


def test_negative_control_a_corrupted_restore_past_the_picture_is_caught(q35_server):
    srv, _ = q35_server
    png = _png(10)
    question = " Is there water in it?"
    msgs = [{"role": "system", "content": SYSTEM}, _user(_url(png), question)]
    resent = [{"role": "system", "content": SYSTEM},
              _user(_url(_png(10, compress_level=1)), question)]
    cold = _cold(srv, resent)
    clear_cache(srv)
    _run(srv, msgs)
    tag = f"negative-control-{uuid.uuid4().hex}"
    corrupt_next_restore(srv, tag, HEADERS)
    warm = _run(srv, resent, request_id=tag)
    done = corruption_result(srv, tag, HEADERS)
    _, end = _pads(warm["prompt"])
    assert warm["cached"] > end
    assert done is not None and done["corrupted"] and done["tokens"] == warm["cached"]
    with pytest.raises(AssertionError):
        _same(warm, cold)
    clear_cache(srv)


def test_a_video_is_refused_with_a_clear_error_and_the_server_stays_up(q35_server):
    srv, _ = q35_server
    before = cache_stats(srv)
    r = _post(srv, [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
        {"type": "text", "text": "what happens here?"}]}])
    assert r.status_code == 400
    assert "0 video" in r.text
    after = cache_stats(srv)
    assert after["tiers"]["ram"]["kinds"]["tree"]["captures"] == \
        before["tiers"]["ram"]["kinds"]["tree"]["captures"]
    assert requests.get(srv.base_url + "/health", timeout=10).status_code == 200
