"""The package's import structure, read from the source (ast): no cycles between modules, no import of a higher
layer, and benchmarks that do not reach into tests/. Imports under `if TYPE_CHECKING:` are annotations, not
dependencies, and are not counted; imports inside functions are."""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path
from typing import Container

REPO = Path(__file__).resolve().parents[2]

# elastic_rt's areas (a sub-package, or a top-level module), lowest first. An area imports its own modules and
# areas of lower layers only; areas of one layer do not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),  # the one error hierarchy
    # vocabulary, syntax, torch's seams, what a metric is
    ("decisions", "worker_env", "torchrun_compat", "sections", "torch_seams", "metric_spec"),
    ("checks", "collectors", "data", "checkpoint", "worker_reports", "interfaces"),  # leaves on their data sources
    ("elastic_rt", "rendezvous", "metrics", "diagnostics"),  # elastic_rt: the package root, the training script's API
    ("goodput", "doctor", "status"),
    ("report", "worker"),  # worker: what runs inside worker processes
    ("agent",),
    ("launch_config", "launch"),  # launch_config: flags -> the agent's frozen configuration; launch: the composition root
    ("chaos",),  # reads agents' command lines with launch_config's grammar
    ("cli",),
)
# Edges that break the rule today, each with the place that owns its removal.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
# benchmarks/ scripts that still import a tests/ harness: alert_latency runs tests/support/node_loss.py's job,
# which needs tests/chaos's node harness and the tests' Prometheus server.
KNOWN_BENCHMARK_TEST_IMPORTS = {"alert_latency"}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_names(source: str, modules: Container[str] = ()) -> set[str]:
    """Every absolute module name `source` imports at run time: `from a import b` gives a.b when that is one of
    `modules`, else a."""
    names: set[str] = set()
    stack: list[ast.AST] = [ast.parse(source)]
    while stack:
        for child in ast.iter_child_nodes(stack.pop()):
            if _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                for alias in child.names:
                    sub = f"{child.module}.{alias.name}"
                    names.add(sub if sub in modules else child.module)
            stack.append(child)
    return names


def module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports, for every .py file under root/package."""
    modules: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return {name: {n for n in imported_names(path.read_text(), modules) if n in modules and n != name}
            for name, path in modules.items()}


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_violations(graph: dict[str, set[str]], layers=LAYERS, known=KNOWN_UPWARD) -> list[str]:
    """'a.b -> c.d (area x, layer i, imports area y, layer j)' for each import not into a lower layer."""
    layer_of = {name: i for i, names in enumerate(layers) for name in names}
    out = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = area(source), area(target)
            if a == b or (a, b) in known:
                continue
            if a not in layer_of or b not in layer_of:
                out.append(f"{source} -> {target}: area {a if a not in layer_of else b!r} is in no layer")
            elif layer_of[b] >= layer_of[a]:
                out.append(f"{source} -> {target} (area {a}, layer {layer_of[a]}, imports {b}, layer {layer_of[b]})")
    return out


@functools.lru_cache(maxsize=1)
def _package_graph() -> dict[str, set[str]]:
    return module_graph(REPO, "elastic_rt")


def _without_known(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {s: {t for t in ts if (area(s), area(t)) not in KNOWN_UPWARD} for s, ts in graph.items()}


# ---- the package ---------------------------------------------------------------------------------------
def test_the_package_has_no_import_cycles():
    assert cycles(_without_known(_package_graph())) == []


def test_no_area_imports_a_higher_or_sibling_layer():
    assert layer_violations(_package_graph()) == []


def test_every_area_is_placed_in_a_layer():
    areas = {area(m) for m in _package_graph()}
    placed = {name for names in LAYERS for name in names}
    assert areas == placed, f"not in LAYERS: {sorted(areas - placed)}; gone: {sorted(placed - areas)}"


def test_the_package_does_not_need_the_repositorys_etcd_testbed():
    """etcd_testbed/ is not installed: no module of the package may import it."""
    reaching = {source for source, path in _module_paths().items()
                if any(n == "etcd_testbed" or n.startswith("etcd_testbed.") for n in imported_names(path.read_text()))}
    assert reaching == set()


def _module_paths() -> dict[str, Path]:
    return {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in sorted((REPO / "elastic_rt").rglob("*.py"))}


# ---- benchmarks/ ---------------------------------------------------------------------------------------
def _benchmark_scripts() -> dict[str, Path]:
    return {p.stem: p for p in sorted((REPO / "benchmarks").glob("*.py"))}


def test_benchmarks_have_no_cycles_and_do_not_import_tests():
    scripts = _benchmark_scripts()
    imports = {name: imported_names(path.read_text()) for name, path in scripts.items()}
    graph = {name: {n for n in names if n in scripts and n != name} for name, names in imports.items()}
    assert cycles(graph) == []
    reaching = {name for name, names in imports.items() if any(n == "tests" or n.startswith("tests.") for n in names)}
    assert reaching == KNOWN_BENCHMARK_TEST_IMPORTS


# ---- the checker itself --------------------------------------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_a_cycle_and_an_upward_import(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "def f():\n    from pkg.high import b\n",  # upward, inside a function
        "pkg/high/__init__.py": "",
        "pkg/high/b.py": "from pkg.low.a import f\n",
        "pkg/high/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import b\n",
    })
    graph = module_graph(tmp_path, "pkg")
    assert graph["pkg.high.c"] == set()  # annotations only
    assert cycles(graph) == [["pkg.high.b", "pkg.low.a"]]
    layers = (("pkg", "low"), ("high",))
    assert layer_violations(graph, layers, known={}) == [
        "pkg.low.a -> pkg.high.b (area low, layer 0, imports high, layer 1)"]
    assert layer_violations(graph, layers, known={("low", "high"): "allowed"}) == []
    assert layer_violations(graph, (("pkg", "low"),), known={})[0].endswith("area 'high' is in no layer")


def test_imports_are_read_without_running_them():
    source = "import os\nfrom a.b import c, d\nfrom . import e\n"
    assert imported_names(source) == {"os", "a.b"}
    assert imported_names(source, modules={"a.b.c"}) == {"os", "a.b", "a.b.c"}
    assert os.path.isdir(REPO / "elastic_rt")
