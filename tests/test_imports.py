"""No import cycles: between the files of megatron_dmoe/ and kernels/, nor between their packages.

The imports are read from the source (ast), not by importing, so every import counts: those inside
functions too, which a cycle hides until the function runs. kernels/ is installed as dmoe_kernels
and counts as one package; megatron_dmoe's packages are its first-level folders (config, moe,
parallel, ...), and its top-level modules (cli.py, ...) count as packages of their own.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder
SOURCES = {"megatron_dmoe": ROOT / "megatron_dmoe", "dmoe_kernels": ROOT / "kernels"}


def _modules(sources):
    """Every module's dotted name -> (its file, whether it is a package's __init__)."""
    found = {}
    for top, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join([top, *parts])] = (path, is_package)
    return found


def _imports(name, path, is_package, modules):
    """The modules of `modules` that the file imports anywhere in it, as dotted names."""
    package = name if is_package else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            names = []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            bases = [base]
            names = [base + "." + alias.name for alias in node.names]
        else:
            continue
        submodules = [n for n in names if n in modules]
        if names and len(submodules) == len(names):
            # `from pkg import mod`: the edge goes to the submodule (pkg's __init__ is its parent,
            # which Python imports first anyway, as for any module of pkg)
            targets.update(submodules)
            continue
        targets.update(submodules)
        for base in bases:
            # `import a.b.c` runs a.b.c; take the longest prefix that is one of ours
            while base and base not in modules:
                base = base.rpartition(".")[0]
            if base:
                targets.add(base)
    targets.discard(name)
    return targets


def import_graph(sources=None):
    modules = _modules(sources or SOURCES)
    return {name: _imports(name, path, is_package, modules) for name, (path, is_package) in modules.items()}


def package_of(module):
    top, _, rest = module.partition(".")
    if top == "dmoe_kernels" or not rest:
        return top
    return top + "." + rest.split(".")[0]


def package_graph(graph):
    packages = {}
    for module, targets in graph.items():
        edges = packages.setdefault(package_of(module), set())
        edges.update(package_of(t) for t in targets)
    for package, edges in packages.items():
        edges.discard(package)
    return packages


def cycles(graph):
    """One cycle (a list of nodes, first repeated last) per strongly connected group of nodes."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def connect(node):  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_one_cycle(graph, group) for group in groups]


def _one_cycle(graph, group):
    """A shortest path from the group's first node back to itself inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def _report(found):
    return "\n".join(" -> ".join(cycle) for cycle in found)


def test_no_cycle_between_files():
    found = cycles(import_graph())
    assert not found, "import cycles between files:\n" + _report(found)


def test_no_cycle_between_packages():
    found = cycles(package_graph(import_graph()))
    assert not found, "import cycles between packages:\n" + _report(found)


def test_the_walk_sees_every_kind_of_import(tmp_path):
    """Relative, absolute, submodule and function-local imports all make edges, and cycles show."""
    files = {
        "__init__.py": "",
        "a/__init__.py": "from .x import f\n",
        "a/x.py": "from ..b import y\n\ndef f():\n    from . import z\n",
        "a/z.py": "import pkg.b.y\n",
        "b/__init__.py": "",
        "b/y.py": "def g():\n    from pkg.a.x import f\n",
    }
    for rel, text in files.items():
        (tmp_path / "pkg" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / rel).write_text(text)
    graph = import_graph({"pkg": tmp_path / "pkg"})
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.a.x"},
        "pkg.a.x": {"pkg.b.y", "pkg.a.z"},
        "pkg.a.z": {"pkg.b.y"},
        "pkg.b": set(),
        "pkg.b.y": {"pkg.a.x"},
    }
    assert cycles(graph) == [["pkg.a.x", "pkg.b.y", "pkg.a.x"]]
    assert cycles(package_graph(graph)) == [["pkg.a", "pkg.b", "pkg.a"]]
