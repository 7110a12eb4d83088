"""Cold prefill cost of Flash-Next's split-invariant forward (on) against the default (off).

One model per (model, dtype), driven in-process (`tools.flash_next_steps`), the same prompt
prefilled cold in steps of `--step` tokens; on and off alternate within one run (`--repeat`
pairs), so the machine's load hits both alike. Prints medians, the on/off ratio of medians,
and whether each mode's prefill is bit-identical across two step patterns (one step of the
prompt vs 64-aligned steps), which is what the mode is for.

    python -m benchmarks.split_invariance_bench --out docs/benchmarks/split-invariance.md
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time


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


def measure(model: str, dtype: str, tokens: int, step: int, repeat: int) -> list[str]:
    from vllm_hybridcache.models import ensure_model
    from vllm_hybridcache.tools.flash_next_steps import FlashNextStepper, steps_of

    # one model per mode: the split-invariant backend re-routes the model's linear layers
    modes = {mode: FlashNextStepper(ensure_model(model), dtype=dtype, ops="cpu",
                                    max_len=max(tokens, 2048), split_invariant=mode == "on")
             for mode in ("off", "on")}
    ids = _prompt(tokens)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(repeat):
        for mode, stepper in modes.items():
            t0 = time.perf_counter()
            stepper.prefill(ids, steps_of(tokens, step))
            times[mode].append(time.perf_counter() - t0)
    invariant = {}
    for mode, stepper in modes.items():
        a = stepper.prefill(ids, steps_of(tokens, step))
        b = stepper.prefill(ids, [*steps_of(tokens - tokens % 64 - 64, 256, first=64), 64,
                                  *([tokens % 64] if tokens % 64 else [])])
        invariant[mode] = _equal(a, b)
    del modes
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return [f"| {model} | {dtype} | {tokens} | {step} | {off:.3f} | {on:.3f} | {on / off:.3f} "
            f"| {'yes' if invariant['off'] else 'no'} | {'yes' if invariant['on'] else 'no'} |"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["flash-next-tiny"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--step", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    lines = [
        f"command: `python -m benchmarks.split_invariance_bench "
        f"{shlex.join(argv if argv is not None else sys.argv[1:])}`",
        f"machine: {platform.processor() or platform.machine()}, torch threads "
        f"{torch.get_num_threads()}, {args.repeat} on/off pairs, medians in seconds",
        "",
        "| model | dtype | tokens | step | off s | on s | on/off | off invariant | "
        "on invariant |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in args.models:
        for dtype in args.dtypes:
            lines += measure(model, dtype, args.tokens, args.step, args.repeat)
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
