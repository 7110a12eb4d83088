"""Property checks of the deployment files, as functions returning problems (empty: fine).

Why functions: each test runs them on the committed file and on a deliberately broken copy, so
a check that could never fail is caught too. No Docker daemon is needed: the Dockerfile is read
with dockerfile-parse, compose and Prometheus files as YAML, the dashboard as JSON.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile.rocm"
DEPLOY = ROOT / "deploy"
TARGETS = ("gfx1151", "gfx1201")
ENTRYPOINT = ["vllm", "serve", "--plugin", "hybridcache"]


def _instructions(text: str) -> list[dict[str, Any]]:
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(fileobj=__import__("io").BytesIO(text.encode()))
    return [i for i in parser.structure if i["instruction"] != "COMMENT"]


def dockerfile_problems(text: str) -> list[str]:
    """Multi-stage, pinned base by ARG tag, GPU target ARG used for the build and
    PYTORCH_ROCM_ARCH, wheel built and installed, non-root, volumes, healthcheck on /health,
    exec-form entrypoint, RDNA environment."""
    ins = _instructions(text)
    out: list[str] = []
    first_from = next((k for k, i in enumerate(ins) if i["instruction"] == "FROM"), len(ins))
    global_args = {}
    for i in ins[:first_from]:
        if i["instruction"] == "ARG":
            name, _, default = i["value"].partition("=")
            global_args[name.strip()] = default.strip()
    stages: list[list[dict[str, Any]]] = []
    for i in ins[first_from:]:
        if i["instruction"] == "FROM":
            stages.append([])
        stages[-1].append(i)
    if len(stages) < 2:
        out.append(f"{len(stages)} stage(s): expected a build stage and a runtime stage")
    tag = global_args.get("BASE_TAG", "")
    if not tag or tag == "latest" or "$" in tag:
        out.append(f"base image tag ARG BASE_TAG={tag!r} is not a pinned tag")
    if global_args.get("GPU_TARGET") not in TARGETS:
        out.append(f"ARG GPU_TARGET default {global_args.get('GPU_TARGET')!r} not in {TARGETS}")
    for k, st in enumerate(stages):
        if "${BASE_IMAGE}:${BASE_TAG}" not in st[0]["value"]:
            out.append(f"stage {k} FROM {st[0]['value']!r} does not use the pinned base ARGs")
        if not any(i["instruction"] == "ARG" and i["value"].split("=")[0] == "GPU_TARGET"
                   for i in st):
            out.append(f"stage {k} does not declare ARG GPU_TARGET")
        if not any(i["instruction"] == "ENV" and "PYTORCH_ROCM_ARCH=${GPU_TARGET}" in i["value"]
                   for i in st):
            out.append(f"stage {k} does not set PYTORCH_ROCM_ARCH from GPU_TARGET")
    if len(stages) >= 2:
        build, run = stages[0], stages[-1]
        runs = " ".join(i["value"] for i in build if i["instruction"] == "RUN")
        if "csrc_build prebuild" not in runs or "pip wheel" not in runs:
            out.append("the build stage does not build csrc/ and the wheel")
        copies = [i["value"] for i in run if i["instruction"] == "COPY"]
        if not any(c.startswith("--from=") for c in copies):
            out.append("the runtime stage copies nothing from the build stage")
        rruns = " ".join(i["value"] for i in run if i["instruction"] == "RUN")
        if "pip install /wheels/" not in rruns:
            out.append("the runtime stage does not install the wheel")
        users = [i["value"].strip() for i in run if i["instruction"] == "USER"]
        if not users or users[-1].split(":")[0] in ("0", "root"):
            out.append(f"the image runs as root (USER {users[-1] if users else 'unset'})")
        vols = " ".join(i["value"] for i in run if i["instruction"] == "VOLUME")
        for v in ("/models", "/cache", "/keys"):  # /keys: the disk key, apart from the links
            if v not in vols:
                out.append(f"no VOLUME {v}")
        hc = [i["value"] for i in run if i["instruction"] == "HEALTHCHECK"]
        if not hc or "/health" not in hc[-1] or "CMD" not in hc[-1]:
            out.append("no HEALTHCHECK on /health")
        ep = [i["value"].strip() for i in run if i["instruction"] == "ENTRYPOINT"]
        try:
            ep_args = json.loads(ep[-1]) if ep else None
        except json.JSONDecodeError:
            ep_args = None
        if ep_args != ENTRYPOINT:
            out.append(f"ENTRYPOINT is not the exec form {ENTRYPOINT}: {ep[-1] if ep else None}")
        env = " ".join(i["value"] for i in run if i["instruction"] == "ENV")
        if "VLLM_ROCM_USE_AITER=0" not in env:
            out.append("VLLM_ROCM_USE_AITER=0 missing (no AITER on RDNA)")
    for i in ins:
        if i["instruction"] in ("ENV", "ARG") and "HSA_OVERRIDE_GFX_VERSION" in i["value"]:
            out.append("HSA_OVERRIDE_GFX_VERSION is baked into the image")
    return out


def compose_problems(doc: dict[str, Any], target: str, known_env: set[str]) -> list[str]:
    """A ROCm container (devices, groups, IPC/shm), the right GPU target, the plugin's settings
    under names it knows, model and cache volumes, and Prometheus + Grafana wired to it."""
    out: list[str] = []
    services = doc.get("services", {})
    vllm = services.get("vllm", {})
    devices = vllm.get("devices", [])
    for dev in ("/dev/kfd", "/dev/dri"):
        if dev not in devices:
            out.append(f"device {dev} not mapped")
    groups = [str(g) for g in vllm.get("group_add", [])]
    if "video" not in groups or not any("RENDER_GID" in g for g in groups):
        out.append(f"group_add {groups} lacks video and the host's render GID")
    if vllm.get("ipc") != "host" and not vllm.get("shm_size"):
        out.append("no shared memory (ipc: host or shm_size)")
    args = vllm.get("build", {}).get("args", {})
    if args.get("GPU_TARGET") != target or not str(vllm.get("image", "")).endswith(target):
        out.append(f"image/build target is not {target}: {vllm.get('image')}, {args}")
    if vllm.get("build", {}).get("dockerfile") != "Dockerfile.rocm":
        out.append("not built from Dockerfile.rocm")
    env = {str(k): str(v) for k, v in (vllm.get("environment") or {}).items()}
    if env.get("VLLM_ROCM_USE_AITER") != "0":
        out.append("VLLM_ROCM_USE_AITER is not 0")
    if "HSA_OVERRIDE_GFX_VERSION" in env:
        out.append("HSA_OVERRIDE_GFX_VERSION set in the compose file")
    for k in env:
        if k.startswith("VLLM_HYBRIDCACHE_") and k not in known_env:
            out.append(f"{k} is not a variable the plugin reads")
    if not any(k.startswith("VLLM_HYBRIDCACHE_BUDGET_BYTES") for k in env):
        out.append("no cache budget sized for the box")
    out += settings_problems({k: v for k, v in env.items() if k in known_env})
    cmd = [str(c) for c in vllm.get("command", [])]
    if not cmd or "MODEL" not in cmd[0]:
        out.append(f"command does not start with the model: {cmd[:1]}")
    if not any(c.startswith("--gpu-memory-utilization=") for c in cmd):
        out.append("no --gpu-memory-utilization for the box")
    vols = " ".join(str(v) for v in vllm.get("volumes", []))
    for v in (":/models", ":/cache", ":/keys"):
        if v not in vols:
            out.append(f"no volume mounted at {v[1:]}")
    env = vllm.get("environment", {})
    disk_dir, key_file = env.get("VLLM_HYBRIDCACHE_DISK_DIR", ""), env.get(
        "VLLM_HYBRIDCACHE_DISK_KEY_FILE", "")
    if not str(disk_dir).startswith("/cache/"):
        out.append("the disk tier's folder is not on the persistent /cache volume")
    if not str(key_file).startswith("/keys/"):
        out.append("the disk key is not on the /keys volume (apart from the links)")
    prom = services.get("prometheus", {})
    if not any("prometheus.yml" in str(v) for v in prom.get("volumes", [])):
        out.append("Prometheus does not get deploy/prometheus.yml")
    graf = services.get("grafana", {})
    if not any("dashboards" in str(v) for v in graf.get("volumes", [])):
        out.append("Grafana does not get the dashboards")
    for svc in services.values():
        image = str(svc.get("image", ""))
        if ":" not in image or image.endswith(":latest"):
            out.append(f"image {image!r} not pinned by tag")
    out += admin_key_problems(doc)
    return out


def settings_problems(env: dict[str, str]) -> list[str]:
    """The plugin's variables as the engine reads them (sizes with units, `32GiB`): a value
    the settings loader refuses would stop every start of the container."""
    from vllm_hybridcache.config import SettingsError, load_settings

    try:
        load_settings(environ=env)
    except SettingsError as e:
        return [f"settings the plugin refuses: {e}"]
    return []


def admin_key_problems(doc: dict[str, Any]) -> list[str]:
    """The cache's admin key (issue 29): read from a compose secret's file through
    VLLM_HYBRIDCACHE_ADMIN_KEY_FILE, the secret's file a variable the operator must set
    (`${VAR:?...}`: compose refuses to start without it), and no key written in the file."""
    out: list[str] = []
    vllm = doc.get("services", {}).get("vllm", {})
    env = {str(k): str(v) for k, v in (vllm.get("environment") or {}).items()}
    if "VLLM_HYBRIDCACHE_ADMIN_KEY" in env:
        out.append("an admin key written in the compose file (VLLM_HYBRIDCACHE_ADMIN_KEY)")
    path = env.get("VLLM_HYBRIDCACHE_ADMIN_KEY_FILE", "")
    name = path.removeprefix("/run/secrets/") if path.startswith("/run/secrets/") else None
    if name is None:
        out.append("no admin key: VLLM_HYBRIDCACHE_ADMIN_KEY_FILE is not a /run/secrets/ file")
        return out
    if name not in [str(x) for x in vllm.get("secrets", [])]:
        out.append(f"the vllm service does not mount the secret {name!r}")
    source = str((doc.get("secrets") or {}).get(name, {}).get("file", ""))
    if not re.fullmatch(r"\$\{[A-Z0-9_]+:\?[^}]+\}", source):
        out.append(f"the secret {name!r} is not read from a required variable: {source!r}")
    return out


def metric_names(stats_module: Any) -> set[str]:
    """Every series name the plugin exports, as Prometheus writes them."""
    names: set[str] = set()
    for n in stats_module.COUNTERS:
        names.add(n + "_total")
    for n, _ in (stats_module.MISSES, stats_module.SKIPS):
        names.add(n + "_total")
    names.update(stats_module.GAUGES)
    for n in stats_module.HISTOGRAMS:
        names.update({n + "_bucket", n + "_sum", n + "_count"})
    return names


LABELS = {"tier", "kind", "reason", "le", "model_name", "engine"}


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard.get("panels", []) for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        q = var.get("query")
        exprs.append(q.get("query", "") if isinstance(q, dict) else str(q or ""))
    return exprs


def dashboard_problems(dashboard: dict[str, Any], exported: set[str]) -> list[str]:
    """Every queried metric is one the plugin exports, grouped by labels it has, and the
    dashboard covers hit rate, tokens served, misses, bytes vs budget and both latencies."""
    out: list[str] = []
    used: set[str] = set()
    for e in _exprs(dashboard):
        for name in re.findall(r"vllm:[A-Za-z0-9_:]+", e):
            used.add(name)
            if name not in exported:
                out.append(f"{name} is not exported by the plugin")
        for group in re.findall(r"\bby \(([^)]*)\)", e):
            for label in (g.strip() for g in group.split(",")):
                if label not in LABELS:
                    out.append(f"grouping by unknown label {label!r}")
    need = {"vllm:hybridcache_hits_total", "vllm:hybridcache_lookups_total",
            "vllm:hybridcache_cached_tokens_total", "vllm:hybridcache_misses_total",
            "vllm:hybridcache_bytes", "vllm:hybridcache_budget_bytes",
            "vllm:hybridcache_restore_seconds_bucket", "vllm:hybridcache_capture_seconds_bucket"}
    for name in sorted(need - used):
        out.append(f"no panel queries {name}")
    for p in dashboard.get("panels", []):
        if not p.get("targets"):
            out.append(f"panel {p.get('title')!r} has no query")
    return out
