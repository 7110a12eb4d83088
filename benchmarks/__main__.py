"""One entry point for every benchmark (the registry: benchmarks/registry.py).

    python -m benchmarks list                       every benchmark, what it needs
    python -m benchmarks run NAME [--size S] [ARGS]  run one (ARGS go to its own command line)
    python -m benchmarks run default                 what `make bench` runs
    python -m benchmarks report                      rebuild docs/benchmarks/README.md and the
                                                     README headline table from the results
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


def report(out: Path = OUT) -> int:
    """The index of the trace-replay results; the headline table from them when both systems
    of one run are there."""
    from benchmarks import headline
    from benchmarks import report as rep

    index = rep.write_index(out)
    print(f"index: {index}")
    rows, commands = headline.load("qwen3-next-tiny", "ci", ("ours", "native"), out)
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
        return report()
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
