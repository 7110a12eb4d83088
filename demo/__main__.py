"""Run the demo: `python -m demo [--model NAME] [--no-baseline]` (what `make demo` does).

Starts `vllm serve MODEL --plugin hybridcache` on an embedded tiny model, plays two agent
sessions through the OpenAI API (a lead agent with tool calls and a growing history, then a
sub-agent that shares the system prompt and tools), and prints per turn the prompt tokens, the
tokens served from cache and the time to first token. Then it runs the same sessions against
stock vLLM with prefix caching off, for the before/after, and stops both servers cleanly.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.servers import SYSTEMS, ServerSettings, running_server
from demo.conversation import TOOLS, demo_sessions


def one_turn(client, model: str, messages: list[dict]) -> tuple[int, int, float]:
    """Stream one chat completion; return (prompt tokens, cached tokens, seconds to 1st token)."""
    t0 = time.perf_counter()
    ttft = None
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if ttft is None and chunk.choices and (chunk.choices[0].delta.content
                                               or chunk.choices[0].delta.tool_calls):
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    if ttft is None:
        ttft = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None)
    cached = (details.cached_tokens or 0) if details is not None else 0
    return usage.prompt_tokens, cached, ttft


def play(base_url: str, model: str, label: str) -> list[tuple[str, int, int, int, float]]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="demo")
    rows = []
    print(f"\n== {label}")
    print(f"{'session':44s} {'turn':>4s} {'prompt':>7s} {'cached':>7s} {'TTFT ms':>8s}")
    for name, turns in demo_sessions():
        for i, messages in enumerate(turns, start=1):
            prompt, cached, ttft = one_turn(client, model, messages)
            rows.append((name, i, prompt, cached, ttft))
            print(f"{name:44s} {i:4d} {prompt:7d} {cached:7d} {ttft * 1000:8.0f}", flush=True)
    total = sum(r[2] for r in rows)
    served = sum(r[3] for r in rows)
    print(f"total: {total} prompt tokens, {served} served from cache "
          f"({100 * served / max(total, 1):.1f}%)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__)
    parser.add_argument("--model", default="flash-next-tiny")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the stock-vLLM run without prefix caching")
    args = parser.parse_args(argv)

    from vllm_hybridcache.models import ModelStoreError, ensure_model

    try:
        path = ensure_model(args.model)
    except ModelStoreError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    settings = ServerSettings(model_path=str(path), served_name=args.model, max_model_len=16384,
                              port=args.port,
                              extra_args=["--enable-auto-tool-choice", "--tool-call-parser",
                                          "hermes"])
    logs = Path(tempfile.mkdtemp(prefix="hybridcache-demo-"))
    systems = [("ours", "vllm serve --plugin hybridcache (snapshot cache on)")]
    if not args.no_baseline:
        systems.append(("nocache", "stock vLLM, prefix caching off (baseline)"))
    results = {}
    for system, label in systems:
        print(f"starting {label} on {args.model} ... (log: {logs / system}.log)", flush=True)
        with running_server(SYSTEMS[system], settings, logs / f"{system}.log") as server:
            print(f"server up in {server.startup_s:.0f} s: {' '.join(server.argv)}")
            results[system] = play(server.base_url, args.model, label)
        print("server stopped")
    if "nocache" in results:
        ours = {(r[0], r[1]): r for r in results["ours"]}
        print("\n== before/after (same turns): TTFT ms without cache -> with cache")
        for r in results["nocache"]:
            o = ours[(r[0], r[1])]
            print(f"{r[0]:44s} turn {r[1]}: {r[4] * 1000:6.0f} -> {o[4] * 1000:6.0f}   "
                  f"(cached {o[3]}/{o[2]} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
