"""Plugin settings: one typed struct, each field a config key and an environment variable.

Sources, weakest first: the defaults below, a TOML config file named by the `config_file`
setting (`VLLM_HYBRIDCACHE_CONFIG_FILE`, or a `config_file` key), `VLLM_HYBRIDCACHE_<KEY>`
environment variables, then keys given in `--kv-transfer-config`'s `kv_connector_extra_config`
(or `vllm.LLM(kv_transfer_config=...)`): a key written closer to the command wins. The file
holds the same keys as the variables (the setting names). Sizes (`*_bytes`) take units
(`32GiB`, `512MiB`, `8GB`) and durations (`*_s`) take `s`/`m`/`h`/`d`/`w`, in every source;
plain integers still mean bytes and seconds. Invalid values raise `SettingsError` at engine
start, with the key, where it came from and the reason, so a typo never silently runs with a
default.

Every `VLLM_HYBRIDCACHE_*` environment variable the project reads is named here (`KNOWN_ENV`):
the settings, plus the process switches in `PROCESS_ENV`. An unknown one (e.g. the typo
`VLLM_HYBRIDCACHE_BUDGET`) is refused at start-up with the closest valid name, since vLLM
cannot tell a typo of ours from a valid name (it warns "Unknown vLLM environment variable" for
every one of them, see docs/usage.md). Unknown keys of the config file and of the extra config
are refused the same way.

Secrets are never settings: the admin key, the disk key and the cluster secret live in files
named by settings (`*_key_file`, `cluster_secret_file`), because settings are logged at
start-up and travel on command lines. A key that looks like a secret is refused with the name
of the setting that takes its file, and its value is never quoted.

Why one module over ~500 lines: every setting, its environment variable, its parser and its
check are declared once, here (tests/foundation checks no other module spells a
`VLLM_HYBRIDCACHE_*` name), so a setting is found, documented and validated in one place.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import msgspec

from vllm_hybridcache.core import TreeConfig

GiB = 1 << 30
_TREE = TreeConfig()
ENV_PREFIX = "VLLM_HYBRIDCACHE_"
CONNECTOR_NAME = "HybridSnapshotConnector"
"""The name the plugin registers its KV connector under (`--kv-transfer-config`)."""
logger = logging.getLogger("vllm_hybridcache")

ALLOW_UNSUPPORTED_VLLM_ENV = ENV_PREFIX + "ALLOW_UNSUPPORTED_VLLM"
HOME_ENV = ENV_PREFIX + "HOME"
FLASH_NEXT_IMPL_ENV = ENV_PREFIX + "FLASH_NEXT_IMPL"
FLASH_NEXT_OPS_ENV = ENV_PREFIX + "FLASH_NEXT_OPS"
FLASH_NEXT_SKIP_ENV = ENV_PREFIX + "FLASH_NEXT_SKIP"
FLASH_NEXT_SPLIT_INVARIANT_ENV = ENV_PREFIX + "FLASH_NEXT_SPLIT_INVARIANT"
CPU_ATTN_SPLIT_INVARIANT_ENV = ENV_PREFIX + "CPU_ATTN_SPLIT_INVARIANT"
COPY_BACKEND_ENV = ENV_PREFIX + "COPY_BACKEND"
CSRC_ENV = ENV_PREFIX + "CSRC"
CLANG_ENV = ENV_PREFIX + "CLANG"
GPU_TARGET_ENV = ENV_PREFIX + "GPU_TARGET"
ADMIN_KEY_ENV = ENV_PREFIX + "ADMIN_KEY"
ADMIN_KEY_MIN = 16  # characters: an admin key guards every tenant's links

PROCESS_ENV: dict[str, str] = {
    ALLOW_UNSUPPORTED_VLLM_ENV: "1 = start on a vLLM outside the supported versions (warns)",
    HOME_ENV: "folder of the embedded models (default ~/.cache/vllm-hybridcache)",
    FLASH_NEXT_IMPL_ENV: "which implementation serves Qwen4Exp*: auto (default: ours on CPU and "
                         "ROCm RDNA, vLLM's elsewhere), hybridcache (ours) or vllm",
    FLASH_NEXT_OPS_ENV: "Flash-Next kernel backend: reference, cpu or triton",
    FLASH_NEXT_SKIP_ENV: "tests: Flash-Next parts to skip (proves a test can fail)",
    FLASH_NEXT_SPLIT_INVARIANT_ENV: "Flash-Next's split-invariant forward (fine segmentation): "
                                    "auto (default: on where measured cheaper, "
                                    "flash_next/ops/split_invariant.py), 1 or 0",
    CPU_ATTN_SPLIT_INVARIANT_ENV: "1 = vLLM's CPU attention computes a query the same way "
                                  "whatever its prefill step, and its GDN op hands states "
                                  "inside a step: fine segmentation for Qwen3-Next on the CPU "
                                  "platform; kernel = our split-invariant kernel; 0 = vLLM's "
                                  "attention, step mode (default auto: the kernel where it "
                                  "applies)",
    COPY_BACKEND_ENV: "snapshot copy kernels: auto, csrc, triton or torch",
    CSRC_ENV: "folder of the csrc/ sources to build the copy kernels from",
    CLANG_ENV: "clang that compiles the AMD code objects of the copy kernels",
    GPU_TARGET_ENV: "set by the ROCm image: the GPU target its kernels were built for (a label)",
    ADMIN_KEY_ENV: "the admin key of /v1/cache/clear and of the admin's /v1/cache/stats (a "
                   "secret, never logged; admin_key_file is the better place for it)",
}
"""Our environment variables that are not cache settings: name -> meaning."""
SECRET_ENV: frozenset[str] = frozenset({ADMIN_KEY_ENV})
"""Variables whose value is never logged (the start-up line says only that they are set)."""


# ------------------------------------------------------------------ sizes and durations

MAX_VALUE = (1 << 63) - 1
"""Largest size or duration accepted: what a signed 64-bit integer holds (file offsets,
`statvfs`, the C side of the copy kernels), so an overflow is refused here, not wrapped there."""
SIZE_UNITS: dict[str, int] = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
"""Size units, case-insensitive: SI (kB = 1000 bytes) and IEC (KiB = 1024 bytes) spelled out.
A bare `K`/`M`/`G`/`T` is refused: which of the two it means is a guess (vLLM's own flags read
`G` as 2**30 and `g` as 10**9)."""
DURATION_UNITS: dict[str, int] = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400,
                                  "w": 7 * 86400}
"""Duration units: seconds, minutes, hours, days, weeks (the duration settings are whole
seconds)."""
_NUMBER_UNIT = re.compile(r"\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


def _shown(raw: str) -> str:
    """`raw` quoted for an error message, cut short: a value pasted into the wrong place can be
    long (or something that should not be printed in full)."""
    return repr(raw if len(raw) <= 40 else raw[:37] + "...")


def _parse_with_units(raw: str, units: Mapping[str, int], what: str, example: str) -> int:
    match = _NUMBER_UNIT.fullmatch(raw)
    if match is None:
        raise ValueError(f"must be {what} ({example}), got {_shown(raw)}")
    number, unit = match.group(1), match.group(2).lower()
    if unit and unit not in units:
        if what == "a size" and unit in ("k", "m", "g", "t"):
            u = unit.upper()
            raise ValueError(f"unit {match.group(2)!r} is ambiguous: write {u}iB "
                             f"(2**{10 * ('kmgt'.index(unit) + 1)} bytes) or {u}B "
                             f"(10**{3 * ('kmgt'.index(unit) + 1)} bytes), got {_shown(raw)}")
        raise ValueError(f"unknown unit {match.group(2)!r} in {_shown(raw)}; units: "
                         f"{', '.join(units)} ({example})")
    try:
        value = Decimal(number)
    except InvalidOperation:  # the pattern admits only numbers; kept for a clear message
        raise ValueError(f"must be {what} ({example}), got {_shown(raw)}") from None
    if value < 0:
        raise ValueError(f"must not be negative, got {_shown(raw)}")
    if value.adjusted() > 40:  # far above MAX_VALUE whatever the unit: no huge product
        raise ValueError(f"is too large (at most {MAX_VALUE}), got {_shown(raw)}")
    total = value * units.get(unit, 1)
    if total != total.to_integral_value():
        base = "bytes" if what == "a size" else "seconds"
        raise ValueError(f"must be a whole number of {base}, got {_shown(raw)}")
    if total > MAX_VALUE:
        raise ValueError(f"is too large (at most {MAX_VALUE}), got {_shown(raw)}")
    return int(total)


def parse_size(raw: str) -> int:
    """Bytes from `32GiB`, `512 MiB`, `8GB`, `1.5GiB`, `1e9` or a plain integer.

    Why units: a person writes `32GiB`; `34359738368` is what a program writes, and a digit too
    many in it goes unnoticed. ValueError (saying what is wrong) for anything else: a negative
    or fractional byte count, an unknown or ambiguous unit, more than MAX_VALUE.
    """
    return _parse_with_units(raw, SIZE_UNITS, "a size",
                             "bytes, or a number with a unit: 32GiB, 512MiB, 8GB")


def parse_duration(raw: str) -> int:
    """Seconds from `4s`, `10m`, `1h`, `7d`, `2w` or a plain integer; ValueError otherwise."""
    return _parse_with_units(raw, DURATION_UNITS, "a duration",
                             "seconds, or a number with a unit: 4s, 10m, 1h, 7d")


class SettingsError(ValueError):
    """A setting is unknown or invalid."""


class CacheSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Snapshot-cache settings (see docs/usage.md, "Settings" for the reasoning behind defaults).

    enabled: master switch; off = the connector passes every request through.
    budget_bytes: host memory for links; 0 turns the cache off (outputs then equal vLLM's).
    grid: prefill cut every `grid` tokens (multiple of 64). 2048: with message-end cuts it
        keeps 97-99% of the reuse of a 512 grid on every trace family, with a third of the
        prefill steps (docs/benchmarks/segmentation.md). Fitted to vLLM's
        max_num_batched_tokens when that is smaller (adapter/startup.py `grid_for_step`).
    max_link_bytes: cap on one link (0 = no cap); larger links are skipped (`too_large`).
    memory_floor_bytes: skip a capture when host available memory would fall below this.
    (budget, cap, floor and policy default to the cache core's TreeConfig: docs/cache-core.md)
    message_end_ids: token ids that end a chat message (cuts after them); empty = model default
        (`<|im_end|>` when the tokenizer has it), [-1] = off.
    message_end_min: a message-end cut needs at least this many tokens since the previous cut.
        512: 256 buys under a point of reuse for 20-30% more cold-prefill time
        (docs/benchmarks/segmentation.md); must be below `grid` to have any effect.
    policy: eviction policy, "cost" (recompute-cost aware) or "lru".
    session_anchors: end anchors kept for live continuation (0 = off): the state where a
        finished request stopped, resumed by a next request that strictly extends its tokens.
        Session-exact, never shared across cache_salt; LRU.
    session_budget_bytes: host memory for end anchors (an anchor holds every KV block of its
        conversation, so it costs more than a tree link).
    disk_dir: folder of the disk tier (link files that survive a restart); "" = tier off.
        Must exist or be creatable and writable: a disk tier asked for and not usable stops
        the start-up (docs/disk-tier.md).
    disk_key_file: the file holding the disk key, the secret that authenticates and names the
        disk tier's files (docs/security.md); "" = `$XDG_CONFIG_HOME/vllm-hybridcache/disk.key`
        (~/.config/...). Created with a new random key (mode 0600) when missing; refused inside
        disk_dir, when another user owns it or when group/others may write it. Every engine
        that shares disk_dir (and every restart) must read the same key: a file written under
        another key is refused (`unauthenticated`) and deleted. In a container, keep it on a
        persistent volume apart from the cache folder.
    disk_budget_bytes: bytes of link files kept under disk_dir by this engine's fingerprint.
    disk_min_free_bytes: a write is skipped when the file system would keep less free space.
    disk_ttl_s: files unused this long are deleted (0 = never).
    disk_direct_reads: a disk hit reads each file with direct I/O, one request straight into
        its page-aligned store buffer (no page-cache copy; a file system without direct I/O
        falls back to the page cache, logged once). On by default: on the 2-core benchmark
        host it read up to 1.5x faster than the same request through the page cache (1.45x on
        38 MiB files, the same on 8 MiB files) with a third to a half of the CPU
        (docs/benchmarks/disk.md). Off: the same request, buffered (a file still in the page
        cache, as in the life that wrote it, is not read again).
    disk_write_first_tokens: which tree links the disk tier writes: a prefix seen in two
        prompts (a repeat, a branch point) and every line of a session's first prompt at least
        this long (an agent's system prompt and tools); 0 = every committed link.
    session_spill: with the disk tier on, end anchors of live conversations are written to it
        at a graceful shutdown (and when RAM evicts them), and read back after a restart, so a
        conversation's next turn resumes where it stopped (docs/disk-tier.md). Off = anchors
        stay in RAM only.
    spill_timeout_s: time limit of the shutdown drain (spilled anchors, then queued writes);
        what is left at the limit is dropped and logged. The drain runs in vLLM's worker
        shutdown, which vLLM allows `VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS` (default 5) and only
        with `--shutdown-timeout` above 0: 4 fits vLLM's defaults; raise all three together.
    cluster_address: address of a Ray cluster (`host:port` of its GCS) whose replicas share
        links (docs/cluster.md); "" = tier off. A tier asked for and not reachable stops the
        start-up.
    cluster_secret_file: the file holding the cluster secret, shared by every replica of the
        cluster: payloads are authenticated with it, directory entries are found by digests
        keyed by it and the directory answers only callers that hold it (docs/security.md).
        Required with cluster_address (the tier refuses to start without one); the local
        launcher (`vllm-hybridcache cluster`) makes one. Same checks as disk_key_file.
    cluster_replica: this replica's name in the cluster's directory ("" = host:pid).
    cluster_budget_bytes: host bytes of fetched remote links held at once before the worker
        takes them; a fetch that would exceed it is a counted miss (`budget`).
    cluster_timeout_s: a remote lookup (directory, then payloads) not answered in this time is
        a counted miss (`timeout`); the request waits at most this long before prefilling cold.
    inner_captures: where the model's forward is split-invariant (Flash-Next with its switch;
        vLLM's Qwen3-Next on CPU with the attention pin), also capture links inside a prefill
        step (fine segmentation: the prompt's last 64-aligned position, junctions;
        docs/split-invariance.md). Off = step mode on every
        engine (links only where a step ends), the same forward. On by default (fine mode's
        purpose); their cost on a cold prefill: docs/benchmarks/split-invariance-captures.md.
    step_wait: a prefill that a step shared with other prefills leaves short of its next cut
        gets no tokens in that step and runs in the next one with room (never waiting on
        decodes), so concurrent prompts keep their links (docs/how-it-works.md, the scheduler
        hook). Off = it takes the tokens left and is not cached past that point (vLLM's use
        of every step's budget).
    attention_in_place: a hit's attention K/V comes from vLLM's block pool, shared in place by
        every request with the prefix, and only the recurrent sections and the rows of the
        hit's last block are copied from the link (docs/how-it-works.md, attention K/V in
        place). On by default; on the AR route only (with speculative decoding a hit's rows
        are copied, as they are with this off).
    sync_loads: a RAM hit loads in the step that runs its request (vLLM's synchronous load),
        so it does not wait a step in vLLM's queue for its copy; a load that fails is
        withdrawn with its step before its output is applied (the request recomputes from
        token 0). Only with the segmentation scheduler on synchronous scheduling and the AR
        route; disk and cluster hits always load a step ahead. Off = every hit loads a step
        ahead (vLLM's asynchronous load), as before (docs/how-it-works.md, loads).
    anchor_in_place: an end-anchor hit also takes from vLLM's block pool the whole blocks
        below its cold rows (the rows a cold prefill wrote: forks of one anchor then hold one
        copy of the prefix), with `attention_in_place`. Off by default: a float32 soak run
        (flash-next-tiny, seed 3, an AVX-512 host) served one such hit 0.036 nats away from
        its cold run with the same picks, twice on one code version, where drift is below 1e-5
        nats; the cause was not found, so an anchor hit copies its rows (docs/reliability.md).
    admin_key_file: a file holding the admin key (read by the API server at start-up; the
        key itself is never a setting: settings are logged and travel on command lines). With
        an admin key or vLLM's --api-key, `POST /v1/cache/clear` of every tenant's links needs
        the key in the `X-Hybridcache-Admin-Key` header (docs/usage.md, docs/security.md).
        "" = none (the `VLLM_HYBRIDCACHE_ADMIN_KEY` variable may hold it instead).
    config_file: a TOML file of settings (the same keys, top-level: `budget_bytes = "32GiB"`),
        read by `load_settings` below the environment variables and the config keys; "" =
        none. Named by `VLLM_HYBRIDCACHE_CONFIG_FILE` or a `config_file` config key (which
        wins); it cannot name itself inside a file. Why a file: a deployment's settings in one
        reviewed place instead of a dozen variables on a command line.

    Sizes (`*_bytes`) and durations (`*_s`) accept units in every source (`parse_size`,
    `parse_duration`); the struct holds plain bytes and seconds.
    """

    enabled: bool = True
    budget_bytes: int = _TREE.budget_bytes
    grid: int = 2048
    max_link_bytes: int = _TREE.max_link_bytes
    memory_floor_bytes: int = _TREE.memory_floor_bytes
    message_end_ids: tuple[int, ...] = ()
    message_end_min: int = 512
    policy: str = _TREE.policy
    session_anchors: int = 32
    session_budget_bytes: int = 2 * GiB
    disk_dir: str = ""
    disk_key_file: str = ""
    disk_budget_bytes: int = 64 * GiB
    disk_min_free_bytes: int = 8 * GiB
    disk_ttl_s: int = 7 * 86400
    disk_direct_reads: bool = True
    disk_write_first_tokens: int = 4096
    session_spill: bool = True
    spill_timeout_s: int = 4
    cluster_address: str = ""
    cluster_secret_file: str = ""
    cluster_replica: str = ""
    cluster_budget_bytes: int = 2 * GiB
    cluster_timeout_s: int = 10
    inner_captures: bool = True
    step_wait: bool = True
    attention_in_place: bool = True
    sync_loads: bool = True
    anchor_in_place: bool = False
    admin_key_file: str = ""
    config_file: str = ""

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if name.endswith(("_bytes", "_s")):
                value = getattr(self, name)
                if isinstance(value, int) and value > MAX_VALUE:
                    raise SettingsError(f"{name} is too large (at most {MAX_VALUE}), got {value}")
        if self.budget_bytes < 0:
            raise SettingsError(f"budget_bytes must be >= 0 (0 = off), got {self.budget_bytes}")
        if self.grid <= 0 or self.grid % 64:
            raise SettingsError(f"grid must be a positive multiple of 64, got {self.grid}")
        if self.max_link_bytes < 0:
            raise SettingsError(f"max_link_bytes must be >= 0, got {self.max_link_bytes}")
        if self.memory_floor_bytes < 0:
            raise SettingsError(f"memory_floor_bytes must be >= 0, got {self.memory_floor_bytes}")
        if self.message_end_min < 1:
            raise SettingsError(f"message_end_min must be >= 1, got {self.message_end_min}")
        if self.session_anchors < 0 or self.session_budget_bytes < 0:
            raise SettingsError("session_anchors and session_budget_bytes must be >= 0")
        if self.disk_budget_bytes <= 0:
            raise SettingsError(f"disk_budget_bytes must be > 0 (unset disk_dir to turn the disk "
                                f"tier off), got {self.disk_budget_bytes}")
        if self.disk_write_first_tokens < 0:
            raise SettingsError("disk_write_first_tokens must be >= 0 (0 = write every link), "
                                f"got {self.disk_write_first_tokens}")
        if self.spill_timeout_s <= 0:
            raise SettingsError(f"spill_timeout_s must be > 0, got {self.spill_timeout_s}")
        if self.disk_min_free_bytes < 0 or self.disk_ttl_s < 0:
            raise SettingsError("disk_min_free_bytes and disk_ttl_s must be >= 0")
        for name in ("disk_dir", "disk_key_file", "cluster_secret_file", "admin_key_file",
                     "config_file"):
            value = getattr(self, name)
            if value != value.strip():
                raise SettingsError(f"{name} has leading or trailing spaces: {value!r}")
        if self.cluster_budget_bytes < 0 or self.cluster_timeout_s <= 0:
            raise SettingsError("cluster_budget_bytes must be >= 0 and cluster_timeout_s > 0")
        if self.policy not in ("cost", "lru"):
            raise SettingsError(f"policy must be 'cost' or 'lru', got {self.policy!r}")

    @property
    def active(self) -> bool:
        return self.enabled and self.budget_bytes > 0

    def disk_key_path(self, environ: Mapping[str, str] | None = None) -> Path:
        """The disk key's file: `disk_key_file`, or the default under the XDG config folder."""
        if self.disk_key_file:
            return Path(self.disk_key_file).expanduser()
        env = os.environ if environ is None else environ
        base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        return Path(base) / "vllm-hybridcache" / "disk.key"

    def tree_config(self, shards: int = 1) -> TreeConfig:
        """The RAM tree's settings; `shards`: the ranks that each hold a shard of every link
        (the budget and the cap count all of them: host memory, whatever the TP size)."""
        return TreeConfig(budget_bytes=self.budget_bytes, max_link_bytes=self.max_link_bytes,
                          memory_floor_bytes=self.memory_floor_bytes, policy=self.policy,
                          shards=shards)


FIELDS: tuple[str, ...] = CacheSettings.__struct_fields__
_DEFAULTS = CacheSettings()
SETTING_ENV: dict[str, str] = {ENV_PREFIX + name.upper(): name for name in FIELDS}
"""Environment variable -> setting it sets."""


def setting_env(name: str) -> str:
    """The environment variable of setting `name` (KeyError for a name that is no setting), so
    a module that reads or sets one never spells it out (issue 31: names declared once)."""
    if name not in FIELDS:
        raise KeyError(f"no setting {name!r}")
    return ENV_PREFIX + name.upper()

KNOWN_ENV: frozenset[str] = frozenset(SETTING_ENV) | frozenset(PROCESS_ENV)
CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG_FILE"
"""The variable naming the config file (the `config_file` setting's own variable)."""
SIZE_SETTINGS: frozenset[str] = frozenset(n for n in FIELDS if n.endswith("_bytes"))
"""Settings in bytes: `parse_size` reads their text in every source."""
DURATION_SETTINGS: frozenset[str] = frozenset(n for n in FIELDS if n.endswith("_s"))
"""Settings in seconds: `parse_duration` reads their text in every source."""
_BOOL_SETTINGS = frozenset(n for n in FIELDS if isinstance(getattr(_DEFAULTS, n), bool))
_STR_SETTINGS = frozenset(n for n in FIELDS if isinstance(getattr(_DEFAULTS, n), str))
PRECEDENCE = f"defaults < config file < {ENV_PREFIX}* variables < config keys"
"""Which source wins, key by key (logged at start-up, documented in docs/usage.md)."""
_UNQUOTED_UNIT = re.compile(r"\s*([a-z_]+)\s*=\s*([0-9.eE+-]+\s*[A-Za-z]+)\s*(?:#.*)?")
_SECRET_WORD = re.compile(r"key|secret|token|passw", re.IGNORECASE)
_SECRET_HOMES = {"admin": "admin_key_file", "disk": "disk_key_file",
                 "cluster": "cluster_secret_file"}


def check_environment(environ: Mapping[str, str]) -> list[str]:
    """Our variables present in `environ`, sorted; SettingsError for an unknown one.

    Matched case-insensitively on the prefix, so `vllm_hybridcache_grid` is caught too (it
    would otherwise be ignored: names are case-sensitive). The error names the closest valid
    variable, since the usual cause is a typo or a shortened name.
    """
    ours = sorted(k for k in environ if k.upper().startswith(ENV_PREFIX))
    unknown = [k for k in ours if k not in KNOWN_ENV]
    if unknown:
        parts = []
        suffixes = sorted(k.removeprefix(ENV_PREFIX) for k in KNOWN_ENV)
        for name in unknown:
            # compare what follows the shared prefix, or every name looks alike
            close = difflib.get_close_matches(name.upper().removeprefix(ENV_PREFIX), suffixes,
                                              n=1, cutoff=0.6)
            hint = f" (did you mean {ENV_PREFIX}{close[0]}?)" if close else ""
            parts.append(f"{name}{hint}")
        raise SettingsError(
            f"unknown environment variable {', '.join(parts)}; known {ENV_PREFIX}* variables: "
            f"{', '.join(sorted(KNOWN_ENV))}")
    return ours


_announced: set[str] = set()


def _announce(message: str) -> None:
    """Log `message` at info once per process (the loader runs in several places per start)."""
    if message not in _announced:
        _announced.add(message)
        logger.info(message)


def _parse_env(name: str, raw: str) -> Any:
    """The value of setting `name` from its environment variable's text."""
    if name in _BOOL_SETTINGS:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{ENV_PREFIX}{name.upper()} must be a boolean, got {raw!r}")
    if name == "message_end_ids":
        try:
            return tuple(int(x) for x in raw.replace(",", " ").split())
        except ValueError:
            raise SettingsError(
                f"{ENV_PREFIX}MESSAGE_END_IDS must be integers, got {raw!r}") from None
    if name in _STR_SETTINGS:
        return raw.strip()
    if name in SIZE_SETTINGS or name in DURATION_SETTINGS:
        parse = parse_size if name in SIZE_SETTINGS else parse_duration
        try:
            return parse(raw)
        except ValueError as e:
            raise SettingsError(f"{ENV_PREFIX}{name.upper()} {e}") from None
    try:
        return int(float(raw)) if any(c in raw for c in ".eE") else int(raw)
    except ValueError:
        raise SettingsError(f"{ENV_PREFIX}{name.upper()} must be an integer, got {raw!r}") from None


def _coerce(name: str, value: Any, where: str) -> Any:
    """A size or duration written as text (`"32GiB"`, `"7d"`) as bytes or seconds; any other
    value unchanged (msgspec checks its type against the struct)."""
    if isinstance(value, str) and (name in SIZE_SETTINGS or name in DURATION_SETTINGS):
        parse = parse_size if name in SIZE_SETTINGS else parse_duration
        try:
            return parse(value)
        except ValueError as e:
            raise SettingsError(f"{name} {e} (in {where})") from None
    return value


def _looks_secret(name: str) -> bool:
    return bool(_SECRET_WORD.search(name)) and not name.lower().endswith("_file")


def _unknown_key(key: object, where: str) -> SettingsError:
    """The error for a key that is not a setting, naming what was probably meant.

    Never quotes the key's value: a key that looks like a secret (`admin_key`) most likely
    holds one, and this message is logged.
    """
    name = str(key)
    upper = name.upper()
    bare = upper.removeprefix(ENV_PREFIX).lower()
    if upper.startswith(ENV_PREFIX) and bare in FIELDS:
        return SettingsError(f"{name!r} in {where} is a variable's name: write the setting's "
                             f"name, {bare!r}")
    typo = difflib.get_close_matches(name, FIELDS, n=1, cutoff=0.9)
    if not typo and _looks_secret(name):
        home = next((f for word, f in _SECRET_HOMES.items() if word in name.lower()),
                    "admin_key_file, disk_key_file or cluster_secret_file")
        return SettingsError(
            f"{name!r} in {where} looks like a secret, and secrets are never settings (settings "
            f"are logged and travel on command lines): write it to a file only you may read "
            f"(mode 0600) and name that file with {home}")
    variable = upper if upper.startswith(ENV_PREFIX) else ENV_PREFIX + upper
    if variable in PROCESS_ENV:
        return SettingsError(f"{name!r} in {where} is not a cache setting: {variable} is a "
                             f"process variable, read from the environment only")
    close = typo or difflib.get_close_matches(name, FIELDS, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return SettingsError(
        f"unknown hybridcache setting {name!r}{hint} in {where}; known: {', '.join(FIELDS)}")


def _unquoted_unit_hint(text: str, error: tomllib.TOMLDecodeError) -> str:
    """The likeliest mistake in a settings file, spelled out: `budget_bytes = 32GiB` is not
    TOML (a value with a unit is a string). Only for a size or duration setting's line, so the
    hint never repeats another line's text."""
    at = re.search(r"at line (\d+)", str(error))
    lines = text.splitlines()
    if at is None or not 0 < int(at.group(1)) <= len(lines):
        return ""
    line = _UNQUOTED_UNIT.fullmatch(lines[int(at.group(1)) - 1])
    if line is None or line.group(1) not in SIZE_SETTINGS | DURATION_SETTINGS:
        return ""
    return (f"; a value with a unit is a quoted string in TOML: {line.group(1)} = "
            f"\"{line.group(2)}\"")


def read_config_file(path: str, origin: str) -> dict[str, Any]:
    """The settings of the TOML file at `path` (named by `origin`), sizes and durations in
    bytes and seconds; SettingsError naming the file for anything unusable.

    Why TOML: the standard library reads it (no dependency beside vLLM's), and its values are
    typed as written: a string stays a string, where YAML 1.1 turns `no`, `off` or `~` into a
    boolean or nothing without a word. Sizes with a unit are strings (`budget_bytes = "32GiB"`).

    The file is refused when any user may write it: its settings choose the folders and key
    files the engine trusts. A symlink is followed (a Kubernetes ConfigMap is one).
    """
    file = Path(path).expanduser()
    where = f"config file {file}"
    try:
        info = file.stat()
        if not stat.S_ISREG(info.st_mode):
            raise SettingsError(f"{where} (from {origin}) is not a regular file")
        if info.st_mode & stat.S_IWOTH:
            raise SettingsError(f"{where} may be written by any user (mode "
                                f"{stat.S_IMODE(info.st_mode):o}); `chmod o-w` it: its settings "
                                "choose the folders and key files the engine trusts")
        data = file.read_bytes()
    except OSError as e:
        raise SettingsError(f"{where} (from {origin}) cannot be read ({type(e).__name__}: "
                            f"{e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SettingsError(f"{where} is not UTF-8 text (byte {e.start})") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # its message gives line and column, not the text
        raise SettingsError(f"{where} is not valid TOML: {e}{_unquoted_unit_hint(text, e)}"
                            ) from None
    values: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            raise SettingsError(f"{where}: {key!r} is a table ([{key}]); write the settings as "
                                "top-level keys, without a section")
        if key == "config_file":
            raise SettingsError(f"{where}: config_file cannot be set inside a config file (one "
                                f"file, named by {CONFIG_FILE_ENV} or a config_file config key)")
        if key not in FIELDS:
            raise _unknown_key(key, where)
        values[key] = _coerce(key, value, where)
    return values


def format_size(n: int) -> str:
    """`n` bytes in the largest IEC unit that divides it (`32GiB`), else plain bytes."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        factor = SIZE_UNITS[unit.lower()]
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def _logged(name: str, value: Any) -> str:
    """A setting's value as the start-up line shows it: sizes in units (what a person wrote)."""
    if name in SIZE_SETTINGS and isinstance(value, int):
        return format_size(value)
    return repr(value)


def _origins_of(message: str, origins: Mapping[str, str]) -> str:
    """" (grid from config file /x.toml)" for the settings `message` names, so an invalid value
    points at the source it came from."""
    named = [f"{k} from {v}" for k, v in origins.items() if re.search(rf"\b{k}\b", message)]
    return f" ({'; '.join(named)})" if named else ""


def load_settings(extra: Mapping[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None) -> CacheSettings:
    """Merge the config file, environment variables and config keys over the defaults into
    validated settings (PRECEDENCE: a later source wins, key by key).

    Runs at start-up in every process that hosts the connector (and in `vllm serve
    --plugin`'s flag hook and `llm_kwargs`), and says, once per process, which file and
    variables it read, which key a stronger source overrode, and the resulting settings. Values
    are shown for settings and our variables only; a secret variable shows as set, never its
    value, and a file or config key that looks like a secret is refused before anything is
    logged. It does not look at vLLM: each of those entries runs the version guard
    (`compat.require_supported_vllm`) before it loads settings, so this module stays below
    compat.
    """
    if environ is None:
        environ = os.environ
    present = check_environment(environ)
    extra = dict(extra or {})
    keys_where = "the config keys (kv_connector_extra_config)"
    for key in extra:
        if key not in FIELDS:
            raise _unknown_key(key, keys_where)
    env_values: dict[str, Any] = {}
    for name in FIELDS:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            env_values[name] = _parse_env(name, raw)
    explicit = {k: _coerce(k, v, keys_where) for k, v in extra.items()}

    # the file: named by a config key, else by the variable (the stronger source names it)
    if "config_file" in explicit:
        file_setting, origin = explicit["config_file"], "the config_file config key"
    else:
        file_setting, origin = env_values.get("config_file", ""), CONFIG_FILE_ENV
    if not isinstance(file_setting, str):
        raise SettingsError(f"config_file must be a path (a string), got "
                            f"{type(file_setting).__name__}")
    if file_setting != file_setting.strip():
        raise SettingsError(f"config_file has leading or trailing spaces: {file_setting!r}")
    file_path = str(Path(file_setting).expanduser().absolute()) if file_setting else ""
    file_values = read_config_file(file_setting, origin) if file_setting else {}

    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    overridden: list[str] = []
    sources = ((file_values, lambda k: f"config file {file_path}"),
               (env_values, lambda k: ENV_PREFIX + k.upper()),
               (explicit, lambda k: "config key"))
    for source, label in sources:
        for key, value in source.items():
            if key in origins and values[key] != value:
                overridden.append(f"{key} ({origins[key]} < {label(key)})")
            values[key] = value
            origins[key] = label(key)
    try:
        settings = msgspec.convert(values, CacheSettings)
    except msgspec.ValidationError as e:
        raise SettingsError(f"invalid hybridcache setting: {e}{_origins_of(str(e), origins)}"
                            ) from None
    except SettingsError as e:
        raise SettingsError(f"{e}{_origins_of(str(e), origins)}") from None

    read = [f"{k}=<set, not shown>" if k in SECRET_ENV else f"{k}={environ[k]}"
            for k in present]
    changed = [f"{name}={_logged(name, getattr(settings, name))}" for name in FIELDS
               if getattr(settings, name) != getattr(_DEFAULTS, name)]
    file_part = (f"config file {file_path} (from {origin}; keys: "
                 f"{', '.join(sorted(file_values)) or 'none'})" if file_setting
                 else "config file: none")
    _announce(f"hybridcache: {file_part}; {ENV_PREFIX}* variables read: "
              + (", ".join(read) if read else "none")
              + (f"; config keys: {', '.join(sorted(extra))}" if extra else "")
              + f"; precedence: {PRECEDENCE}"
              + (f"; overridden: {', '.join(overridden)}" if overridden else "")
              + f"; settings other than the defaults: {', '.join(changed) or 'none'}")
    return settings


def admin_key(settings: CacheSettings, environ: Mapping[str, str] | None = None) -> str | None:
    """The admin key (docs/security.md), from `admin_key_file` or the `VLLM_HYBRIDCACHE_ADMIN_KEY`
    variable; None when neither is set.

    Read once, by the API server at start-up. A key asked for and not usable stops the start-up
    (SettingsError, naming the file or the variable, never the key): a server that silently ran
    without it would be either locked or open. Both set is refused too (which would win is a
    guess). The file follows the rules of every key file (core/auth.py `load_key_file`: no
    symlink, owned by this user or root, not writable by group or others, a warning when they
    may read it). The key is stripped of surrounding whitespace (a file's last newline), must be
    printable ASCII without spaces (what an HTTP header carries) and at least ADMIN_KEY_MIN
    characters long.
    """
    from vllm_hybridcache.core.auth import KeyFileError, load_key_file

    environ = os.environ if environ is None else environ
    raw_env = environ.get(ADMIN_KEY_ENV, "")
    path = settings.admin_key_file
    if path and raw_env:
        raise SettingsError(f"both {ADMIN_KEY_ENV} and admin_key_file ({path}) are set; set "
                            "one of them")
    if path:
        where = f"admin_key_file {path!r}"
        try:
            data = load_key_file(Path(path))
        except KeyFileError as e:  # its message names the file and the fix, never the key
            raise SettingsError(f"{where}: {e}") from None
        except OSError as e:
            raise SettingsError(f"{where} cannot be read ({type(e).__name__}: {e.strerror})"
                                ) from None
        try:
            raw = data.decode("ascii")
        except UnicodeDecodeError:  # its message would quote the file's bytes
            raise SettingsError(f"the admin key in {where} must be printable ASCII without "
                                "spaces (an HTTP header carries it)") from None
    elif raw_env:
        raw, where = raw_env, ADMIN_KEY_ENV
    else:
        return None
    key = raw.strip()
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise SettingsError(f"the admin key in {where} must be printable ASCII without spaces "
                            "(an HTTP header carries it)")
    if len(key) < ADMIN_KEY_MIN:
        raise SettingsError(f"the admin key in {where} is shorter than {ADMIN_KEY_MIN} "
                            "characters (e.g. `openssl rand -hex 32`)")
    return key


CPU_ATTN_AUTO = "auto"
CPU_ATTN_OFF = "0"
CPU_ATTN_PIN = "1"
CPU_ATTN_KERNEL = "kernel"
CPU_ATTN_SETTINGS = (CPU_ATTN_AUTO, CPU_ATTN_OFF, CPU_ATTN_PIN, CPU_ATTN_KERNEL)


def cpu_attention_setting() -> str:
    """How vLLM's CPU attention is made split-invariant for fine segmentation of vLLM's
    Qwen3-Next on CPU (docs/split-invariance.md), from
    `VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT`:

    - `auto` (or unset, the default): our split-invariant kernel (ops/cpu_attention.py) where
      it applies (compat.split_attention_plan: the CPU platform, vLLM's `vec` KV layout, a
      head size it takes, the kernel built on the host), else vLLM's attention and step mode;
    - `kernel`: the same, and an engine where it does not apply refuses to start;
    - `1`: the pin of vLLM's own kernel (compat.pin_cpu_attention_split; each query piece
      reads the keys again: 1.42x a turn after a 16K context, docs/split-invariance.md);
    - `0`: vLLM's attention as shipped, step mode.

    Any other value raises `SettingsError`, so a typo never silently picks a mode."""
    value = os.environ.get(CPU_ATTN_SPLIT_INVARIANT_ENV, "").strip().lower() or CPU_ATTN_AUTO
    if value not in CPU_ATTN_SETTINGS:
        raise SettingsError(f"{CPU_ATTN_SPLIT_INVARIANT_ENV} must be one of "
                            f"{', '.join(CPU_ATTN_SETTINGS)} (unset = auto), got {value!r}")
    return value


def connector_cache_off(vllm_config: Any) -> str:
    """'' when the engine of `vllm_config` runs the plugin's connector with the snapshot cache
    on, else why not. The `auto` defaults that change what a model computes (the
    split-invariant CPU attention, Flash-Next's split-invariant forward) apply only then, so
    installing the package, or turning the cache off, changes nothing such an engine computes
    (off means off). Reads only the engine's config: the same answer in every process."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if getattr(ktc, "kv_connector", None) != CONNECTOR_NAME:
        return "the engine does not run the hybridcache connector"
    try:
        active = load_settings(getattr(ktc, "kv_connector_extra_config", None)).active
    except SettingsError as e:
        return f"the connector's settings are refused ({e})"
    if not active:
        return "the snapshot cache is off (enabled=false or budget_bytes=0)"
    return ""


def cpu_attention_pinned() -> bool:
    """Whether vLLM's CPU attention is pinned so that a query's arithmetic does not follow its
    prefill step (compat.pin_cpu_attention_split), `VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT=1`
    (`cpu_attention_setting`)."""
    return cpu_attention_setting() == CPU_ATTN_PIN
