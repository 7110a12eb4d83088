"""Worker extensions for the serving tests' servers, and the calls that reach them.

vLLM takes one `--worker-extension-cls`, and the image server needs two: the vision probe
(benchmarks/vision_probe.py: the tower's calls) and the fault injection
(vllm_hybridcache/testing/instrumentation.py: restores corrupted for the negative control).
The worker imports this module by name, so the server needs the repository on its PYTHONPATH
(the image tests' fixture puts it there).
"""

from __future__ import annotations

import requests

from benchmarks.vision_probe import VisionProbe
from vllm_hybridcache.testing.instrumentation import FaultInjection


class VisionProbeAndFaults(VisionProbe, FaultInjection):
    """Both extensions' `collective_rpc` methods in every worker."""


EXTENSION_ARGS = ["--worker-extension-cls",
                  "tests.serving.worker_extensions.VisionProbeAndFaults"]


def _rpc(srv, method: str, args: list[str], headers: dict[str, str]) -> list:
    r = requests.post(srv.base_url + "/collective_rpc", headers=headers, timeout=60,
                      json={"method": method, "args": args})
    assert r.status_code == 200, r.text
    return r.json()["results"]


def corrupt_next_restore(srv, tag: str, headers: dict[str, str]) -> None:
    """Arm every worker: the next restore of the request whose id contains `tag` (send it as
    the body's `request_id`) gets its state corrupted after every check of the bytes passed
    (`instrumentation.RestoreCorruption`), whatever its depth."""
    armed = _rpc(srv, "hybridcache_corrupt_restore", [tag], headers)
    assert armed == [{"armed": True}], armed


def corruption_result(srv, tag: str, headers: dict[str, str]) -> dict | None:
    """What the worker restored for the tagged request (`tier`, `kind`, `tokens`) and whether
    it corrupted it; None when there was no successful restore."""
    (result,) = _rpc(srv, "hybridcache_corruption_result", [tag], headers)
    return result
