"""Settings: config keys, environment variables, defaults, validation with clear errors."""

from __future__ import annotations

import pytest

from vllm_hybridcache.config import CacheSettings, SettingsError, load_settings


def test_defaults_are_valid_and_documented():
    s = load_settings({}, environ={})
    assert s == CacheSettings()
    assert s.grid % 64 == 0 and s.active
    assert "grid" in CacheSettings.__doc__ and "budget_bytes" in CacheSettings.__doc__


def test_config_key_beats_environment():
    env = {"VLLM_HYBRIDCACHE_GRID": "256", "VLLM_HYBRIDCACHE_BUDGET_BYTES": "1000000"}
    s = load_settings({"grid": 1024}, environ=env)
    assert s.grid == 1024 and s.budget_bytes == 1000000


@pytest.mark.parametrize("env,value", [
    ({"VLLM_HYBRIDCACHE_ENABLED": "off"}, False),
    ({"VLLM_HYBRIDCACHE_ENABLED": "1"}, True),
])
def test_enabled_switch_from_environment(env, value):
    assert load_settings(environ=env).enabled is value


def test_budget_zero_turns_the_cache_off():
    assert not load_settings({"budget_bytes": 0}, environ={}).active


@pytest.mark.parametrize("extra,message", [
    ({"grid": 100}, "multiple of 64"),
    ({"grid": 0}, "multiple of 64"),
    ({"budget_bytes": -1}, "budget_bytes must be >= 0"),
    ({"max_link_bytes": -5}, "max_link_bytes"),
    ({"memory_floor_bytes": -5}, "memory_floor_bytes"),
    ({"policy": "fifo"}, "policy"),
    ({"grdi": 512}, "unknown hybridcache setting 'grdi'"),
    ({"grid": "large"}, "Expected `int`"),
])
def test_bad_settings_are_clear_errors(extra, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(extra, environ={})


@pytest.mark.parametrize("env,message", [
    ({"VLLM_HYBRIDCACHE_GRID": "abc"}, "VLLM_HYBRIDCACHE_GRID must be an integer"),
    ({"VLLM_HYBRIDCACHE_ENABLED": "maybe"}, "must be a boolean"),
    ({"VLLM_HYBRIDCACHE_MESSAGE_END_IDS": "1,x"}, "must be integers"),
])
def test_bad_environment_is_a_clear_error(env, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(environ=env)


def test_message_end_ids_from_environment():
    s = load_settings(environ={"VLLM_HYBRIDCACHE_MESSAGE_END_IDS": "7, 9"})
    assert s.message_end_ids == (7, 9)


def test_memory_headroom_warning_names_the_fix():
    from vllm_hybridcache.adapter.startup import memory_headroom_warning

    gib = 1 << 30
    s = CacheSettings(memory_floor_bytes=4 * gib, budget_bytes=8 * gib)
    assert memory_headroom_warning(20 * gib, s) is None
    msg = memory_headroom_warning(4 * gib + gib // 2, s)
    assert msg is not None and "VLLM_CPU_KVCACHE_SPACE" in msg and "0.5 GiB" in msg
    assert "memory_guard" in (memory_headroom_warning(gib, s) or "")
    # a small budget needs only itself above the floor
    assert memory_headroom_warning(4 * gib + gib // 2, CacheSettings(budget_bytes=gib // 4)) is None


# ------------------------------------------------------------- environment variables


@pytest.mark.parametrize("name,suggestion", [
    ("VLLM_HYBRIDCACHE_BUDGET", "VLLM_HYBRIDCACHE_BUDGET_BYTES"),
    ("VLLM_HYBRIDCACHE_GIRD", "VLLM_HYBRIDCACHE_GRID"),
    ("vllm_hybridcache_grid", "VLLM_HYBRIDCACHE_GRID"),
    ("VLLM_HYBRIDCACHE_FLASH_NEXT_OP", "VLLM_HYBRIDCACHE_FLASH_NEXT_OPS"),
])
def test_unknown_environment_variable_names_the_closest_valid_one(name, suggestion):
    with pytest.raises(SettingsError) as e:
        load_settings(environ={name: "1"})
    assert f"unknown environment variable {name} (did you mean {suggestion}?)" in str(e.value)


def test_unrelated_unknown_variable_gets_no_guess():
    with pytest.raises(SettingsError, match=r"VLLM_HYBRIDCACHE_XYZZY; known"):
        load_settings(environ={"VLLM_HYBRIDCACHE_XYZZY": "1"})


def test_unknown_config_key_names_the_closest_setting():
    with pytest.raises(SettingsError, match=r"'budget' \(did you mean 'budget_bytes'\?\)"):
        load_settings({"budget": 1}, environ={})


def test_variables_read_are_logged_at_start_up(caplog):
    import logging

    from vllm_hybridcache import config

    config._announced.clear()
    env = {"VLLM_HYBRIDCACHE_GRID": "256", "VLLM_HYBRIDCACHE_HOME": "/tmp/models",
           "VLLM_OTHER": "x"}
    with caplog.at_level(logging.INFO, logger="vllm_hybridcache"):
        load_settings({"policy": "cost"}, environ=env)
        load_settings({"policy": "cost"}, environ=env)  # once per process, not per call
    msgs = [r.getMessage() for r in caplog.records if "variables read" in r.getMessage()]
    assert len(msgs) == 1
    assert "VLLM_HYBRIDCACHE_GRID=256, VLLM_HYBRIDCACHE_HOME=/tmp/models" in msgs[0]
    assert "config keys: policy" in msgs[0] and "grid=256" in msgs[0]
    assert "VLLM_OTHER" not in msgs[0]


def _package_env_names() -> dict[str, set[str]]:
    """Every VLLM_HYBRIDCACHE_* name written in the package (file -> names), config.py aside."""
    import re
    from pathlib import Path

    import vllm_hybridcache
    from vllm_hybridcache.config import ENV_PREFIX

    root = Path(vllm_hybridcache.__file__).parent
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        if path.name == "config.py" and path.parent == root:
            continue
        names = set(re.findall(ENV_PREFIX + r"[A-Z0-9_]+", path.read_text(encoding="utf-8")))
        names.discard(ENV_PREFIX)
        if names:
            found[str(path.relative_to(root))] = names
    return found


def test_every_variable_the_package_reads_is_a_known_name():
    """One registry (config.KNOWN_ENV): a variable read elsewhere must be declared there."""
    from vllm_hybridcache.config import KNOWN_ENV, SETTING_ENV

    used = _package_env_names()
    undeclared = {f: sorted(n - KNOWN_ENV) for f, n in used.items() if n - KNOWN_ENV}
    assert not undeclared, f"declare these in config.PROCESS_ENV: {undeclared}"
    assert "VLLM_HYBRIDCACHE_GRID" in SETTING_ENV


def _deployment_env_names() -> dict[str, set[str]]:
    """VLLM_HYBRIDCACHE_* names the images and compose files set (file -> names)."""
    import re
    from pathlib import Path

    repo = Path(__file__).parents[2]
    files = [*repo.glob("Dockerfile*"), *(repo / "deploy").rglob("*.y*ml")]
    found = {str(f.relative_to(repo)): set(re.findall(r"VLLM_HYBRIDCACHE_[A-Z0-9_]+",
                                                      f.read_text(encoding="utf-8")))
             for f in files}
    return {f: n for f, n in found.items() if n}


def test_deployment_files_set_only_known_variables():
    """An image or compose file setting an unknown name would stop every start-up."""
    from vllm_hybridcache.config import KNOWN_ENV

    unknown = {f: sorted(n - KNOWN_ENV) for f, n in _deployment_env_names().items()
               if n - KNOWN_ENV}
    assert not unknown, f"declare these in config.PROCESS_ENV or drop them: {unknown}"


def _names_used_through_config_constants() -> set[str]:
    """PROCESS_ENV names the package reads through config's constant for them (modules import
    `CLANG_ENV`, not the spelled-out name: tests/foundation/test_import_graph.py)."""
    import re
    from pathlib import Path

    import vllm_hybridcache
    from vllm_hybridcache import config

    constants = {k: v for k, v in vars(config).items()
                 if k.isupper() and isinstance(v, str) and v in config.PROCESS_ENV}
    root = Path(vllm_hybridcache.__file__).parent
    text = "\n".join(p.read_text(encoding="utf-8") for p in root.rglob("*.py")
                     if not (p.name == "config.py" and p.parent == root))
    return {v for k, v in constants.items() if re.search(rf"\b{k}\b", text)}


def test_every_declared_process_variable_is_used():
    from vllm_hybridcache.config import PROCESS_ENV

    used = set().union(*_package_env_names().values(), *_deployment_env_names().values(),
                       _names_used_through_config_constants())
    assert not set(PROCESS_ENV) - used, "declared but set or read nowhere: remove it"


def test_every_known_variable_is_documented():
    from pathlib import Path

    from vllm_hybridcache.config import KNOWN_ENV, PROCESS_ENV

    usage = (Path(__file__).parents[2] / "docs" / "usage.md").read_text(encoding="utf-8")
    assert all(name in usage for name in PROCESS_ENV), "document it in docs/usage.md"
    assert len(KNOWN_ENV) > len(PROCESS_ENV)


def test_disk_settings_from_environment_and_validation():
    """The disk tier's settings: off by default, a folder from the environment, limits checked."""
    assert CacheSettings().disk_dir == ""
    s = load_settings(environ={"VLLM_HYBRIDCACHE_DISK_DIR": " /var/cache/hc ",
                               "VLLM_HYBRIDCACHE_DISK_BUDGET_BYTES": "1e9",
                               "VLLM_HYBRIDCACHE_DISK_TTL_S": "0"})
    assert (s.disk_dir, s.disk_budget_bytes, s.disk_ttl_s) == ("/var/cache/hc", 10**9, 0)
    assert s.disk_direct_reads          # direct I/O unless turned off
    assert not load_settings(
        environ={"VLLM_HYBRIDCACHE_DISK_DIRECT_READS": "off"}).disk_direct_reads
    with pytest.raises(SettingsError, match="DISK_DIRECT_READS must be a boolean"):
        load_settings(environ={"VLLM_HYBRIDCACHE_DISK_DIRECT_READS": "2"})
    for extra, message in (({"disk_budget_bytes": 0}, "disk_budget_bytes must be > 0"),
                           ({"disk_min_free_bytes": -1}, "disk_min_free_bytes"),
                           ({"disk_ttl_s": -1}, "disk_ttl_s"),
                           ({"disk_dir": " /x"}, "spaces")):
        with pytest.raises(SettingsError, match=message):
            load_settings(extra, environ={})


def test_the_admin_key_comes_from_a_file_or_the_environment(tmp_path):
    """Issue 29: the admin key is read from `admin_key_file` (its last newline dropped) or
    from VLLM_HYBRIDCACHE_ADMIN_KEY; none of the two: no key; both: refused."""
    from vllm_hybridcache.config import ADMIN_KEY_ENV, admin_key

    key = "k" * 24
    f = tmp_path / "admin.key"
    f.write_text(key + "\n")
    f.chmod(0o600)
    s = load_settings(environ={"VLLM_HYBRIDCACHE_ADMIN_KEY_FILE": str(f)})
    assert s.admin_key_file == str(f) and admin_key(s, environ={}) == key
    assert admin_key(CacheSettings(), environ={ADMIN_KEY_ENV: key}) == key
    assert admin_key(CacheSettings(), environ={}) is None
    with pytest.raises(SettingsError, match="set one of them"):
        admin_key(s, environ={ADMIN_KEY_ENV: key})


@pytest.mark.parametrize("content,message", [
    ("short-key", "shorter than 16|at least 16"),
    ("two words but long enough", "without spaces"),
    ("ключ-ключ-ключ-ключ-ключ", "printable ASCII"),
])
def test_an_unusable_admin_key_is_a_clear_error_that_never_shows_it(tmp_path, content, message):
    from vllm_hybridcache.config import ADMIN_KEY_ENV, admin_key

    f = tmp_path / "admin.key"
    f.write_text(content)
    f.chmod(0o600)
    for settings, env in ((CacheSettings(admin_key_file=str(f)), {}),
                          (CacheSettings(), {ADMIN_KEY_ENV: content})):
        with pytest.raises(SettingsError, match=message) as err:
            admin_key(settings, environ=env)
        assert content not in str(err.value)
    with pytest.raises(SettingsError, match="cannot be read"):
        admin_key(CacheSettings(admin_key_file=str(tmp_path / "missing")), environ={})
    f.write_bytes(b"\xff\xfe" + b"k" * 30)
    with pytest.raises(SettingsError, match="printable ASCII") as err:
        admin_key(CacheSettings(admin_key_file=str(f)), environ={})
    assert "kkk" not in str(err.value)
    # the rules of every key file (core/auth.py): a file others may write is refused
    f.write_text("k" * 30)
    f.chmod(0o666)
    with pytest.raises(SettingsError, match="writable by group or others") as err:
        admin_key(CacheSettings(admin_key_file=str(f)), environ={})
    assert "k" * 30 not in str(err.value)
    link = tmp_path / "link.key"
    f.chmod(0o600)
    link.symlink_to(f)
    with pytest.raises(SettingsError, match="symlink"):
        admin_key(CacheSettings(admin_key_file=str(link)), environ={})


def test_the_start_up_line_never_shows_the_admin_key(caplog):
    """Every variable read is logged with its value (test above), except a secret: the line
    says the admin key is set, never what it is (negative control: the grid's value shows)."""
    import logging

    from vllm_hybridcache import config

    config._announced.clear()
    key = "s3cr3t-admin-key-0123456789"
    env = {config.ADMIN_KEY_ENV: key, "VLLM_HYBRIDCACHE_GRID": "256"}
    with caplog.at_level(logging.INFO, logger="vllm_hybridcache"):
        load_settings(environ=env)
    (msg,) = [r.getMessage() for r in caplog.records if "variables read" in r.getMessage()]
    assert f"{config.ADMIN_KEY_ENV}=<set, not shown>" in msg and key not in msg
    assert "VLLM_HYBRIDCACHE_GRID=256" in msg
