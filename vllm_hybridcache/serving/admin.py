"""Who may clear and read the cache over HTTP (docs/security.md, "Who can clear and read the
cache").

vLLM's `--api-key` (or `VLLM_API_KEY`) is one key shared by every API user, and its middleware
checks it on every `/v1` route in `Authorization: Bearer`. That key cannot tell an operator from
a tenant, so the routes that act on every tenant's links ask for a second credential, the admin
key (`config.admin_key`: `admin_key_file` or `VLLM_HYBRIDCACHE_ADMIN_KEY`), in a header of its
own, `X-Hybridcache-Admin-Key`: a request then carries both, the API key for vLLM's middleware
and the admin key for these routes.

- A server with any credential (an API key, an admin key or both) is *guarded*: clearing every
  tenant's links, or the links of requests without a salt (`"cache_salt": ""`: a cache every
  unsalted client shares), needs the admin key; a tenant clears its own links by naming its
  salt (`{"cache_salt": "<salt>"}` in the body, never in the URL, which access logs keep: the
  salt is the tenant's secret, and whoever holds it is that tenant for the cache already).
  With an API key but no admin key, nobody can clear every tenant's links over HTTP.
- A server with neither is *open*, by its operator's choice: anyone who reaches the port may
  clear, and the server says so in a warning at start-up.
- A request that presents a wrong admin key is refused (403), whatever it asks: a typo must not
  silently run with less.

Keys are compared with `hmac.compare_digest` on their SHA-256 digests (no timing signal of
where two keys differ, nor of their lengths).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger("vllm_hybridcache")

ADMIN_HEADER = "X-Hybridcache-Admin-Key"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class Access:
    """The credentials a server was started with (never the keys themselves in clear: the
    admin key is kept as its digest, so a repr or a log line cannot show it)."""

    api_key: bool  # vLLM's middleware guards /v1 (--api-key or VLLM_API_KEY)
    admin_digest: bytes | None  # SHA-256 of the admin key; None: no admin key

    @classmethod
    def of(cls, api_key: bool, admin_key: str | None) -> Access:
        return cls(api_key, None if admin_key is None else _digest(admin_key))

    @property
    def open(self) -> bool:
        """No credential at all: anyone may clear (the operator's choice; warned at start)."""
        return not self.api_key and self.admin_digest is None

    def admin(self, headers: Mapping[str, str]) -> bool | None:
        """Whether the request is the admin's: True (the admin key presented, or an open
        server), False (no admin key presented), None (a wrong one presented: refuse)."""
        presented = headers.get(ADMIN_HEADER)
        if presented is None:
            return self.open
        if self.admin_digest is None:
            return None  # a key is presented to a server that has none: say so, refuse
        return True if hmac.compare_digest(_digest(presented), self.admin_digest) else None


def api_key_set(args) -> bool:
    """Whether vLLM guards /v1 with an API key, as vLLM decides it
    (entrypoints/serve/middleware/register.py: `--api-key`, else `VLLM_API_KEY`)."""
    keys = list(getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")])
    return any(keys)


def startup_warnings(access: Access, dev_mode: bool) -> list[str]:
    """What the server says at start-up about who may clear the cache."""
    out = []
    if access.open:
        out.append("hybridcache: POST /v1/cache/clear is open to anyone who reaches this "
                   "port: the server has neither --api-key nor an admin key "
                   "(VLLM_HYBRIDCACHE_ADMIN_KEY or admin_key_file; docs/security.md)")
    elif access.admin_digest is None:
        out.append("hybridcache: no admin key (VLLM_HYBRIDCACHE_ADMIN_KEY or admin_key_file): "
                   "POST /v1/cache/clear of every tenant's links is refused; a tenant may "
                   "still clear its own ({\"cache_salt\": ...} in the body)")
    if dev_mode:
        out.append("hybridcache: VLLM_SERVER_DEV_MODE is set: vLLM's POST "
                   "/reset_prefix_cache?reset_external=true clears every tenant's links "
                   "without any credential (a development route, outside /v1)")
    return out
