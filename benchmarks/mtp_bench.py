"""Agent traces with MTP speculative decoding: the cache on vs off, k draft tokens vs none.

    python -m benchmarks.mtp_bench [--model flash-next-tiny] [--size ci] [--seed 0]
                                   [--trace coding-agent,interleaved,concurrent,sub-agents]
                                   [--k 0,1,2] [--out docs/benchmarks/mtp-flash-next-tiny.md]

For every k (0: no speculative decoding, the AR route), two servers with the same model and
settings: `ours` (`--plugin hybridcache`) and `nocache` (prefix caching off), each started
with `--speculative-config '{"method": "mtp", "num_speculative_tokens": k}'` when k > 0. Each
replays every trace family from an empty cache with live history (every next turn resends
the answers the server gave, as an agent does), so end anchors can serve the next turn.
Per run: the cached fraction of the ideal (the ideal is measured from what the server
processed, `benchmarks.ideal`), TTFT p50, and draft acceptance (accepted / proposed draft
tokens, read from the server's `/metrics` before and after the replay): with the cache on vs
off on the same trace. Results are printed and written as markdown and JSON, with the command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import msgspec
import requests

from benchmarks import report as rep
from benchmarks.ideal import PromptTokenizer
from benchmarks.replay import ReplayConfig, replay
from benchmarks.run import resolve_model
from benchmarks.servers import SYSTEMS, ServerSettings, reset_cache, running_server
from benchmarks.traces import SIZES, generate

REPO = Path(__file__).resolve().parent.parent
AGENT_FAMILIES = ("coding-agent", "interleaved", "concurrent", "sub-agents")
SPEC_COUNTERS = ("vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")


def spec_counters(base_url: str) -> dict[str, float]:
    """The server's speculative decoding counters (summed over label sets); 0 when absent."""
    text = requests.get(base_url.rstrip("/") + "/metrics", timeout=30).text
    out = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def measure(base_url: str, trace, cfg: ReplayConfig, tokenizer: PromptTokenizer
            ) -> dict[str, Any]:
    """Replay one trace; its summary plus the draft tokens proposed and accepted meanwhile."""
    before = spec_counters(base_url)
    result = replay(trace, msgspec.structs.replace(cfg, base_url=base_url), tokenizer)
    after = spec_counters(base_url)
    m = rep.summarize(result.requests, result.wall_s, result.peak_snapshot_bytes)
    drafts = after[SPEC_COUNTERS[0]] - before[SPEC_COUNTERS[0]]
    accepted = after[SPEC_COUNTERS[1]] - before[SPEC_COUNTERS[1]]
    return {"errors": m.errors, "prompt_tokens": m.prompt_tokens,
            "cached_tokens": m.cached_tokens, "cached_fraction": m.cached_fraction,
            "ideal_fraction": m.ideal_fraction, "cached_of_ideal": m.cached_of_ideal,
            "ttft_p50_ms": m.ttft_p50_ms, "e2e_s": m.e2e_s,
            "draft_tokens": int(drafts), "accepted_tokens": int(accepted),
            "acceptance": (accepted / drafts) if drafts else None,
            "per_request": [{"session": r.session, "turn": r.turn, "wave": r.wave,
                             "prompt": r.prompt_tokens, "cached": r.cached_tokens,
                             "ideal": r.ideal_tokens, "completion": r.completion_tokens}
                            for r in result.requests]}


def _pct(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{100 * v:.{digits}f}%"


def render(rows: list[dict[str, Any]], command: str, meta: dict[str, Any]) -> str:
    lines = [f"# MTP speculative decoding and the cache: {meta['model']}, size {meta['size']}",
             "", f"Command: `{command}`", "",
             f"Host: {meta['host']}; git {meta['git']}; {meta['started']} to "
             f"{meta['finished']}; history live, max_tokens {meta['max_tokens']}.", "",
             "| family | k | system | cached | ideal | cached / ideal | TTFT p50 (ms) "
             "| drafts | accepted | acceptance |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["m"]
        lines.append(
            f"| {r['family']} | {r['k']} | {r['system']} | {_pct(m['cached_fraction'])} | "
            f"{_pct(m['ideal_fraction'])} | {_pct(m['cached_of_ideal'])} | "
            f"{'-' if m['ttft_p50_ms'] is None else round(m['ttft_p50_ms'])} | "
            f"{m['draft_tokens']} | {m['accepted_tokens']} | {_pct(m['acceptance'], 2)} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.mtp_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flash-next-tiny")
    p.add_argument("--size", default="ci", choices=list(SIZES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=",".join(AGENT_FAMILIES))
    p.add_argument("--k", default="0,1,2", help="comma list of draft token counts (0: none)")
    p.add_argument("--systems", default="ours,nocache")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--out", type=Path,
                   default=REPO / "docs" / "benchmarks" / "mtp-flash-next-tiny.md")
    p.add_argument("--logs", type=Path, default=REPO / "bench-out" / "logs" / "mtp")
    args = p.parse_args(argv)
    from benchmarks.results import git_commit
    from benchmarks.run import _host, _utc

    command = "python -m benchmarks.mtp_bench " + shlex.join(argv)
    model_path, served = resolve_model(args.model)
    tokenizer = PromptTokenizer(model_path)
    traces = [generate(f, args.size, args.seed) for f in args.trace.split(",")]
    cfg = ReplayConfig(base_url="", model=served, max_tokens=args.max_tokens, history="live")
    started = _utc()
    rows: list[dict[str, Any]] = []
    status = 0
    for k in (int(x) for x in args.k.split(",")):
        extra = list(args.server_arg)
        if k > 0:
            extra += ["--speculative-config",
                      json.dumps({"method": "mtp", "num_speculative_tokens": k})]
        settings = ServerSettings(model_path=model_path, served_name=served,
                                  max_model_len=SIZES[args.size].max_model_len, port=args.port,
                                  seed=args.seed, extra_args=extra)
        for name in args.systems.split(","):
            log = args.logs / f"k{k}-{name}.log"
            with running_server(SYSTEMS[name], settings, log) as srv:
                print(f"== k={k} {name}: up in {srv.startup_s:.0f} s", flush=True)
                for i, trace in enumerate(traces):
                    if i and not reset_cache(srv.base_url):
                        raise SystemExit(f"{name}: cache reset refused")
                    m = measure(srv.base_url, trace, cfg, tokenizer)
                    status = max(status, int(bool(m["errors"])))
                    rows.append({"family": trace.family, "k": k, "system": name, "m": m})
                    print(f"   {trace.family}: cached {_pct(m['cached_fraction'])} (ideal "
                          f"{_pct(m['ideal_fraction'])}, {_pct(m['cached_of_ideal'])} of it), "
                          f"TTFT p50 {m['ttft_p50_ms']} ms, drafts {m['draft_tokens']} "
                          f"accepted {m['accepted_tokens']}", flush=True)
    meta = {"model": args.model, "size": args.size, "host": _host()["summary"],
            "git": git_commit(), "started": started, "finished": _utc(),
            "max_tokens": args.max_tokens}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(rows, command, meta))
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command, **meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
