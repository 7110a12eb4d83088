"""Progress of long work (vllm_hybridcache/progress.py): a tqdm bar on a terminal, a few log
lines in a server log, nothing for short work; the weight hashing of the engine fingerprint
(the digest unchanged, only files actually read counted) and the cluster launcher's wait for
its replicas (which ones are still starting)."""

from __future__ import annotations

import hashlib
import io
import logging
from types import SimpleNamespace

import pytest

from vllm_hybridcache.adapter import fingerprint
from vllm_hybridcache.progress import Progress

LOGGER = "vllm_hybridcache"
MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    """stderr as a terminal."""

    def isatty(self) -> bool:
        return True


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_log_gets_a_line_per_interval_and_a_last_one(caplog):
    clock, stream = Clock(), io.StringIO()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with Progress(100 * MiB, "hashing", logger=logging.getLogger(LOGGER), interval_s=30,
                      stream=stream, clock=clock) as bar:
            bar.update(10 * MiB)
            clock.t += 29  # not yet
            bar.update(10 * MiB)
            assert _lines(caplog) == []
            clock.t += 1
            bar.update(20 * MiB)
            clock.t += 10
            bar.update(10 * MiB)  # within the interval: no line
    lines = _lines(caplog)
    assert lines[0] == "hashing: 40.0 MiB of 100.0 MiB (40%), 30 s, 1.3 MiB/s"
    assert len(lines) == 2 and lines[1].startswith("hashing: done, 50.0 MiB of 100.0 MiB")
    assert stream.getvalue() == ""  # no bar (carriage returns) in a log


def test_short_work_says_nothing(caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with Progress(3, "replicas up", unit="replica", logger=logging.getLogger(LOGGER),
                      interval_s=30, stream=io.StringIO(), clock=clock,
                      status=lambda: "still starting: r2") as bar:
            clock.t += 5
            bar.update(3)
    assert _lines(caplog) == []
    bar = Progress(3, "replicas up", unit="replica", clock=clock, status=lambda: "x: r2")
    clock.t += 12
    bar.update(1)
    assert bar.line() == "replicas up: 1 of 3 replicas (33%), 12 s; x: r2"


def test_a_terminal_gets_a_tqdm_bar_and_no_log_lines(caplog):
    term = Terminal()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with Progress(8 * MiB, "verifying /cache", logger=logging.getLogger(LOGGER),
                      interval_s=0, stream=term) as bar:
            bar.update(8 * MiB)
    assert "verifying /cache:" in term.getvalue() and "/8.00M" in term.getvalue()
    assert _lines(caplog) == []
    # the control: the same work with a stream that is no terminal draws nothing there
    plain = io.StringIO()
    with Progress(8 * MiB, "verifying /cache", interval_s=0, stream=plain) as bar:
        bar.update(8 * MiB)
    assert plain.getvalue() == ""


# ---------------------------------------------------------------------------- weight hashing


def _checkpoint(path, size: int):
    path.mkdir()
    (path / "model-00001.safetensors").write_bytes(b"\1" * size)
    (path / "model-00002.safetensors").write_bytes(b"\2" * (size // 2))
    (path / "config.json").write_text('{"hidden_size": 8}')
    return path


def _expected(folder) -> str:
    """weights_digest computed independently: sha256 over (name, sha256 of the content)."""
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        h.update(p.name.encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).hexdigest().encode() + b"\0")
    return h.hexdigest()


def test_weight_hashing_shows_its_progress_in_the_log(tmp_path, monkeypatch, caplog):
    ckpt = _checkpoint(tmp_path / "ckpt", 24 * MiB)
    monkeypatch.setattr(fingerprint, "PROGRESS_INTERVAL_S", 0.0)
    monkeypatch.setattr(fingerprint, "LARGE_HASH_BYTES", 1 * MiB)
    monkeypatch.setattr(fingerprint, "_PROCESS_MEMO", {})
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a server log: stderr is no terminal
    memo = tmp_path / "memo.json"
    with caplog.at_level(logging.INFO, logger=LOGGER):
        digest = fingerprint.weights_digest(ckpt, memo)
    assert digest == _expected(ckpt)  # the bar changes nothing in the digest
    lines = _lines(caplog)
    assert lines[0].startswith("hybridcache: hashing 3 checkpoint file(s), 0.0 GiB")
    progress = [x for x in lines if x.startswith("hybridcache: hashing the checkpoint: ")]
    assert len(progress) >= 4, lines  # one per chunk read here (interval 0)
    assert progress[0].startswith("hybridcache: hashing the checkpoint: 18 B of 36.0 MiB (0%)")
    assert any("8.0 MiB of 36.0 MiB (22%)" in x for x in progress)
    assert progress[-1].startswith("hybridcache: hashing the checkpoint: done, 36.0 MiB of "
                                   "36.0 MiB (100%)")
    # a restart with the memo reads nothing: nothing to show
    caplog.clear()
    monkeypatch.setattr(fingerprint, "_PROCESS_MEMO", {})
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert fingerprint.weights_digest(ckpt, memo) == digest
    assert _lines(caplog) == []
    # the control: a changed file is read again, and only its bytes are counted
    (ckpt / "model-00002.safetensors").write_bytes(b"\3" * (12 * MiB))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert fingerprint.weights_digest(ckpt, memo) == _expected(ckpt) != digest
    assert _lines(caplog)[-1].startswith("hybridcache: hashing the checkpoint: done, 12.0 MiB "
                                         "of 12.0 MiB")


def test_weight_hashing_on_a_terminal_draws_a_bar(tmp_path, monkeypatch, caplog):
    ckpt = _checkpoint(tmp_path / "ckpt", 2 * MiB)
    monkeypatch.setattr(fingerprint, "PROGRESS_INTERVAL_S", 0.0)
    monkeypatch.setattr(fingerprint, "_PROCESS_MEMO", {})
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert fingerprint.weights_digest(ckpt) == _expected(ckpt)
    assert "hybridcache: hashing the checkpoint" in term.getvalue()


# ---------------------------------------------------------------------------- replicas


class _Remote:
    def __init__(self, value) -> None:
        self.value = value

    def remote(self):
        return self.value


def _cluster(monkeypatch, ready_after: dict[str, int]):
    """A launcher Cluster without Ray: replica `name` answers /health from its n-th poll."""
    from vllm_hybridcache.fleet import launcher

    polls = {name: 0 for name in ready_after}

    def get(url: str, timeout: float):
        name = url.split("//")[1].split("/")[0]
        polls[name] += 1
        return SimpleNamespace(status_code=200 if polls[name] >= ready_after[name] else 503)

    monkeypatch.setattr(launcher.requests, "get", get)
    monkeypatch.setattr(launcher.ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(launcher.ray, "kill", lambda actor: None)
    c = object.__new__(launcher.Cluster)
    c._secret_dir, c.url, c.book = None, None, None
    c.endpoints = {name: f"http://{name}" for name in ready_after}
    c.actors = {name: SimpleNamespace(alive=_Remote(True), stop=_Remote(None),
                                      log_tail=_Remote("")) for name in ready_after}
    return launcher, c, polls


def test_the_launcher_says_which_replicas_are_still_starting(monkeypatch, caplog):
    _, c, polls = _cluster(monkeypatch, {"r0": 1, "r1": 3, "r2": 5})
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        c._wait_ready(60, interval_s=0, poll_s=0)
    lines = _lines(caplog)
    assert lines[0].startswith("hybridcache cluster: replicas up: 1 of 3 replicas (33%)")
    assert lines[0].endswith("still starting: r1, r2")
    assert any(x.endswith("still starting: r2") and "2 of 3" in x for x in lines)
    assert lines[-1].startswith("hybridcache cluster: replicas up: done, 3 of 3 replicas")
    assert polls == {"r0": 1, "r1": 3, "r2": 5}


def test_the_launcher_times_out_naming_the_replicas_left(monkeypatch, caplog):
    launcher, c, _ = _cluster(monkeypatch, {"r0": 1, "r1": 10**9})
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with pytest.raises(launcher.LaunchError, match=r"replicas \['r1'\] not up in 0 s"):
        c._wait_ready(0, interval_s=0, poll_s=0)
