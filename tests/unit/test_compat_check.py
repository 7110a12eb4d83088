"""compat_check: every bend's assumptions, read from a vLLM release's source without importing it.

On the installed vLLM (0.32.0, which the rest of the suite runs) every check must pass; on the
0.33.0 wheel's source every bend `compat` claims for 0.33.0 must pass. The negative controls
change one thing a bend relies on in a copy of the installed source and see the check fail,
and change only what a bend does not rely on (docstrings, comments, formatting) and see it
pass.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_hybridcache import compat
from vllm_hybridcache import compat_check as cc


@pytest.fixture(scope="module")
def installed() -> cc.SourceTree:
    return cc.SourceTree(cc.installed_tree())


def _failures(findings: list[cc.Finding]) -> list[str]:
    return [f"{f.bend}: {f.check.kind} {f.check.where()}: {f.detail}" for f in findings
            if not f.ok]


def test_every_bend_has_its_assumptions_listed():
    assert set(cc.ASSUMPTIONS) == set(compat.BENDS)
    assert all(cc.ASSUMPTIONS[b] for b in compat.BENDS)


def test_the_installed_vllm_passes_every_check(installed):
    version = compat.installed_vllm_version().split("+")[0]
    assert all(version in v for v in compat.BENDS.values())
    findings = cc.check_tree(installed) + cc.api_findings(installed)
    assert not _failures(findings)
    assert cc.main([version, "--installed"]) == 0


@pytest.fixture(scope="module")
def vllm_033() -> cc.SourceTree:
    try:
        return cc.SourceTree(cc.wheel_tree("0.33.0"))
    except cc.WheelUnavailable as e:
        pytest.skip(f"vLLM 0.33.0's wheel cannot be had here (no network, no local copy): {e}")


def test_vllm_033_source_passes_every_bend_claimed_for_it(vllm_033):
    claimed = [b for b, versions in compat.BENDS.items() if "0.33.0" in versions]
    assert claimed, "no bend claims 0.33.0"
    assert not _failures(cc.check_tree(vllm_033, claimed) + cc.api_findings(vllm_033))
    if "0.33.0" in compat.SUPPORTED_VLLM:  # supported = every bend checked on it
        assert set(claimed) == set(compat.BENDS)


def test_vllm_033_is_not_vllm_032(vllm_033, installed):
    """The 0.33.0 tree really is another release: bodies the bends read changed there (and
    were reviewed; compat_check records their 0.33.0 digests)."""
    module, qualname = cc._SCHED, "Scheduler._mamba_block_aligned_split"
    assert (cc.digest(vllm_033.find(module, qualname)[1])
            != cc.digest(installed.find(module, qualname)[1]))


# --------------------------------------------------------------------- negative controls


def _copy(tmp_path: Path, changes: dict[str, tuple[str, str]]) -> cc.SourceTree:
    """The installed source with `changes` (relative path -> (old, new) text) applied."""
    src = cc.installed_tree()
    root = tmp_path / "vllm"
    for rel in {"__init__.py", *changes}:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, root / rel)
    for rel, (old, new) in changes.items():
        text = (root / rel).read_text()
        assert old in text, (rel, old)
        (root / rel).write_text(text.replace(old, new, 1))
    return cc.SourceTree(root)


def _bend(tree: cc.SourceTree, bend: str, kind: str, qualname: str | None = None
          ) -> list[cc.Finding]:
    return [f for f in cc.check_tree(tree, [bend]) if f.check.kind == kind
            and qualname in (None, f.check.qualname)]


SCHED = "v1/core/sched/scheduler.py"


def test_a_changed_split_hook_signature_is_caught(tmp_path):
    tree = _copy(tmp_path, {SCHED: ("num_external_computed_tokens: int = 0,",
                                    "num_external_computed_tokens: int = 1,")})
    assert not all(f.ok for f in _bend(tree, "install_prefill_split", "signature"))


def test_a_lost_hook_site_is_caught(tmp_path):
    tree = _copy(tmp_path, {SCHED: ("if self.need_mamba_block_aligned_split:\n",
                                    "if False:\n")})
    failed = [f for f in cc.check_tree(tree, ["install_prefill_split"]) if not f.ok]
    assert [f.check.kind for f in failed] == ["contains"]
    assert "1 x 'if self.need_mamba_block_aligned_split:'" in failed[0].detail


def test_a_changed_chunk_length_decision_in_schedule_is_caught(tmp_path):
    tree = _copy(tmp_path, {SCHED: ("num_new_tokens = min(num_new_tokens, request_token_budget)",
                                    "num_new_tokens = max(num_new_tokens, request_token_budget)")})
    (assigns,) = _bend(tree, "install_prefill_split", "assigns")
    assert not assigns.ok and "changed" in assigns.detail


def test_a_digest_follows_code_not_docstrings_comments_or_layout(tmp_path):
    path = "v1/attention/backends/cpu_attn.py"
    src = (cc.installed_tree() / path).read_text()
    start = src.index("    def build(", src.index("class CPUAttentionMetadataBuilder"))
    header_end = src.index(":\n", src.index(") ->", start)) + 2
    harmless = _copy(tmp_path / "a", {path: (src[start:header_end], src[start:header_end]
                                             + "        # a comment\n\n")})
    build = "CPUAttentionMetadataBuilder.build"
    (check,) = _bend(harmless, "pin_cpu_attention_split", "body", build)
    assert check.ok, check.detail
    line = src[header_end:src.index("\n", header_end) + 1]
    assert line.strip(), line
    changed = _copy(tmp_path / "b", {path: (src[start:header_end] + line,
                                            src[start:header_end] + line
                                            + "        common_prefix_len = 0\n")})
    (check,) = _bend(changed, "pin_cpu_attention_split", "body", build)
    assert not check.ok and "changed" in check.detail


def test_a_reworded_docstring_keeps_the_digest(tmp_path):
    tree = _copy(tmp_path, {SCHED: ('"""Clip a prefill chunk so it ends where Mamba state must be '
                                    'cached.', '"""Clip a prefill chunk (reworded).')})
    (check,) = _bend(tree, "install_prefill_split", "body")
    assert check.ok, check.detail


def test_a_new_scheduler_manager_keyword_is_caught(tmp_path):
    tree = _copy(tmp_path, {SCHED: ("watermark=self.scheduler_config.watermark,",
                                    "watermark=self.scheduler_config.watermark, new_knob=1,")})
    (check,) = _bend(tree, "install_attention_in_place", "call_keywords")
    assert not check.ok and "not mirrored: ['new_knob']" in check.detail


def test_a_new_plugin_group_filtered_by_vllm_plugins_is_caught(tmp_path):
    tree = _copy(tmp_path, {"plugins/__init__.py": (
        "def load_general_plugins():",
        "def load_more():\n    load_plugins_by_group(NEW_GROUP)\n\n\ndef load_general_plugins():")})
    (check,) = _bend(tree, "enable_endpoint_plugin", "calls_with")
    assert not check.ok and "NEW_GROUP" in check.detail


def test_a_missing_definition_fails_unless_optional(tmp_path):
    tree = _copy(tmp_path, {"config/vllm.py": ("def try_verify_and_update_config(self):",
                                               "def renamed(self):")})
    failed = [f for f in cc.check_tree(tree, ["extend_config_hook"]) if not f.ok]
    assert failed and all(f.detail == "missing" for f in failed)
    # `num_hash_lookahead_tokens` (a 0.33 property) is absent from 0.32: that check is n/a
    (optional,) = [f for f in cc.check_tree(tree, ["provenance_block_hasher"])
                   if f.check.optional]
    assert optional.ok and "n/a" in optional.detail


def test_a_changed_connector_api_and_a_missing_import_are_caught(tmp_path):
    tree = _copy(tmp_path, {"distributed/kv_transfer/kv_connector/v1/base.py": (
        "def wait_for_save(self)", "def wait_for_save(self, timeout)")})
    findings = {f.bend: f for f in cc.api_findings(tree)}
    assert not findings["(api) KV connector methods"].ok
    assert "wait_for_save(self, timeout)" in findings["(api) KV connector methods"].detail
    assert not findings["(api) vLLM names the package imports"].ok  # a partial tree


def test_main_fails_for_a_claimed_bend_that_differs(tmp_path, capsys):
    src = cc.installed_tree()
    root = tmp_path / "vllm"
    shutil.copytree(src, root, ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.pyc",
                                                               "*.json", "*.txt", "*.cu*"))
    path = root / SCHED
    path.write_text(path.read_text().replace("if self.need_mamba_block_aligned_split:\n",
                                             "if False:\n", 1))
    assert cc.main(["0.32.0", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS install_prefill_split" in out


def test_no_wheel_is_a_clear_error(tmp_path):
    with pytest.raises(cc.WheelUnavailable, match="found no wheel"):
        cc.fetch_wheel("vllm==0.0.0.dev999", tmp_path)
    with pytest.raises(ValueError, match="name==version"):
        cc.fetch_wheel("vllm", tmp_path)


def test_scheduler_manager_kwargs_are_the_ones_checked():
    """What `install_attention_in_place` passes `KVCacheManager` is the keyword set
    compat_check compares with the call in vLLM's `Scheduler.__init__`."""
    from types import SimpleNamespace

    scheduler = SimpleNamespace(
        vllm_config=SimpleNamespace(max_in_flight_tokens=None), use_eagle_block_drop=False,
        num_prefill_lookahead=0, log_stats=False, enable_kv_cache_events=False,
        dcp_world_size=1, kv_metrics_collector=None,
        scheduler_config=SimpleNamespace(watermark=0.0),
        cache_config=SimpleNamespace(enable_mamba_shared_prefix_checkpoint=False))
    ours = set(compat.scheduler_manager_kwargs(scheduler)) | set(compat.MANAGER_KWARGS_SET_BY_US)
    assert ours == set(cc._SCHEDULER_MANAGER_KWARGS) - {"num_hash_lookahead_tokens"}  # 0.32
    scheduler.num_hash_lookahead_tokens = 0  # 0.33's scheduler has it
    assert compat.scheduler_manager_kwargs(scheduler)["num_hash_lookahead_tokens"] == 0
