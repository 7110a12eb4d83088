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


VLLM_LABELS = frozenset({"model_name", "engine"})
"""vLLM's labels on every series of its logger and of a KV connector's metrics (loggers.py)."""


def plugin_series(stats_module: Any) -> dict[str, frozenset[str]]:
    """Every series the plugin exports (adapter/stats.py), as Prometheus writes them, with the
    labels each carries."""
    base = VLLM_LABELS | {"tier", "kind"}
    out: dict[str, frozenset[str]] = {}
    for n in (*stats_module.COUNTERS, *stats_module.IN_PLACE):
        out[n + "_total"] = base
    for n, _ in (stats_module.MISSES, stats_module.SKIPS, stats_module.CHOICES):
        out[n + "_total"] = base | {"reason"}
    for n in stats_module.GAUGES:
        out[n] = base
    for n in stats_module.HISTOGRAMS:
        out.update({n + "_bucket": base | {"le"}, n + "_sum": base, n + "_count": base})
    return out


def metric_names(stats_module: Any) -> set[str]:
    """Every series name the plugin exports, as Prometheus writes them."""
    return set(plugin_series(stats_module))


_METRIC_CLS = {"_counter_cls": "counter", "_gauge_cls": "gauge", "_histogram_cls": "histogram"}


def vllm_loggers_source() -> Path:
    """vLLM's Prometheus logger in the installed vLLM (found without importing vLLM)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"


def vllm_series(source: str) -> dict[str, frozenset[str]]:
    """Every series vLLM's logger defines (`self._counter_cls(name="vllm:...", labelnames=...)`
    and the gauge and histogram kinds), as Prometheus writes them, with their labels: read from
    the source with `ast`. Raises ValueError for labels it cannot read (a new shape of vLLM's
    code must not pass unread); a metric named at run time is left out."""
    import ast

    tree = ast.parse(source)
    base = None
    consts: dict[str, str] = {}  # self.<attr> = "<label>" (the LoRA info gauge's label names)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = node.targets[0]
        if (isinstance(target, ast.Name) and target.id == "labelnames"
                and isinstance(node.value, ast.List)):
            base = [ast.literal_eval(e) for e in node.value.elts]
        elif (isinstance(target, ast.Attribute) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            consts[target.attr] = node.value.value

    def label(e: ast.expr, name: str) -> str:
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return e.value
        if isinstance(e, ast.Attribute) and e.attr in consts:
            return consts[e.attr]
        raise ValueError(f"cannot read a label of {name}: {ast.unparse(e)}")

    def labels(expr: ast.expr | None, name: str) -> list[str]:
        if expr is None:
            return []
        if isinstance(expr, ast.Name) and expr.id == "labelnames" and base is not None:
            return list(base)
        if isinstance(expr, ast.List):
            return [label(e, name) for e in expr.elts]
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            return labels(expr.left, name) + labels(expr.right, name)
        raise ValueError(f"cannot read the labels of {name}: {ast.unparse(expr)}")

    out: dict[str, frozenset[str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in _METRIC_CLS):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        if not isinstance(kw.get("name"), ast.Constant):
            continue  # an info gauge named at run time (vllm:cache_config_info): not queried
        name = kw["name"].value
        found = frozenset(labels(kw.get("labelnames"), name))
        kind = _METRIC_CLS[node.func.attr]
        if kind == "counter":
            out[name.removesuffix("_total") + "_total"] = found
        elif kind == "gauge":
            out[name] = found
        else:
            out.update({name + "_bucket": found | {"le"}, name + "_sum": found,
                        name + "_count": found})
    return out


def reason_values(stats_module: Any) -> frozenset[str]:
    """The `reason` values the plugin's series take: the miss, skip and hit-choice enums, the
    disk files' problems, and the disk writer's reasons its series' help text names."""
    from vllm_hybridcache.core import ChoiceReason, MissReason, SkipReason
    from vllm_hybridcache.core.linkformat.linkfile import LinkFileProblem

    values = {r.value for e in (MissReason, SkipReason, ChoiceReason, LinkFileProblem)
              for r in e}
    for _, text in (stats_module.MISSES, stats_module.SKIPS):  # "(budget, memory_guard, ..."
        values.update(w.strip() for w in re.split(r"[,;:()]", text)
                      if re.fullmatch(r"[a-z_]+", w.strip()))
    return frozenset(values)


LABELS = {"tier", "kind", "reason", "le", "model_name", "engine"}
DS_VAR = "DS_PROMETHEUS"
DS_REF = "${" + DS_VAR + "}"
_SELECTOR = re.compile(r"(vllm:[A-Za-z0-9_:]+)(?:\{([^}]*)\})?")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard.get("panels", []) for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "datasource":
            continue
        q = var.get("query")
        exprs.append(q.get("query", "") if isinstance(q, dict) else str(q or ""))
    return exprs


def expr_problems(expr: str, exported: dict[str, frozenset[str]],
                  reasons: frozenset[str] | None = None) -> list[str]:
    """One PromQL expression: every metric exported, every label matched or grouped by one
    its metrics carry, every `reason` value one the plugin counts, brackets balanced."""
    out: list[str] = []
    labels: set[str] = set()
    for name, matchers in _SELECTOR.findall(expr):
        if name not in exported:
            out.append(f"{name} is not exported by the plugin or vLLM")
            continue
        labels |= exported[name]
        for label, _, value in _MATCHER.findall(matchers):
            if label not in exported[name]:
                out.append(f"{name} has no label {label!r}")
            elif label == "reason" and reasons is not None:
                for v in value.split("|"):
                    if v not in reasons:
                        out.append(f"{name} never counts reason {v!r}")
    for m in re.finditer(r"label_values\((vllm:[A-Za-z0-9_:]+),\s*([A-Za-z_]+)\)", expr):
        if m.group(1) in exported and m.group(2) not in exported[m.group(1)]:
            out.append(f"{m.group(1)} has no label {m.group(2)!r}")
    for group in re.findall(r"\b(?:by|without) \(([^)]*)\)", expr):
        for label in (g.strip() for g in group.split(",")):
            if label not in (labels or LABELS):  # the labels its metrics carry
                out.append(f"grouping by unknown label {label!r}")
    for a, b in ("()", "[]", "{}"):
        depth = 0
        for c in expr:
            depth += (c == a) - (c == b)
            if depth < 0:
                break
        if depth:
            out.append(f"unbalanced {a}{b} in {expr[:60]!r}")
    return out


def dashboard_problems(dashboard: dict[str, Any], exported: dict[str, frozenset[str]]
                       ) -> list[str]:
    """Every queried metric is one the plugin or vLLM exports, matched and grouped by labels
    it has, filtered by the `model_name` variable; the datasource is the `${DS_PROMETHEUS}`
    variable everywhere (declared for import in `__inputs` and as a datasource variable);
    the dashboard covers hit rate, tokens served, misses, bytes vs budget, both cache
    latencies, and vLLM's TTFT and throughput beside them."""
    out: list[str] = []
    used: set[str] = set()
    for e in _exprs(dashboard):
        out += expr_problems(e, exported)
        used.update(_SELECTOR_NAMES.findall(e))
    for p in dashboard.get("panels", []):
        for t in p.get("targets", []):
            for name, matchers in _SELECTOR.findall(t["expr"]):
                if 'model_name=~"$model_name"' not in matchers:
                    out.append(f"panel {p.get('title')!r}: {name} is not filtered by "
                               "the model_name variable")
    need = {"vllm:hybridcache_hits_total", "vllm:hybridcache_lookups_total",
            "vllm:hybridcache_cached_tokens_total", "vllm:hybridcache_misses_total",
            "vllm:hybridcache_bytes", "vllm:hybridcache_budget_bytes",
            "vllm:hybridcache_restore_seconds_bucket", "vllm:hybridcache_capture_seconds_bucket",
            "vllm:time_to_first_token_seconds_bucket", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total"}
    for name in sorted(need - used):
        out.append(f"no panel queries {name}")
    for p in dashboard.get("panels", []):
        if not p.get("targets"):
            out.append(f"panel {p.get('title')!r} has no query")
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    ds = variables.get(DS_VAR, {})
    if ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        out.append(f"no datasource variable {DS_VAR} of type prometheus")
    if variables.get("model_name", {}).get("type") != "query":
        out.append("no model_name variable")
    inputs = [i for i in dashboard.get("__inputs", []) if i.get("name") == DS_VAR]
    if not inputs or inputs[0].get("pluginId") != "prometheus":
        out.append(f"__inputs does not declare {DS_VAR} (import asks for no datasource)")
    for where, ref in _datasources(dashboard):
        if ref.get("uid") != DS_REF:
            out.append(f"{where}: datasource {ref.get('uid')!r} is not {DS_REF}")
    return out


_SELECTOR_NAMES = re.compile(r"vllm:[A-Za-z0-9_:]+")


def _datasources(node: Any, where: str = "dashboard") -> list[tuple[str, dict[str, Any]]]:
    """Every datasource reference in the dashboard (panels, targets, variables)."""
    found = []
    if isinstance(node, dict):
        ref = node.get("datasource")
        if isinstance(ref, dict):
            found.append((f"{where} {node.get('title') or node.get('name') or ''}".strip(), ref))
        elif isinstance(ref, str):
            found.append((where, {"uid": ref}))
        for k, v in node.items():
            if k != "datasource":
                found += _datasources(v, where)
    elif isinstance(node, list):
        for v in node:
            found += _datasources(v, where)
    return found


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def alert_problems(doc: dict[str, Any], exported: dict[str, frozenset[str]],
                   reasons: frozenset[str], docs: str) -> list[str]:
    """The alert rules: every expression checked like a dashboard's (metrics, labels, reason
    values), every rule with a duration, a severity, a summary, a description and a runbook
    anchor that exists in `docs` (docs/operations.md); the four alerts issue 32 asks for are
    there (hit rate collapse, restore failures, disk writer drops, memory guard refusals)."""
    out: list[str] = []
    anchors = {_slug(line.lstrip("#")) for line in docs.splitlines() if line.startswith("#")}
    rules = [r for g in doc.get("groups", []) for r in g.get("rules", [])]
    if not rules:
        out.append("no alert rules")
    for r in rules:
        name = r.get("alert", "?")
        expr = str(r.get("expr", ""))
        out += [f"{name}: {p}" for p in expr_problems(expr, exported, reasons)]
        if not re.fullmatch(r"\d+[smhd]", str(r.get("for", ""))):
            out.append(f"{name}: no `for` duration")
        if r.get("labels", {}).get("severity") not in ("warning", "critical"):
            out.append(f"{name}: severity is not warning or critical")
        notes = r.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            if not notes.get(key):
                out.append(f"{name}: no {key}")
        runbook = str(notes.get("runbook", ""))
        if "#" in runbook and runbook.split("#", 1)[1] not in anchors:
            out.append(f"{name}: runbook anchor {runbook!r} is not a heading of the docs")
    exprs = [str(r.get("expr", "")) for r in rules]
    wanted = {
        "hit rate collapse": lambda e: "hybridcache_hits_total" in e and "lookups_total" in e,
        "restore failures": lambda e: "hybridcache_restore_failures_total" in e,
        "disk writer drops": lambda e: "capture_skips_total" in e and '"queue_full"' in e,
        "memory guard refusals": lambda e: "capture_skips_total" in e and '"memory_guard"' in e,
    }
    for what, test in wanted.items():
        if not any(test(e) for e in exprs):
            out.append(f"no alert for {what}")
    return out
