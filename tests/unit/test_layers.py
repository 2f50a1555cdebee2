"""The import graph of the package: no cycle, and no arrow from a lower layer up to a higher one.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING`` (a type-only
arrow still ties two rooms together for a reader). The layers, lowest first, are the ones
``docs/architecture.md`` draws; a module may import its own room and any lower layer.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rdq_core", "rdq_testing")

# (layer, rooms): a room is a module or package prefix; earlier layers are lower.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vocabulary", ("rdq_core.errors", "rdq_core.model", "rdq_core.ids", "rdq_core.text",
                    "rdq_core.validation", "rdq_core.flow", "rdq_core.events", "rdq_core.problems")),
    ("storage", ("rdq_core.storage",)),
    ("aws", ("rdq_core.aws",)),
    ("engine", ("rdq_core.engine",)),
    ("targets", ("rdq_core.targets",)),
    ("clients", ("rdq_core.client", "rdq_core.client_protocol", "rdq_core.http_client", "rdq_core.examples")),
    ("facade", ("rdq_core",)),
    ("hosts", ("rdq_core.hosts",)),
    ("kit", ("rdq_core.compliance", "rdq_testing")),
)
# Layers that sit side by side: neither may import the other.
SIDE_BY_SIDE = {frozenset({"storage", "aws"})}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[: -(node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache  # read once per run: two tests walk the same graph
def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node)
                for alias in node.names:
                    # ``from package import submodule`` is an arrow to the submodule
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in modules else base)
            for target in targets:
                while target and target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def layer_of(module: str) -> tuple[int, str]:
    best: tuple[int, int, str] | None = None  # (prefix length, rank, layer)
    for rank, (layer, rooms) in enumerate(LAYERS):
        for room in rooms:
            if module == room or module.startswith(room + "."):
                if best is None or len(room) > best[0]:
                    best = (len(room), rank, layer)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best[1], best[2]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module are the cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_has_no_cycle() -> None:
    cycles = strongly_connected(import_graph())
    assert cycles == [], "modules that import each other, directly or around a circle: " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles)


def test_no_module_imports_a_higher_layer_or_a_side_by_side_one() -> None:
    wrong = []
    for module, targets in sorted(import_graph().items()):
        rank, layer = layer_of(module)
        for target in sorted(targets):
            target_rank, target_layer = layer_of(target)
            if target_layer == layer:
                continue
            if target_rank > rank or frozenset({layer, target_layer}) in SIDE_BY_SIDE:
                wrong.append(f"{module} ({layer}) -> {target} ({target_layer})")
    assert wrong == [], "imports against the layers:\n" + "\n".join(wrong)


def test_the_checker_sees_a_cycle_and_an_upward_arrow() -> None:
    # The two checks above would pass on an empty graph; make sure they can fail.
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert layer_of("rdq_core.storage.spi")[0] < layer_of("rdq_core.engine.claiming")[0]
    assert layer_of("rdq_core.hosts.cli.main")[1] == "hosts"


@pytest.mark.parametrize("layer, rooms", LAYERS)
def test_every_room_of_a_layer_exists_and_the_architecture_doc_names_it(layer: str, rooms: tuple[str, ...]) -> None:
    modules = _modules()
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for room in rooms:
        assert room in modules, f"{room} is listed in layer {layer} but does not exist"
        named = room.replace(".", "/") in doc or room in doc
        assert named, f"docs/architecture.md does not name {room}"
