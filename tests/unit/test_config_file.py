"""Configuration a person writes (issue 32, item 4): sizes and durations with units in every
source, a TOML config file named by `VLLM_HYBRIDCACHE_CONFIG_FILE` or a `config_file` key, the
precedence file < environment < config keys (documented and logged), unknown or secret-looking
keys refused with the closest name, malformed files a clear SettingsError."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from vllm_hybridcache import config
from vllm_hybridcache.config import (
    CONFIG_FILE_ENV,
    FIELDS,
    MAX_VALUE,
    SIZE_SETTINGS,
    CacheSettings,
    SettingsError,
    load_settings,
    parse_duration,
    parse_size,
)

GiB = 1 << 30
ROOT = Path(__file__).parents[2]


def _file(tmp_path: Path, text: str, name: str = "hybridcache.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    path.chmod(0o644)
    return path


# ------------------------------------------------------------------------------ units


@pytest.mark.parametrize("raw,expected", [
    ("32GiB", 32 * GiB),
    ("512MiB", 512 << 20),
    ("8GB", 8 * 10**9),
    ("1.5GiB", 3 * GiB // 2),
    (" 4 kib ", 4096),
    ("16tib", 16 << 40),
    ("100B", 100),
    ("1e9", 10**9),
    ("34359738368", 32 * GiB),
    ("0", 0),
    (str(MAX_VALUE), MAX_VALUE),
])
def test_sizes_with_units(raw: str, expected: int) -> None:
    assert parse_size(raw) == expected


@pytest.mark.parametrize("raw,message", [
    ("32G", r"unit 'G' is ambiguous: write GiB \(2\*\*30 bytes\) or GB \(10\*\*9 bytes\)"),
    ("512m", "ambiguous"),
    ("abc", r"must be a size \(bytes, or a number with a unit: 32GiB"),
    ("", "must be a size"),
    ("32 GiB please", "must be a size"),
    ("8EiB", "unknown unit 'EiB'"),
    ("1.5B", "whole number of bytes"),
    ("0.1KiB", "whole number of bytes"),
    ("-1GiB", "must not be negative"),
    ("-5", "must not be negative"),
    ("1e30", "too large"),
    (str(MAX_VALUE + 1), "too large"),
    ("8388608TiB", "too large"),          # exactly 2**63
    ("1e999999999", "too large"),          # no huge product computed
])
def test_bad_sizes_say_what_is_wrong(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(raw)


@pytest.mark.parametrize("raw,expected", [
    ("4s", 4), ("10m", 600), ("10min", 600), ("1h", 3600), ("7d", 7 * 86400),
    ("2w", 14 * 86400), ("1.5h", 5400), ("90", 90),
])
def test_durations_with_units(raw: str, expected: int) -> None:
    assert parse_duration(raw) == expected


@pytest.mark.parametrize("raw,message", [
    ("1.5s", "whole number of seconds"), ("500ms", "unknown unit 'ms'"),
    ("-4s", "negative"), ("soon", "must be a duration"),
])
def test_bad_durations_say_what_is_wrong(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_duration(raw)


def test_every_size_and_duration_setting_takes_units_from_the_environment() -> None:
    """`VLLM_HYBRIDCACHE_BUDGET_BYTES=32GiB` was refused before issue 32; now every `*_bytes`
    and `*_s` variable reads units (a value none of them would read as a plain integer)."""
    s = load_settings(environ={"VLLM_HYBRIDCACHE_BUDGET_BYTES": "32GiB"})
    assert s.budget_bytes == 32 * GiB
    for name in SIZE_SETTINGS:
        env = {f"VLLM_HYBRIDCACHE_{name.upper()}": "3GiB"}
        assert getattr(load_settings(environ=env), name) == 3 * GiB, name
    for name in config.DURATION_SETTINGS:
        env = {f"VLLM_HYBRIDCACHE_{name.upper()}": "2m"}
        assert getattr(load_settings(environ=env), name) == 120, name
    assert SIZE_SETTINGS >= {"budget_bytes", "disk_budget_bytes", "memory_floor_bytes"}
    assert config.DURATION_SETTINGS == {"disk_ttl_s", "spill_timeout_s", "cluster_timeout_s"}


@pytest.mark.parametrize("env,message", [
    ({"VLLM_HYBRIDCACHE_BUDGET_BYTES": "32G"}, "VLLM_HYBRIDCACHE_BUDGET_BYTES unit 'G' is ambig"),
    ({"VLLM_HYBRIDCACHE_BUDGET_BYTES": "-1GiB"}, "BUDGET_BYTES must not be negative"),
    ({"VLLM_HYBRIDCACHE_DISK_BUDGET_BYTES": "1e30"}, "DISK_BUDGET_BYTES is too large"),
    ({"VLLM_HYBRIDCACHE_DISK_TTL_S": "7 days"}, "DISK_TTL_S unknown unit 'days'"),
    ({"VLLM_HYBRIDCACHE_GRID": "2KiB"}, "VLLM_HYBRIDCACHE_GRID must be an integer"),
])
def test_bad_units_in_the_environment_name_the_variable(env: dict[str, str], message: str
                                                         ) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(environ=env)


def test_config_keys_take_units_and_plain_integers() -> None:
    s = load_settings({"budget_bytes": "8GiB", "memory_floor_bytes": 1 << 20,
                       "disk_ttl_s": "1d"}, environ={})
    assert (s.budget_bytes, s.memory_floor_bytes, s.disk_ttl_s) == (8 * GiB, 1 << 20, 86400)
    with pytest.raises(SettingsError, match=r"budget_bytes must not be negative, got '-8GiB' "
                                            r"\(in the config keys"):
        load_settings({"budget_bytes": "-8GiB"}, environ={})


def test_an_integer_beyond_64_bits_is_refused_not_wrapped() -> None:
    """msgspec holds any Python int; the C side would not."""
    assert load_settings({"budget_bytes": MAX_VALUE}, environ={}).budget_bytes == MAX_VALUE
    for extra in ({"budget_bytes": MAX_VALUE + 1}, {"disk_ttl_s": 10**30}):
        with pytest.raises(SettingsError, match="too large"):
            load_settings(extra, environ={})


# ------------------------------------------------------------------------- the file


def test_the_file_from_the_variable(tmp_path: Path) -> None:
    f = _file(tmp_path, 'budget_bytes = "32GiB"\ngrid = 512\ndisk_ttl_s = "7d"\n'
                        'message_end_ids = [7, 9]\nenabled = true\npolicy = "cost"\n')
    s = load_settings(environ={CONFIG_FILE_ENV: str(f)})
    assert (s.budget_bytes, s.grid, s.disk_ttl_s, s.message_end_ids, s.policy) == (
        32 * GiB, 512, 7 * 86400, (7, 9), "cost")
    assert s.config_file == str(f)
    assert load_settings(environ={}) == CacheSettings()   # no file, no change


def test_the_file_from_the_config_key_wins_over_the_variables_file(tmp_path: Path) -> None:
    by_env = _file(tmp_path, "grid = 256\n", "env.toml")
    by_key = _file(tmp_path, "grid = 1024\n", "key.toml")
    env = {CONFIG_FILE_ENV: str(by_env)}
    assert load_settings({"config_file": str(by_key)}, environ=env).grid == 1024
    assert load_settings(environ=env).grid == 256
    # an explicit empty key turns the variable's file off
    assert load_settings({"config_file": ""}, environ=env).grid == CacheSettings().grid


def test_a_relative_or_home_path_is_expanded(tmp_path: Path, monkeypatch) -> None:
    _file(tmp_path, "grid = 128\n")
    monkeypatch.chdir(tmp_path)
    assert load_settings(environ={CONFIG_FILE_ENV: "hybridcache.toml"}).grid == 128
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_settings(environ={CONFIG_FILE_ENV: "~/hybridcache.toml"}).grid == 128


def test_precedence_file_then_environment_then_config_keys(tmp_path: Path) -> None:
    """Key by key: a stronger source replaces only the keys it sets."""
    f = _file(tmp_path, 'grid = 512\nbudget_bytes = "1GiB"\npolicy = "cost"\n')
    env = {CONFIG_FILE_ENV: str(f), "VLLM_HYBRIDCACHE_GRID": "1024",
           "VLLM_HYBRIDCACHE_BUDGET_BYTES": "2GiB"}
    s = load_settings({"grid": 2048}, environ=env)
    assert (s.grid, s.budget_bytes, s.policy) == (2048, 2 * GiB, "cost")
    s = load_settings(environ=env)
    assert (s.grid, s.budget_bytes, s.policy) == (1024, 2 * GiB, "cost")
    s = load_settings(environ={CONFIG_FILE_ENV: str(f)})
    assert (s.grid, s.budget_bytes, s.policy) == (512, GiB, "cost")


@pytest.mark.parametrize("text,message", [
    ("grdi = 512\n", r"unknown hybridcache setting 'grdi' \(did you mean 'grid'\?\) in config "
                     r"file .*hybridcache\.toml; known: enabled"),
    ("budget = 1\n", r"'budget' \(did you mean 'budget_bytes'\?\)"),
    ("VLLM_HYBRIDCACHE_GRID = 512\n", r"is a variable's name: write the setting's name, 'grid'"),
    ("home = \"/models\"\n", "VLLM_HYBRIDCACHE_HOME is a process variable"),
    ("[hybridcache]\ngrid = 512\n", r"'hybridcache' is a table \(\[hybridcache\]\); write the "
                                    "settings as top-level keys"),
    ("config_file = \"other.toml\"\n", "config_file cannot be set inside a config file"),
])
def test_unknown_keys_in_the_file_are_refused_with_the_closest_name(tmp_path: Path, text: str,
                                                                    message: str) -> None:
    f = _file(tmp_path, text)
    with pytest.raises(SettingsError, match=message):
        load_settings(environ={CONFIG_FILE_ENV: str(f)})


@pytest.mark.parametrize("text,message", [
    ("grid = \n", r"is not valid TOML: Invalid value \(at line 1, column 8\)"),
    ("grid = 512\nbudget_bytes = 32GiB  # host RAM\n",
     r"not valid TOML: .*\(at line 2, column 18\); a value with a unit is a quoted string in "
     r"TOML: budget_bytes = \"32GiB\""),
    ("disk_dir = /cache\n", r"not valid TOML: Invalid value \(at line 1, column 12\)$"),
    ("grid = 512\ngrid = 1024\n", r"not valid TOML: Cannot overwrite a value \(at line 2"),
    ("grid = \"big\"\n", r"Expected `int`, got `str` - at `\$.grid` \(grid from config file "),
    ("grid = 100\n", r"grid must be a positive multiple of 64, got 100 \(grid from config file"),
    ("budget_bytes = \"32G\"\n", r"budget_bytes unit 'G' is ambiguous.*\(in config file .*\)"),
    ("disk_ttl_s = -1\n", r"disk_ttl_s must be >= 0 \(disk_ttl_s from config file"),
])
def test_a_malformed_file_is_a_clear_settings_error(tmp_path: Path, text: str, message: str
                                                    ) -> None:
    f = _file(tmp_path, text)
    with pytest.raises(SettingsError, match=message) as err:
        load_settings(environ={CONFIG_FILE_ENV: str(f)})
    assert str(f) in str(err.value)


def test_an_unreadable_file_names_the_file_and_who_named_it(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(SettingsError, match=rf"config file {re.escape(str(missing))} \(from "
                                            rf"{CONFIG_FILE_ENV}\) cannot be read "
                                            r"\(FileNotFoundError"):
        load_settings(environ={CONFIG_FILE_ENV: str(missing)})
    with pytest.raises(SettingsError, match="from the config_file config key"):
        load_settings({"config_file": str(missing)}, environ={})
    with pytest.raises(SettingsError, match="is not a regular file"):
        load_settings(environ={CONFIG_FILE_ENV: str(tmp_path)})
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"grid = 512\n\xff\xfe\n")
    with pytest.raises(SettingsError, match=r"is not UTF-8 text \(byte 11\)"):
        load_settings(environ={CONFIG_FILE_ENV: str(binary)})
    with pytest.raises(SettingsError, match="config_file must be a path"):
        load_settings({"config_file": 5}, environ={})


def test_a_file_any_user_may_write_is_refused(tmp_path: Path) -> None:
    """Its settings choose the disk folder and the key files; a symlink to a safe file (a
    Kubernetes ConfigMap) is fine."""
    f = _file(tmp_path, "grid = 512\n")
    link = tmp_path / "link.toml"
    link.symlink_to(f)
    assert load_settings(environ={CONFIG_FILE_ENV: str(link)}).grid == 512
    f.chmod(0o666)
    with pytest.raises(SettingsError, match=r"may be written by any user \(mode 666\); "
                                            "`chmod o-w` it"):
        load_settings(environ={CONFIG_FILE_ENV: str(f)})


# ---------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("key,home", [
    ("admin_key", "admin_key_file"), ("disk_key", "disk_key_file"),
    ("cluster_secret", "cluster_secret_file"), ("hf_token", "admin_key_file, disk_key_file"),
])
def test_a_secret_is_never_a_config_value_and_never_shown(tmp_path: Path, caplog, key: str,
                                                          home: str) -> None:
    secret = "s3cr3t-0123456789abcdef-value"
    f = _file(tmp_path, f'grid = 512\n{key} = "{secret}"\n')
    config._announced.clear()
    with caplog.at_level(logging.DEBUG, logger="vllm_hybridcache"):
        with pytest.raises(SettingsError, match=rf"'{key}' in config file .* looks like a "
                                                rf"secret.*name that file with {home}") as err:
            load_settings(environ={CONFIG_FILE_ENV: str(f)})
        with pytest.raises(SettingsError, match="looks like a secret") as err2:
            load_settings({key: secret}, environ={})
    assert secret not in str(err.value) and secret not in str(err2.value)
    assert not [r for r in caplog.records if secret in r.getMessage()]


def test_key_file_settings_are_paths_and_are_logged(tmp_path: Path, caplog) -> None:
    """Negative control of the test above: the *_file settings are not secrets (paths), so the
    file may set them and the start-up line shows them."""
    f = _file(tmp_path, 'admin_key_file = "/run/secrets/admin"\ndisk_key_file = "/keys/d.key"\n'
                        'disk_key_fil = "x"\n')
    with pytest.raises(SettingsError, match=r"'disk_key_fil' \(did you mean 'disk_key_file'"):
        load_settings(environ={CONFIG_FILE_ENV: str(f)})
    f = _file(tmp_path, 'admin_key_file = "/run/secrets/admin"\ndisk_key_file = "/keys/d.key"\n')
    config._announced.clear()
    with caplog.at_level(logging.INFO, logger="vllm_hybridcache"):
        s = load_settings(environ={CONFIG_FILE_ENV: str(f)})
    assert (s.admin_key_file, s.disk_key_file) == ("/run/secrets/admin", "/keys/d.key")
    (msg,) = [r.getMessage() for r in caplog.records if "variables read" in r.getMessage()]
    assert "admin_key_file='/run/secrets/admin'" in msg


# ---------------------------------------------------------------------- the start-up line


def test_the_start_up_line_names_the_file_the_precedence_and_what_was_overridden(
        tmp_path: Path, caplog) -> None:
    f = _file(tmp_path, 'grid = 512\nbudget_bytes = "32GiB"\n')
    env = {CONFIG_FILE_ENV: str(f), "VLLM_HYBRIDCACHE_GRID": "1024"}
    config._announced.clear()
    with caplog.at_level(logging.INFO, logger="vllm_hybridcache"):
        load_settings({"policy": "cost"}, environ=env)
        load_settings({"policy": "cost"}, environ=env)   # once per process
    msgs = [r.getMessage() for r in caplog.records if "variables read" in r.getMessage()]
    assert len(msgs) == 1
    (msg,) = msgs
    assert (f"config file {f} (from {CONFIG_FILE_ENV}; keys: budget_bytes, grid)") in msg
    assert ("precedence: defaults < config file < VLLM_HYBRIDCACHE_* variables < config keys"
            in msg)
    assert f"overridden: grid (config file {f} < VLLM_HYBRIDCACHE_GRID)" in msg
    assert "budget_bytes=32GiB" in msg and "grid=1024" in msg and "policy='cost'" in msg
    config._announced.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm_hybridcache"):
        load_settings(environ={})
    (msg,) = [r.getMessage() for r in caplog.records if "variables read" in r.getMessage()]
    assert "config file: none" in msg and "overridden" not in msg


def test_every_setting_and_the_config_file_are_documented(tmp_path: Path) -> None:
    """The settings table of docs/usage.md has a row per setting saying which take units, the
    precedence is the one the loader applies, and the example file loads as written."""
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (size|duration|) \|", usage, flags=re.MULTILINE))
    assert set(FIELDS) <= set(rows), sorted(set(FIELDS) - set(rows))
    assert {k for k, v in rows.items() if v == "size"} == SIZE_SETTINGS
    assert {k for k, v in rows.items() if v == "duration"} == config.DURATION_SETTINGS
    assert config.PRECEDENCE.replace("*", "\\*") in usage
    example = re.search(r"```toml\n(.*?)```", usage, flags=re.DOTALL)
    assert example, "docs/usage.md: no ```toml example of the config file"
    s = load_settings(environ={CONFIG_FILE_ENV: str(_file(tmp_path, example.group(1)))})
    assert s.budget_bytes == 32 * GiB and s.disk_ttl_s == 7 * 86400
