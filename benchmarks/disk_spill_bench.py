"""Session spill scenario: a live conversation's next turn after a restart, with and without
its end anchor on disk.

One server with the disk tier and session spill on a fresh folder, `--shutdown-timeout 30`:
1. life 1: a conversation's turn (a `--head` of system prompt and tools plus a `--tail` of
   history, answered with `--answer` tokens) leaves an end anchor; SIGTERM: the shutdown
   drain writes it (and the head's tree links, written as a session's first long prompt);
2. life 2 on the same folder, after a short unrelated warm-up request:
   - **spill**: the conversation's next turn (prompt + answer + `--new` tokens) resumes at the
     end anchor read from disk;
   - **tree only** (what a restart without session spill gives): a next turn whose answer
     differs from the first token on: it resumes at the head's deepest tree link on disk and
     prefills the rest of the history;
   - **RAM anchor**: the turn after the spill one resumes at the end anchor the spill turn
     left in RAM (what no restart would have given);
   - **cold**: the spill turn's prompt with a unique `cache_salt`.

Each measured request asks for one token (`/v1/completions` with prompt token ids), so its
latency is the time to first token plus one HTTP round trip. Token ids are seeded and avoid
the message-end ids, so cuts fall on the grid only.

Usage: python -m benchmarks.disk_spill_bench [--spill-model qwen3-next-tiny] [--head 8192]
       [--tail 1536]
Prints one JSON line; docs/benchmarks/disk.md records the results.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from unittest import mock

import numpy as np
import requests

from benchmarks.disk_restart_bench import complete, random_prompt
from benchmarks.servers import SYSTEMS, ServerSettings, running_server


def _complete(base: str, ids: list[int], max_tokens: int = 1, **extra) -> tuple[float, dict]:
    return complete(base, ids, max_tokens, ignore_eos=True, return_token_ids=True, **extra)


def _cached(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _wait_anchors(base: str, n: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ram = requests.get(base + "/v1/cache/stats").json()["tiers"]["ram"]["kinds"]
        if ram.get("anchor", {}).get("captures", 0) >= n:
            return
        time.sleep(0.5)
    raise RuntimeError("the end anchor was not committed")


def run(model: str, head: int, tail: int, answer: int, new: int, grid: int, port: int,
        workdir: Path) -> dict:
    from vllm_hybridcache.models import ensure_model

    path = ensure_model(model)
    rng = np.random.default_rng(0)
    vocab = int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    prompt = random_prompt(rng, head + tail, vocab)
    news = [random_prompt(rng, new, vocab) for _ in range(3)]
    settings = ServerSettings(model_path=str(path), served_name="m",
                              max_model_len=head + tail + 2 * (answer + new) + 64, port=port,
                              kv_cache_space_gib=4, extra_args=["--shutdown-timeout", "30"])
    env_keys = {"VLLM_HYBRIDCACHE_DISK_DIR": str(workdir / "disk"),
                "VLLM_HYBRIDCACHE_GRID": str(grid), "VLLM_HYBRIDCACHE_MESSAGE_END_IDS": "-1",
                "VLLM_HYBRIDCACHE_SESSION_SPILL": "1"}
    out: dict = {"model": model, "head": head, "tail": tail, "answer": answer, "new": new,
                 "grid": grid}
    with mock.patch.dict(os.environ, env_keys):
        with running_server(SYSTEMS["ours"], settings, workdir / "life1.log") as srv:
            out["first_turn_s"], body = _complete(srv.base_url, prompt, max_tokens=answer)
            ans = body["choices"][0]["token_ids"]
            _wait_anchors(srv.base_url, 1)
        log = (workdir / "life1.log").read_text(errors="replace")
        drain = [ln for ln in log.splitlines() if "shutdown drain" in ln]
        out["drain_log"] = drain[-1].split("hybridcache: ", 1)[-1] if drain else None
        turn = prompt + ans + news[0]
        other = prompt + [(ans[0] + 1) % 3000 + 1000] + ans[1:] + news[1]
        with running_server(SYSTEMS["ours"], settings, workdir / "life2.log") as srv:
            _complete(srv.base_url, news[2][:64], cache_salt="warm-up")
            out["spill_s"], body = _complete(srv.base_url, turn)
            out["spill_cached_tokens"] = _cached(body)
            nxt = turn + body["choices"][0]["token_ids"] + news[2]
            out["tree_only_s"], body = _complete(srv.base_url, other)
            out["tree_only_cached_tokens"] = _cached(body)
            _wait_anchors(srv.base_url, 3)  # the spill, tree-only and warm-up turns' anchors
            out["ram_anchor_s"], body = _complete(srv.base_url, nxt)
            out["ram_anchor_cached_tokens"] = _cached(body)
            out["cold_s"], body = _complete(srv.base_url, turn,
                                            cache_salt=f"cold-{uuid.uuid4().hex}")
            assert _cached(body) == 0
    out["spill_over_ram_anchor"] = out["spill_s"] / out["ram_anchor_s"]
    out["spill_over_cold"] = out["spill_s"] / out["cold_s"]
    out["tree_only_over_cold"] = out["tree_only_s"] / out["cold_s"]
    out["ram_anchor_over_cold"] = out["ram_anchor_s"] / out["cold_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spill-model", default="qwen3-next-tiny")
    ap.add_argument("--head", type=int, default=8192)
    ap.add_argument("--tail", type=int, default=1536)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--grid", type=int, default=2048)
    ap.add_argument("--port", type=int, default=8430)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hc-spill-") as work:
        print(json.dumps(run(args.spill_model, args.head, args.tail, args.answer, args.new,
                             args.grid, args.port, Path(work))))
    return 0


if __name__ == "__main__":
    main()
