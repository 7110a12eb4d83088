"""Cold prefill cost of Flash-Next's split-invariant forward (on) against the default (off).

One model per (model, dtype), driven in-process (`tools.flash_next_steps`), the same prompt
prefilled cold in steps of `--step` tokens; the arms alternate within one run (`--repeat`
rounds), so the machine's load hits all alike. Arms: `off` (the default forward), `on` (the
split-invariant forward) and, with `--before`, `before` (the split-invariant forward with its
attention and indexer scores as they were before they were made cheaper,
`benchmarks/split_invariant_baseline.py`; same model object as `on`). Prints medians, ratios of
medians, whether each arm's prefill is bit-identical across two step patterns (one step of the
prompt vs 64-aligned steps), which is what the mode is for, and whether `before` and `on` gave
the same bits. With `--tiles`, a third arm: the split-invariant forward in its "tiles" form
(64-row GEMM tiles, per-query attention; what runs where the row-invariant CPU kernel is not
built), a model of its own, against `on` in its "rowwise" form.

    python -m benchmarks.split_invariance_bench --before --out docs/benchmarks/split-invariance.md
    python -m benchmarks.split_invariance_bench --tiles --tokens 1024 --step 1024 --threads 1

With `--captures`, instead: the cost of fine segmentation's inner captures on the
split-invariant forward, in-process (no engine, so no IPC or scheduler noise): one step of
`--tokens` tokens prefilled cold with the capture hook armed at the two positions fine mode
wants in it (a junction at `--junction` rounded down to 64, the prompt's last 64-aligned
position; the GDN and PLE ops run piece by piece and every handed-over state is copied) against
the same step without the hook, arms alternating, the same model object. The KV-row copies the
engine's worker makes after the step are not in it (`split_invariance_captures_bench` measures
the whole engine path).

    python -m benchmarks.split_invariance_bench --captures --tokens 2000 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import shlex
import sys
import time

from benchmarks.ab import alternate
from benchmarks.engine_cpu import emit


def _prompt(n: int, seed: int = 7) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 4000, (n,), generator=g).tolist()


def _equal(a, b) -> bool:
    import torch

    return (torch.equal(a.logits, b.logits)
            and all(torch.equal(x, y) for k in a.sections
                    for x, y in zip(a.sections[k], b.sections[k], strict=True))
            and all(torch.equal(a.rows[k], b.rows[k]) for k in a.rows))


def measure(model: str, dtype: str, tokens: int, step: int, repeat: int,
            before: bool = False, tiles: bool = False) -> list[str]:
    from benchmarks.split_invariant_baseline import baseline_forms, tiles_form
    from vllm_hybridcache.models import ensure_model
    from vllm_hybridcache.tools.flash_next_steps import FlashNextStepper, steps_of

    # one model per mode: the split-invariant backend re-routes the model's linear layers
    modes = {mode: FlashNextStepper(ensure_model(model), dtype=dtype, ops="cpu",
                                    max_len=max(tokens, 2048), split_invariant=mode == "on")
             for mode in ("off", "on")}
    arms = {"off": (modes["off"], contextlib.nullcontext),
            "on": (modes["on"], contextlib.nullcontext)}
    if before:
        arms["before"] = (modes["on"], baseline_forms)
    if tiles:
        with tiles_form():
            modes["tiles"] = FlashNextStepper(ensure_model(model), dtype=dtype, ops="cpu",
                                              max_len=max(tokens, 2048), split_invariant=True)
        arms["tiles"] = (modes["tiles"], tiles_form)
    ids = _prompt(tokens)
    results = {}

    def one(arm: str, r: int) -> dict[str, float]:
        stepper, forms = arms[arm]
        with forms():
            t0 = time.perf_counter()
            results[arm] = stepper.prefill(ids, steps_of(tokens, step))
            return {"wall": time.perf_counter() - t0}

    ab = alternate(tuple(arms), repeat, one, read_load=None)
    invariant = {}
    for arm, (stepper, forms) in arms.items():
        with forms():
            b = stepper.prefill(ids, [*steps_of(tokens - tokens % 64 - 64, 256, first=64), 64,
                                      *([tokens % 64] if tokens % 64 else [])])
        invariant[arm] = _equal(results[arm], b)
    same = "n/a" if not before else ("yes" if _equal(results["on"], results["before"]) else "no")
    modes.clear()  # the rounds' closure holds these: empty them to free the models
    arms.clear()
    results.clear()
    off, on = ab.median("wall", "off"), ab.median("wall", "on")
    old = ab.median("wall", "before") if before else None
    yes = {True: "yes", False: "no"}
    if tiles:
        tl = ab.median("wall", "tiles")
        return [f"| {model} | {dtype} | {tokens} | {step} | {off:.3f} | {tl:.3f} | {on:.3f} "
                f"| {tl / off:.3f} | {on / off:.3f} | {yes[invariant['off']]} "
                f"| {yes[invariant['tiles']]} | {yes[invariant['on']]} |"]
    return [f"| {model} | {dtype} | {tokens} | {step} | {off:.3f} "
            f"| {'' if old is None else f'{old:.3f}'} | {on:.3f} "
            f"| {'' if old is None else f'{old / off:.3f}'} | {on / off:.3f} "
            f"| {'' if old is None else f'{old / on:.2f}'} | {same} "
            f"| {yes[invariant['off']]} | {yes[invariant['on']]} |"]


class _KeepStates:
    """The capture hook (`InnerCapture` in flash_next/gdn.py): armed at fixed offsets of the
    step, copies every state it is handed, as the worker's hook does."""

    def __init__(self, offsets: tuple[int, ...]) -> None:
        self._offsets = offsets
        self.got: dict = {}

    def offsets(self, slot: int) -> tuple[int, ...]:
        return self._offsets

    def put(self, layer: str, slot: int, offset: int, index: int, value) -> None:
        self.got[(layer, offset, index)] = value.clone()


def measure_captures(model: str, dtype: str, tokens: int, junction: int,
                     repeat: int) -> list[str]:
    """[row] of the in-process captures' cost (see the module docstring)."""
    from vllm_hybridcache.models import ensure_model
    from vllm_hybridcache.tools.flash_next_steps import FlashNextStepper

    stepper = FlashNextStepper(ensure_model(model), dtype=dtype, ops="cpu",
                               max_len=max(tokens, 2048), split_invariant=True)
    offsets = tuple(sorted({junction // 64 * 64, (tokens - 1) // 64 * 64} - {0}))
    gdn, _ = stepper.state_layers()
    ids = _prompt(tokens)

    @contextlib.contextmanager
    def armed():
        hook = _KeepStates(offsets)
        for layer in gdn.values():
            layer.inner_capture = hook
        try:
            yield hook
        finally:
            for layer in gdn.values():
                layer.inner_capture = None

    arms = {"plain": contextlib.nullcontext, "captures": armed}
    results, handed = {}, 0
    stepper.prefill(ids, [tokens])  # warm-up

    def one(arm: str, r: int) -> dict[str, float]:
        nonlocal handed
        with arms[arm]() as hook:
            t0 = time.perf_counter()
            results[arm] = stepper.prefill(ids, [tokens])
            seconds = time.perf_counter() - t0
            if hook is not None:
                handed = len(hook.got)
        return {"wall": seconds}

    ab = alternate(tuple(arms), repeat, one, read_load=None)
    same = "yes" if _equal(results["plain"], results["captures"]) else "no"
    return [f"| {model} | {dtype} | {tokens} | {', '.join(map(str, offsets))} | {handed} "
            f"| {ab.median('wall', 'plain'):.3f} | {ab.median('wall', 'captures'):.3f} "
            f"| {ab.ratio('wall', 'captures', 'plain'):.3f} "
            f"| {ab.paired('wall', 'captures', 'plain'):.3f} | {same} |"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["flash-next-tiny"])
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's own choice)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--step", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--before", action="store_true",
                    help="also time the split-invariant forward's former attention and "
                         "indexer scores (benchmarks/split_invariant_baseline.py)")
    ap.add_argument("--tiles", action="store_true",
                    help="also time the split-invariant forward's tiles form (where the "
                         "row-invariant kernel is not built); the columns then name on as "
                         "rowwise")
    ap.add_argument("--captures", action="store_true",
                    help="time the inner captures on the split-invariant forward instead")
    ap.add_argument("--junction", type=int, default=1000,
                    help="with --captures: where the junction capture goes (rounded down to 64)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import os

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.captures:
        lines = [
            f"command: `python -m benchmarks.split_invariance_bench "
            f"{shlex.join(argv if argv is not None else sys.argv[1:])}`",
            f"machine: {platform.processor() or platform.machine()}, torch threads "
            f"{torch.get_num_threads()}, {args.repeat} rounds of the arms (order alternating), "
            f"medians in seconds; load average before: {os.getloadavg()[0]:.1f}",
            "",
            "| model | dtype | tokens (one step) | captured at | states handed over "
            "| plain s | captures s | captures/plain | median of the rounds' ratios "
            "| same logits and states |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for model in args.models:
            for dtype in args.dtypes:
                lines += measure_captures(model, dtype, args.tokens, args.junction,
                                          args.repeat)
                print(lines[-1], flush=True)
        lines.append(f"\nload average after: {os.getloadavg()[0]:.1f}")
        emit(lines, args.out)
        return 0
    lines = [
        f"command: `python -m benchmarks.split_invariance_bench "
        f"{shlex.join(argv if argv is not None else sys.argv[1:])}`",
        f"machine: {platform.processor() or platform.machine()}, torch threads "
        f"{torch.get_num_threads()}, {args.repeat} rounds of the arms, medians in seconds; "
        f"load average before: {os.getloadavg()[0]:.1f}",
        "",
    ]
    if args.tiles:
        lines += ["| model | dtype | tokens | step | off s | tiles s | rowwise s | tiles/off "
                  "| rowwise/off | off invariant | tiles invariant | rowwise invariant |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    else:
        lines += ["| model | dtype | tokens | step | off s | before s | on s | before/off "
                  "| on/off | before/on | on = before (bits) | off invariant | on invariant |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in args.models:
        for dtype in args.dtypes:
            lines += measure(model, dtype, args.tokens, args.step, args.repeat, args.before,
                             args.tiles)
            print(lines[-1], flush=True)
    lines.append(f"\nload average after: {os.getloadavg()[0]:.1f}")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
