"""One entry point for every benchmark: the registry names each runnable module once, `run`
hands arguments to the module's own command line, `list` and `report` work without servers."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import benchmarks
from benchmarks import __main__ as entry
from benchmarks import registry

ROOT = Path(benchmarks.__file__).resolve().parent


def _modules_with_main() -> set[str]:
    """Every benchmarks module that defines a top-level `main` (a runnable benchmark)."""
    out = set()
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            parts = path.relative_to(ROOT.parent).with_suffix("").parts
            out.add(".".join(parts))
    return out


def test_every_runnable_module_is_registered_once() -> None:
    registered = [s.module for s in registry.SUITES]
    assert len(registered) == len(set(registered))
    entry_points = {"benchmarks.__main__", "benchmarks.report", "benchmarks.soak.__main__"}
    missing = _modules_with_main() - set(registered) - entry_points
    assert missing == set(), "register these in benchmarks/registry.py"


def test_every_suite_takes_its_arguments() -> None:
    for suite in registry.SUITES:
        params = inspect.signature(suite.main()).parameters
        assert "argv" in params, f"{suite.module}.main must take argv"


def test_run_hands_the_arguments_on(monkeypatch, tmp_path) -> None:
    seen: list[list[str]] = []
    fake = registry.Suite("fake", "benchmarks.core_bench", "d", "none", sizes=True)
    monkeypatch.setitem(registry.BY_NAME, "fake", fake)
    monkeypatch.setattr(registry.Suite, "main", lambda self: lambda argv: seen.append(argv) or 3)
    assert entry.run("fake", ["--size", "ci", "--x"], docs=tmp_path) == 3
    assert seen == [["--size", "ci", "--x"]]
    # default: the presets of DEFAULT, extra arguments after them
    monkeypatch.setattr(registry, "DEFAULT", (("fake", ("--a",)), ("fake", ("--b",))))
    seen.clear()
    assert entry.run("default", ["--c"], docs=tmp_path) == 3
    assert seen == [["--a", "--c"], ["--b", "--c"]]


def test_a_size_is_refused_by_a_suite_without_sizes_and_an_unknown_name_named() -> None:
    with pytest.raises(SystemExit, match="takes no --size"):
        entry.run("core", ["--size", "ci"])
    with pytest.raises(SystemExit, match="did you mean replay"):
        entry.main(["run", "replai"])


def test_list_and_report(tmp_path, capsys) -> None:
    assert entry.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(s.name in listed for s in registry.SUITES)
    assert entry.report(tmp_path) == 0
    assert (tmp_path / "results" / "replay" / "README.md").exists()
    assert (tmp_path / "results" / "README.md").exists()


def test_report_prints_the_headline_of_the_model_and_size_asked(tmp_path, capsys) -> None:
    """`report --model M --size S` reads M's replays at S; the default (the README's model)
    finds none of them here, so it prints no table."""
    import json

    from benchmarks.results import REPLAY

    doc = json.loads((REPLAY / "qwen3-next-tiny-chat-ui-ci.json").read_text())
    doc["model"]["name"] = "other-tiny"
    (tmp_path / "results" / "replay").mkdir(parents=True)
    (tmp_path / "results" / "replay" / "other-tiny-chat-ui-ci.json").write_text(json.dumps(doc))
    assert entry.report(tmp_path) == 0
    assert "| chat-ui |" not in capsys.readouterr().out
    assert entry.report(tmp_path, ["--model", "other-tiny", "--size", "ci"]) == 0
    assert "| chat-ui |" in capsys.readouterr().out
