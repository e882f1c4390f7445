"""The package's import graph, read with ast (nothing is imported): no cycles, and the layering holds: layers/,
models/, kernels/, checkpoint/ and sampling/ never import from engine/ or distributed/ (but for distributed/group.py,
the tensor-parallel group the layers' collectives use). Imports inside functions count too (a lazy import still ties
two modules together); imports under `if TYPE_CHECKING:` do not."""
import ast
import os

import nanovllm

PACKAGE_DIR = os.path.dirname(nanovllm.__file__)
LOWER_LAYERS = ("nanovllm.layers", "nanovllm.models", "nanovllm.kernels", "nanovllm.checkpoint", "nanovllm.sampling")
UPPER_LAYERS = ("nanovllm.engine", "nanovllm.distributed")
ALLOWED = ("nanovllm.distributed.group",)


def _modules() -> dict[str, str]:
    """module name -> file path, for every module of the package."""
    modules = {}
    root = os.path.dirname(PACKAGE_DIR)
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = os.path.join(folder, name)
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package modules `module` imports."""
    tree = ast.parse(open(path).read(), path)
    is_package = path.endswith("__init__.py")
    found: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:
                    found.add(target)  # `from package import module`
                elif base in modules:
                    found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path) per strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def test_the_graph_is_read():
    graph = _graph()
    assert "nanovllm.engine.llm_engine" in graph
    assert "nanovllm.engine.scheduler" in graph["nanovllm.engine.llm_engine"]
    assert "nanovllm.layers.context" in graph["nanovllm.layers.embed_head"]
    assert "nanovllm.distributed.group" in graph["nanovllm.layers.linear"]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_lower_layers_never_import_the_engine():
    bad = [f"{module} imports {target}" for module, targets in sorted(_graph().items())
           if module.startswith(LOWER_LAYERS) for target in sorted(targets)
           if target.startswith(UPPER_LAYERS) and target not in ALLOWED]
    assert bad == []


def test_the_checks_can_fail(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    probe = tmp_path / "probe.py"
    probe.write_text("from nanovllm.engine.sequence import Sequence\nfrom typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    import nanovllm.engine.other\n"
                     "def lazy():\n    from nanovllm.engine import scheduler\n")
    modules = dict.fromkeys(["nanovllm.layers.x", "nanovllm.engine", "nanovllm.engine.sequence",
                             "nanovllm.engine.other", "nanovllm.engine.scheduler"], "")
    assert _imports("nanovllm.layers.x", str(probe), modules) == {"nanovllm.engine.sequence",
                                                                   "nanovllm.engine.scheduler"}
