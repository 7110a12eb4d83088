"""The compose files for both boxes, the Prometheus config, its alert rules and the Grafana
dashboard: parsed and checked against what the plugin really reads and exports (setting names
from config.py, metric names and labels from adapter/stats.py) and what vLLM exports (its
logger's metric definitions, read from the installed vLLM's source), with broken copies to
show each check can fail."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from tests.deploy.checks import (
    DEPLOY,
    DS_REF,
    ROOT,
    alert_problems,
    compose_problems,
    dashboard_problems,
    metric_names,
    plugin_series,
    reason_values,
    vllm_loggers_source,
    vllm_series,
)

BOXES = {"compose.r9700.yaml": "gfx1201", "compose.strix-halo.yaml": "gfx1151"}


@pytest.fixture(scope="module")
def known_env() -> set[str]:
    from vllm_hybridcache import config

    return set(config.KNOWN_ENV)


@pytest.fixture(scope="module")
def exported() -> dict[str, frozenset[str]]:
    """Every series a server with the plugin exports, with its labels: the plugin's and
    vLLM's own."""
    from vllm_hybridcache.adapter import stats

    ours = plugin_series(stats)
    assert set(ours) == metric_names(stats)
    theirs = vllm_series(vllm_loggers_source().read_text())
    assert not set(ours) & set(theirs)
    return {**theirs, **ours}


@pytest.fixture(scope="module")
def reasons() -> frozenset[str]:
    from vllm_hybridcache.adapter import stats

    return reason_values(stats)


DASHBOARD = DEPLOY / "grafana/dashboards/hybridcache.json"
ALERTS = DEPLOY / "hybridcache-alerts.yml"
OPERATIONS = ROOT / "docs/operations.md"


@pytest.mark.parametrize("name,target", sorted(BOXES.items()))
def test_compose_file(name: str, target: str, known_env) -> None:
    doc = yaml.safe_load((DEPLOY / name).read_text())
    assert compose_problems(doc, target, known_env) == []
    # every file the services mount from deploy/ exists
    for svc in doc["services"].values():
        for vol in svc.get("volumes", []):
            src = str(vol).split(":")[0]
            if src.startswith("./"):
                assert (DEPLOY / src).exists(), f"{name}: {src} missing"


def test_compose_checks_fail_on_broken_files(known_env) -> None:
    doc = yaml.safe_load((DEPLOY / "compose.r9700.yaml").read_text())
    cases = {
        "device /dev/kfd": lambda d: d["services"]["vllm"]["devices"].remove("/dev/kfd"),
        "render GID": lambda d: d["services"]["vllm"].__setitem__("group_add", ["video"]),
        "not gfx1151": None,
        "not a variable the plugin reads": lambda d: d["services"]["vllm"]["environment"]
        .__setitem__("VLLM_HYBRIDCACHE_BUDGET", "1"),
        "settings the plugin refuses": lambda d: d["services"]["vllm"]["environment"]
        .__setitem__("VLLM_HYBRIDCACHE_BUDGET_BYTES", "32G"),
        "HSA_OVERRIDE_GFX_VERSION": lambda d: d["services"]["vllm"]["environment"]
        .__setitem__("HSA_OVERRIDE_GFX_VERSION", "12.0.1"),
        "not pinned": lambda d: d["services"]["grafana"].__setitem__("image",
                                                                     "grafana/grafana"),
        "an admin key written": lambda d: d["services"]["vllm"]["environment"]
        .__setitem__("VLLM_HYBRIDCACHE_ADMIN_KEY", "0123456789abcdef0123"),
        "no admin key": lambda d: d["services"]["vllm"]["environment"]
        .pop("VLLM_HYBRIDCACHE_ADMIN_KEY_FILE"),
        "does not mount the secret": lambda d: d["services"]["vllm"].pop("secrets"),
        "not read from a required variable": lambda d: d["secrets"]["hybridcache_admin_key"]
        .__setitem__("file", "./admin.key"),
        "not on the persistent /cache volume": lambda d: d["services"]["vllm"]["environment"]
        .pop("VLLM_HYBRIDCACHE_DISK_DIR"),
        "not on the /keys volume": lambda d: d["services"]["vllm"]["environment"]
        .__setitem__("VLLM_HYBRIDCACHE_DISK_KEY_FILE", "/cache/links/disk.key"),
        "no volume mounted at /keys": lambda d: d["services"]["vllm"]["volumes"]
        .remove("hybridcache-keys:/keys"),
    }
    for expect, mutate in cases.items():
        d = copy.deepcopy(doc)
        target = "gfx1201"
        if mutate is None:
            target = "gfx1151"
        else:
            mutate(d)
        problems = compose_problems(d, target, known_env)
        assert any(expect in p for p in problems), (expect, problems)


@pytest.mark.parametrize("name", sorted(BOXES))
def test_strix_halo_and_r9700_sizing_differ(name: str) -> None:
    """Unified memory: the Strix Halo file gives vLLM a smaller share and the cache a smaller
    host budget than the R9700 file, whose VRAM is separate from host RAM; both budgets are the
    sizing tool's for their box."""
    docs = {n: yaml.safe_load((DEPLOY / n).read_text()) for n in BOXES}

    def util(n: str) -> float:
        cmd = docs[n]["services"]["vllm"]["command"]
        return float(next(c for c in cmd if c.startswith("--gpu-memory-utilization="))
                     .split("=")[1])

    def budget(n: str) -> int:
        from vllm_hybridcache.config import parse_size

        return parse_size(docs[n]["services"]["vllm"]["environment"]
                          ["VLLM_HYBRIDCACHE_BUDGET_BYTES"])

    assert util("compose.strix-halo.yaml") < util("compose.r9700.yaml")
    assert budget("compose.strix-halo.yaml") < budget("compose.r9700.yaml")
    # the budgets the sizing table gives for these boxes (docs/deploy-rocm.md, "Sizing")
    from vllm_hybridcache.tools.sizing import BOXES as SIZED
    from vllm_hybridcache.tools.sizing import GIB, cache_budget_gib

    assert budget("compose.strix-halo.yaml") == cache_budget_gib(SIZED["strix-halo-128"]) * GIB
    assert budget("compose.r9700.yaml") == cache_budget_gib(SIZED["r9700"]) * GIB
    assert name in docs


def test_prometheus_scrapes_vllm_metrics() -> None:
    doc = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = doc["scrape_configs"]
    assert any(j.get("metrics_path", "/metrics") == "/metrics"
               and "vllm:8000" in j["static_configs"][0]["targets"] for j in jobs)


def test_dashboard_queries_only_exported_metrics(exported) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dashboard_problems(dash, exported) == []
    # provisioned, the datasource variable resolves to the default datasource: the one the
    # compose network's Grafana is given
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml")
                        .read_text())
    assert [d["type"] for d in ds["datasources"] if d.get("isDefault")] == ["prometheus"]
    assert all(p["datasource"]["uid"] == DS_REF for p in dash["panels"])


def test_dashboard_check_catches_unknown_metric_and_label(exported) -> None:
    dash = json.loads(DASHBOARD.read_text())
    bad = copy.deepcopy(dash)
    bad["panels"][0]["targets"][0]["expr"] = "sum by (session) (rate(vllm:hybridcache_hit[5m]))"
    problems = dashboard_problems(bad, exported)
    assert any("vllm:hybridcache_hit is not exported" in p for p in problems)
    assert any("unknown label 'session'" in p for p in problems)
    bad["panels"] = [p for p in bad["panels"] if "restore_seconds" not in json.dumps(p)]
    assert any("no panel queries vllm:hybridcache_restore_seconds_bucket" in p
               for p in dashboard_problems(bad, exported))


def _panel(dash: dict, metric: str) -> dict:
    return next(p for p in dash["panels"] if metric in json.dumps(p))


def test_dashboard_check_catches_vllm_metrics_and_labels_it_does_not_have(exported) -> None:
    """vLLM's series are checked against vLLM's own definitions: a misspelled name, a label
    the metric lacks (the cache's `tier` on vLLM's TTFT), grouping by it."""
    dash = json.loads(DASHBOARD.read_text())
    cases = {
        "vllm:time_to_first_token_second_bucket is not exported":
            lambda e: e.replace("time_to_first_token_seconds_bucket",
                                "time_to_first_token_second_bucket"),
        "vllm:time_to_first_token_seconds_bucket has no label 'tier'":
            lambda e: e.replace('{model_name=~"$model_name"}',
                                '{model_name=~"$model_name", tier="disk"}'),
        "grouping by unknown label 'tier'": lambda e: e.replace("by (le)", "by (le, tier)"),
        "vllm:prompt_tokens_totals is not exported":
            lambda e: e.replace("vllm:prompt_tokens_total", "vllm:prompt_tokens_totals"),
    }
    for expect, mutate in cases.items():
        bad = copy.deepcopy(dash)
        metric = "prompt_tokens_total" if "prompt" in expect else "time_to_first_token"
        for t in _panel(bad, "vllm:" + metric)["targets"]:
            t["expr"] = mutate(t["expr"])
        problems = dashboard_problems(bad, exported)
        assert any(expect in p for p in problems), (expect, problems)
    # the TTFT and throughput panels are required beside the cache's
    for metric in ("vllm:time_to_first_token_seconds_bucket", "vllm:generation_tokens_total"):
        bad = copy.deepcopy(dash)
        bad["panels"] = [p for p in bad["panels"] if metric not in json.dumps(p)]
        assert f"no panel queries {metric}" in dashboard_problems(bad, exported)


def test_dashboard_check_catches_a_fixed_datasource_and_a_missing_model_filter(exported):
    """Importing into another Grafana must not break panels: no datasource uid is written
    in, import asks for one (`__inputs`), and every series is filtered by the model."""
    dash = json.loads(DASHBOARD.read_text())
    bad = copy.deepcopy(dash)
    bad["panels"][3]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "prometheus"}
    assert any("datasource 'prometheus' is not ${DS_PROMETHEUS}" in p
               for p in dashboard_problems(bad, exported))
    bad = copy.deepcopy(dash)
    bad.pop("__inputs")
    assert any("__inputs does not declare" in p for p in dashboard_problems(bad, exported))
    bad = copy.deepcopy(dash)
    bad["templating"]["list"] = [v for v in bad["templating"]["list"]
                                 if v["type"] != "datasource"]
    assert any("no datasource variable" in p for p in dashboard_problems(bad, exported))
    bad = copy.deepcopy(dash)
    t = _panel(bad, "vllm:generation_tokens_total")["targets"][1]
    t["expr"] = t["expr"].replace('{model_name=~"$model_name"}', "")
    assert any("not filtered by the model_name variable" in p
               for p in dashboard_problems(bad, exported))


def test_vllm_series_are_read_from_vllms_source() -> None:
    """The parser reads what the source says (not a list kept here): every metric vLLM's
    logger names literally is found, and a shape it cannot read is an error, never a pass."""
    import re

    source = vllm_loggers_source().read_text()
    series = vllm_series(source)
    for name in set(re.findall(r'name="(vllm:[^"]+)"', source)):
        assert any(s in series for s in (name, name.removesuffix("_total") + "_total",
                                          name + "_bucket")), name
    assert series["vllm:time_to_first_token_seconds_bucket"] == {"model_name", "engine", "le"}
    assert series["vllm:request_success_total"] == {"model_name", "engine", "finished_reason"}
    snippet = ('labelnames = ["model_name", "engine"]\n'
               'x = self._counter_cls(name="vllm:made_up", labelnames=labelnames + ["why"])\n'
               'y = self._histogram_cls(name="vllm:made_up_seconds", labelnames=["a"])\n')
    assert vllm_series(snippet) == {
        "vllm:made_up_total": {"model_name", "engine", "why"},
        "vllm:made_up_seconds_bucket": {"a", "le"}, "vllm:made_up_seconds_sum": {"a"},
        "vllm:made_up_seconds_count": {"a"}}
    with pytest.raises(ValueError, match="cannot read"):
        vllm_series('g = self._gauge_cls(name="vllm:g", labelnames=make_labels())\n')


def test_alert_rules_query_only_exported_metrics(exported, reasons) -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    assert alert_problems(doc, exported, reasons, OPERATIONS.read_text()) == []
    names = [r["alert"] for g in doc["groups"] for r in g["rules"]]
    assert len(names) == len(set(names)) >= 4


def test_alert_check_catches_misspelled_metrics_reasons_and_labels(exported, reasons) -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    docs = OPERATIONS.read_text()

    def rule(d: dict, needle: str) -> dict:
        return next(r for g in d["groups"] for r in g["rules"] if needle in r["expr"])

    cases = {
        "vllm:hybridcache_restore_failure_total is not exported": (
            "restore_failures", lambda r: r.__setitem__("expr", r["expr"].replace(
                "restore_failures_total", "restore_failure_total"))),
        "never counts reason 'queue_ful'": (
            "queue_full", lambda r: r.__setitem__("expr", r["expr"].replace(
                '"queue_full"', '"queue_ful"'))),
        "has no label 'finished_reason'": (
            "memory_guard", lambda r: r.__setitem__("expr", r["expr"].replace(
                'reason="memory_guard"', 'reason="memory_guard", finished_reason="stop"'))),
        "no `for` duration": ("memory_guard", lambda r: r.pop("for")),
        "is not a heading of the docs": ("memory_guard", lambda r: r["annotations"].__setitem__(
            "runbook", "docs/operations.md#no-such-section")),
        "no alert for memory guard refusals": ("memory_guard", lambda r: r.__setitem__(
            "expr", r["expr"].replace("memory_guard", "budget"))),
    }
    for expect, (needle, mutate) in cases.items():
        bad = copy.deepcopy(doc)
        mutate(rule(bad, needle))
        problems = alert_problems(bad, exported, reasons, docs)
        assert any(expect in p for p in problems), (expect, problems)


def test_prometheus_loads_the_alert_rules_the_compose_files_mount() -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (rules,) = prom["rule_files"]
    for name in BOXES:
        doc = yaml.safe_load((DEPLOY / name).read_text())
        mounts = {str(v).split(":")[0]: str(v).split(":")[1]
                  for v in doc["services"]["prometheus"]["volumes"]}
        assert mounts.get("./hybridcache-alerts.yml") == rules, (name, mounts)
        assert (DEPLOY / "hybridcache-alerts.yml").is_file()
