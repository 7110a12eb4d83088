"""`python -m benchmarks.traces FAMILY [--size S] [--seed N] [--model M] [--dump FILE]`

Prints a trace request by request (session, turn, wave, prompt tokens, the ideal cached prefix
if the model had written the scripted answers) without any server, so a user can see what a
benchmark will send before spending GPU time on it. `--dump` writes the trace as JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from benchmarks.ideal import PromptTokenizer, scripted_profile
from benchmarks.traces import FAMILIES, SIZES, generate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.traces", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("family", choices=list(FAMILIES))
    p.add_argument("--size", default="ci", choices=list(SIZES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="qwen3-next-tiny",
                   help="whose tokenizer and chat template count the tokens")
    p.add_argument("--dump", type=Path, help="write the trace as JSON here")
    args = p.parse_args(argv)

    trace = generate(args.family, args.size, args.seed)
    if args.dump:
        args.dump.write_bytes(msgspec.json.format(msgspec.json.encode(trace), indent=1))
    from benchmarks.run import resolve_model

    tokenizer = PromptTokenizer(resolve_model(args.model)[0])
    prompts, ideal = scripted_profile(trace, tokenizer)
    print(f"{trace.family} ({trace.size}, seed {trace.seed}, digest {trace.digest()}): "
          f"{trace.description}")
    print(f"{'#':>3} {'session':10} {'turn':>4} {'wave':>4} {'prompt':>8} {'ideal':>8}")
    for i, req in enumerate(trace.requests):
        print(f"{i:3d} {req.session:10} {req.turn:4d} {req.wave:4d} {prompts[i]:8d} "
              f"{ideal[i]:8d}")
    total = sum(prompts)
    print(f"{len(trace.requests)} requests, {len(trace.waves())} waves, {total:,} prompt tokens,"
          f" ideal {sum(ideal) / total:.1%} (scripted answers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
