"""Images in the key, through the real server: `vllm serve flash-next-vl-tiny --plugin
hybridcache`, OpenAI chat with image content parts (grid 64, so cuts fall before, inside and
after each image's placeholder rows).

Every hit is checked against a cold run of the same request in the same server (cache
cleared): same tokens, same logprobs, bit for bit. The sensitivity of each check is asserted
too: the two requests of the different-image case have identical prompt token ids, so a key
without the image's content would restore the first image's state (the unit-level negative
control, tests/adapter/test_unkeyed_inputs.py, runs exactly that)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import requests

from benchmarks.servers import SYSTEMS, ServerSettings, running_server
from tests.serving.conftest import KEY, cache_stats, cached_tokens, clear_cache

pytestmark = pytest.mark.slow

GRID = 64
SYSTEM = ("You are a careful assistant who describes pictures for people who cannot see them. "
          "Describe shapes, colours and their positions, and say when you are unsure. " * 2)


def _png(seed: int, w: int = 256, h: int = 192) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def vl_server(embedded_model, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_HYBRIDCACHE_GRID", str(GRID))
    mp.setenv("VLLM_HYBRIDCACHE_MESSAGE_END_MIN", "16")
    settings = ServerSettings(model_path=str(embedded_model("flash-next-vl-tiny")),
                              served_name="vl", max_model_len=4096, port=8310,
                              extra_args=["--api-key", KEY, "--allowed-local-media-path",
                                          str(media)])
    log = tmp_path_factory.mktemp("server") / "vl.log"
    with running_server(SYSTEMS["ours"], settings, log) as srv:
        yield srv, media
    mp.undo()


def _post(srv, messages, model: str = "vl") -> requests.Response:
    body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 5, "return_token_ids": True}
    return requests.post(srv.base_url + "/v1/chat/completions",
                         headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=300)


def _run(srv, messages) -> dict:
    r = _post(srv, messages)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    return {"prompt": body["prompt_token_ids"], "cached": cached_tokens(body),
            "tokens": choice["token_ids"],
            "logprobs": [(t["token"], t["logprob"], [(a["token"], a["logprob"])
                                                     for a in t["top_logprobs"]])
                         for t in choice["logprobs"]["content"]]}


def _cold(srv, messages) -> dict:
    clear_cache(srv)
    out = _run(srv, messages)
    assert out["cached"] == 0
    return out


def _same(warm: dict, cold: dict) -> None:
    assert warm["prompt"] == cold["prompt"]
    assert warm["tokens"] == cold["tokens"]
    assert warm["logprobs"] == cold["logprobs"]


def _user(url: str, text: str) -> dict:
    return {"role": "user", "content": [
        {"type": "text", "text": "Here is the picture I took this morning in the garden: "},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": text}]}


def _pads(srv, prompt: list[int]) -> tuple[int, int]:
    """[first, last + 1) of the image placeholder rows in a prompt."""
    pad = 4096 + 2  # <|image_pad|>: the VL tokenizer appends the vision tokens after 4096
    rows = [i for i, t in enumerate(prompt) if t == pad]
    assert rows and rows == list(range(rows[0], rows[-1] + 1))
    return rows[0], rows[-1] + 1


def test_different_images_never_share_state_past_the_first_placeholder(vl_server):
    srv, _ = vl_server
    question = " What do you see, and where is the brightest spot?"
    msgs_x = [{"role": "system", "content": SYSTEM}, _user(_data_url(_png(1)), question)]
    msgs_y = [{"role": "system", "content": SYSTEM}, _user(_data_url(_png(2)), question)]
    cold_y = _cold(srv, msgs_y)
    clear_cache(srv)
    x = _run(srv, msgs_x)
    y = _run(srv, msgs_y)
    start, end = _pads(srv, y["prompt"])
    # sensitivity: same token ids through and past the image, and a cut after it
    assert x["prompt"] == y["prompt"] and (end // GRID + 1) * GRID < len(y["prompt"]) - 1
    assert 0 < y["cached"] <= start  # the shared text before the image, nothing of the image
    _same(y, cold_y)


def test_same_image_under_another_url_hits_and_equals_cold(vl_server):
    srv, media = vl_server
    png = _png(3)
    path = media / "garden.png"
    path.write_bytes(png)
    question = " Is it day or night?"
    by_data = [{"role": "system", "content": SYSTEM}, _user(_data_url(png), question)]
    by_file = [{"role": "system", "content": SYSTEM}, _user(path.as_uri(), question)]
    cold = _cold(srv, by_file)
    clear_cache(srv)
    _run(srv, by_data)
    warm = _run(srv, by_file)
    _, end = _pads(srv, warm["prompt"])
    assert warm["cached"] > end  # restored past the image
    _same(warm, cold)


def test_later_turns_hit_past_the_image_and_equal_cold(vl_server):
    srv, _ = vl_server
    url = _data_url(_png(4))
    turn1 = [{"role": "system", "content": SYSTEM}, _user(url, " Describe it in one line.")]
    first = _run(srv, turn1)
    turn2 = [*turn1, {"role": "assistant", "content": "A noisy square of many colours."},
             {"role": "user", "content": "Which colour covers most of it? Think about the "
              "corners first, then the middle, and answer in a few words."}]
    cold = _cold(srv, turn2)
    clear_cache(srv)
    _run(srv, turn1)
    warm = _run(srv, turn2)
    _, end = _pads(srv, warm["prompt"])
    assert first["prompt"] == warm["prompt"][:len(first["prompt"])]
    assert warm["cached"] > end
    _same(warm, cold)


def test_bad_images_get_vllm_errors_and_cache_nothing(vl_server):
    srv, _ = vl_server
    clear_cache(srv)
    before = cache_stats(srv)
    garbage = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    thin = _data_url(_png(5, w=1000, h=4))  # aspect ratio beyond what the processor takes
    for url in (garbage, thin):
        r = _post(srv, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "what is this?"}]}])
        assert r.status_code == 400, r.text
    assert cache_stats(srv) == before
    # the server goes on serving
    ok = _run(srv, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(_png(6))}},
        {"type": "text", "text": "and this one?"}]}])
    assert ok["tokens"]
