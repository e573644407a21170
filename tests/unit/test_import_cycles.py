"""No import cycles in either package, counting every import: function-local ones too (a cycle hidden
inside a function still ties the modules together); within pagoda.config, annotation-only ones as well."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (imports for annotations only, never executed)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *runtime_nodes(child)])
            continue
        yield node
        yield from runtime_nodes(node)


def import_graph(package_dir: Path, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports; ``type_checking``: those under ``if TYPE_CHECKING:`` too."""
    package = package_dir.name
    modules = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree) if type_checking else runtime_nodes(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == package and owner(target) not in ("", name):
                    graph[name].add(owner(target))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", ["runtime/pagoda", "operator/pagoda_operator"])
def test_no_import_cycles(package):
    assert cycles(import_graph(ROOT / package)) == []


def test_the_check_finds_a_cycle_hidden_in_a_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import f\n")
    (package / "b.py").write_text("def f():\n    from pkg import a\n")
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.b"]]


def config_graph(package_dir: Path) -> dict[str, set[str]]:
    """The imports among the modules of ``package_dir``'s config package, annotation-only ones included."""
    prefix = f"{package_dir.name}.config"
    graph = import_graph(package_dir, type_checking=True)
    inside = {m for m in graph if m == prefix or m.startswith(prefix + ".")}
    return {m: graph[m] & inside for m in inside}


def test_config_modules_import_one_way():
    """Arguments, configs and their resolution: resolve uses args, and nothing in pagoda.config comes back to
    it, not even for an annotation (``pagoda.config.create_engine_config(args)``, not a method of the args)."""
    graph = config_graph(ROOT / "runtime" / "pagoda")
    assert "pagoda.config.args" in graph["pagoda.config.resolve"]
    assert cycles(graph) == []


def test_the_config_check_counts_type_checking_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "config").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "config" / "__init__.py").write_text("from pkg.config.resolve import create\n")
    (package / "config" / "args.py").write_text("def create(self):\n    from pkg.config.resolve import create\n")
    (package / "config" / "resolve.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.config.args import Args\n")
    assert cycles(import_graph(package)) == []  # the annotation-only import is not executed
    assert cycles(config_graph(package)) == [["pkg.config.args", "pkg.config.resolve"]]


def test_every_executor_implements_the_protocol():
    from pagoda.executor.base import Executor
    from pagoda.executor.mp import MultiprocExecutor
    from pagoda.executor.ray_executor import RayExecutor
    from pagoda.executor.uni import UniProcExecutor

    for cls in (UniProcExecutor, MultiprocExecutor, RayExecutor):
        assert isinstance(cls.__new__(cls), Executor), cls
        assert not hasattr(cls, "execute")  # the engine core drives submit/wait only


def test_test_files_have_unique_basenames():
    """pytest imports test files by basename: two of the same name in different tiers break collection."""
    names = [path.name for path in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


# The runtime's packages from the bottom up (docs/architecture.md draws them): a module may import its own
# layer and the layers below, never above. Top-level modules count as packages of their own.
RUNTIME_LAYERS = [
    {"__init__", "errors", "sampling_params", "pooling_params", "config", "platform"},  # contracts, configuration,
    # and the device and CPU found once (platform chooses dtype and kernels; config resolves "auto" through it)
    {"process", "cpp_extensions", "ops"},  # this process and its compiled kernels
    {"core", "structured_output"},  # torch-free: scheduling, blocks, sequences, step contracts, grammars
    {"distributed", "kernels", "attention", "layers", "models"},  # collectives and the nn code
    {"sample", "spec_decode"},  # sampling, pooling, logprobs, rejection sampling, draft proposers
    {"kv_transfer"},  # KV connectors (P/D disaggregation): the scheduler's and the runner's halves, over NIXL
    {"worker", "lora"},  # the model runner, KV cache, loading models; LoRA adapters (slots, the layers' hook)
    {"executor"},  # uni, mp, ray: where the runners run
    {"engine"},  # input processing, the engine core, output processing
    {"http"},  # what the server and the router share: OpenAI's error shape, the X-Request-Id middleware
    {"router"},  # the router and the EPP: they talk to servers over HTTP, never import them
    {"entrypoints"},  # LLM, the OpenAI server, the CLI (`pagoda router` included)
    {"bench"},
]
# Imports that cross upwards on purpose, each with its reason.
UPWARD_IMPORTS = {
    # the n-gram proposer is torch-free and proposes on the scheduler's side, from the tokens it holds
    ("pagoda.core.scheduler", "pagoda.spec_decode.ngram_proposer"),
    ("pagoda.core.scheduler", "pagoda.spec_decode.stats"),
}


def layer_of(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for rank, packages in enumerate(RUNTIME_LAYERS):
        if top in packages:
            return rank
    raise AssertionError(f"{module}: package {top!r} has no place in RUNTIME_LAYERS")


def test_runtime_packages_import_downwards_only():
    graph = import_graph(ROOT / "runtime" / "pagoda")
    upward = sorted((a, b) for a, targets in graph.items() for b in targets
                    if layer_of(b) > layer_of(a) and (a, b) not in UPWARD_IMPORTS)
    assert upward == []


def above_the_config(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports from pagoda.config into a higher layer, function-local ones included: the leaf has none,
    not even by an allowance in UPWARD_IMPORTS."""
    config = layer_of("pagoda.config")
    return sorted((a, b) for a, targets in graph.items() if layer_of(a) == config and a.startswith("pagoda.config")
                  for b in targets if layer_of(b) > config)


def test_the_config_imports_nothing_above_it():
    assert above_the_config(import_graph(ROOT / "runtime" / "pagoda")) == []


def test_the_config_check_sees_an_import_made_when_called(tmp_path):
    package = tmp_path / "pagoda"
    for sub in ("config", "worker"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "worker" / "loader.py").write_text("def load():\n    pass\n")
    (package / "config" / "resolve.py").write_text("def create():\n    from pagoda.worker.loader import load\n")
    assert above_the_config(import_graph(package)) == [("pagoda.config.resolve", "pagoda.worker.loader")]


def test_the_router_may_not_import_the_server():
    graph = {"pagoda.router.app": {"pagoda.entrypoints.openai.api_server"}}
    assert [(a, b) for a, bs in graph.items() for b in bs if layer_of(b) > layer_of(a)] == \
        [("pagoda.router.app", "pagoda.entrypoints.openai.api_server")]


def test_the_layer_check_sees_an_upward_import():
    graph = {"pagoda.core.scheduler": {"pagoda.engine.llm_engine"}, "pagoda.engine.llm_engine": set()}
    assert [(a, b) for a, bs in graph.items() for b in bs if layer_of(b) > layer_of(a)] == \
        [("pagoda.core.scheduler", "pagoda.engine.llm_engine")]
