"""Images in the key, through the real server: `vllm serve flash-next-vl-tiny --plugin
hybridcache`, OpenAI chat with image content parts (grid 64, so cuts fall before, inside and
after each image's placeholder rows).

Every hit is checked against a cold run of the same request in the same server (cache
cleared): same tokens, same logprobs, bit for bit. The sensitivity of each check is asserted
too: the two requests of the different-image case have identical prompt token ids, so a key
without the image's content would restore the first image's state (the unit-level negative
control, tests/adapter/test_unkeyed_inputs.py, runs exactly that). End to end, the comparison
can fail: a hit past an image whose restored state the worker corrupts after every check of
the bytes passed (the fault injection's `RestoreCorruption`) differs from its cold run.

The server carries the vision probe (`benchmarks.vision_probe`: the tower's calls, counted in
the worker) with the fault injection (tests/serving/worker_extensions.py) and an operator's
pixel limit (`VLLM_MAX_IMAGE_PIXELS`), so the same engine shows
that a conversation encodes its image once and that oversized images are refused."""

from __future__ import annotations

import base64
import io
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests

from benchmarks import vision_probe
from benchmarks.servers import SYSTEMS, ServerSettings, reset_cache, running_server
from tests.serving import worker_extensions
from tests.serving.conftest import KEY, cache_stats, cached_tokens, clear_cache
from tests.serving.worker_extensions import corrupt_next_restore, corruption_result

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

GRID = 64
MAX_IMAGE_PIXELS = 4_000_000  # the operator's limit the server runs with (vLLM's own check)
SYSTEM = ("You are a careful assistant who describes pictures for people who cannot see them. "
          "Describe shapes, colours and their positions, and say when you are unsure. " * 2)


def _png(seed: int, w: int = 256, h: int = 192, **save) -> bytes:
    """Random pixels of `seed` as PNG (`save`: PIL's PNG options, e.g. another
    `compress_level` for other bytes of the same pixels)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG",
                                                                          **save)
    return buf.getvalue()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def vl_server(embedded_model, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_HYBRIDCACHE_GRID", str(GRID))
    mp.setenv("VLLM_HYBRIDCACHE_MESSAGE_END_MIN", "16")
    mp.setenv("VLLM_MAX_IMAGE_PIXELS", str(MAX_IMAGE_PIXELS))
    # the worker imports the probe from the repository
    mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                            if p))
    settings = ServerSettings(model_path=str(embedded_model("flash-next-vl-tiny")),
                              served_name="vl", max_model_len=4096, port=8310,
                              extra_args=["--api-key", KEY, "--allowed-local-media-path",
                                          str(media), *worker_extensions.EXTENSION_ARGS])
    log = tmp_path_factory.mktemp("server") / "vl.log"
    with running_server(SYSTEMS["ours"], settings, log) as srv:
        yield srv, media
    mp.undo()


def _post(srv, messages, model: str = "vl", **extra) -> requests.Response:
    body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 5, "return_token_ids": True, **extra}
    return requests.post(srv.base_url + "/v1/chat/completions",
                         headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=300)


def _run(srv, messages, **extra) -> dict:
    r = _post(srv, messages, **extra)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    return {"prompt": body["prompt_token_ids"], "cached": cached_tokens(body),
            "tokens": choice["token_ids"],
            "logprobs": [(t["token"], t["logprob"], [(a["token"], a["logprob"])
                                                     for a in t["top_logprobs"]])
                         for t in choice["logprobs"]["content"]]}


def _cold(srv, messages, **extra) -> dict:
    clear_cache(srv)
    out = _run(srv, messages, **extra)
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


def test_negative_control_a_corrupted_restore_past_the_image_is_caught(vl_server):
    """The comparison above can fail on the image path: the same image under another URL hits
    past its placeholder rows, the worker corrupts the restored state after every check of its
    bytes passed (checksums all valid), and `_same` calls the answer different from the cold
    run. The prompt ends a few tokens past the restored link, so its first token is computed
    from that state (some tens of tokens of prefill wash a random-weight model's state out)."""
    srv, media = vl_server
    headers = {"Authorization": f"Bearer {KEY}"}
    png = _png(10)
    path = media / "pond.png"
    path.write_bytes(png)
    question = " Is there water in it?"
    by_data = [{"role": "system", "content": SYSTEM}, _user(_data_url(png), question)]
    by_file = [{"role": "system", "content": SYSTEM}, _user(path.as_uri(), question)]
    cold = _cold(srv, by_file)
    clear_cache(srv)
    _run(srv, by_data)
    tag = f"negative-control-{uuid.uuid4().hex}"
    corrupt_next_restore(srv, tag, headers)
    warm = _run(srv, by_file, request_id=tag)
    done = corruption_result(srv, tag, headers)
    _, end = _pads(srv, warm["prompt"])
    assert warm["cached"] > end  # restored past the image, as the positive test
    assert done is not None and done["corrupted"] and done["tokens"] == warm["cached"]
    assert warm["prompt"] == cold["prompt"]
    with pytest.raises(AssertionError):
        _same(warm, cold)
    # the corrupted request's links and vLLM's blocks of it leave with it
    clear_cache(srv)
    assert reset_cache(srv.base_url, headers)


def _tower(srv) -> dict:
    return vision_probe.read(srv.base_url, {"Authorization": f"Bearer {KEY}"})


def test_a_conversation_sending_the_same_image_every_turn_encodes_it_once(vl_server):
    """vLLM 0.32's encoder cache is keyed by the item's hash and outlives the request, so the
    tower runs once for the image even when the snapshot cache is emptied before every turn
    (each later turn is then a full prefill that still needs the image's rows)."""
    srv, _ = vl_server
    url = _data_url(_png(7))
    history = [{"role": "system", "content": SYSTEM}, _user(url, " Describe it in one line.")]
    before = _tower(srv)
    _run(srv, history)
    first = _tower(srv)
    assert (first["calls"], first["images"]) == (before["calls"] + 1, before["images"] + 1)
    for i, question in enumerate(("Which colour covers most of it?", "Is there a face?")):
        clear_cache(srv)
        history = [*history, {"role": "assistant", "content": f"Answer number {i}."},
                   {"role": "user", "content": question}]
        out = _run(srv, history)
        assert out["cached"] == 0  # nothing restored: the prefill ran over the image's rows
        assert _tower(srv) == first
    # sensitivity: another picture in the same conversation is encoded
    _run(srv, [*history, {"role": "assistant", "content": "No."},
               _user(_data_url(_png(8)), " And this one?")])
    assert _tower(srv)["images"] == first["images"] + 1


def _bad(srv, url: str) -> requests.Response:
    return _post(srv, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "what is this?"}]}])


def _solid_png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (w, h), 1).save(buf, format="PNG")  # 1 bit per pixel: small to build
    return buf.getvalue()


def test_bad_images_get_vllm_errors_and_cache_nothing(vl_server):
    srv, _ = vl_server
    clear_cache(srv)
    before = cache_stats(srv)
    garbage = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    thin = _data_url(_png(5, w=1000, h=4))  # aspect ratio beyond what the processor takes
    for url, message in ((garbage, "Failed to load image"), (thin, "aspect ratio"),
                         # over the operator's VLLM_MAX_IMAGE_PIXELS
                         (_data_url(_solid_png(2500, 2000)), "VLLM_MAX_IMAGE_PIXELS")):
        r = _bad(srv, url)
        assert r.status_code == 400 and message in r.text, r.text
    # beyond PIL's decompression-bomb bound (2 x 89,478,485 pixels): PIL refuses it while
    # opening, before vLLM's own check; vLLM 0.32 answers 500 (not 400) with PIL's message
    r = _bad(srv, _data_url(_solid_png(14000, 14000)))
    assert r.status_code == 500 and "decompression bomb" in r.text, r.text
    # more image rows than the context holds: vLLM's length check, after processing
    square = _data_url(_solid_png(256, 256))  # 64 rows each
    many = [{"type": "image_url", "image_url": {"url": square}}] * (4096 // 64 + 1)
    r = _post(srv, [{"role": "user", "content": [*many, {"type": "text", "text": "all?"}]}])
    assert r.status_code == 400 and "maximum context length" in r.text, r.text
    assert cache_stats(srv) == before
    # the server goes on serving
    ok = _run(srv, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(_png(6))}},
        {"type": "text", "text": "and this one?"}]}])
    assert ok["tokens"]


def test_an_image_on_a_text_only_registration_is_refused(server, embedded_model):
    """Our text-only registrations are not multimodal to vLLM: flash-next-tiny's architecture
    maps to `FlashNextForCausalLM`, which lacks `SupportsMultiModal` (what vLLM's registry
    checks), like the package's qwen3-next-tiny server, so vLLM's chat front end refuses image
    parts before anything reaches the engine or the cache."""
    import json
    from importlib import import_module

    from vllm.model_executor.models.interfaces import supports_multimodal

    from tests.serving.conftest import chat
    from vllm_hybridcache.flash_next.registration import ARCHITECTURES

    config = json.loads((embedded_model("flash-next-tiny") / "config.json").read_text())
    module, name = ARCHITECTURES[config["architectures"][0]].split(":")
    assert not supports_multimodal(getattr(import_module(module), name))
    before = cache_stats(server)
    r = requests.post(server.base_url + "/v1/chat/completions",
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "max_tokens": 2, "messages": [
                          {"role": "user", "content": [
                              {"type": "image_url", "image_url": {"url": _data_url(_png(9))}},
                              {"type": "text", "text": "what is this?"}]}]}, timeout=120)
    assert r.status_code == 400 and "not a multimodal model" in r.text, r.text
    assert cache_stats(server) == before
    assert chat(server, [{"role": "user", "content": "still there?"}])[0]
