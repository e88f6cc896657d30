"""The project's imports run one way (README.md, "Files, in reading order"): the graph of its own
modules (every import, at the top of a file or inside a function; tests/, docs/ and benchmarks/
left out: nothing imports them) has no circle."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("harness", "toyworld")


def project_modules() -> dict:
    """{module name: path}: the top-level files and the two packages' modules."""
    modules = {name[:-3]: os.path.join(REPO, name) for name in os.listdir(REPO) if name.endswith(".py")}
    for package in PACKAGES:
        for name in os.listdir(os.path.join(REPO, package)):
            if name.endswith(".py"):
                module = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                modules[module] = os.path.join(REPO, package, name)
    return modules


def imports_of(module: str, path: str, modules: dict) -> set:
    """The project modules `module` imports: `import a.b`, `from a import b` (b a module, else a),
    `from . import b` and `from .b import c` inside a package (at the top level: beside it)."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(part for part in (package, base) if part)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules and name != module}


def find_circle(graph: dict):
    """A list of modules that import each other round to the first, or None."""
    state = {}  # module: "open" while on the path, "done" after

    def visit(module, path):
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state and (circle := visit(other, path + [other])):
                return circle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (circle := visit(module, [module])):
            return circle
    return None


def test_the_project_imports_in_one_direction():
    modules = project_modules()
    graph = {module: imports_of(module, path, modules) for module, path in modules.items()}
    assert "toyworld.causal" in graph["harness.analysis"]  # the harness runs the toy world,
    assert "harness.files" in graph["toyworld.pretrain"]  # which takes its files from the leaf
    circle = find_circle(graph)
    assert circle is None, "an import circle: " + " -> ".join(circle)


def test_the_circle_finder_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
