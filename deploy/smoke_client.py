#!/usr/bin/env python3
"""Smoke checks against a running vllm-hybridcache server (stdlib only: runs on the host).

    python3 deploy/smoke_client.py exact --url http://127.0.0.1:8000 --model flash-next-tiny
    python3 deploy/smoke_client.py ttft  --url ... --model ... --label cache-on --out on.json

``exact``: a long prompt, cold (cache cleared first) then warm (served from the cache); the
generated tokens and their logprobs must be equal bit for bit (the cache's promise), and the
warm request must report cached tokens. ``ttft``: a growing agent-style conversation (a shared
system block, then turns appended), streamed; time to first token and cached tokens per turn,
written as JSON for ``report``. ``report``: one table from the JSON files of cache on and off.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

SYSTEM = ("You are a coding agent. Tools: read_file(path), write_file(path, text), "
          "run(cmd). Answer with one tool call per turn. ") * 40


def _post(url: str, path: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def _turn(i: int) -> str:
    return (f"\nTurn {i}: the tool returned " + " ".join(f"line{i}_{k}" for k in range(180))
            + f"\nWhat next for step {i}?")


def _complete(url: str, model: str, prompt: str) -> dict:
    return _post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 24,
                                          "temperature": 0, "logprobs": 1, "seed": 0})


def exact(args: argparse.Namespace) -> int:
    prompt = SYSTEM + "".join(_turn(i) for i in range(6))
    _post(args.url, "/v1/cache/clear", {})
    cold = _complete(args.url, args.model, prompt)
    warm = _complete(args.url, args.model, prompt)
    c, w = cold["choices"][0], warm["choices"][0]
    cached = ((warm.get("usage") or {}).get("prompt_tokens_details") or {}).get(
        "cached_tokens") or 0
    same_text = c["text"] == w["text"]
    same_lp = c["logprobs"]["token_logprobs"] == w["logprobs"]["token_logprobs"]
    ok = same_text and same_lp and cached > 0
    print(json.dumps({"check": "exact", "ok": ok, "prompt_tokens": warm["usage"][
        "prompt_tokens"], "warm_cached_tokens": cached, "same_tokens": same_text,
        "same_logprobs": same_lp}))
    return 0 if ok else 1


def _stream_ttft(url: str, model: str, prompt: str) -> tuple[float, int, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    usage: dict = {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (ttft if ttft is not None else time.perf_counter() - t0,
            usage.get("prompt_tokens", 0), cached)


def ttft(args: argparse.Namespace) -> int:
    try:
        _post(args.url, "/v1/cache/clear", {})
    except urllib.error.HTTPError:
        pass  # cache off: the route may answer an error; nothing to clear
    rows = []
    prompt = SYSTEM
    for i in range(args.turns):
        prompt += _turn(i)
        t, n, cached = _stream_ttft(args.url, args.model, prompt)
        rows.append({"turn": i + 1, "prompt_tokens": n, "cached_tokens": cached, "ttft_s": t})
    with open(args.out, "w") as f:
        json.dump({"label": args.label, "rows": rows}, f)
    return 0


def report(args: argparse.Namespace) -> int:
    runs = [json.load(open(p)) for p in args.files]
    print(f"{'turn':>4s} {'prompt':>7s} " + " ".join(
        f"{r['label'] + ' cached':>16s} {r['label'] + ' TTFT ms':>17s}" for r in runs))
    for k in range(len(runs[0]["rows"])):
        cells = [runs[0]["rows"][k]["turn"], runs[0]["rows"][k]["prompt_tokens"]]
        line = f"{cells[0]:4d} {cells[1]:7d} "
        line += " ".join(f"{r['rows'][k]['cached_tokens']:16d} {r['rows'][k]['ttft_s'] * 1e3:17.0f}"
                         for r in runs)
        print(line)
    if len(runs) == 2:
        on, off = (sorted(r["ttft_s"] for r in run["rows"][1:]) for run in runs)
        med = lambda xs: xs[len(xs) // 2]  # noqa: E731
        print(f"median TTFT after the first turn: {runs[0]['label']} {med(on) * 1e3:.0f} ms, "
              f"{runs[1]['label']} {med(off) * 1e3:.0f} ms "
              f"({med(off) / max(med(on), 1e-9):.2f}x)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("exact", "ttft"):
        p = sub.add_parser(name)
        p.add_argument("--url", default="http://127.0.0.1:8000")
        p.add_argument("--model", default="flash-next-tiny")
        if name == "ttft":
            p.add_argument("--turns", type=int, default=8)
            p.add_argument("--label", required=True)
            p.add_argument("--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    return {"exact": exact, "ttft": ttft, "report": report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
