"""The effect handlers and the distributions import no module that imports them back."""

import ast
import os

import pyro_vinit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pyro_vinit.__file__)))


def _modules():
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "pyro_vinit")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[module.removesuffix(".__init__")] = path
    return found


def _imports(path, modules):
    # Every import of a package module, wherever it is: module level, in a function, or
    # under TYPE_CHECKING.
    names = set()
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names & modules.keys()


def _cycle_from(start, graph):
    # A path start -> ... -> start, or None.
    stack, seen = [(start, [start])], set()
    while stack:
        module, path = stack.pop()
        for dep in graph[module]:
            if dep == start:
                return path + [start]
            if dep not in seen:
                seen.add(dep)
                stack.append((dep, path + [dep]))
    return None


def test_no_import_cycle_through_poutine_or_distributions():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    mine = [m for m in modules if m.startswith(("pyro_vinit.poutine", "pyro_vinit.distributions"))]
    assert len(mine) > 10
    cycles = [c for c in (_cycle_from(m, graph) for m in mine) if c is not None]
    assert cycles == []


def test_cycle_finder_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle_from("a", graph) == ["a", "b", "c", "a"]
    assert _cycle_from("d", graph) is None
