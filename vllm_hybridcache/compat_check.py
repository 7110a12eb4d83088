"""Check `compat`'s bends against a vLLM release's source, without importing it.

Run: `python -m vllm_hybridcache.compat_check 0.33.0` (downloads the release's wheel, once,
with `pip download --no-deps` into the wheel cache, and reads its Python files), or
`--root DIR` for an unpacked `vllm` source tree.

Why one module over ~500 lines: the AST checker and the list of every check it runs against a
vLLM release are read together when a bend is added or a release is checked.
"""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hybridcache.config import HOME_ENV


class WheelUnavailable(RuntimeError):
    """pip could not get the wheel (no network and not in any local index or cache)."""


def wheel_cache() -> Path:
    """Where downloaded wheels are kept: $VLLM_HYBRIDCACHE_HOME/wheels, else the XDG cache."""
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env).expanduser() / "wheels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "vllm-hybridcache" / "wheels"


def fetch_wheel(requirement: str, folder: Path | None = None) -> Path:
    """The wheel for `requirement` (`name==version`, for this platform, no dependencies).

    Found in `folder` (the wheel cache by default) from an earlier call, else fetched with
    `pip download` and pip's own configuration (its index, find-links and cache). Raises
    WheelUnavailable with pip's last lines when neither has it.
    """
    name, sep, version = requirement.partition("==")
    if not sep or not version:
        raise ValueError(f"expected name==version, got {requirement!r}")
    folder = folder or wheel_cache()
    folder.mkdir(parents=True, exist_ok=True)
    prefix = f"{name.replace('-', '_').lower()}-{version}-"

    def found() -> list[Path]:
        return sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix))

    if not found():
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                              "--only-binary=:all:", "--disable-pip-version-check", "-q",
                              "-d", str(folder), requirement],
                             capture_output=True, text=True, timeout=1800, check=False)
        if res.returncode != 0 or not found():
            tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-5:])
            raise WheelUnavailable(f"`pip download --no-deps {requirement}` found no wheel "
                                   f"(no network, and no local index or cache has it):\n{tail}")
    return found()[0]


# --------------------------------------------------------------------- reading a source tree


def installed_tree() -> Path:
    """The installed `vllm` package's folder (found, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("vLLM is not installed")
    return Path(spec.origin).parent


def wheel_tree(version: str, folder: Path | None = None) -> Path:
    """The `vllm` package folder of vLLM `version`'s wheel: its Python files only, unpacked
    once next to the wheel (the wheel is a CUDA build: nothing in it is imported)."""
    import zipfile

    wheel = fetch_wheel(f"vllm=={version}", folder)
    out = wheel.with_name(wheel.name.removesuffix(".whl") + "-py")
    done = out / ".complete"
    if not done.exists():
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if member.startswith("vllm/") and member.endswith(".py"):
                    z.extract(member, out)
        done.write_text(wheel.name + "\n")
    return out / "vllm"


class SourceTree:
    """A `vllm` package folder, parsed with `ast` on demand (never imported)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._modules: dict[str, tuple[str, ast.Module] | None] = {}

    def module(self, name: str) -> tuple[str, ast.Module] | None:
        """(source, tree) of module `name` (`vllm.a.b`), None when the tree has no such file."""
        if name not in self._modules:
            parts = name.split(".")[1:]
            candidates = [self.root.joinpath(*parts).with_suffix(".py"),
                          self.root.joinpath(*parts, "__init__.py")] if parts else [
                              self.root / "__init__.py"]
            path = next((p for p in candidates if p.is_file()), None)
            if path is None:
                self._modules[name] = None
            else:
                text = path.read_text(encoding="utf-8", errors="replace")
                self._modules[name] = (text, ast.parse(text))
        return self._modules[name]

    def find(self, module: str | tuple[str, ...], qualname: str
             ) -> tuple[str, ast.AST | None, str]:
        """(module found, node, source) of `qualname` in the first of `module` that has it;
        node None when absent. An empty qualname is the whole module."""
        for name in (module,) if isinstance(module, str) else module:
            found = self.module(name)
            if found is None:
                continue
            text, tree = found
            node: ast.AST | None = tree
            for part in qualname.split(".") if qualname else ():
                node = _child(node, part)
                if node is None:
                    break
            if node is not None:
                return name, node, text
        return (module if isinstance(module, str) else module[0]), None, ""


def _children(node: ast.AST) -> list[ast.AST]:
    """Direct definitions of a module or class body, looking into `if`/`try` blocks at that
    level (e.g. `FlexibleArgumentParser` defines methods under `if sys.version_info ...`)."""
    out: list[ast.AST] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.If, ast.Try)):
            out += _children(child)
        else:
            out.append(child)
    return out


def _child(node: ast.AST, name: str) -> ast.AST | None:
    found = None
    for child in _children(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if child.name == name:
                found = child
        elif isinstance(child, (ast.Assign, ast.AnnAssign)):
            targets = child.targets if isinstance(child, ast.Assign) else [child.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found = child
        elif isinstance(child, (ast.ImportFrom, ast.Import)):
            if any((a.asname or a.name.split(".")[-1]) == name for a in child.names):
                found = child
    return found


def _without_docstring(node: ast.AST) -> ast.AST:
    body = getattr(node, "body", None)
    if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
            and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        fields = {f: getattr(node, f) for f in node._fields}
        return type(node)(**{**fields, "body": body[1:]})
    return node


def digest(node: ast.AST) -> str:
    """What a definition does, not how it is written: its AST without docstring, comments,
    formatting or line numbers, hashed (16 hex digits of SHA-256)."""
    dumped = ast.dump(_without_docstring(node), include_attributes=False)
    return hashlib.sha256(dumped.encode()).hexdigest()[:16]


def _signature(node: ast.AST) -> str:
    args = node.args  # type: ignore[attr-defined]
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parts = [a.arg if d is None else f"{a.arg}={ast.unparse(d)}"
             for a, d in zip(positional, defaults, strict=True)]
    if args.vararg is not None:
        parts.append("*" + args.vararg.arg)
    elif args.kwonlyargs:
        parts.append("*")
    parts += [a.arg if d is None else f"{a.arg}={ast.unparse(d)}"
              for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg is not None:
        parts.append("**" + args.kwarg.arg)
    return ", ".join(parts)


def _flat(text: str) -> str:
    return " ".join(text.split())


# --------------------------------------------------------------------- what a bend assumes


@dataclass(frozen=True)
class Check:
    """One assumption of a bend about vLLM's source (see the constructors below)."""

    kind: str
    module: str | tuple[str, ...]
    qualname: str
    arg: Any = None
    count: int | None = None
    optional: bool = False
    """Passes when the definition is absent (an assumption about a later vLLM's addition)."""

    def where(self) -> str:
        module = self.module if isinstance(self.module, str) else "|".join(self.module)
        return f"{module}:{self.qualname}" if self.qualname else module


def exists(module: str | tuple[str, ...], qualname: str) -> Check:
    """The definition exists (function, class, method, assignment or re-export)."""
    return Check("exists", module, qualname)


def signature(module: str | tuple[str, ...], qualname: str, *accepted: str) -> Check:
    """The function's parameters are one of `accepted` (`"self, a, b=0"`)."""
    return Check("signature", module, qualname, accepted)


def accepts(module: str, qualname: str, *names: str) -> Check:
    """The function has parameters named `names` (others may be added)."""
    return Check("accepts", module, qualname, names)


def body(module: str | tuple[str, ...], qualname: str, digests: dict[str, str]) -> Check:
    """The definition's `digest` is one recorded for a checked vLLM version: unchanged, or
    changed and read (the digest recorded under the version whose change was reviewed)."""
    return Check("body", module, qualname, digests)


def contains(module: str | tuple[str, ...], qualname: str, snippet: str,
             count: int | None = None, optional: bool = False) -> Check:
    """The definition's source holds `snippet` (whitespace-insensitive), `count` times."""
    return Check("contains", module, qualname, snippet, count, optional)


def order(module: str | tuple[str, ...], qualname: str, first: str, then: str) -> Check:
    """In the definition's source, `first` comes before `then`."""
    return Check("order", module, qualname, (first, then))


def attribute(module: str, cls: str, name: str) -> Check:
    """Class `cls` defines `name`: in its body, or as `self.name = ...` in a method."""
    return Check("attribute", module, cls, name)


def assigns(module: str, qualname: str, target: str, digests: dict[str, str]) -> Check:
    """Every assignment to the local `target` in the function, in order, as recorded: where and
    how a value is decided, whatever else the function does."""
    return Check("assigns", module, qualname, (target, digests))


def call_keywords(module: str, qualname: str, callee: str, allowed: tuple[str, ...]) -> Check:
    """Every call of `callee` in the definition passes keywords among `allowed` only."""
    return Check("call_keywords", module, qualname, (callee, allowed))


def calls_with(callee: str, names: tuple[str, ...]) -> Check:
    """Across the whole tree, the first arguments `callee` is called with are `names`."""
    return Check("calls_with", "vllm", "", (callee, names))


@dataclass(frozen=True)
class Finding:
    bend: str
    check: Check
    ok: bool
    detail: str


def _assignments(node: ast.AST, target: str) -> list[str]:
    found: list[tuple[int, int, str]] = []
    for sub in ast.walk(node):
        value = None
        if isinstance(sub, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == target for t in sub.targets):
            value = sub.value
        elif isinstance(sub, (ast.AugAssign, ast.AnnAssign)) and isinstance(
                sub.target, ast.Name) and sub.target.id == target:
            value = sub.value
        if value is not None:
            found.append((sub.lineno, sub.col_offset, ast.dump(sub, include_attributes=False)))
    return [d for _, _, d in sorted(found)]


def _self_attributes(cls: ast.AST) -> set[str]:
    names: set[str] = set()
    for child in _children(cls):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(child.name)
        elif isinstance(child, ast.Assign):
            names |= {t.id for t in child.targets if isinstance(t, ast.Name)}
        elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
            names.add(child.target.id)
    for sub in ast.walk(cls):
        targets: list[ast.AST] = []
        if isinstance(sub, ast.Assign):
            targets = list(sub.targets)
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for t in targets:
            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                    and t.value.id == "self"):
                names.add(t.attr)
    return names


def run_check(tree: SourceTree, check: Check) -> tuple[bool, str]:
    """(passes, what was found) for one check on one source tree."""
    if check.kind == "calls_with":
        callee, names = check.arg
        seen: set[str] = set()
        for path in sorted(tree.root.rglob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            if callee not in text:
                continue
            module = ast.parse(text)
            for sub in ast.walk(module):
                if (isinstance(sub, ast.Call) and getattr(sub.func, "id", getattr(
                        sub.func, "attr", None)) == callee):
                    first = sub.args[0] if sub.args else next(
                        (k.value for k in sub.keywords if k.arg == "group"), None)
                    if isinstance(first, ast.Name):
                        seen.add(first.id)
        return seen == set(names), f"called with {sorted(seen)}"
    module, node, text = tree.find(check.module, check.qualname)
    if node is None:
        return check.optional, ("absent (an assumption about a later vLLM: n/a)"
                                if check.optional else "missing")
    source = ast.get_source_segment(text, node) if check.qualname else text
    if check.kind == "exists":
        return True, "exists"
    if check.kind in ("signature", "accepts"):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False, f"not a function: {type(node).__name__}"
        sig = _signature(node)
        if check.kind == "signature":
            return sig in check.arg, f"({sig})"
        params = {p.strip().split("=")[0].lstrip("*") for p in sig.split(",")}
        missing = [n for n in check.arg if n not in params]
        return not missing, f"({sig})" + (f" lacks {missing}" if missing else "")
    if check.kind == "body":
        got = digest(node)
        match = [v for v, d in check.arg.items() if d == got]
        return bool(match), (f"as in {', '.join(match)}" if match else
                             f"changed: digest {got}, recorded {check.arg}")
    if check.kind == "contains":
        n = _flat(source or "").count(_flat(check.arg))
        ok = n == check.count if check.count is not None else n > 0
        return ok, f"{n} x {check.arg!r}"
    if check.kind == "order":
        flat = _flat(source or "")
        first, then = (flat.find(_flat(s)) for s in check.arg)
        ok = 0 <= first < then
        return ok, f"{check.arg[0]!r} at {first}, {check.arg[1]!r} at {then}"
    if check.kind == "attribute":
        return check.arg in _self_attributes(node), f"{check.qualname}.{check.arg}"
    if check.kind == "assigns":
        target, digests = check.arg
        got = hashlib.sha256("\n".join(_assignments(node, target)).encode()).hexdigest()[:16]
        match = [v for v, d in digests.items() if d == got]
        return bool(match), (f"assignments to {target} as in {', '.join(match)}" if match else
                             f"assignments to {target} changed: {got}, recorded {digests}")
    if check.kind == "call_keywords":
        callee, allowed = check.arg
        passed: set[str] = set()
        calls = 0
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and getattr(sub.func, "id", getattr(
                    sub.func, "attr", None)) == callee:
                calls += 1
                passed |= {k.arg for k in sub.keywords if k.arg}
        extra = sorted(passed - set(allowed))
        return calls > 0 and not extra, (f"{calls} call(s), keywords {sorted(passed)}"
                                         + (f"; not mirrored: {extra}" if extra else ""))
    raise ValueError(f"unknown check kind {check.kind!r}")


# --------------------------------------------------------------------- the bends' assumptions

_MAIN = "vllm.entrypoints.cli.main"
_SCHED = "vllm.v1.core.sched.scheduler"
_COORD = "vllm.v1.core.kv_cache_coordinator"
_MANAGER = "vllm.v1.core.kv_cache_manager"
_STM = "vllm.v1.core.single_type_kv_cache_manager"
_ARGPARSE = "vllm.utils.argparse_utils"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
_CPU_GDN = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
_QWEN_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
_MAKE_ARG_PARSER = ("vllm.entrypoints.launchers.cli_args",  # 0.32
                    "vllm.entrypoints.common.cli_args")     # 0.33
_SCHEDULER_MANAGER_KWARGS = (
    "kv_cache_config", "max_model_len", "max_in_flight_tokens", "enable_caching", "use_eagle",
    "num_prefill_lookahead", "log_stats", "enable_kv_cache_events", "dcp_world_size",
    "pcp_world_size", "scheduler_block_size", "hash_block_size", "metrics_collector",
    "watermark", "enable_mamba_shared_prefix_checkpoint", "num_hash_lookahead_tokens")
"""The keywords `compat.install_attention_in_place` mirrors from the `KVCacheManager(...)`
call in `Scheduler.__init__` (num_hash_lookahead_tokens: 0.33)."""

V32, V33 = "0.32.0", "0.33.0"

ASSUMPTIONS: dict[str, tuple[Check, ...]] = {
    "install_vllm_metadata_alias": (
        contains(_MAIN, "main", 'importlib.metadata.version("vllm")'),
        contains("vllm.platforms", "resolve_current_platform_cls_qualname",
                 "load_plugins_by_group(PLATFORM_PLUGINS_GROUP)"),
        order(_MAIN, "main", "import vllm.entrypoints.cli.serve",
              'importlib.metadata.version("vllm")'),
        body("vllm.plugins", "load_plugins_by_group", {V32: "7309d39158d96cdb"}),
    ),
    "rocm_gcn_arch": (exists("vllm.platforms.rocm", "_GCN_ARCH"),),
    "run_vllm_cli": (
        signature(_MAIN, "main", ""),
        contains(_MAIN, "main", "args = parser.parse_args()"),
    ),
    "extend_vllm_serve": (
        body(_ARGPARSE, "FlexibleArgumentParser.parse_args", {V32: "64e0727c768be495"}),
        body(_ARGPARSE, "FlexibleArgumentParser._pull_args_from_config",
             {V32: "3fe71ae23152352c"}),
        contains(_MAIN, "main", 'subparsers = parser.add_subparsers(required=False, '
                 'dest="subparser")'),
        order(_MAIN, "main", "cmd.subparser_init(subparsers)", "args = parser.parse_args()"),
        body("vllm.entrypoints.cli.serve", "ServeSubcommand.subparser_init",
             {V32: "87b2924507439ae7"}),
        contains(_MAKE_ARG_PARSER, "make_arg_parser", "AsyncEngineArgs.add_cli_args(parser)"),
        order("vllm.engine.arg_utils", "AsyncEngineArgs.add_cli_args", "load_general_plugins()",
              "EngineArgs.add_cli_args(parser)"),
        exists("vllm.config", "KVTransferConfig"),
    ),
    "parse_vllm_serve": (
        exists("vllm.entrypoints.cli.serve", "ServeSubcommand"),
        body("vllm.entrypoints.cli.serve", "ServeSubcommand.subparser_init",
             {V32: "87b2924507439ae7"}),
        contains(_MAIN, "main", "FlexibleArgumentParser("),
    ),
    "enable_endpoint_plugin": (
        body("vllm.plugins", "load_endpoint_plugins", {V32: "6b0e712bdd0d1fef"}),
        body("vllm.plugins", "load_plugins_by_group", {V32: "7309d39158d96cdb"}),
        calls_with("load_plugins_by_group", (
            "DEFAULT_PLUGINS_GROUP", "PLATFORM_PLUGINS_GROUP", "STAT_LOGGER_PLUGINS_GROUP",
            "IO_PROCESSOR_PLUGINS_GROUP", "ENDPOINT_PLUGINS_GROUP")),
    ),
    "route_logs_through_vllm": (
        contains("vllm.logger", "DEFAULT_LOGGING_CONFIG",
                 '"loggers": { "vllm": { "handlers": ["vllm"],'),
        body("vllm.logger", "_configure_vllm_root_logger", {V32: "8f2e24d2f2a9b8e4"}),
    ),
    "register_kv_connector": (
        body("vllm.distributed.kv_transfer.kv_connector.factory",
             "KVConnectorFactory.register_connector", {V32: "a43df42ce69efd0b"}),
        attribute("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory",
                  "_registry"),
    ),
    "extend_config_hook": (
        body("vllm.model_executor.models.config", "VerifyAndUpdateConfig",
             {V32: "a4ee48e24ab1e6c6"}),
        exists("vllm.model_executor.models.config", "MODELS_CONFIG_MAP"),
        contains("vllm.config.vllm", "VllmConfig.try_verify_and_update_config",
                 "cls = MODELS_CONFIG_MAP.get(architecture, None)", count=2),
        order("vllm.config.vllm", "VllmConfig.try_verify_and_update_config",
              "cls.verify_and_update_config(self)",
              "HybridAttentionMambaModelConfig.verify_and_update_config(self)"),
        contains("vllm.config.vllm", "VllmConfig.__post_init__",
                 "self.try_verify_and_update_config()"),
    ),
    "install_prefill_split": (
        signature(_SCHED, "Scheduler._mamba_block_aligned_split",
                  "self, request, num_new_tokens, num_new_local_computed_tokens=0, "
                  "num_external_computed_tokens=0"),
        # 0.33: hands `num_hash_lookahead_tokens` (0 with a KV connector) to its helpers; the
        # bend calls it unchanged when the segmentation leaves a step to vLLM
        body(_SCHED, "Scheduler._mamba_block_aligned_split",
             {V32: "3fed017193dfee3c", V33: "f3405419e904a2f8"}),
        contains(_SCHED, "Scheduler.schedule", "if self.need_mamba_block_aligned_split:",
                 count=2),
        contains(_SCHED, "Scheduler.schedule", "num_new_tokens = self._mamba_block_aligned_split("
                 " request, num_new_tokens )", count=1),
        contains(_SCHED, "Scheduler.schedule", "num_new_tokens = self._mamba_block_aligned_split("
                 " request, num_new_tokens, num_new_local_computed_tokens, "
                 "num_external_computed_tokens, )", count=1),
        assigns(_SCHED, "Scheduler.schedule", "num_new_tokens", {V32: "a5dac65e11c5619d"}),
        attribute(_SCHED, "Scheduler", "need_mamba_block_aligned_split"),
    ),
    "prefill_step_limit": (
        attribute(_SCHED, "Scheduler", "max_num_scheduled_tokens"),
        attribute("vllm.config.scheduler", "SchedulerConfig", "max_num_batched_tokens"),
        attribute("vllm.config.scheduler", "SchedulerConfig", "long_prefill_token_threshold"),
        contains(_SCHED, "Scheduler.schedule",
                 "if 0 < long_prefill_token_threshold < num_new_tokens:"),
    ),
    "decode_rows": (
        attribute(_SCHED, "Scheduler", "running"),
        attribute("vllm.v1.request", "Request", "num_computed_tokens"),
        attribute("vllm.v1.request", "Request", "num_prompt_tokens"),
        attribute("vllm.v1.request", "Request", "spec_token_ids"),
    ),
    "withdraw_failed_sync_load": (
        accepts(_SCHED, "Scheduler._preempt_request", "request", "timestamp",
                "drop_stale_output"),
        contains(_SCHED, "Scheduler._preempt_request", "request.num_computed_tokens = 0"),
        contains(_SCHED, "Scheduler._preempt_request", "self.waiting.prepend_request(request)"),
        contains(_SCHED, "Scheduler.update_from_output",
                 "if output_is_stale and request.drop_stale_output:"),
        contains(_SCHED, "Scheduler.reset_prefix_cache",
                 "self.prev_step_scheduled_req_ids.clear()"),
        contains(_SCHED, "Scheduler.schedule", "has_sync_kv_loads = True"),
        contains("vllm.v1.worker.kv_connector_model_runner_mixin",
                 "KVConnectorModelRunnerMixin._get_kv_connector_output",
                 "start_after_forward = not scheduler_output.has_sync_kv_loads"),
        exists(_MANAGER, "KVCacheManager.evict_blocks"),
        attribute(_SCHED, "Scheduler", "running"),
        attribute("vllm.v1.request", "Request", "prefill_stats"),
        accepts("vllm.v1.metrics.stats", "PrefillStats.set", "num_prompt_tokens",
                "num_local_cached_tokens", "num_external_cached_tokens"),
        attribute("vllm.v1.core.block_pool", "BlockPool", "null_block"),
    ),
    "scheduler_has_recurrent_layers": (
        contains(_SCHED, "Scheduler.__init__",
                 "self.has_mamba_layers = kv_cache_config.has_mamba_layers"),
    ),
    "register_forward_layer": (
        attribute("vllm.config.compilation", "CompilationConfig", "static_forward_context"),
        contains("vllm.model_executor.layers.mamba.mamba_mixer2", "MambaMixer2.__init__",
                 "compilation_config.static_forward_context[prefix] = self"),
    ),
    "forward_layers": (
        attribute("vllm.config.compilation", "CompilationConfig", "static_forward_context"),
    ),
    "layer_attn_metadata": (
        body("vllm.forward_context", "get_forward_context", {V32: "7d38c4b9d543c31c"}),
        body("vllm.forward_context", "is_forward_context_available", {V32: "7e238efd1c388fec"}),
        attribute("vllm.forward_context", "ForwardContext", "attn_metadata"),
    ),
    "vllm_cpu_linear": (
        body("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm",
             {V32: "b65f36ce55579a98"}),
    ),
    "vllm_cpu_gdn_prefill": (
        body("vllm._custom_ops", "chunk_gated_delta_rule_cpu", {V32: "ea6ee0496df87771"}),
    ),
    "pin_cpu_attention_split": (
        body(_CPU_ATTN, "CPUAttentionMetadataBuilder.build", {V32: "218acc6a4adf9f98"}),
        body(_CPU_ATTN, "CPUAttentionMetadataBuilder.__init__", {V32: "9efdaafbe5bdd140"}),
        body(_CPU_ATTN, "CPUAttentionMetadata", {V32: "54c9e5a4dfa25812"}),
        body("vllm._custom_ops", "cpu_attn_get_scheduler_metadata", {V32: "6d700d146ce0a026"}),
    ),
    "split_attention_plan": (
        body(_CPU_ATTN, "_get_attn_isa", {V32: "8f1cbc670bcdbbfb"}),
        exists("vllm.model_executor.models", "ModelRegistry"),
    ),
    "install_split_invariant_cpu_attention": (
        body(_CPU_ATTN, "CPUAttentionBackendImpl.forward", {V32: "955f1782841ec4ce"}),
        body(_CPU_ATTN, "CPUAttentionBackendImpl.__init__", {V32: "e0f3b215e9c38945"}),
        body(_CPU_ATTN, "CPUAttentionMetadataBuilder.__init__", {V32: "9efdaafbe5bdd140"}),
        exists(_CPU_ATTN, "get_layers_from_vllm_config"),
        exists("vllm.v1.attention.backend", "AttentionType"),
    ),
    "install_cpu_gdn_inner_states": (
        body(_CPU_GDN, "_cpu_gdn_attention_nonspec", {V32: "63ebe8e5ebb29340"}),
        contains(_CPU_GDN, "cpu_gdn_attention_core", "_cpu_gdn_attention_nonspec(", count=1),
        contains(_QWEN_GDN, "", "class QwenGatedDeltaNetAttention(GatedDeltaNetAttention):"),
        attribute("vllm.model_executor.layers.mamba.gdn.base", "GatedDeltaNetAttention",
                  "prefix"),
    ),
    "takes_cpu_gdn_inner_capture": (exists(_QWEN_GDN, "QwenGatedDeltaNetAttention"),),
    "cpu_gdn_inner_states_installed": (exists(_CPU_GDN, "_cpu_gdn_attention_nonspec"),),
    "inproc_scheduler_connector": (
        body("vllm.v1.engine.core_client", "InprocClient.__init__", {V32: "e491bd089763bcdd"}),
        exists("vllm.v1.core.sched.interface", "SchedulerInterface.get_kv_connector"),
        attribute("vllm.v1.engine.core", "EngineCore", "scheduler"),
    ),
    "worker_connector": (
        exists("vllm.distributed.kv_transfer", "get_kv_transfer_group"),
        body("vllm.distributed.kv_transfer.kv_transfer_state", "get_kv_transfer_group",
             {V32: "b5bb39cd212291ff"}),
    ),
    "reserve_cpus_as_without_connector": (
        # one config read for the connector, the reservation it adds; the rest of the binding
        # is vLLM's own (0.33 also reads `parallel_config.assigned_physical_gpu_ids`, which the
        # config stand-in passes through)
        body("vllm.utils.ompmultiprocessing", "OMPProcessManager.__init__",
             {V32: "0ca10d457b87f4ae", V33: "d617998b5bea88fb"}),
        contains("vllm.utils.ompmultiprocessing", "OMPProcessManager.__init__",
                 "if config.kv_transfer_config: self.reserve_cpu_num += self.local_world_size"),
        contains("vllm.v1.executor.multiproc_executor", "MultiprocExecutor._init_executor",
                 "cpu_omp_manager = OMPProcessManager(self.vllm_config)"),
    ),
    "expose_connector_utility": (
        contains("vllm.v1.engine.core", "EngineCoreProc._handle_client_request",
                 "(method := getattr(self, method_name)) and method(*self._convert_msgspec_args("
                 "method, args))"),
        attribute("vllm.v1.engine.core", "EngineCore", "scheduler"),
    ),
    "call_connector_utility": (
        body("vllm.v1.engine.core_client", "AsyncMPClient.call_utility_all_async",
             {V32: "04071004280c3e40"}),
        attribute("vllm.v1.engine.async_llm", "AsyncLLM", "engine_core"),
    ),
    "attention_in_place_manager": (
        accepts(_MANAGER, "KVCacheManager.__init__", *(
            k for k in _SCHEDULER_MANAGER_KWARGS if k != "num_hash_lookahead_tokens")),
        contains(_SCHED, "Scheduler._get_local_prefix_cache_hit",
                 "if connector is not None and connector.supports_divergent_local_hybrid_hits:"),
        exists("vllm.distributed.kv_transfer.kv_connector.v1.base",
               "KVConnectorBase_V1.supports_divergent_local_hybrid_hits"),
        attribute(_MANAGER, "KVCacheManager", "coordinator"),
        signature(_MANAGER, "KVCacheManager.get_computed_blocks", "self, request",
                  "self, request, max_cache_hit_length=None"),
        # 0.33: an optional upper bound `max_cache_hit_length`, which the bend passes on
        body(_MANAGER, "KVCacheManager.get_computed_blocks",
             {V32: "e83147f5ea111ea0", V33: "11b9eece955b29b4"}),
        body(_COORD, "HybridKVCacheCoordinator.find_longest_cache_hit",
             {V32: "ca610b0f5b303d3f"}),
        body(_COORD, "HybridKVCacheCoordinator._cache_hit_alignment_tokens",
             {V32: "2bda268bfcd8e016"}),
        body(_COORD, "HybridKVCacheCoordinator._align_cacheable", {V32: "2fc4c51a2b7b7f32"}),
        signature(_COORD, "KVCacheCoordinator.cache_blocks", "self, request, num_computed_tokens"),
        # 0.33: EAGLE's block drop follows `drop_eagle_group_ids` (EAGLE groups only)
        body(_COORD, "KVCacheCoordinator.cache_blocks",
             {V32: "30a2c903c9dee799", V33: "042a9dff18213d8d"}),
        attribute(_COORD, "HybridKVCacheCoordinator", "attention_groups"),
        attribute(_COORD, "KVCacheCoordinator", "single_type_managers"),
        attribute(_COORD, "HybridKVCacheCoordinator", "hash_block_size"),
        attribute("vllm.v1.kv_cache_interface", "MambaSpec", "mamba_cache_mode"),
        exists("vllm.utils.math_utils", "round_down"),
    ),
    "provenance_block_hasher": (
        signature("vllm.v1.core.kv_cache_utils", "get_request_block_hasher",
                  "hash_block_size, caching_hash_fn",
                  "hash_block_size, caching_hash_fn, num_hash_lookahead_tokens=0"),
        # 0.33: lookahead hashes when `num_hash_lookahead_tokens` > 0, which vLLM sets to 0
        # with a KV connector (next check); at 0 it hashes as 0.32 did
        body("vllm.v1.core.kv_cache_utils", "get_request_block_hasher",
             {V32: "7ef776964bac8ac9", V33: "2160032bfea89b83"}),
        contains("vllm.v1.core.kv_cache_utils", "get_request_block_hasher",
                 "request.block_hashes[-1] if request.block_hashes else None"),
        contains("vllm.config.vllm", "VllmConfig.num_hash_lookahead_tokens",
                 "if self.kv_transfer_config is not None: return 0", optional=True),
        exists("vllm.v1.core.kv_cache_utils", "BlockHash"),
    ),
    "mark_off_segmentation": (
        body("vllm.v1.request", "Request.update_block_hashes", {V32: "0514cb573abc7628"}),
        attribute("vllm.v1.request", "Request", "block_hashes"),
    ),
    "share_cached_blocks": (
        # vLLM's own lookup, called outside `get_computed_blocks` (the cap unset)
        body(_COORD, "HybridKVCacheCoordinator.find_longest_cache_hit", {V32: "ca610b0f5b303d3f"}),
        # a local hit's blocks are touched and counted cached (`num_cached_block`); the blocks
        # for external tokens are fresh ones, recorded for zeroing unless the load writes them
        body(_STM, "SingleTypeKVCacheManager.add_local_computed_blocks",
             {V32: "c2a926be3c31d027"}),
        body(_STM, "SingleTypeKVCacheManager.allocate_external_computed_blocks",
             {V32: "bb882fd191a7e585"}),
        # 0.33: caches up to the hashed tokens too, and an EAGLE boundary; still from
        # `num_cached_block` on
        body(_STM, "SingleTypeKVCacheManager.cache_blocks",
             {V32: "30843d162a0fde66", V33: "34232145f4ca6886"}),
        *(attribute(_STM, "SingleTypeKVCacheManager", name) for name in (
            "req_to_blocks", "num_cached_block", "new_block_ids", "block_pool", "block_size")),
        # 0.33: null blocks skipped first (the bend never passes one)
        body("vllm.v1.core.block_pool", "BlockPool.touch",
             {V32: "e200f3b0521cbcb8", V33: "066213ff862ef5c1"}),
        body("vllm.v1.core.block_pool", "BlockPool.free_blocks",
             {V32: "5bbcbe07cacd6932", V33: "a5ab0603b2e6a927"}),
        # the connector hears of the allocation before the step is built (nothing written)
        order(_SCHED, "Scheduler.schedule", "self.kv_cache_manager.allocate_slots(",
              "self.connector.update_state_after_alloc("),
    ),
    "install_attention_in_place": (
        call_keywords(_SCHED, "Scheduler.__init__", "KVCacheManager", _SCHEDULER_MANAGER_KWARGS),
        *(attribute(_SCHED, "Scheduler", name) for name in (
            "kv_cache_config", "max_model_len", "block_size", "use_eagle_block_drop",
            "num_prefill_lookahead", "log_stats", "enable_kv_cache_events", "dcp_world_size",
            "kv_metrics_collector", "scheduler_config", "cache_config", "connector",
            "hash_block_size", "vllm_config", "kv_cache_manager")),
        exists("vllm.distributed.kv_transfer.kv_connector.v1.base",
               "KVConnectorBase_V1.bind_kv_cache_manager"),
        exists("vllm.utils.hashing", "get_hash_fn_by_name"),
    ),
    "install_pil_image_processor_fallback": (
        contains("vllm.model_executor.models.qwen3_vl", "",
                 "from transformers.models.qwen2_vl.image_processing_qwen2_vl import ("),
        contains("vllm.model_executor.models.qwen3_5", "", "from .qwen3_vl import ("),
    ),
    "rehash_request": (
        body("vllm.v1.request", "Request.update_block_hashes", {V32: "0514cb573abc7628"}),
        attribute("vllm.v1.request", "Request", "_block_hasher"),
    ),
}
"""Bend name -> what it assumes of vLLM's source. A bend is verified on a version when every
check passes on that version's source; `body`/`assigns` digests are recorded per version once
the change (if any) was read and found to keep the bend's assumption."""


# Beyond the bends, the public vLLM surface the package is built on: the names it imports, the
# KV-connector methods its connector overrides, the Scheduler methods its scheduler overrides.

_PACKAGE = Path(__file__).resolve().parent
API_SIGNATURES: dict[str, tuple[str, str, str, dict[str, str]]] = {
    "(api) KV connector methods": (
        "vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1",
        "adapter/connector.py:HybridSnapshotConnector", {V32: "32a339d9fab53372"}),
    "(api) Scheduler methods": (
        _SCHED, "Scheduler", "adapter/scheduler.py:SegmentedScheduler",
        {V32: "4aebff18964aad6f"}),
}
"""Name -> (vLLM module, vLLM class, our subclass as `file:Class`, digest of the signatures of
the vLLM methods our subclass overrides, per version)."""


def _our_methods(spec: str) -> list[str]:
    path, cls = spec.split(":")
    tree = ast.parse((_PACKAGE / path).read_text(encoding="utf-8"))
    node = _child(tree, cls)
    return sorted(c.name for c in _children(node)
                  if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef)))


def overridden_signatures(tree: SourceTree, module: str, cls: str, ours: str) -> str:
    """`name(signature)` lines of `cls`'s methods that our class `ours` overrides."""
    _, node, _ = tree.find(module, cls)
    if node is None:
        return "missing"
    theirs = {c.name: c for c in _children(node)
              if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return "\n".join(f"{name}({_signature(theirs[name])})" for name in _our_methods(ours)
                     if name in theirs)


def package_imports() -> list[tuple[str, str, str]]:
    """(our file, vLLM module, name) of every `from vllm... import name` in the package
    (name "" for `import vllm.x`)."""
    out = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            rel = str(path.relative_to(_PACKAGE))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module == "vllm" or node.module.startswith("vllm.")):
                out += [(rel, node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                out += [(rel, a.name, "") for a in node.names
                        if a.name == "vllm" or a.name.startswith("vllm.")]
    return sorted(set(out))


def _importable(tree: SourceTree, module: str, name: str) -> bool:
    found = tree.module(module)
    if found is None:
        return False
    if not name:
        return True
    text, mod = found
    if _child(mod, name) is not None or tree.module(f"{module}.{name}") is not None:
        return True
    lazy = _child(mod, "__getattr__") is not None  # a module-level lazy `__getattr__`
    return lazy and (f'"{name}"' in text or f"'{name}'" in text)


def api_findings(tree: SourceTree) -> list[Finding]:
    """The public-surface checks (see `API_SIGNATURES`, `package_imports`)."""
    out = []
    for name, (module, cls, ours, digests) in API_SIGNATURES.items():
        sigs = overridden_signatures(tree, module, cls, ours)
        got = hashlib.sha256(sigs.encode()).hexdigest()[:16]
        match = [v for v, d in digests.items() if d == got]
        out.append(Finding(name, Check("signatures", module, cls, digests), bool(match),
                           f"as in {', '.join(match)}" if match else
                           f"changed: {got}, recorded {digests}:\n{sigs}"))
    missing = [f"{f}: {m}{'.' + n if n else ''}" for f, m, n in package_imports()
               if not _importable(tree, m, n)]
    out.append(Finding("(api) vLLM names the package imports",
                       Check("imports", "vllm", ""), not missing,
                       "all found" if not missing else "missing: " + "; ".join(missing)))
    return out


def check_tree(tree: SourceTree, bends: list[str] | None = None) -> list[Finding]:
    """Every check of `bends` (all by default) on `tree`."""
    out = []
    for bend in bends or list(ASSUMPTIONS):
        for check in ASSUMPTIONS[bend]:
            ok, detail = run_check(tree, check)
            out.append(Finding(bend, check, ok, detail))
    return out


def verified_bends(findings: list[Finding]) -> dict[str, bool]:
    """Bend -> whether all its checks passed."""
    result: dict[str, bool] = {}
    for f in findings:
        result[f.bend] = result.get(f.bend, True) and f.ok
    return result


def report(version: str, findings: list[Finding]) -> str:
    """A plain-text table: each bend, verified or not on `version`, and what differs."""
    from vllm_hybridcache.compat import BENDS

    lines = [f"vllm-hybridcache compat bends against vLLM {version}'s source:"]
    verified = verified_bends(findings)
    for bend, ok in verified.items():
        claimed = version in BENDS.get(bend, ()) or bend.startswith("(api)")
        lines.append(f"  {'ok     ' if ok else 'DIFFERS'} {bend}"
                     f"{'' if claimed else '  (not claimed for this version)'}")
        for f in findings:
            if f.bend == bend and not f.ok:
                lines.append(f"            {f.check.kind} {f.check.where()}: {f.detail}")
    n_ok = sum(verified.values())
    lines.append(f"{n_ok}/{len(verified)} bends verified on vLLM {version}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Check the bends on vLLM VERSION's wheel (or `--root`); 1 when a bend `compat` claims
    for that version (`@checked`) fails, 2 when the source cannot be had."""
    import argparse

    from vllm_hybridcache.compat import BENDS

    parser = argparse.ArgumentParser(prog="python -m vllm_hybridcache.compat_check",
                                     description=__doc__)
    parser.add_argument("version", help="the vLLM release, e.g. 0.33.0")
    parser.add_argument("--root", type=Path, help="an unpacked `vllm` package folder instead "
                        "of the release's wheel")
    parser.add_argument("--installed", action="store_true",
                        help="the installed vLLM's source (VERSION names it)")
    args = parser.parse_args(argv)
    try:
        root = (args.root if args.root else installed_tree() if args.installed
                else wheel_tree(args.version))
    except WheelUnavailable as e:
        print(f"compat_check: {e}", file=sys.stderr)
        return 2
    tree = SourceTree(root)
    findings = check_tree(tree) + api_findings(tree)
    print(report(args.version, findings))
    verified = verified_bends(findings)
    claimed_failing = [b for b, ok in verified.items()
                       if not ok and (b.startswith("(api)") or args.version in BENDS[b])]
    return 1 if claimed_failing else 0


if __name__ == "__main__":
    sys.exit(main())
