"""The image-chat family: a user shows screenshots and asks follow-up questions about them.

Each session: a short system prompt; a user message with a screenshot (an OpenAI `image_url`
part holding a PNG data URL) and a question; the answer; text-only follow-ups; halfway, a
second screenshot ("after I clicked ...") and more follow-ups. Every request resends the whole
history, images included, as chat clients do, so a server that keys nothing on images must
either re-encode and re-prefill them every turn or reuse what it kept.

Screenshots are drawn from the session's seed (window, title bar, side panel, lines of "text"
as dark bars, a coloured chart), 1280x800 like a laptop screen: vLLM's processor resizes them
to the model's pixel bound, so what the tower sees is the model's business, and every session's
pictures differ. Token estimates count each image as `IMAGE_TOKENS` (the tiny VL model's most
rows per image); the replayer measures real counts.
"""

from __future__ import annotations

import base64
import io
import random

from benchmarks.traces import text
from benchmarks.traces.model import Message, Request, Session
from benchmarks.traces.sizes import Size

IMAGE_TOKENS = 64
SCREEN = (1280, 800)

_SYSTEM = ("You are a support assistant for a desktop application. The user shares screenshots "
           "of what they see; describe only what is in them, point at elements by position, "
           "and say when something is not visible.")
_ACTIONS = ("opened the settings", "clicked Save", "switched to the dark theme",
            "opened the report view", "pressed Export", "resized the side panel")


def screenshot(rng: random.Random, size: tuple[int, int] = SCREEN) -> bytes:
    """A PNG that looks like an application window (flat colours compress like a screen)."""
    from PIL import Image, ImageDraw

    w, h = size
    bg = tuple(rng.randint(200, 250) for _ in range(3))
    img = Image.new("RGB", size, bg)
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, w, 36], fill=tuple(rng.randint(30, 90) for _ in range(3)))  # title bar
    panel = rng.randint(w // 6, w // 4)
    d.rectangle([0, 36, panel, h], fill=tuple(rng.randint(150, 210) for _ in range(3)))
    y = 60
    while y < h - 40:  # lines of text as dark bars, in the panel and in the main area
        d.rectangle([16, y, 16 + rng.randint(40, panel - 32), y + 10], fill=(40, 40, 40))
        d.rectangle([panel + 24, y, panel + 24 + rng.randint(100, w - panel - 60), y + 10],
                    fill=(30, 30, 30))
        y += rng.randint(22, 40)
    x0, y0 = rng.randint(panel + 40, w // 2), rng.randint(120, h // 2)
    for i in range(rng.randint(4, 9)):  # a bar chart in the main area
        top = y0 + rng.randint(10, 200)
        d.rectangle([x0 + 36 * i, top, x0 + 36 * i + 24, y0 + 240],
                    fill=tuple(rng.randint(0, 255) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _image_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _tokens(s: str) -> float:
    return len(s) / text.CHARS_PER_TOKEN["message"]


class _ImageConversation:
    """One session being written; tokens estimated without the data URLs' characters."""

    def __init__(self, sid: str) -> None:
        self.sid = sid
        self.messages: list[Message] = [{"role": "system", "content": _SYSTEM}]
        self.request_at: list[int] = []
        self.tokens = _tokens(_SYSTEM)

    def say(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})
        self.tokens += _tokens(content)

    def show(self, intro: str, png: bytes, question: str) -> None:
        self.messages.append({"role": "user", "content": [
            {"type": "text", "text": intro},
            {"type": "image_url", "image_url": {"url": _image_url(png)}},
            {"type": "text", "text": question}]})
        self.tokens += _tokens(intro) + IMAGE_TOKENS + _tokens(question)

    def ask(self) -> None:
        self.request_at.append(len(self.messages))

    def session(self) -> Session:
        return Session(id=self.sid, tools=None, messages=self.messages)


def image_session(sid: str, rng: random.Random, size: Size, target: int) -> _ImageConversation:
    """Screenshot + question, follow-ups, a second screenshot at half the target, follow-ups."""
    conv = _ImageConversation(sid)
    conv.show("Here is what my screen shows right now:", screenshot(rng),
              text.prose(rng, size.user_tokens))
    conv.ask()
    shown_second = False
    while True:
        conv.say("assistant", text.prose(rng, size.answer_tokens))
        if conv.tokens >= target:
            return conv
        if not shown_second and conv.tokens >= target / 2:
            conv.show(f"Then I {rng.choice(_ACTIONS)}; now it looks like this:",
                      screenshot(rng), text.prose(rng, size.user_tokens))
            shown_second = True
        else:
            conv.say("user", text.prose(rng, size.user_tokens))
        conv.ask()


def image_chat(seed: int, size: Size) -> tuple[list[_ImageConversation], list[Request]]:
    """Sessions one after another (one request per wave), each about its own screenshots;
    half the ci size's conversation length (images make every turn longer to serve)."""
    target = size.conversation_tokens // 2
    convs = [image_session(f"img{i}", random.Random(f"{seed}/image-chat/img{i}"), size, target)
             for i in range(size.sessions)]
    reqs: list[Request] = []
    for conv in convs:
        for turn, n in enumerate(conv.request_at):
            reqs.append(Request(conv.sid, turn, len(reqs), n))
    return convs, reqs
