"""The shape of the I-BLM package: typed options in step with IBLMOptions, and
no import cycle among the modules of ``pyro_vinit.initialization``."""

import ast
import dataclasses
import inspect
import pathlib

import pytest
import torch

from pyro_vinit.initialization import IBLMGuideInitializer, init_guide_iblm
from pyro_vinit.initialization._options import IBLMOptions
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

PACKAGE = pathlib.Path(__file__).parents[2] / "pyro_vinit" / "initialization"


def _keyword_options(fn):
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


@pytest.mark.parametrize("fn", [init_guide_iblm, IBLMGuideInitializer.__init__],
                         ids=["init_guide_iblm", "IBLMGuideInitializer"])
def test_options_are_typed_keywords_with_the_options_defaults(fn):
    fields = {f.name: f.default for f in dataclasses.fields(IBLMOptions)}
    assert _keyword_options(fn) == fields
    hints = inspect.signature(fn).parameters
    assert all(hints[name].annotation is not inspect.Parameter.empty for name in fields)


def test_misspelled_option_is_refused_before_any_work():
    from pyro.infer.autoguide import AutoNormal

    model = BayesianClassifier(bayesianize(mlp((4, 3))))
    guide = AutoNormal(model)
    with pytest.raises(TypeError, match="batch_sise"):
        init_guide_iblm(guide, (torch.randn(8, 4), torch.randint(0, 3, (8,))),
                        batch_sise=4)  # type: ignore[call-arg]
    assert guide.prototype_trace is None  # not even set up


def _imports(path):
    """Every pyro_vinit.initialization module ``path`` imports, at any depth of
    the file (functions and ``if TYPE_CHECKING:`` blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("pyro_vinit.initialization."):
                leaf = name.split(".")[2]
                if (PACKAGE / f"{leaf}.py").exists():
                    found.add(leaf)
    return found


def test_no_import_cycle_among_the_modules():
    graph = {p.stem: _imports(p) - {p.stem} for p in PACKAGE.glob("*.py")
             if p.stem != "__init__"}
    done, path = set(), []

    def visit(module):
        if module in path:
            pytest.fail(f"import cycle: {' -> '.join(path[path.index(module):] + [module])}")
        if module in done:
            return
        path.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


# every option away from its default (and from None), valid together
_NON_DEFAULTS = dict(
    batch_size=7, output_rows=9, alpha=0.5, center_targets=True, alternate_hidden_signs=False,
    hidden_target_scale=0.5, hidden_columns="random", hidden_batches="random",
    propagate="sample", noise_scale=0.3, estimate_noise=False, strict=True, solver="dual",
    jitter=1e-4, max_scale_ratio=0.25, max_pool_size=99, chunk_rows=33,
    max_chunk_elements=1000, input_rank=5,
)


def test_options_and_process_group_reach_the_pipeline(monkeypatch):
    # what init_guide_iblm and IBLMGuideInitializer hand on: the options (defaults, and
    # each one given) and the process group, down to every guide's collective
    from pyro.infer.autoguide import AutoDelta, AutoGuideList, AutoNormal

    from pyro_vinit.initialization import iblm
    from pyro_vinit.initialization._collective import LocalCollective

    assert {f.name for f in dataclasses.fields(IBLMOptions)} == set(_NON_DEFAULTS)
    group = object()  # (check_process_group refuses it outside torch.distributed)
    monkeypatch.setattr(iblm, "check_process_group", lambda process_group: None)
    calls = []
    monkeypatch.setattr(iblm, "_initialize",
                        lambda guide, data, options, pg: calls.append((options, pg)) or guide)
    guide, data = object(), (torch.zeros(2, 4),)
    for kwargs in ({}, _NON_DEFAULTS):
        init_guide_iblm(guide, data, group, **kwargs)
        IBLMGuideInitializer(group, **kwargs)(guide, data)
        assert calls == [(IBLMOptions(**kwargs), group)] * 2
        calls.clear()
    monkeypatch.undo()

    groups = []

    def collective_for(process_group):
        groups.append(process_group)
        return LocalCollective()

    monkeypatch.setattr(iblm, "check_process_group", lambda process_group: None)
    monkeypatch.setattr(iblm, "collective_for", collective_for)
    model = BayesianClassifier(bayesianize(mlp((4, 3))))
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    init_guide_iblm(AutoNormal(model), (x, y), group, batch_size=20)
    guides = AutoGuideList(model)
    guides.append(AutoNormal(model))
    guides.append(AutoDelta(lambda *args: None))
    with pytest.warns(UserWarning, match="1: AutoDelta"):
        init_guide_iblm(guides, (x, y), group, batch_size=20)
    assert groups == [group, group]
