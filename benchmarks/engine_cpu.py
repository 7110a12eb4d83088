"""CPU seconds spent by the processes of one vLLM engine (engine core, workers).

Why: on a small shared machine a request's wall time moves with other jobs' load (the same cold
prefill measured 0.8-8 s in one run), while the CPU time the engine's own processes spend on
it moves much less. Engines started by `vllm.LLM` run their engine core (and workers) as child
processes; `new_children` finds them by diffing this process's descendants around the start.
Linux only (`/proc`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields after the command name


def descendants(root: int | None = None) -> set[int]:
    """Every live process below `root` (default: this one)."""
    root = os.getpid() if root is None else root
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                parents[int(name)] = int(st[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def cpu_seconds(pids: set[int]) -> float:
    """User + system CPU seconds of `pids` so far (exited ones count as 0)."""
    total = 0
    for pid in pids:
        st = _stat(pid)
        if st is not None:
            total += int(st[11]) + int(st[12])  # utime, stime
    return total / _TICK


def timed_generate(llm: Any, ids: list[int]) -> tuple[float, float, Any]:
    """(wall s, CPU s of the engine's processes, the `RequestOutput`) of one greedy one-token
    request on `llm`, whose processes `llm.hybridcache_pids` holds (see `descendants`)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    c0, t0 = cpu_seconds(llm.hybridcache_pids), time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    t1, c1 = time.perf_counter(), cpu_seconds(llm.hybridcache_pids)
    return t1 - t0, c1 - c0, out[0]


def report(header: list[str], groups: Iterable[list[str]], out: str | None) -> int:
    """A benchmark's table: `header`, then each group of rows as it is measured (printed at
    once, so a long run shows progress), the whole written by `emit`; the exit status 0."""
    lines = list(header)
    for rows in groups:
        lines += rows
        print("\n".join(rows), flush=True)
    emit(lines, out)
    return 0


def emit(lines: list[str], out: str | None) -> None:
    """Print a benchmark's report and write it to `out` (when given)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
