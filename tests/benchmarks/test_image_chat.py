"""The image-chat trace and the replayer's image accounting (no server)."""

from __future__ import annotations

import pytest

from benchmarks.ideal import PromptTokenizer, ideal_cached
from benchmarks.image_chat_bench import new_screenshot, without_reuse
from benchmarks.image_keys import collapse, ideal_ids, image_refs, pad_id, pad_runs
from benchmarks.traces import generate

PAD = 7


def _user(url: str, uuid: str | None = None) -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return {"role": "user", "content": [{"type": "text", "text": "see"}, part]}


def test_refs_name_images_by_uuid_else_url_in_prompt_order():
    msgs = [{"role": "system", "content": "s"}, _user("data:a"), {"role": "assistant",
                                                                  "content": "ok"},
            _user("data:b", uuid="u-b")]
    assert image_refs(msgs) == ["data:a", "u-b"]
    assert image_refs([{"role": "user", "content": "text only"}]) == []


def test_pad_runs_collapse_and_ideal_ids():
    ids = [1, 2, PAD, PAD, PAD, 3, PAD, PAD, 4]
    assert pad_runs(ids, PAD) == [(2, 5), (6, 8)]
    assert collapse(ids, PAD) == [1, 2, PAD, 3, PAD, 4]
    x = ideal_ids(ids, PAD, ["x", "y"])
    y = ideal_ids(ids, PAD, ["z", "y"])
    assert x[:2] == [1, 2] and all(t < 0 for t in x[2:5]) and x[5] == 3
    assert x == ideal_ids(ids, PAD, ["x", "y"])  # same images, same ids
    # another first picture: the ideal prefix stops at its first pad, as the cache's keys do
    assert ideal_cached([0, 1], [x, y], [x, y])[1] == 2
    with pytest.raises(ValueError, match="pad runs"):
        ideal_ids(ids, PAD, ["x"])


@pytest.fixture(scope="module")
def vl_tokenizer(embedded_model) -> PromptTokenizer:
    return PromptTokenizer(embedded_model("flash-next-vl-tiny"))


def test_image_chat_trace_resends_its_screenshots_and_renders_one_pad_each(vl_tokenizer):
    trace = generate("image-chat", "ci", 0)
    pad = pad_id(vl_tokenizer)
    assert pad is not None
    urls_by_session: dict[str, set[str]] = {}
    for req in trace.requests:
        msgs = trace.messages(req)
        refs = image_refs(msgs)
        assert 1 <= len(refs) <= 2
        urls_by_session.setdefault(req.session, set()).update(refs)
        ids = vl_tokenizer.prompt_ids(msgs, None)
        assert len(pad_runs(ids, pad)) == len(refs) and ids.count(pad) == len(refs)
    assert all(len(u) == 2 for u in urls_by_session.values()), "two screenshots a session"
    sessions = list(urls_by_session.values())
    assert sessions[0].isdisjoint(sessions[1]), "every session has its own pictures"
    kinds = [new_screenshot(trace, r) for r in trace.requests]
    assert kinds.count(True) == 2 * len(trace.sessions) and kinds.count(False) >= 6


def test_without_reuse_gives_every_request_its_own_image_names():
    trace = generate("image-chat", "ci", 0)
    control = without_reuse(trace)
    assert len(control.requests) == len(trace.requests)
    seen: set[str] = set()
    for a, b in zip(trace.requests, control.requests, strict=True):
        refs = image_refs(control.messages(b))
        assert len(refs) == len(image_refs(trace.messages(a)))
        assert seen.isdisjoint(refs)
        seen.update(refs)
        # the prompt is otherwise the same: same texts, same URLs
        strip = [[{k: v for k, v in p.items() if k != "uuid"} for p in m["content"]]
                 if isinstance(m["content"], list) else m["content"]
                 for m in control.messages(b)]
        assert strip == [m["content"] for m in trace.messages(a)]
