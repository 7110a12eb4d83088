"""The package's import graph: no cycle, the core pure, and arrows that point down the layers.

Read from the source with `ast` (every `import` counts: module level, inside functions, and
under `TYPE_CHECKING`, since each one is a dependency a reader has to hold in mind), so the
test needs no vLLM and sees imports a run would not execute.

The layers, low to high (docs/architecture.md): the pure base (the cache core and the small
shared pieces below everything), settings, the bends of vLLM and the copy ops, the model, the
cluster tier's transport (Ray), the adapter (the request lifecycle), the serving surface, the
fleet of replicas, and the entry points with the test tooling. A module may import its own
layer and the ones below. `STILL_UPWARD` lists arrows allowed to point up while a move is under
way (none now); the test fails when a new one appears and when a listed one is gone, so the
list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_hybridcache

ROOT = Path(vllm_hybridcache.__file__).resolve().parent
PKG = "vllm_hybridcache"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("", "core", "units", "segmentation", "inner_capture"),
    ("config", "progress"),
    ("compat", "compat_check", "ops", "models"),
    ("flash_next",),
    ("cluster",),
    ("adapter",),
    ("serving",),
    ("fleet",),
    ("registrations", "plugin", "cli", "tools", "testing"),
)
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}

# The adapter reaches the lower tiers only by name through adapter/tier_registry.py, as vLLM's
# OffloadingSpecFactory does (so Ray loads only with a cluster): the cluster package sits below
# it all the same and imports nothing of it (its opener gets the fingerprint and segmentation
# mode in its context). tests/adapter/test_tier_registry.py checks every registered path.
STILL_UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _target(name: str) -> str | None:
    """The package module `name` (dotted, without the package prefix) lives in, or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name if name in MODULES else None


def _imports(module: str) -> set[str]:
    """Package modules `module` imports (relative imports resolved), itself excluded."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                base_name = ".".join([PKG, *[p for p in base if p]]
                                     + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            names = [f"{base_name}.{a.name}" for a in node.names] + [base_name]
        for name in names:
            if name == PKG or name.startswith(PKG + "."):
                target = _target(name[len(PKG) + 1:] if name != PKG else "")
                if target is not None and target != module:
                    found.add(target)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _layer(module: str) -> str:
    return module.split(".")[0]


def test_every_top_level_module_has_a_layer() -> None:
    assert {_layer(m) for m in MODULES} <= set(RANK), (
        "a new top-level module or package: give it a layer in LAYERS (and in "
        "docs/architecture.md)")


def test_the_graph_reader_sees_imports_of_every_kind() -> None:
    """The negative control of the reader: function-level, relative and TYPE_CHECKING imports
    are all edges (a reader that missed them would pass a cyclic graph)."""
    assert "segmentation" in GRAPH["cluster.engine"]               # inside a function
    assert "adapter.plans" in GRAPH["testing.instrumentation"]     # under TYPE_CHECKING
    assert "cluster.directory" in GRAPH["cluster.engine"]          # relative (from .directory)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle() -> None:
    assert _cycles(GRAPH) == []


def test_the_core_imports_nothing_above_it_and_no_vllm() -> None:
    for module in (m for m in MODULES if _layer(m) == "core"):
        assert all(_layer(t) == "core" for t in GRAPH[module]), (module, GRAPH[module])
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "vllm" for a in node.names), module
            elif isinstance(node, ast.ImportFrom) and not node.level:
                assert (node.module or "").split(".")[0] != "vllm", module


def test_arrows_point_down_the_layers() -> None:
    upward = {(src, dst) for src, targets in GRAPH.items() for dst in targets
              if RANK[_layer(dst)] > RANK[_layer(src)]}
    assert upward - STILL_UPWARD == set(), "an import up a layer"
    assert STILL_UPWARD - upward == set(), "gone: take it off STILL_UPWARD"


def test_production_code_never_imports_the_test_tooling() -> None:
    users = {src for src, targets in GRAPH.items() if _layer(src) != "testing"
             for dst in targets if _layer(dst) == "testing"}
    assert users == set()


def test_environment_variable_names_are_spelled_only_in_config() -> None:
    """Every `VLLM_HYBRIDCACHE_*` name a module reads or sets comes from config (a constant
    there, or `config.setting_env`), so a rename or a typo cannot leave two spellings; a name
    inside a message or a docstring is text, not a read, and is not counted."""
    import re

    name = re.compile(r"VLLM_HYBRIDCACHE_[A-Z0-9_]+")
    spelled = []
    for module, path in MODULES.items():
        if module == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and name.fullmatch(node.value)):
                spelled.append(f"{module}:{node.lineno} {node.value}")
    assert spelled == []
