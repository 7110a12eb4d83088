"""What a tier that outlives the engine needs to know about the engine's identity.

The fingerprint itself is computed above the core, from vLLM's config and the checkpoint's
files (adapter/fingerprint.py); the tiers that key their links by it (disk, cluster) only call
the function the composition root hands them, and catch this error when there is none. It
lives here, below both, so a tier's opener never imports the adapter for it.
"""

from __future__ import annotations

__all__ = ["FingerprintUnavailable"]


class FingerprintUnavailable(RuntimeError):
    """This engine's arithmetic cannot be named: its weights could not be found and hashed,
    or a setting that changes the arithmetic could not be put into canonical form.

    The callers (the disk tier in `adapter.disk_setup.open_disk`, the cluster tier in
    `cluster.engine.open_cluster_tier`) log one warning with `reason` and run without that
    tier: links that outlive the engine are only safe between engines known to compute the
    same bytes, and a guess (the model's name) is not knowing.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
