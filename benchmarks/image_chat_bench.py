"""Image chat on a vision-language model: the cache vs vLLM native vs off, and the tower's share.

    python -m benchmarks.image_chat_bench [--size ci] [--seed 0]
                                          [--systems ours,native,nocache] [--out FILE.md]

Replays the `image-chat` trace (screenshots and follow-up questions, every request resending
the history with its images) on `flash-next-vl-tiny`, one server per system, each started with
the vision probe (`benchmarks.vision_probe`) so every request's tower runs and seconds are read
from the worker after it. Per system: the cached fraction of the ideal (the ideal keys images by
content, `benchmarks.image_keys`), TTFT medians, and the tower's share of TTFT on the turns that
bring a new screenshot and on the follow-ups.

"Without reuse": the `nocache` server replays the trace once more with a fresh `uuid` on every
image part of every request. vLLM keys an item on the uuid a client gives, so its encoder cache
never finds an earlier output and the tower runs on every request, as it would without
cross-request encoder reuse; the prompts are otherwise identical. Results are printed and
written as markdown (and JSON beside it) with the command that produced them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import msgspec

from benchmarks import vision_probe
from benchmarks.ideal import PromptTokenizer
from benchmarks.replay import ReplayConfig, ReplayResult, replay
from benchmarks.servers import (
    SYSTEMS,
    ServerSettings,
    process_tree_cpu_s,
    reset_cache,
    running_server,
)
from benchmarks.traces import SIZES, Request, Session, Trace, generate

REPO = Path(__file__).resolve().parent.parent
MODEL = "flash-next-vl-tiny"
NO_REUSE = "nocache, no encoder reuse"


def without_reuse(trace: Trace) -> Trace:
    """The same requests, each in a session of its own whose image parts carry a uuid unique to
    that request (vLLM then keys the item on it: no request finds another's encoder output)."""
    sessions: dict[str, Session] = {}
    requests: list[Request] = []
    for i, req in enumerate(trace.requests):
        sid = f"{req.session}#{i}"
        messages = []
        for msg in trace.sessions[req.session].messages[: req.n_messages + 1]:
            if isinstance(msg.get("content"), list):
                parts = [dict(p, uuid=f"{trace.digest()}-r{i}-{k}")
                         if p.get("type") == "image_url" else p
                         for k, p in enumerate(msg["content"])]
                msg = dict(msg, content=parts)
            messages.append(msg)
        sessions[sid] = Session(id=sid, tools=None, messages=messages)
        requests.append(Request(sid, req.turn, req.wave, req.n_messages))
    return Trace(family=trace.family + " (no encoder reuse)", size=trace.size, seed=trace.seed,
                 description=trace.description, sessions=sessions, requests=requests)


def new_screenshot(trace: Trace, req: Request) -> bool:
    """The request's last message brings an image (else it is a text follow-up)."""
    content = trace.messages(req)[-1].get("content")
    return isinstance(content, list) and any(p.get("type") == "image_url" for p in content)


def run_system(srv, trace: Trace, tokenizer: PromptTokenizer,
               max_tokens: int) -> tuple[ReplayResult, list[dict[str, float]], float | None]:
    """Replay `trace` on a running server; the tower's totals per request (one per wave) and
    the CPU seconds the server's processes spent on the replay (its own work: on a shared
    machine this moves less with other jobs' load than TTFT does)."""
    tower: dict[int, dict[str, float]] = {}
    last = vision_probe.read(srv.base_url)

    def after_wave(indices: list[int]) -> None:
        nonlocal last
        if len(indices) != 1:
            raise ValueError("the tower is attributed per request: one request per wave")
        now = vision_probe.read(srv.base_url)
        tower[indices[0]] = {k: now[k] - last[k] for k in now}
        last = now

    cfg = ReplayConfig(base_url=srv.base_url, model="vl", max_tokens=max_tokens)
    cpu0 = process_tree_cpu_s(srv.pid)
    result = replay(trace, cfg, tokenizer, after_wave=after_wave)
    cpu1 = process_tree_cpu_s(srv.pid)
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    return result, [tower[i] for i in range(len(trace.requests))], cpu


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(trace: Trace, result: ReplayResult, tower: list[dict[str, float]],
              server_cpu_s: float | None) -> dict[str, Any]:
    rs = result.requests
    ok = [r for r in rs if r.error is None]
    new = [r for r in ok if new_screenshot(trace, trace.requests[r.index])]
    follow = [r for r in ok if not new_screenshot(trace, trace.requests[r.index])]

    def share(group) -> float | None:
        return _median([tower[r.index]["seconds"] / r.ttft_s for r in group if r.ttft_s])

    cached = sum(r.cached_tokens or 0 for r in ok)
    ideal = sum(r.ideal_tokens for r in ok)
    return {
        "requests": len(rs), "errors": len(rs) - len(ok),
        "prompt_mismatches": sum(1 for r in ok if r.prompt_ids_match is False),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": cached, "ideal_tokens": ideal,
        "cached_of_ideal": cached / ideal if ideal else None,
        "ttft_p50_s": _median([r.ttft_s for r in ok if r.ttft_s is not None]),
        "ttft_p50_new_s": _median([r.ttft_s for r in new if r.ttft_s is not None]),
        "ttft_p50_follow_s": _median([r.ttft_s for r in follow if r.ttft_s is not None]),
        "tower_runs": sum(int(t["calls"]) for t in tower),
        "tower_images": sum(int(t["images"]) for t in tower),
        "tower_s_per_run": _median([t["seconds"] / t["calls"] for t in tower if t["calls"]]),
        "tower_share_new": share(new), "tower_share_follow": share(follow),
        "follow_ups_with_a_tower_run": sum(1 for r in follow if tower[r.index]["calls"]),
        "server_cpu_s": server_cpu_s,
    }


def _fmt(v: Any, kind: str = "") -> str:
    if v is None:
        return "n/a"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "ms":
        return f"{1000 * v:.0f}"
    if kind == "s":
        return f"{v:.1f}"
    return str(v)


def render(summary: dict[str, dict[str, Any]], trace: Trace, command: str) -> str:
    base = summary.get("nocache", {}).get("ttft_p50_s")
    n_new = sum(1 for r in trace.requests if new_screenshot(trace, r))
    lines = [
        f"# Image chat on {MODEL}", "",
        f"Command: `{command}`", "",
        f"Trace `image-chat` ({trace.size}, seed {trace.seed}, digest {trace.digest()}): "
        f"{len(trace.sessions)} sessions, {len(trace.requests)} requests ({n_new} bring a new "
        f"screenshot, the rest are follow-ups resending the history with its images).", "",
        "| system | cached / ideal | TTFT p50 ms | vs off | new-screenshot p50 ms | "
        "follow-up p50 ms | server CPU s | tower runs | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        ratio = (f"{s['ttft_p50_s'] / base:.2f}" if base and s["ttft_p50_s"] else "n/a")
        lines.append(
            f"| {name} | {_fmt(s['cached_of_ideal'], 'pct')} | {_fmt(s['ttft_p50_s'], 'ms')} "
            f"| {ratio} | {_fmt(s['ttft_p50_new_s'], 'ms')} | "
            f"{_fmt(s['ttft_p50_follow_s'], 'ms')} | {_fmt(s.get('server_cpu_s'), 's')} | "
            f"{s['tower_runs']} | {s['errors']} |")
    lines += [
        "", "The vision tower's share of TTFT (median over requests of tower seconds / TTFT; "
        "tower seconds measured in the worker):", "",
        "| system | tower ms per run (median) | share, new-screenshot turns | share, follow-ups "
        "| follow-ups that ran the tower |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        n_follow = len(trace.requests) - n_new
        lines.append(f"| {name} | {_fmt(s['tower_s_per_run'], 'ms')} | "
                     f"{_fmt(s['tower_share_new'], 'pct')} | "
                     f"{_fmt(s['tower_share_follow'], 'pct')} | "
                     f"{s['follow_ups_with_a_tower_run']} of {n_follow} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.image_chat_bench",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="ci", choices=list(SIZES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="ours,native,nocache")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--port", type=int, default=8420)
    p.add_argument("--out", type=Path, help="write the markdown here (JSON beside it)")
    p.add_argument("--logs", type=Path, default=Path("/tmp/image_chat_bench"))
    args = p.parse_args(argv)
    command = "python -m benchmarks.image_chat_bench " + shlex.join(argv or sys.argv[1:])

    from vllm_hybridcache.models import ensure_model

    model = ensure_model(MODEL)
    trace = generate("image-chat", args.size, args.seed)
    tokenizer = PromptTokenizer(model)
    # the workers import the probe from the repository
    os.environ["PYTHONPATH"] = os.pathsep.join(
        x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)
    settings = ServerSettings(model_path=str(model), served_name="vl",
                              max_model_len=SIZES[args.size].max_model_len, port=args.port,
                              extra_args=list(vision_probe.EXTENSION_ARGS))
    summary: dict[str, dict[str, Any]] = {}
    for name in args.systems.split(","):
        with running_server(SYSTEMS[name], settings, args.logs / f"{name}.log") as srv:
            summary[name] = summarize(trace, *run_system(srv, trace, tokenizer,
                                                         args.max_tokens))
            print(name, summary[name], flush=True)
            if name == "nocache":
                reset_cache(srv.base_url)
                control = without_reuse(trace)
                summary[NO_REUSE] = summarize(control, *run_system(srv, control, tokenizer,
                                                                   args.max_tokens))
                print(NO_REUSE, summary[NO_REUSE], flush=True)
    text = render(summary, trace, command)
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_bytes(msgspec.json.format(
            msgspec.json.encode({"command": command, "trace_digest": trace.digest(),
                                 "summary": summary}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
