"""The cluster tier's worker handler: publishes committed links to the other replicas.

Executes the `ClusterOps` of each plan (core/tiers/cluster_behind.py) with a Publisher
(cluster/engine.py), started on the first plan (Ray is imported only then). Publications run
after the step's captures and before its drops, so the buffers are alive; a dropped link is
withdrawn. A publisher that cannot start (e.g. the secret file is unreadable here) is logged
once and costs only reuse: the links stay local.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from vllm_hybridcache.core.store import MissingLinkError
from vllm_hybridcache.core.tiers.handler import TierHandler

__all__ = ["ClusterHandler"]

logger = logging.getLogger("vllm_hybridcache")


class ClusterHandler(TierHandler):
    def __init__(self, store: Any, between_steps: threading.Event) -> None:
        super().__init__(store, between_steps)
        self.publisher = None
        self.off = False  # the publisher could not start here: links stay local

    def start(self, ops: Any) -> None:
        if self.publisher is not None or self.off:
            return
        from vllm_hybridcache.cluster.engine import Publisher

        try:
            self.publisher = Publisher(ops.target, self.rank)  # this rank's shard
        except Exception as e:  # e.g. the secret file is unreadable here: serve on
            logger.warning("hybridcache: cluster publishing off in this worker: %s: %s",
                           type(e).__name__, e)
            self.off = True
        else:
            atexit.register(self.publisher.close)

    def after_captures(self, ops: Any) -> None:
        if self.publisher is None:  # off, or its start failed
            return
        for job in ops.publish:
            if self.store.has(job.link_id):
                try:
                    bufs = self.store.buffers(job.link_id)
                except MissingLinkError as e:  # a promoted disk link whose state failed
                    logger.warning("hybridcache: link %d not published: %s", job.link_id, e)
                    continue
                self.publisher.publish(job, {**bufs.sections, **bufs.views})

    def dropped(self, link_ids: list[int]) -> None:
        if self.publisher is not None:
            self.publisher.dropped(link_ids)
