"""`vllm-hybridcache cache stats|clear URL`: a running server's `/v1/cache/*` routes from a shell.

Why a command rather than curl: the routes need up to two credentials in two headers (vLLM's
API key in `Authorization: Bearer`, the plugin's admin key in `X-Hybridcache-Admin-Key`), a
tenant's clear carries its salt in a JSON body (never in the URL, which access logs keep), and
the stats answer is a nested JSON of counters per tier and kind; the command sends what the
routes expect (serving/http.py, serving/admin.py), prints the figures readably (or `--json`),
and turns every refusal into a message that says which credential is missing, with an exit
code a script can test:

    0  done
    1  the server answered with an error (401, 403, 400, 404, 5xx): the message says why
    2  a usage error (arguments, an unusable key file)
    3  the server cannot be reached (refused, timed out, no such host)

Credentials come from the flags or from the variables the server reads itself: `--api-key` or
`VLLM_API_KEY` (vLLM's), `--admin-key-file` or `VLLM_HYBRIDCACHE_ADMIN_KEY_FILE`, else
`VLLM_HYBRIDCACHE_ADMIN_KEY`. The admin key is read and checked by the server's own reader
(config.admin_key: the same file rules and the same key rules), so a key this command accepts
is one the server could have been started with. Plain HTTP only, from the standard library:
no client package is needed beside the plugin.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from vllm_hybridcache.config import setting_env
from vllm_hybridcache.serving.admin import ADMIN_HEADER
from vllm_hybridcache.units import human_bytes

__all__ = ["EXIT_ERROR", "EXIT_UNREACHABLE", "EXIT_USAGE", "add_parser", "render_stats"]

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
ADMIN_KEY_FILE_ENV = setting_env("admin_key_file")


class CommandError(Exception):
    """A failure with its exit code and the message to print."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def base_url(url: str) -> str:
    """`http://host:port` of a server given as `host:port`, `http://host:port/` or with `/v1`
    (the routes are added here)."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CommandError(EXIT_USAGE, f"{url!r} is not a server URL (http://host:port)")
    if parts.query or parts.fragment:
        raise CommandError(EXIT_USAGE, f"{url!r}: give the server's URL without a query "
                           "(a cache_salt goes in the body: --cache-salt)")
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _admin_key(args: argparse.Namespace) -> str | None:
    """The admin key, read like the server reads it (config.admin_key); None without one."""
    from vllm_hybridcache.config import ADMIN_KEY_ENV, CacheSettings, SettingsError, admin_key

    path = args.admin_key_file or os.environ.get(ADMIN_KEY_FILE_ENV, "")
    # a file (flag or variable) wins over the key variable: an explicit choice is not refused
    # for a variable left in the environment
    environ = {} if path else {ADMIN_KEY_ENV: os.environ.get(ADMIN_KEY_ENV, "")}
    try:
        return admin_key(CacheSettings(admin_key_file=path), environ)
    except SettingsError as e:
        raise CommandError(EXIT_USAGE, str(e)) from None


def _headers(args: argparse.Namespace) -> dict[str, str]:
    out = {"Accept": "application/json"}
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or ""
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    admin = _admin_key(args)
    if admin is not None:
        out[ADMIN_HEADER] = admin
    return out


def _explain(status: int, error: str, headers: dict[str, str], route: str) -> str:
    """What a refusal means for the person who typed the command."""
    if status == 401:
        has = "Authorization" in headers
        return ("the server refused vLLM's API key (401): " + (
            "the key given is not one of the server's --api-key keys" if has else
            "it was started with --api-key; give it with --api-key KEY or VLLM_API_KEY"))
    if status == 403:
        hint = ""
        if ADMIN_HEADER not in headers:
            hint = (" Give the admin key with --admin-key-file FILE (or "
                    f"{ADMIN_KEY_FILE_ENV} / VLLM_HYBRIDCACHE_ADMIN_KEY).")
        return f"the server refused (403): {error}.{hint}"
    if status == 404:
        return (f"{route}: not found (404): is the plugin's HTTP endpoint loaded on this server "
                "(vllm serve --plugin hybridcache; docs/usage.md)?")
    return f"the server answered {status}: {error}"


def call(method: str, url: str, route: str, *, headers: dict[str, str],
         params: dict[str, str] | None = None, body: dict[str, Any] | None = None,
         timeout: float = 30.0) -> dict[str, Any]:
    """One request to `url` + `route`; the JSON answer, or CommandError with its exit code."""
    full = url + route + (f"?{urllib.parse.urlencode(params)}" if params else "")
    data = None
    headers = dict(headers)
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(full, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        text = e.read().decode("utf-8", "replace")
        try:
            error = json.loads(text).get("error", text)
        except (ValueError, AttributeError):
            error = text
        if isinstance(error, dict):  # vLLM's own errors: {"error": {"message": ...}}
            error = error.get("message", json.dumps(error))
        raise CommandError(EXIT_ERROR, _explain(e.code, str(error).strip(), headers, route)
                           ) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise CommandError(EXIT_UNREACHABLE, f"cannot reach {url} ({reason}): is the server "
                           "running, and is this its http://host:port?") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise CommandError(EXIT_ERROR, f"{route} answered something that is not JSON: "
                           f"{raw[:200]!r}") from None


def _pct(num: float, den: float) -> str:
    return f"{100 * num / den:.1f}%" if den else "-"


def _reasons(counts: dict[str, int] | None) -> str:
    items = sorted(((k, v) for k, v in (counts or {}).items() if v), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v}" for k, v in items)


def render_stats(stats: dict[str, Any]) -> str:
    """The `/v1/cache/stats` answer as a few readable lines: per tier and kind what is held,
    what was served, misses and skipped captures by reason."""
    lines = []
    modes = stats.get("segmentation") or {}
    mode = ", ".join(f"engine {k} {v}" for k, v in sorted(modes.items())) or "unknown"
    lines.append(f"engines: {stats.get('engines', 0)} (segmentation: {mode})")
    tiers = stats.get("tiers") or {}
    if not tiers:
        lines.append("no stats yet (the engines send theirs with their first steps)")
        return "\n".join(lines)
    head = (f"{'tier':8s} {'kind':7s} {'links':>8s} {'held':>10s} {'budget':>10s} "
            f"{'lookups':>9s} {'hits':>8s} {'tokens served':>14s}")
    lines += ["", head]
    for tier in sorted(tiers):
        for kind, st in sorted((tiers[tier].get("kinds") or {}).items()):
            lines.append(
                f"{tier:8s} {kind:7s} {st.get('links', 0):8d} "
                f"{human_bytes(st.get('bytes_held', 0)):>10s} "
                f"{human_bytes(st.get('budget_bytes', 0)):>10s} {st.get('lookups', 0):9d} "
                f"{st.get('hits', 0):8d} {st.get('tokens_served', 0):14d}")
    lines.append("")
    for tier in sorted(tiers):
        t = tiers[tier]
        hits, lookups = t.get("hits", 0), t.get("lookups", 0)
        served, prompt = t.get("tokens_served", 0), t.get("prompt_tokens", 0)
        lines.append(
            f"{tier}: hit rate {_pct(hits, lookups)} of {lookups} lookups; "
            f"{_pct(served, prompt)} of {prompt} prompt tokens served; "
            f"{t.get('restores_failed', 0)} restores failed; {t.get('evictions', 0)} evictions")
    for title, key in (("misses", "misses"), ("capture skips", "skips")):
        rows = [(tier, kind, _reasons(st.get(key)))
                for tier in sorted(tiers)
                for kind, st in sorted((tiers[tier].get("kinds") or {}).items())]
        rows = [r for r in rows if r[2]]
        if rows:
            lines.append(f"{title} by reason:")
            lines += [f"  {tier}/{kind}: {text}" for tier, kind, text in rows]
    domains = [(f"{tier}/{kind}", st["domains"]) for tier in sorted(tiers)
               for kind, st in sorted((tiers[tier].get("kinds") or {}).items())
               if "domains" in st]
    if domains:
        lines.append("domains holding links (admin only): "
                     + ", ".join(f"{where} {n}" for where, n in domains))
    return "\n".join(lines)


def _salt(args: argparse.Namespace) -> str | None:
    """The tenant's salt: `--cache-salt`, or `--cache-salt-file` (`-`: stdin), which keeps the
    salt, the tenant's secret, off the command line (`ps`, shell history)."""
    if args.cache_salt_file is None:
        return args.cache_salt
    try:
        if args.cache_salt_file == "-":
            text = sys.stdin.read()
        else:
            with open(args.cache_salt_file, encoding="utf-8") as f:
                text = f.read()
    except OSError as e:
        raise CommandError(EXIT_USAGE, f"--cache-salt-file {args.cache_salt_file}: "
                           f"{e.strerror}") from None
    return text.rstrip("\r\n")


def _stats(args: argparse.Namespace) -> int:
    url = base_url(args.url)
    answer = call("GET", url, "/v1/cache/stats", headers=_headers(args), timeout=args.timeout)
    print(json.dumps(answer, indent=2, sort_keys=True) if args.json else render_stats(answer))
    return 0


def _clear(args: argparse.Namespace) -> int:
    url = base_url(args.url)
    salt = _salt(args)
    body = None if salt is None else {"cache_salt": salt}
    answer = call("POST", url, "/v1/cache/clear", headers=_headers(args),
                  params={"tier": args.tier, "kind": args.kind}, body=body,
                  timeout=args.timeout)
    if args.json:
        print(json.dumps(answer, indent=2, sort_keys=True))
    else:
        whose = "one tenant's" if answer.get("tenant") else "every tenant's"
        print(f"cleared {answer.get('links', 0)} links ({whose}; tier {answer.get('tier')}, "
              f"kind {answer.get('kind')}; the engines have: "
              f"{', '.join(answer.get('tiers', [])) or 'none'})")
    return 0


def _run(func):
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except CommandError as e:
            print(f"vllm-hybridcache cache: error: {e}", file=sys.stderr)
            return e.code
    return run


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`cache stats|clear` under the `vllm-hybridcache` command."""
    p = sub.add_parser("cache", help="a running server's cache: stats, clear (live routes)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = p.add_subparsers(dest="cache_cmd", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("url", help="the server, e.g. http://localhost:8000")
        q.add_argument("--api-key", default=None,
                       help="vLLM's API key (default: $VLLM_API_KEY; the variable keeps it "
                            "out of `ps`)")
        q.add_argument("--admin-key-file", default=None,
                       help=f"the admin key's file (default: ${ADMIN_KEY_FILE_ENV}, else the "
                            "key in $VLLM_HYBRIDCACHE_ADMIN_KEY)")
        q.add_argument("--json", action="store_true", help="print the server's JSON answer")
        q.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")

    q = cmds.add_parser("stats", help="what each tier holds and served (GET /v1/cache/stats)")
    common(q)
    q.set_defaults(func=_run(_stats))
    q = cmds.add_parser("clear", help="drop links (POST /v1/cache/clear)")
    common(q)
    q.add_argument("--tier", default="all", help="ram, disk, cluster or all (default)")
    q.add_argument("--kind", default="all", help="tree, anchor or all (default)")
    salt = q.add_mutually_exclusive_group()
    salt.add_argument("--cache-salt", default=None,
                      help="only this tenant's links (sent in the body, never in the URL; "
                           "\"\" = the requests without a salt, which needs the admin key)")
    salt.add_argument("--cache-salt-file", default=None,
                      help="the tenant's salt from a file (- = stdin), off the command line")
    q.set_defaults(func=_run(_clear))
