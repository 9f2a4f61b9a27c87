"""
The package's architecture (docs/architecture.rst), read from the source with
``ast``: every import of every module of ``pyro_vinit`` (at the top, inside
functions and under ``if TYPE_CHECKING``) makes the module graph, which must
have no cycles and follow the layering rule; no module is over
:data:`MAX_LINES` lines; Pyro's private names are used in
``pyro_vinit/_pyro_compat.py`` only.

The allowlists (:data:`KNOWN_CYCLES`, :data:`OVERSIZED`) hold today's
exceptions, which the architecture restructuring removes: a new exception
fails, and so does an entry that no longer is one (remove it).
"""

import ast
import configparser
import os
from functools import cache

import pyro
from setuptools import find_packages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "pyro_vinit"

#: The layers, lowest first. A module may import the modules of lower layers
#: and those of its own component (its subpackage, or itself for a top-level
#: module); the components of one layer are independent of each other.
#: ``""`` is ``pyro_vinit/__init__.py``, which re-exports the public API.
LAYERS = [
    ["_typing", "_warn"],
    ["_pyro_compat"],
    ["distributions", "schedules", "data"],
    ["guides"],
    ["poutine"],
    ["initialization"],
    ["nn", "metrics"],
    ["training"],
    ["testing"],
    [""],
]

#: Top-level packages of the repository that the library must never import.
OUTSIDE = {"tests", "benchmarks", "examples", "tools", "docs"}

#: Import cycles of today, each as the sorted modules of one strongly connected
#: component. The architecture restructuring of initialization/ and poutine/
#: removes them; do not add to this list.
KNOWN_CYCLES = [
]

MAX_LINES = 600

#: Modules over MAX_LINES today, with their sizes: they may shrink, not grow.
OVERSIZED = {
}

#: The one module allowed to use Pyro's private names.
COMPAT = "pyro_vinit._pyro_compat"

#: Pyro's autoguide sources whose private methods and attributes only
#: ``_pyro_compat`` may touch (on an object other than ``self``).
PYRO_AUTOGUIDE = os.path.join(os.path.dirname(pyro.__file__), "infer", "autoguide")


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@cache
def modules():
    """``{dotted name: path}`` of every module of the package."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


@cache
def parse(name):
    with open(modules()[name]) as f:
        return ast.parse(f.read(), filename=modules()[name])


def rel(name):
    """The path of module ``name`` from the repository's root."""
    return os.path.relpath(modules()[name], ROOT)


def _is_package(name):
    return modules()[name].endswith("__init__.py")


def imported_names(name):
    """Every ``(dotted name, line)`` that module ``name`` imports, anywhere in it;
    ``from a import b`` gives ``a.b``, relative imports are resolved."""
    here = name if _is_package(name) else name.rpartition(".")[0]
    return imports_in(parse(name), here)


def imports_in(tree, here):
    """``(dotted name, line)`` of every import anywhere in ``tree``, a module of
    package ``here``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            out += [(f"{source}.{alias.name}", node.lineno) for alias in node.names]
    return out


def dependency(target):
    """The module of the package that importing ``target`` runs (the longest
    prefix of it that is a module), or None for a name outside the package."""
    while target not in modules():
        if "." not in target:
            return None
        target = target.rpartition(".")[0]
    return target


@cache
def graph():
    """``{module: {imported module: first line}}``, leaving out a module's own
    ancestor packages (importing a submodule runs them anyway)."""
    edges = {}
    for name in modules():
        edges[name] = {}
        for target, line in imported_names(name):
            dep = dependency(target)
            if dep is None or dep == name or name.startswith(dep + "."):
                continue
            edges[name].setdefault(dep, line)
    return edges


def cycles(edges):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def component(name):
    """The top-level part of ``pyro_vinit.<part>...`` ("" for the package itself)."""
    return name.split(".")[1] if "." in name else ""


def layer(name):
    for i, parts in enumerate(LAYERS):
        if component(name) in parts:
            return i
    return None


def test_graph_sees_every_kind_of_import():
    # the three places an import hides: top level, a function, `if TYPE_CHECKING`
    edges = graph()
    assert "pyro_vinit.guides._base" in edges["pyro_vinit.guides.auto_k_tied_normal"]
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pyro_vinit.poutine import layer_call_messenger\n"
        "def f():\n"
        "    from ._site_value import unwrap\n"
    )
    found = {target for target, _ in imports_in(ast.parse(source), "pyro_vinit.poutine")}
    assert "pyro_vinit.poutine.layer_call_messenger" in found
    assert "pyro_vinit.poutine._site_value.unwrap" in found
    # `from pyro_vinit.guides import site_params` imports the submodule
    assert "pyro_vinit.guides.site_params" in edges["pyro_vinit.initialization.baselines"]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        ["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(graph())
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert not new, (
        f"import cycles {new}: move what both modules need into a lower module, or import "
        "the lower-level one only (docs/architecture.rst, the layering rule)")
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"the cycles {gone} are gone: remove them from KNOWN_CYCLES"


def layering_violations(edges):
    """``(module, imported module, line)`` of every import against :data:`LAYERS`."""
    return [(name, dep, line)
            for name, deps in sorted(edges.items()) for dep, line in sorted(deps.items())
            if component(dep) != component(name) and layer(dep) >= layer(name)]


def test_layering():
    edges = graph()
    unplaced = sorted({component(m) for m in edges if layer(m) is None})
    assert not unplaced, (
        f"{unplaced} have no layer: add them to LAYERS here and to docs/architecture.rst")
    wrong = [f"{rel(name)}:{line} imports {dep} (layer {layer(dep)} may not be "
             f"imported from layer {layer(name)}: docs/architecture.rst)"
             for name, dep, line in layering_violations(edges)]
    assert not wrong, "\n".join(wrong)


def test_architecture_page_maps_every_module():
    with open(os.path.join(ROOT, "docs", "architecture.rst")) as f:
        page = f.read()
    missing = []
    for name in sorted(modules()):
        path = rel(name).replace(os.sep, "/")
        folder, _, file = path.rpartition("/")
        if folder == PACKAGE:
            found = f"``{path}``" in page
        else:
            found = f"``{folder}/``" in page and f"``{file}``" in page
        if not found and not (file == "__init__.py" and folder != PACKAGE):
            missing.append(path)
    assert not missing, f"docs/architecture.rst's module map lacks {missing}"
    for parts in LAYERS:
        for part in parts:
            assert f"``{part or 'pyro_vinit/__init__.py'}``" in page, part


def test_nothing_outside_the_package():
    wrong = [f"{rel(name)}:{line} imports {target}"
             for name in sorted(modules())
             for target, line in imported_names(name)
             if target.split(".")[0] in OUTSIDE]
    assert not wrong, "\n".join(wrong)


def test_wheel_holds_the_package_only():
    # setup.cfg's package selection: benchmarks, tests and examples stay out of the wheel
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    include = config["options.packages.find"]["include"].replace(",", " ").split()
    packages = find_packages(ROOT, include=include)
    assert "pyro_vinit" in packages and "pyro_vinit.testing" in packages
    assert {p.split(".")[0] for p in packages} == {PACKAGE}, packages


def _line_count(path):
    with open(path) as f:
        return sum(1 for _ in f)


def test_module_sizes():
    sizes = {os.path.relpath(path, ROOT).replace(os.sep, "/"): _line_count(path)
             for path in modules().values()}
    over = {p: n for p, n in sorted(sizes.items()) if n > MAX_LINES}
    new = {p: n for p, n in over.items() if p not in OVERSIZED}
    assert not new, f"modules over {MAX_LINES} lines: {new}; split them"
    grown = {p: (OVERSIZED[p], n) for p, n in over.items() if p in OVERSIZED and n > OVERSIZED[p]}
    assert not grown, f"oversized modules grew (allowed, now): {grown}; split them"
    fixed = {p: sizes.get(p) for p in OVERSIZED if sizes.get(p, 0) <= MAX_LINES}
    assert not fixed, f"{fixed} are {MAX_LINES} lines or less now (or gone): remove from OVERSIZED"


@cache
def pyro_autoguide_private_names():
    """The private methods and attributes of Pyro's autoguides: defined in a
    class body, or set on ``self``, in ``pyro/infer/autoguide``."""
    names = set()
    for file in os.listdir(PYRO_AUTOGUIDE):
        if not file.endswith(".py"):
            continue
        with open(os.path.join(PYRO_AUTOGUIDE, file)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "self" and isinstance(node.ctx, ast.Store)):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def _root_and_attrs(node):
    """``a.b.c`` as ``("a", ["b", "c"])``; None if it is not rooted at a name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def _is_own(receiver):
    """``self.x``, ``cls.x`` or ``super().x``: a subclass of a Pyro class using its
    own protocol (``Base.x(self)`` inside the override ``def x`` is let through
    where the receiver's name is found)."""
    if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
        return True
    return (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name)
            and receiver.func.id == "super")


def private_pyro_uses(name):
    """``(line, what)`` of every private Pyro name used in module ``name``."""
    tree = parse(name)
    found = []
    # names bound to Pyro modules or objects by the module's imports
    pyro_names = {"pyro"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                and node.module.split(".")[0] == "pyro":
            if any(_private(p) for p in node.module.split(".")):
                found.append((node.lineno, f"from {node.module} import ..."))
            for alias in node.names:
                if _private(alias.name):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
                pyro_names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pyro":
                    if any(_private(p) for p in alias.name.split(".")):
                        found.append((node.lineno, f"import {alias.name}"))
                    pyro_names.add(alias.asname or alias.name.split(".")[0])
    autoguide_private = pyro_autoguide_private_names()

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _root_and_attrs(node)
            if chain is not None and chain[0] in pyro_names:
                # pyro.poutine.runtime._PYRO_STACK, AutoGuide._setup_prototype, ...
                override = chain[1] == [function] and chain[0] != "pyro"
                if not override:
                    found.append((node.lineno, ".".join([chain[0], *chain[1]])))
            elif node.attr in autoguide_private and not _is_own(node.value):
                found.append((node.lineno, f"<object>.{node.attr}"))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return sorted(set(found))


def test_private_pyro_names_only_in_compat():
    wrong = [f"{rel(name)}:{line}: {what}"
             for name in sorted(modules()) if name != COMPAT
             for line, what in private_pyro_uses(name)]
    assert not wrong, (
        "Pyro's private names outside pyro_vinit/_pyro_compat.py (wrap them there, with a "
        "check in tests/test_pyro_compat.py):\n" + "\n".join(wrong))


def test_private_pyro_check_finds_uses(tmp_path, monkeypatch):
    # the check itself: each kind of use is found, the allowed ones are not
    source = (
        "import pyro.poutine.runtime\n"
        "from pyro.infer.autoguide import AutoGuide\n"
        "from pyro.infer.autoguide.utils import _product\n"
        "class G(AutoGuide):\n"
        "    def _setup_prototype(self, *args):\n"
        "        AutoGuide._setup_prototype(self, *args)\n"
        "        super()._setup_prototype(*args)\n"
        "        self._prototype_trace = None\n"
        "def f(guide):\n"
        "    guide._setup_prototype()\n"
        "    AutoGuide._setup_prototype(guide)\n"
        "    return pyro.poutine.runtime._PYRO_STACK, guide._prototype_frames\n"
    )
    path = tmp_path / "m.py"
    path.write_text(source)
    monkeypatch.setitem(modules(), "pyro_vinit._probe", str(path))
    try:
        found = private_pyro_uses("pyro_vinit._probe")
    finally:
        parse.cache_clear()
    assert found == [
        (3, "from pyro.infer.autoguide.utils import _product"),
        (10, "<object>._setup_prototype"),
        (11, "AutoGuide._setup_prototype"),
        (12, "<object>._prototype_frames"),
        (12, "pyro.poutine.runtime._PYRO_STACK"),
    ]


def test_rules_catch_a_new_violation():
    # a lower layer importing a higher one, or a new cycle, fails the checks above
    edges = {k: dict(v) for k, v in graph().items()}
    edges["pyro_vinit.distributions.k_tied_normal"]["pyro_vinit.guides._base"] = 7
    assert layering_violations(edges) == [
        ("pyro_vinit.distributions.k_tied_normal", "pyro_vinit.guides._base", 7)]
    edges = {k: dict(v) for k, v in graph().items()}
    edges["pyro_vinit.guides._base"]["pyro_vinit.guides.auto_k_tied_normal"] = 1
    assert [c for c in cycles(edges) if c not in KNOWN_CYCLES] == [
        ["pyro_vinit.guides._base", "pyro_vinit.guides.auto_k_tied_normal",
         "pyro_vinit.guides.site_params"]]
