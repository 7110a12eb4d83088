"""Every benchmark by name: what it measures, what it needs, and the module that runs it.

`python -m benchmarks list | run NAME [--size S] [ARGS...] | report` (benchmarks/__main__.py)
reads this table, so a reader finds every benchmark in one place and runs any of them the same
way. Each entry's module keeps its own command line (`python -m benchmarks run NAME --help`
shows it); `--size` is handed on only to the suites that take one. `DEFAULT` is what
`make bench` runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Suite:
    name: str
    module: str
    summary: str
    needs: str
    """What it starts or requires: "servers" (vLLM servers it starts), "engine" (in-process
    engines), "ray", "gpu", or "none" (pure Python / CPU kernels)."""
    sizes: bool = False
    """Whether the suite takes `--size` (the trace sizes: ci, medium, long)."""

    def main(self):
        """The suite's `main(argv) -> int`."""
        return importlib.import_module(self.module).main


SUITES: tuple[Suite, ...] = (
    Suite("replay", "benchmarks.run", "trace replay: native vLLM, no cache and ours on the "
          "agent trace families (cached share, TTFT, end-to-end, server CPU)", "servers",
          sizes=True),
    Suite("replay-ab", "benchmarks.replay_ab", "paired replays: ours and native side by side "
          "round after round on every trace family, medians and paired ratios", "servers",
          sizes=True),
    Suite("headline", "benchmarks.headline", "the README's headline table and figure, from "
          "one replay run's results", "none", sizes=True),
    Suite("fork-probe", "benchmarks.fork_probe", "forks of one head: peak K/V of N concurrent "
          "extensions, native vs ours", "servers"),
    Suite("bench-serve-prefix", "benchmarks.bench_serve_prefix", "vLLM's own `vllm bench "
          "serve` prefix_repetition against the compared servers", "servers"),
    Suite("kv-sharing", "benchmarks.kv_sharing_bench", "KV blocks of N sessions sharing a "
          "head: in place vs copy vs native", "servers"),
    Suite("segmentation", "benchmarks.segmentation_bench", "grid and message-end cut settings: "
          "reuse and prefill cost", "engine", sizes=True),
    Suite("mtp", "benchmarks.mtp_bench", "agent traces with MTP speculative decoding, cache on "
          "vs off", "servers", sizes=True),
    Suite("image-chat", "benchmarks.image_chat_bench", "image chat on a vision-language model: "
          "ours vs native vs off, the tower's runs", "servers", sizes=True),
    Suite("core", "benchmarks.core_bench", "the cache core: keys, tree, eviction (no vLLM)",
          "none"),
    Suite("connector", "benchmarks.connector_bench", "KV connector: cold vs warm TTFT, restore "
          "and capture cost", "engine"),
    Suite("copy", "benchmarks.copy_bench", "snapshot copies on the CPU: csrc's CPU twin vs "
          "per-block torch copies", "none"),
    Suite("model", "benchmarks.model_bench", "Flash-Next CPU prefill and decode beside vLLM's "
          "Qwen3-Next", "engine"),
    Suite("kernels", "benchmarks.kernels_bench", "Flash-Next Triton kernels at real head "
          "dimensions: correctness and throughput", "gpu"),
    Suite("kernels-compile", "benchmarks.kernels_compile", "ahead-of-time compile of every "
          "Triton kernel for the real GPU targets", "none"),
    Suite("decode", "benchmarks.decode_bench", "decode speed of a CPU engine: native vs ours "
          "vs ours with vLLM's extra core for a connector", "engine"),
    Suite("cpu-attention-pin", "benchmarks.cpu_attention_pin_bench", "cold prefill cost of "
          "a split-invariant CPU attention: the pin or our kernel (--on kernel)", "engine"),
    Suite("cpu-attention-kernel", "benchmarks.cpu_attention_kernel_bench", "our "
          "split-invariant CPU attention kernel vs vLLM's CPU attention op, kernel alone",
          "none"),
    Suite("rowwise-linear", "benchmarks.rowwise_linear_bench", "the row-invariant CPU linear "
          "vs torch's GEMM and 64-row tiles, kernel alone", "none"),
    Suite("split-invariance", "benchmarks.split_invariance_bench", "cold prefill cost of "
          "Flash-Next's split-invariant forward", "engine"),
    Suite("split-invariance-captures", "benchmarks.split_invariance_captures_bench", "cold "
          "prefill cost of fine segmentation's inner captures", "engine"),
    Suite("disk", "benchmarks.disk_bench", "disk tier: link file write and verified read vs "
          "dd", "none"),
    Suite("disk-read-profile", "benchmarks.disk_read_profile", "where a disk hit's read "
          "spends its time", "none"),
    Suite("disk-restart", "benchmarks.disk_restart_bench", "next-turn latency after a "
          "restart: cold, RAM, disk", "servers"),
    Suite("disk-spill", "benchmarks.disk_spill_bench", "a live conversation's next turn after "
          "a restart, with and without session spill", "servers"),
    Suite("disk-writer", "benchmarks.disk_writer_bench", "the disk writer's cost on serving "
          "(TTFT with and without it)", "servers", sizes=True),
    Suite("disk-plots", "benchmarks.disk_plots", "plots of the disk benchmarks from their "
          "JSON lines", "none"),
    Suite("cluster-restore", "benchmarks.cluster_restore", "cross-replica restore vs cold "
          "prefill on two replicas", "ray"),
    Suite("cluster-routing", "benchmarks.cluster_routing", "two replicas behind the front: "
          "routing and the cluster tier", "ray", sizes=True),
    Suite("soak", "benchmarks.soak.cli", "one server under mixed traffic and injected faults "
          "for a duration, every answer checked", "servers"),
    Suite("traces", "benchmarks.traces.__main__", "inspect a generated trace (no server)",
          "none", sizes=True),
)

BY_NAME: dict[str, Suite] = {s.name: s for s in SUITES}

DEFAULT: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("replay", ("--trace", "coding-agent", "--size", "ci")),
)
"""`make bench` (`python -m benchmarks run default`): the coding-agent replay at CI size, the
three systems side by side (native, no cache, ours)."""


def get(name: str) -> Suite:
    """The suite called `name`; KeyError naming the closest known names otherwise."""
    try:
        return BY_NAME[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, BY_NAME, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise KeyError(f"no benchmark {name!r}{hint}; `python -m benchmarks list` shows them "
                       "all") from None
