"""The cluster tier's transport on Ray: a directory actor and payloads in Ray's object store.

The cluster tier's logic (what to publish, how a remote link is verified, why a lookup missed)
is in core/tiers/cluster.py and imports no Ray; this package is the one place that talks to
Ray. See docs/cluster.md.
"""

from .directory import DIRECTORY_NAME, NAMESPACE, DirectoryClient, DirectoryRefused
from .transport import RayTransport

__all__ = ["DIRECTORY_NAME", "NAMESPACE", "DirectoryClient", "DirectoryRefused", "RayTransport"]
