"""The front's /metrics: every replica's Prometheus series with a `replica` label, one page.

Each replica's vLLM server exports its own series (vLLM's and the plugin's `vllm:hybridcache_*`)
without knowing it is one of several. The front reads every replica's page, parses it with
prometheus_client's own parser, adds `replica="<name>"` to every sample and renders the families
merged (one HELP/TYPE per family, samples of all replicas under it), with the front's own series
(routing decisions) appended.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

LABEL = "replica"


class _Merged:
    """A collector yielding already-built families (prometheus_client renders them)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge(pages: Mapping[str, str], extra: Iterable[Metric] = ()) -> bytes:
    """One exposition page of `pages` (replica name -> its /metrics text), each sample labelled
    with its replica, plus `extra` families. A page that does not parse is left out (its
    replica's samples are missing rather than the page failing)."""
    families: dict[str, Metric] = {}
    for replica, text in pages.items():
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        for fam in parsed:
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                  fam.unit)
            if out.type != fam.type:  # replicas of different versions: keep the first kind
                continue
            for s in fam.samples:
                out.samples.append(Sample(s.name, {**s.labels, LABEL: replica}, s.value,
                                          s.timestamp, s.exemplar))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged([*families.values(), *extra]))
    return generate_latest(registry)
