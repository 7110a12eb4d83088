"""Segmentation benchmark: what the grid G and the message-end minimum M cost and buy.

Two parts, one command (`python -m benchmarks.run --micro segmentation`):

1. Reuse (no engine, seconds): every trace family's scripted prompts, rendered with the model's
   chat template, go through the segmentation of each (G, M) in wave order, exactly as the
   connector captures and looks up links: a request hits the deepest cut of its prompt (leaving
   one token to prefill) that an earlier wave's prompt also cut at, on the same tokens. The
   table gives tokens served from cache (share of the ideal) and the prefill steps the cuts add
   to the steps stock vLLM takes anyway.
2. Cost (`--engine`, one vLLM engine per setting, the same prompts): the time to prefill every
   request of a trace cold (cache emptied before each request: the capture copies and the
   smaller steps, nothing restored) against two floors with vLLM's own prefix caching off:
   stock vLLM, and the plugin's connector installed at budget 0 (`off`: same processes and
   hooks, no cuts or copies). `cold / off` is the price every cold prefill pays for the links;
   the in-order replay total is what they buy back.

Settings are given as `G/M` pairs, `M` = `off` for grid-only cuts (e.g. `512/256,2048/off`).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Sequence

import msgspec

from benchmarks.ideal import PromptTokenizer, ideal_cached
from benchmarks.traces import TEXT_FAMILIES, Trace, generate
from vllm_hybridcache.core.keys import PromptKeys
from vllm_hybridcache.segmentation import Segmentation


class Setting(msgspec.Struct, frozen=True):
    """One segmentation setting: grid G and message-end minimum M (None = grid only)."""

    grid: int
    message_end_min: int | None

    @property
    def label(self) -> str:
        return f"{self.grid}/{self.message_end_min or 'off'}"

    def segmentation(self, im_end: int) -> Segmentation:
        if self.message_end_min is None:
            return Segmentation(grid=self.grid)
        return Segmentation(grid=self.grid, message_end_ids=(im_end,),
                            message_end_min=self.message_end_min)

    def plugin_settings(self) -> dict:
        """The plugin at this setting, end anchors off: the replay sends each prompt for one
        token, so every next prompt would extend the previous one's anchor and hide the cuts."""
        ends = [-1] if self.message_end_min is None else []
        return {"grid": self.grid, "message_end_ids": ends,
                "message_end_min": self.message_end_min or 256, "session_anchors": 0}


def parse_settings(text: str) -> list[Setting]:
    out = []
    for item in text.split(","):
        g, _, m = item.strip().partition("/")
        out.append(Setting(int(g), None if m in ("", "off") else int(m)))
    return out


class TracePrompts(msgspec.Struct, frozen=True):
    """A trace's scripted prompts as token ids, with waves and the ideal cached prefix."""

    family: str
    waves: list[int]
    prompts: list[list[int]]
    ideal: list[int]


def trace_prompts(trace: Trace, tok: PromptTokenizer) -> TracePrompts:
    prompts = [tok.prompt_ids(trace.messages(r), trace.tools(r)) for r in trace.requests]
    seen = [tok.scripted_seen_ids(trace.messages(r), trace.answer(r), trace.tools(r))
            for r in trace.requests]
    waves = [r.wave for r in trace.requests]
    return TracePrompts(trace.family, waves, prompts, ideal_cached(waves, prompts, seen))


class ReuseRow(msgspec.Struct):
    family: str
    setting: str
    prompt_tokens: int
    cached_tokens: int
    ideal_tokens: int
    cold_steps: int
    """Forward steps to prefill every prompt from token 0 under this segmentation."""
    stock_steps: int
    """The same with stock vLLM (`step_tokens` per step)."""


def _steps(cuts: Sequence[int], start: int, end: int, step_tokens: int) -> int:
    n, pos = 0, start
    for c in [*(c for c in cuts if start < c < end), end]:
        while pos < c:
            pos = min(c, pos + step_tokens)
            n += 1
    return n


def simulate(tp: TracePrompts, setting: Setting, im_end: int, step_tokens: int) -> ReuseRow:
    """Tokens served and prefill steps of one trace under one segmentation (no eviction).

    A link exists at every cut of every prompt of an earlier wave (cold and resumed prefills
    capture each cut they cross); a request resumes at its deepest cut below its last token that
    has a link. A prefill step ends at the next cut or after `step_tokens` (vLLM's token
    budget), whichever comes first; stock vLLM takes `step_tokens` per step.
    """
    seg = setting.segmentation(im_end)
    links: set[bytes] = set()
    cached = cold_steps = stock_steps = 0
    pending: list[set[bytes]] = []
    last_wave = None
    for wave, prompt in zip(tp.waves, tp.prompts, strict=True):
        if wave != last_wave:
            for s in pending:
                links |= s
            pending, last_wave = [], wave
        cuts = seg.cuts(prompt)
        keys = PromptKeys(prompt)  # the cache core's own prefix digests
        digests = [keys.digest(c) for c in cuts]
        hit = 0
        for c, d in zip(cuts, digests, strict=True):
            if c <= len(prompt) - 1 and d in links:
                hit = c
        cached += hit
        cold_steps += _steps(cuts, 0, len(prompt), step_tokens)
        stock_steps += _steps((), 0, len(prompt), step_tokens)
        pending.append(set(digests))
    return ReuseRow(tp.family, setting.label, sum(map(len, tp.prompts)), cached,
                    sum(tp.ideal), cold_steps, stock_steps)


# ------------------------------------------------------------------ engine part
STOCK = "stock"
"""Floor 1: vLLM without the plugin and with its own prefix caching off."""
OFF = "off"
"""Floor 2: the plugin's connector installed with budget 0 (no lookups, captures or cuts).

The same engine processes and connector hooks as every plugin setting, so `cold / off` is the
price of the links alone (extra steps plus copies). It is the fair floor on small CPU boxes,
where stock vLLM's engine-core loop waits for the worker differently without a connector and
shares the cores with it (measured here: stock is slower than `off` with identical steps)."""


def _engine(model_path: str, setting: Setting | str, max_model_len: int, step_tokens: int):
    """vLLM with the plugin at `setting`, or one of the floors (STOCK, OFF).

    Both floors turn vLLM's own prefix caching off explicitly: for hybrid models it is on by
    default and runs `mamba_cache_mode=align`, whose block-aligned steps and state copies would
    otherwise be measured as the floor.
    """
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from vllm_hybridcache.serving.flags import CONNECTOR_CONFIG
    from vllm_hybridcache.serving.python_api import llm_kwargs

    if setting == STOCK:
        cache: dict = {"enable_prefix_caching": False}
    elif setting == OFF:
        cache = {"enable_prefix_caching": False, "kv_transfer_config": KVTransferConfig(
            **CONNECTOR_CONFIG, kv_connector_extra_config={"budget_bytes": 0})}
    else:
        cache = llm_kwargs(**setting.plugin_settings())
    # compiled like `vllm serve` (no enforce_eager): step costs as a server pays them
    return LLM(model=model_path, max_model_len=max_model_len,
               max_num_batched_tokens=step_tokens, seed=0, **cache)


def _prefill(llm, prompts: list[list[int]]) -> tuple[float, int]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t0, sum(o.num_cached_tokens or 0 for o in outs)


def _by_wave(tp: TracePrompts) -> list[list[list[int]]]:
    waves: dict[int, list[list[int]]] = {}
    for w, p in zip(tp.waves, tp.prompts, strict=True):
        waves.setdefault(w, []).append(p)
    return [waves[w] for w in sorted(waves)]


class CostRow(msgspec.Struct):
    setting: str
    cold_s: float
    replay_s: float | None
    replay_cached: int | None


def measure(llm, tp: TracePrompts, repeats: int, cache: bool) -> tuple[float, float | None,
                                                                      int | None]:
    """(cold prefill seconds of every request, in-order replay seconds, cached tokens)."""
    cold, replay, cached = [], [], None
    for _ in range(repeats):
        total, leaked = 0.0, 0
        for p in tp.prompts:
            llm.reset_prefix_cache(reset_connector=True)
            t, c = _prefill(llm, [p])
            total, leaked = total + t, leaked + c
        if leaked:
            raise RuntimeError(f"cold pass served {leaked} tokens from cache: reset failed")
        cold.append(total)
        if cache:
            llm.reset_prefix_cache(reset_connector=True)
            total, hits = 0.0, 0
            for wave in _by_wave(tp):
                t, c = _prefill(llm, wave)
                total, hits = total + t, hits + c
            replay.append(total)
            cached = hits
    return (statistics.median(cold), statistics.median(replay) if replay else None, cached)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="segmentation_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-next-tiny")
    parser.add_argument("--size", default="medium")
    parser.add_argument("--traces", default="all")
    parser.add_argument("--settings", default="256/256,512/off,512/128,512/256,1024/off,"
                        "1024/256,2048/off,2048/128,2048/256,2048/512,2048/1024,4096/256,"
                        "4096/512")
    parser.add_argument("--step-tokens", type=int, default=2048,
                        help="vLLM's max_num_batched_tokens (its CPU serving default)")
    parser.add_argument("--engine", action="store_true", help="also time prefills in vLLM")
    parser.add_argument("--engine-trace", default="coding-agent")
    parser.add_argument("--engine-size", default=None, help="default: --size")
    parser.add_argument("--engine-settings", default=None, help="default: --settings")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from vllm_hybridcache.models import ensure_model

    path = str(ensure_model(args.model))
    tok = PromptTokenizer(path)
    im_end = tok.tok.convert_tokens_to_ids("<|im_end|>")
    settings = parse_settings(args.settings)
    families = list(TEXT_FAMILIES) if args.traces == "all" else args.traces.split(",")

    print(f"# segmentation_bench: model {args.model}, size {args.size}, "
          f"vLLM step budget {args.step_tokens} tokens")
    print("\n## Reuse by setting (G/M), scripted history, no eviction\n")
    print("| setting | " + " | ".join(families)
          + " | all: cached / ideal | cold-prefill steps / stock |")
    print("|---|" + "---:|" * (len(families) + 2))
    traces = {f: trace_prompts(generate(f, args.size), tok) for f in families}
    for s in settings:
        rows = [simulate(traces[f], s, im_end, args.step_tokens) for f in families]
        cells = [f"{100 * r.cached_tokens / r.prompt_tokens:.1f}%" for r in rows]
        ideal = sum(r.ideal_tokens for r in rows)
        cached = sum(r.cached_tokens for r in rows)
        steps, stock = sum(r.cold_steps for r in rows), sum(r.stock_steps for r in rows)
        print(f"| {s.label} | " + " | ".join(cells)
              + f" | {100 * cached / ideal:.1f}% | {steps / stock:.2f} |")
    ideal_row = [f"{100 * sum(traces[f].ideal) / sum(map(len, traces[f].prompts)):.1f}%"
                 for f in families]
    print("| ideal | " + " | ".join(ideal_row) + " | 100% | |")

    if not args.engine:
        return 0
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    size = args.engine_size or args.size
    tp = trace_prompts(generate(args.engine_trace, size), tok)
    max_len = max(map(len, tp.prompts)) + 64
    engine_settings = parse_settings(args.engine_settings or args.settings)
    rows: list[CostRow] = []
    # floors first and last: a drift of the machine between settings shows up as a difference
    plan: list[Setting | str] = [STOCK, OFF, *engine_settings, OFF]
    longest = max(tp.prompts, key=len)
    for s in plan:
        llm = _engine(path, s, max_len, args.step_tokens)
        for n in (512, 4096):  # warm-up: first calls of each shape range, allocator growth
            _prefill(llm, [longest[:n]])
        plugin = isinstance(s, Setting)
        cold, replay, cached = measure(llm, tp, args.repeats, cache=plugin)
        rows.append(CostRow(s.label if plugin else s, cold, replay, cached))
        print(f"   {rows[-1].setting}: cold {cold:.2f} s, replay {replay} s, cached {cached}",
              flush=True)
        del llm
        gc.collect()
    off = statistics.median(r.cold_s for r in rows if r.setting == OFF)
    total = sum(map(len, tp.prompts))
    print(f"\n## Prefill cost in vLLM: {args.engine_trace} ({size}), {len(tp.prompts)} requests, "
          f"{total:,} prompt tokens, medians of {args.repeats}\n")
    print("| setting | cold prefill of every request s | cold / off | in-order replay s | "
          "replay / off cold | cached |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        rep = "" if r.replay_s is None else f"{r.replay_s:.2f}"
        ratio = "" if r.replay_s is None else f"{r.replay_s / off:.2f}"
        cached = "" if r.replay_cached is None else f"{100 * r.replay_cached / total:.1f}%"
        print(f"| {r.setting} | {r.cold_s:.2f} | {r.cold_s / off:.3f} | {rep} | {ratio} | "
              f"{cached} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
