"""One entry point for every benchmark (the registry: benchmarks/registry.py).

    python -m benchmarks list                       every benchmark, what it needs
    python -m benchmarks run NAME [--size S] [ARGS]  run one (ARGS go to its own command line);
                                                     its run record (command, commit, host,
                                                     load, the JSON it printed, the files it
                                                     wrote) goes to docs/benchmarks/results/NAME/
    python -m benchmarks run default                 what `make bench` runs
    python -m benchmarks results [SUITE]             the latest run record of each suite
    python -m benchmarks report [--model M] [--size S]
                                                     rebuild the indexes under
                                                     docs/benchmarks/results/ (the run records;
                                                     the replays) and print the headline table
                                                     of M's replays at size S (default: the
                                                     README's, qwen3-next-tiny at ci)
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks import registry
from benchmarks import results as res

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
USAGE = __doc__.split("\n\n", 1)[1].rstrip()


def list_suites() -> str:
    width = max(len(s.name) for s in registry.SUITES)
    lines = [f"{s.name:<{width}}  [{s.needs}{', --size' if s.sizes else ''}]  {s.summary}"
             for s in registry.SUITES]
    return "\n".join(lines)


def run(name: str, args: list[str], docs: Path = OUT) -> int:
    """Run one suite (or the default set) and write its run record under
    `docs/results/<suite>/` (benchmarks/results.py), whatever the suite writes itself."""
    if name == "default":
        status = 0
        for suite, preset in registry.DEFAULT:
            status |= run(suite, [*preset, *args], docs)
        return status
    suite = registry.get(name)
    if not suite.sizes and any(a == "--size" or a.startswith("--size=") for a in args):
        raise SystemExit(f"benchmarks: {name} takes no --size (`python -m benchmarks run "
                         f"{name} --help`)")
    code, path = res.record_run(suite.name, args, suite.main(), docs)
    if path is not None:
        print(f"run record: {path}", file=sys.stderr)
    return code


def latest(docs: Path = OUT, suite: str | None = None) -> str:
    """One line per suite: its latest run record (when, commit, load, exit, what it wrote)."""
    newest: dict[str, tuple[Path, res.RunRecord]] = {}
    for path, rec in res.load_records(docs, suite):
        newest[rec.suite] = (path, rec)
    lines = []
    for name in sorted(newest):
        path, rec = newest[name]
        load = "" if rec.load_peak is None else f", load up to {rec.load_peak:.1f}"
        lines.append(f"{name}: {rec.started_utc} commit {rec.commit or '?'} exit "
                     f"{rec.exit_code}, {rec.seconds:.0f} s{load}"
                     f"{' (loaded)' if rec.loaded else ''}, {len(rec.records)} records, "
                     f"{len(rec.files)} files -> {path.relative_to(docs)}")
    return "\n".join(lines) if lines else "no run records yet"


def report(out: Path = OUT, args: list[str] | None = None) -> int:
    """The index of the run records and of the trace-replay results (under `out`/results/);
    the headline table of one model and size from them when both systems of one run are
    there."""
    import argparse

    from benchmarks import headline
    from benchmarks import report as rep

    p = argparse.ArgumentParser(prog="python -m benchmarks report")
    p.add_argument("--model", default="qwen3-next-tiny")
    p.add_argument("--size", default="ci")
    opts = p.parse_args(args or [])
    replay = out / res.RESULTS / "replay"
    replay.mkdir(parents=True, exist_ok=True)
    print(f"index: {rep.write_index(replay)}")
    print(f"run records: {res.records_index(out)}")
    rows, commands = headline.load(opts.model, opts.size, ("ours", "native"), replay)
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
    if command == "results" and len(rest) <= 1:
        print(latest(OUT, rest[0] if rest else None))
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
