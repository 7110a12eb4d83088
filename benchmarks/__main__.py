"""One entry point for every benchmark (the registry: benchmarks/registry.py).

    python -m benchmarks list                       every benchmark, what it needs
    python -m benchmarks run NAME [--size S] [ARGS]  run one (ARGS go to its own command line)
    python -m benchmarks run default                 what `make bench` runs
    python -m benchmarks report [--model M] [--size S]
                                                     rebuild docs/benchmarks/README.md and print
                                                     the headline table of M's replays at size
                                                     S (default: the README's, qwen3-next-tiny
                                                     at ci) from the results
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks import registry

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
USAGE = __doc__.split("\n\n", 1)[1].rstrip()


def list_suites() -> str:
    width = max(len(s.name) for s in registry.SUITES)
    lines = [f"{s.name:<{width}}  [{s.needs}{', --size' if s.sizes else ''}]  {s.summary}"
             for s in registry.SUITES]
    return "\n".join(lines)


def run(name: str, args: list[str]) -> int:
    if name == "default":
        status = 0
        for suite, preset in registry.DEFAULT:
            status |= run(suite, [*preset, *args])
        return status
    suite = registry.get(name)
    if not suite.sizes and any(a == "--size" or a.startswith("--size=") for a in args):
        raise SystemExit(f"benchmarks: {name} takes no --size (`python -m benchmarks run "
                         f"{name} --help`)")
    return int(suite.main()(args) or 0)


def report(out: Path = OUT, args: list[str] | None = None) -> int:
    """The index of the trace-replay results; the headline table of one model and size from
    them when both systems of one run are there."""
    import argparse

    from benchmarks import headline
    from benchmarks import report as rep

    p = argparse.ArgumentParser(prog="python -m benchmarks report")
    p.add_argument("--model", default="qwen3-next-tiny")
    p.add_argument("--size", default="ci")
    opts = p.parse_args(args or [])
    index = rep.write_index(out)
    print(f"index: {index}")
    rows, commands = headline.load(opts.model, opts.size, ("ours", "native"), out)
    if rows and len(commands) == 1:
        print(headline.table(rows, ("ours", "native")))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "list":
        print(list_suites())
        return 0
    if command == "run" and rest:
        try:
            return run(rest[0], rest[1:])
        except KeyError as e:
            raise SystemExit(f"benchmarks: {e.args[0]}") from None
    if command == "report":
        return report(args=rest)
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
