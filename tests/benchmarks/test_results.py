"""The run record every suite gets from the registry (benchmarks/results.py): one schema, under
docs/benchmarks/results/<suite>/, with the command, commit, host, load, the JSON lines the suite
printed and the files it wrote. No servers: fake suites stand in."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest

from benchmarks import __main__ as entry
from benchmarks import registry
from benchmarks import results as res
from benchmarks.report import LOAD_LIMIT

WHEN = datetime(2026, 12, 6, 18, 0, 0, tzinfo=UTC)


class FixedLoad:
    """A LoadSampler stand-in that saw `peak`."""

    def __init__(self, peak: float) -> None:
        self.peak = peak

    def __enter__(self) -> FixedLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _record(docs: Path, run, argv=("--x",), peak=0.5, before=0.4):
    return res.record_run("fake", list(argv), run, docs, sampler=lambda: FixedLoad(peak),
                          now=lambda: WHEN, read_load=lambda: before)


def _suite_that_writes(docs: Path):
    def run(argv: list[str]) -> int:
        print("warming up (not a result)")
        print(json.dumps({"metric": "ttft_ms", "value": 12.5}))
        print("[1, 2]")  # JSON, but not an object: not a record
        print(json.dumps({"metric": "cached", "value": 0.8}))
        (docs / "fake-table.md").write_text("| a |\n")
        return 0
    return run


def test_a_run_is_recorded_with_what_it_printed_and_wrote(tmp_path):
    (tmp_path / "narrative.md").write_text("untouched\n")
    (tmp_path / "fake-table.md").write_text("old\n")
    code, path = _record(tmp_path, _suite_that_writes(tmp_path))
    assert code == 0 and path == tmp_path / "results" / "fake" / "run-20261206T180000Z.json"
    ((got_path, rec),) = res.load_records(tmp_path)
    assert got_path == path and rec.schema == res.SCHEMA and rec.suite == "fake"
    assert rec.argv == ["--x"] and rec.exit_code == 0
    assert rec.records == [{"metric": "ttft_ms", "value": 12.5},
                           {"metric": "cached", "value": 0.8}]
    assert rec.output == "warming up (not a result)\n[1, 2]"
    assert rec.files == ["fake-table.md"]  # rewritten; the narrative page was not touched
    assert rec.started_utc == "2026-12-06T18:00:00+00:00"
    assert rec.load_before == 0.4 and rec.load_peak == 0.5 and not rec.loaded
    assert rec.host.usable_cpus >= 1 and rec.host.cpus >= rec.host.usable_cpus
    # a second run in the same second gets its own file, the first is kept
    _, second = _record(tmp_path, _suite_that_writes(tmp_path))
    assert second.name == "run-20261206T180000Z-2.json" and path.exists()
    # a record is not a file the next run wrote
    _, third = _record(tmp_path, lambda argv: 0)
    assert msgspec.json.decode(third.read_bytes(), type=res.RunRecord).files == []


def test_a_loaded_machine_is_flagged_by_the_one_limit():
    """`loaded` follows benchmarks.report.LOAD_LIMIT, before or during the run."""
    for before, peak, want in ((0.1, LOAD_LIMIT + 0.5, True), (LOAD_LIMIT + 1, 0.1, True),
                               (0.1, LOAD_LIMIT, False)):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            _record(Path(d), lambda argv: 0, peak=peak, before=before)
            ((_, rec),) = res.load_records(Path(d))
            assert rec.loaded is want, (before, peak)


def test_help_records_nothing_and_a_crash_is_recorded_then_raised(tmp_path):
    def helps(argv):
        raise SystemExit(0)

    with pytest.raises(SystemExit):
        _record(tmp_path, helps)
    assert not (tmp_path / "results").exists()

    def crashes(argv):
        print(json.dumps({"step": 1}))
        raise RuntimeError("server died")

    with pytest.raises(RuntimeError, match="server died"):
        _record(tmp_path, crashes)
    ((_, rec),) = res.load_records(tmp_path)
    assert rec.exit_code == 1 and rec.records == [{"step": 1}]


def test_files_that_are_not_records_of_this_schema_are_skipped_not_half_read(tmp_path, capsys):
    _record(tmp_path, lambda argv: 0)
    folder = tmp_path / "results" / "fake"
    (good,) = folder.glob("*.json")
    doc = json.loads(good.read_text())
    (folder / "run-b-truncated.json").write_text(good.read_text()[:40])
    (folder / "run-c-other-schema.json").write_text(json.dumps({**doc,
                                                                "schema": res.SCHEMA + 1}))
    (folder / "run-d-extra-field.json").write_text(json.dumps({**doc, "guess": 1}))
    (folder / "a-report.json").write_text("{}")  # a suite's own file: not a record, not read
    (tmp_path / "results" / "other").mkdir()
    (tmp_path / "results" / "other" / "run-moved.json").write_text(good.read_text())
    assert [p for p, _ in res.load_records(tmp_path)] == [good]
    err = capsys.readouterr().err
    assert all(name in err for name in ("b-truncated", "c-other-schema", "d-extra-field",
                                        "moved"))
    # negative control: the same document under its own name decodes
    assert msgspec.json.decode(good.read_bytes(), type=res.RunRecord).suite == "fake"


def test_the_registry_records_every_run_and_the_index_lists_the_latest(tmp_path, monkeypatch,
                                                                       capsys):
    fake = registry.Suite("fake", "benchmarks.core_bench", "d", "none")
    monkeypatch.setitem(registry.BY_NAME, "fake", fake)
    monkeypatch.setattr(registry.Suite, "main",
                        lambda self: lambda argv: print(json.dumps({"argv": argv})) or 0)
    assert entry.run("fake", ["--n", "3"], docs=tmp_path) == 0
    ((_, rec),) = res.load_records(tmp_path, "fake")
    assert rec.argv == ["--n", "3"] and rec.records == [{"argv": ["--n", "3"]}]
    assert "fake:" in entry.latest(tmp_path) and "1 records" in entry.latest(tmp_path)
    text = res.records_index(tmp_path).read_text()
    assert "| fake |" in text and "(fake/run-" in text
    # negative control: a folder without records lists none
    empty = tmp_path / "empty"
    empty.mkdir()
    assert entry.latest(empty) == "no run records yet"
    assert "| fake |" not in res.records_index(empty).read_text()


def test_the_printed_text_is_kept_up_to_its_limit():
    records, text = res.split_output("a\n" + "x" * (res.OUTPUT_CHARS + 10) + '\n{"k": 1}\n')
    assert records == [{"k": 1}] and len(text) == res.OUTPUT_CHARS and text.endswith("x")


def test_json_lines_and_changed_files():
    assert res.json_lines('x\n{"a": 1}\n{bad}\n  {"b": [2]}  \n[3]\n') == [{"a": 1},
                                                                         {"b": [2]}]
    before = {"a.md": (1, 10), "b.md": (1, 10)}
    after = {"a.md": (1, 10), "b.md": (2, 10), "c.png": (1, 5)}
    assert res.files_changed(before, after) == ["b.md", "c.png"]
    assert res.files_changed(after, after) == []


def test_the_host_names_the_isa_that_picks_the_kernels(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\n"
                    "flags\t\t: fpu sse avx2 avx512f amx_tile\n\nprocessor\t: 1\n"
                    "model name\t: Test CPU 9000\nflags\t\t: fpu\n")
    h = res.host(info)
    assert h.cpu == "Test CPU 9000" and h.isa == ["avx2", "avx512f", "amx_tile"]
    assert res.host(tmp_path / "missing").isa == []
