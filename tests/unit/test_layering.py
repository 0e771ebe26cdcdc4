"""The architecture as data, and a check that the import graph keeps it.

Every module under ``gateway/`` is parsed with :mod:`ast`; every import counts (module
level, inside functions, under ``if TYPE_CHECKING:``). The check fails, listing each
offending import, when

(a) a module imports a layer above its own, or a sibling beside it (fleet <-> proxy);
(b) modules import each other in a cycle (the cycle is reported);
(c) the simulator is imported from outside it by anything but the demo and the CLI, or
    imports a layer above 2 itself;
(d) a pure package imports an I/O library;
(e) a module sits in no layer (every module must be placed, so none escapes the rules).

A pattern ``a.b.*`` names the package ``a.b`` and everything below it; ``a.b`` names that
one module. A module belongs to the most specific pattern that names it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# ---- The architecture ----------------------------------------------------------------------

LAYERS: tuple[tuple[str, ...], ...] = (
    # 0: shared vocabulary, the config schema, metric declarations
    #    (gateway.embedded: the uvicorn server the gateway, the simulator and tests embed)
    #    (gateway.config_diff: what a live reload changes; gateway.config_history: the kept
    #    applied configs; gateway.reload_errors: why a reload did not apply)
    #    (gateway.logs: log lines and the request's log fields; gateway.tracing: the
    #    optional OpenTelemetry spans, no-op without the SDK)
    #    (gateway.ops.*: the dashboard and alert rules built from the config's thresholds)
    ("gateway", "gateway.core.*", "gateway.config", "gateway.metrics", "gateway.embedded",
     "gateway.config_diff", "gateway.config_history", "gateway.reload_input",
     "gateway.reload_errors",
     "gateway.config_rollouts", "gateway.logs", "gateway.tracing", "gateway.signals",
     "gateway.ops.*"),
    # 1: pure decisions: routing policies, admission, breaker, retries, forecasts, capacity,
    #    the Responses API's response-id table (gateway.routing.response_owners),
    #    rendezvous hashing of sessions (gateway.routing.rendezvous), the replicas'
    #    capacity shares (gateway.traffic.shares), the autoscaler (gateway.autoscale)
    ("gateway.routing.*", "gateway.traffic.*", "gateway.autoscale"),
    # 2: the fleet's state and control loops; the upstream transport (siblings);
    #    the maintenance-lease seam (gateway.fleet.leases: pure, LocalLeases)
    ("gateway.fleet.*", "gateway.proxy.*"),
    # 3: the request flow: lease, admission I/O, queue/batching, attempts, Responses API
    #    pinning (gateway.flow.responses)
    #    fleet mode's shared state over Redis (gateway.coord.*: a sibling of the flow;
    #    gateway.coord.leases / lease_mirror / lease_scripts: fleet-wide maintenance;
    #    gateway.coord.quota: global rate limits (the pure side: gateway.traffic.quota);
    #    coord.protection: coolings and breaker trips, coord.capacity: capacity shares,
    #    coord.affinity: response ids)
    ("gateway.flow.*", "gateway.coord.*"),
    # 4: the component container (Gateway) and build_gateway
    #    (gateway.reloading: live reload, applied to the Gateway; gateway.reload_state: the
    #    state kept with its snapshots; gateway.reload_fleet: fleet mode's config on a replica)
    ("gateway.wiring", "gateway.reloading", "gateway.reload_state", "gateway.reload_fleet"),
    # 5: the HTTP edge (gateway.api.forms: multipart bodies; gateway.api.responses: by-id)
    ("gateway.api.*",),
    # 6: the ASGI app and its lifespan
    ("gateway.app",),
    # 7: entry points (gateway.workers: serve --workers N, the supervisor of N replicas)
    ("gateway.cli", "gateway.demo", "gateway.serving", "gateway.workers", "gateway.agent",
     "gateway.agent_control", "gateway.__main__"),
)
"""Bottom to top: a module may import its own layer or a lower one, never a higher one."""

SIBLINGS: tuple[tuple[str, str], ...] = (
    ("gateway.fleet.*", "gateway.proxy.*"),
    ("gateway.flow.*", "gateway.coord.*"),
)
"""Pairs in one layer that must not import each other."""

SIMULATOR = "gateway.sim.*"
SIMULATOR_MAY_IMPORT_UP_TO = 2
"""The simulator may import itself and layers 0..2 only."""
SIMULATOR_IMPORTERS = ("gateway.demo", "gateway.cli")
"""The only modules outside the simulator that may import it."""

PURE = (
    "gateway.core.*",
    "gateway.config_diff",
    "gateway.reload_errors",
    "gateway.routing.*",
    "gateway.traffic.*",
    "gateway.autoscale",
    "gateway.fleet.lifecycle",
    "gateway.fleet.liveness",
    "gateway.fleet.cycles",
    "gateway.fleet.leases",
    "gateway.fleet.gpu_health",
    "gateway.fleet.kube_objects",
    "gateway.fleet.membership_plan",
    "gateway.proxy.sse",
    "gateway.proxy.inband",
    "gateway.proxy.transcript",
    "gateway.proxy.continuation",
    "gateway.proxy.stitch",
    "gateway.ops.dashboard",
    "gateway.ops.alerts",
    "gateway.ops.limits",
)
"""No I/O: these take time and data as arguments."""
IO_LIBRARIES = (
    "aiohttp", "httpx", "fastapi", "starlette", "uvicorn", "redis", "socket", "dns",
    "kubernetes_asyncio",
)

ROOT = Path(__file__).resolve().parents[2] / "gateway"


# ---- The checker ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """``importer`` imports ``target`` at ``line``. A gateway target is the module it
    names (``from gateway.fleet import backend`` -> ``gateway.fleet.backend``); any
    other is the dotted name as written."""

    importer: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.target}"


def matches(module: str, pattern: str) -> bool:
    """Whether ``pattern`` (``a.b`` exactly, or ``a.b.*``: ``a.b`` and below) names it."""
    if pattern.endswith(".*"):
        base = pattern[:-2]
        return module == base or module.startswith(base + ".")
    return module == pattern


def _specificity(pattern: str) -> tuple[int, int]:
    exact = not pattern.endswith(".*")
    return (pattern.removesuffix(".*").count("."), exact)


def placement(module: str) -> tuple[int, str] | None:
    """``(layer, pattern)`` of ``module`` (the simulator: ``(-1, SIMULATOR)``), or None
    when no pattern names it."""
    found = [(layer, p) for layer, pats in enumerate(LAYERS) for p in pats if matches(module, p)]
    if matches(module, SIMULATOR):
        found.append((-1, SIMULATOR))
    if not found:
        return None
    return max(found, key=lambda lp: _specificity(lp[1]))


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under ``root`` (a package directory)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: Iterable[str]) -> str:
    """The longest known module that ``name`` is or lies in (``name`` itself if none)."""
    known = set(known)
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return name


def imports_in(source: str, module: str, is_package: bool, known: Iterable[str]) -> list[Import]:
    """Every import in ``source`` (the text of ``module``), wherever it sits: module level,
    functions, ``if TYPE_CHECKING:`` blocks, ``try`` blocks. Relative imports are resolved
    against ``module`` (a package when ``is_package``)."""
    known = set(known)
    out: list[Import] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(module, _resolve(alias.name, known), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = module.split(".")
                drop = node.level - 1 if is_package else node.level
                base_parts = base_parts[: len(base_parts) - drop]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in known else _resolve(base, known)
                out.append(Import(module, target, node.lineno))
    return out


def import_graph(root: Path = ROOT) -> dict[str, list[Import]]:
    """Module -> its imports, for every module under ``root``."""
    names = module_names(root)
    return {
        name: imports_in(path.read_text(), name, path.name == "__init__.py", names)
        for name, path in names.items()
    }


def _cycles(graph: Mapping[str, Sequence[Import]]) -> list[tuple[list[str], list[str]]]:
    """Per strongly connected group of modules that import each other (Tarjan's
    algorithm; self-imports included): one shortest cycle in it (``[a, b, ..., a]``) and
    the group's members."""
    edges = {m: sorted({i.target for i in imps if i.target in graph}) for m, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in edges[v]:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)

    out = []
    for group in sorted(groups):
        members = set(group)
        start = group[0]
        # the shortest way back to ``start`` inside the group (breadth first)
        parent: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parent:
            nxt = []
            for v in frontier:
                for w in edges[v]:
                    if w in members and w not in parent:
                        parent[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        v = parent[start]
        while v != start:
            path.append(v)
            v = parent[v]
        path.append(start)
        out.append((path[::-1], group))
    return out


def violations(graph: Mapping[str, Sequence[Import]]) -> list[str]:
    """Every breach of the architecture in ``graph`` (module -> its imports), one line
    each, naming the rule; empty when the graph keeps it."""
    out: list[str] = []
    for module in sorted(graph):
        here = placement(module)
        if here is None:
            out.append(f"{module}: in no layer (place it in LAYERS)")
            continue
        layer, pattern = here
        pure = any(matches(module, p) for p in PURE)
        for imp in graph[module]:
            top = imp.target.split(".")[0]
            if pure and top in IO_LIBRARIES:
                out.append(f"{imp}: a pure module imports an I/O library")
            if top != "gateway" or imp.target == module:
                continue
            there = placement(imp.target)
            if there is None:
                continue  # reported once, as a module in no layer
            t_layer, t_pattern = there
            if t_pattern == SIMULATOR:
                if pattern != SIMULATOR and not any(matches(module, p) for p in
                                                    SIMULATOR_IMPORTERS):
                    out.append(f"{imp}: only {', '.join(SIMULATOR_IMPORTERS)} may import "
                               "the simulator")
                continue
            if pattern == SIMULATOR:
                if t_layer > SIMULATOR_MAY_IMPORT_UP_TO:
                    out.append(f"{imp}: the simulator imports layer {t_layer} "
                               f"(it may import layers 0-{SIMULATOR_MAY_IMPORT_UP_TO})")
                continue
            if t_layer > layer:
                out.append(f"{imp}: layer {layer} imports layer {t_layer}")
            elif t_layer == layer and any(
                {pattern, t_pattern} == set(pair) for pair in SIBLINGS
            ):
                out.append(f"{imp}: siblings {pattern} and {t_pattern} import each other")
    for cycle, group in _cycles(graph):
        line = "import cycle: " + " -> ".join(cycle)
        if len(group) > len(cycle) - 1:
            line += f" (one of the cycles among {', '.join(group)})"
        out.append(line)
    return out


# ---- Tests ---------------------------------------------------------------------------------


def test_the_gateway_keeps_its_architecture() -> None:
    found = violations(import_graph())
    assert not found, f"{len(found)} breaches of the architecture:\n" + "\n".join(found)


def _graph(edges: Mapping[str, Sequence[str]]) -> dict[str, list[Import]]:
    graph = {m: [Import(m, t, n + 1) for n, t in enumerate(ts)] for m, ts in edges.items()}
    for targets in edges.values():
        for t in targets:
            if t.startswith("gateway.") and t not in graph:
                graph[t] = []
    return graph


def test_the_checker_reports_each_kind_of_breach() -> None:
    graph = _graph(
        {
            "gateway.core.vocab": ["gateway.api.errors"],  # (a) upward
            "gateway.fleet.backend": ["gateway.proxy.relay"],  # (a) sibling
            "gateway.routing.a": ["gateway.routing.b"],  # (b) cycle a -> b -> c -> a
            "gateway.routing.b": ["gateway.routing.c"],
            "gateway.routing.c": ["gateway.routing.a"],
            "gateway.api.admin": ["gateway.sim.engine"],  # (c) simulator from outside
            "gateway.sim.server": ["gateway.api.errors"],  # (c) simulator upward
            "gateway.traffic.breaker": ["aiohttp.client"],  # (d) I/O in a pure package
            "gateway.pipeline": [],  # (e) in no layer
        }
    )
    found = violations(graph)
    assert found == [
        "gateway.api.admin:1 imports gateway.sim.engine: only gateway.demo, gateway.cli "
        "may import the simulator",
        "gateway.core.vocab:1 imports gateway.api.errors: layer 0 imports layer 5",
        "gateway.fleet.backend:1 imports gateway.proxy.relay: siblings gateway.fleet.* and "
        "gateway.proxy.* import each other",
        "gateway.pipeline: in no layer (place it in LAYERS)",
        "gateway.sim.server:1 imports gateway.api.errors: the simulator imports layer 5 "
        "(it may import layers 0-2)",
        "gateway.traffic.breaker:1 imports aiohttp.client: a pure module imports an I/O "
        "library",
        "import cycle: gateway.routing.a -> gateway.routing.b -> gateway.routing.c -> "
        "gateway.routing.a",
    ]


def test_the_checker_passes_a_graph_that_keeps_the_rules() -> None:
    graph = _graph(
        {
            "gateway.cli": ["gateway.config", "gateway.sim.cli", "argparse"],
            "gateway.demo": ["gateway.sim.runner", "gateway.app"],
            "gateway.app": ["gateway.wiring", "gateway.api.openai", "fastapi"],
            "gateway.api.openai": ["gateway.flow.lease", "gateway.core.vocab", "starlette"],
            "gateway.flow.lease": ["gateway.fleet.backend", "gateway.proxy.upstream"],
            "gateway.fleet.backend": ["gateway.routing.policy", "gateway.fleet.liveness"],
            "gateway.proxy.upstream": ["aiohttp", "gateway.metrics"],
            "gateway.routing.policy": ["gateway.traffic.capacity", "gateway.config"],
            "gateway.sim.runner": ["gateway.sim.server", "gateway.fleet.lifecycle", "uvicorn"],
            "gateway.sim.server": ["gateway.config", "fastapi"],
        }
    )
    assert violations(graph) == []


def test_modules_that_import_each_other_are_one_cycle_group() -> None:
    graph = _graph(
        {
            "gateway.app": ["gateway.api.admin", "gateway.api.ops"],
            "gateway.api.admin": ["gateway.app"],
            "gateway.api.ops": ["gateway.app"],
        }
    )
    assert violations(graph) == [
        "gateway.api.admin:1 imports gateway.app: layer 5 imports layer 6",
        "gateway.api.ops:1 imports gateway.app: layer 5 imports layer 6",
        "import cycle: gateway.api.admin -> gateway.app -> gateway.api.admin (one of the "
        "cycles among gateway.api.admin, gateway.api.ops, gateway.app)",
    ]


def test_every_kind_of_import_is_seen() -> None:
    source = '''
from __future__ import annotations
import socket
from typing import TYPE_CHECKING
from gateway.fleet import backend
from gateway.fleet.backend import Fleet
from . import vocab
from ..routing.policy import Router

if TYPE_CHECKING:
    from gateway.api.errors import Refusal

def later() -> None:
    import gateway.sim.engine
    try:
        from gateway.proxy import relay
    except ImportError:
        pass
'''
    known = [
        "gateway.core.samples",
        "gateway.core.vocab",
        "gateway.fleet",
        "gateway.fleet.backend",
        "gateway.routing.policy",
        "gateway.api.errors",
        "gateway.sim",
        "gateway.sim.engine",
        "gateway.proxy",
        "gateway.proxy.relay",
    ]
    found = [(i.target, i.line) for i in imports_in(source, "gateway.core.samples", False,
                                                     known)]
    assert sorted(found) == sorted(
        [
            ("__future__", 2),
            ("socket", 3),
            ("typing", 4),
            ("gateway.fleet.backend", 5),
            ("gateway.fleet.backend", 6),
            ("gateway.core.vocab", 7),
            ("gateway.routing.policy", 8),
            ("gateway.api.errors", 11),
            ("gateway.sim.engine", 14),
            ("gateway.proxy.relay", 16),
        ]
    )
    # A package's relative import is resolved against the package itself.
    assert [i.target for i in imports_in("from . import vocab", "gateway.core", True, known)] == [
        "gateway.core.vocab"
    ]
