"""The compose files for both boxes, the Prometheus config and the Grafana dashboard: parsed
and checked against what the plugin really reads and exports (setting names from config.py,
metric names from adapter/stats.py), with broken copies to show each check can fail."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from tests.deploy.checks import DEPLOY, compose_problems, dashboard_problems, metric_names

BOXES = {"compose.r9700.yaml": "gfx1201", "compose.strix-halo.yaml": "gfx1151"}


@pytest.fixture(scope="module")
def known_env() -> set[str]:
    from vllm_hybridcache import config

    return set(config.KNOWN_ENV)


@pytest.fixture(scope="module")
def exported() -> set[str]:
    from vllm_hybridcache.adapter import stats

    return metric_names(stats)


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
    host budget than the R9700 file, whose VRAM is separate from host RAM."""
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
    assert (budget("compose.strix-halo.yaml"), budget("compose.r9700.yaml")) == (16 << 30,
                                                                                 32 << 30)
    assert name in docs


def test_prometheus_scrapes_vllm_metrics() -> None:
    doc = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = doc["scrape_configs"]
    assert any(j.get("metrics_path", "/metrics") == "/metrics"
               and "vllm:8000" in j["static_configs"][0]["targets"] for j in jobs)


def test_dashboard_queries_only_exported_metrics(exported) -> None:
    dash = json.loads((DEPLOY / "grafana/dashboards/hybridcache.json").read_text())
    assert dashboard_problems(dash, exported) == []
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml")
                        .read_text())
    uids = {d["uid"] for d in ds["datasources"]}
    assert all(p["datasource"]["uid"] in uids for p in dash["panels"])


def test_dashboard_check_catches_unknown_metric_and_label(exported) -> None:
    dash = json.loads((DEPLOY / "grafana/dashboards/hybridcache.json").read_text())
    bad = copy.deepcopy(dash)
    bad["panels"][0]["targets"][0]["expr"] = "sum by (session) (rate(vllm:hybridcache_hit[5m]))"
    problems = dashboard_problems(bad, exported)
    assert any("vllm:hybridcache_hit is not exported" in p for p in problems)
    assert any("unknown label 'session'" in p for p in problems)
    bad["panels"] = [p for p in bad["panels"] if "restore_seconds" not in json.dumps(p)]
    assert any("no panel queries vllm:hybridcache_restore_seconds_bucket" in p
               for p in dashboard_problems(bad, exported))
