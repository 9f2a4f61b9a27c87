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
    max_chunk_elements=1000, input_rank=5, kl_weight=0.3, standardize_hidden=True,
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


_PREFIX = "IBLMGuideInitializer: "


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=0), "batch_size must be positive, got 0"),
    (dict(batch_size=-3), "batch_size must be positive, got -3"),
    (dict(batch_size=2.0), "batch_size must be positive, got 2.0"),  # an int option
    (dict(batch_size=True), "batch_size must be positive, got True"),  # not a bool
    (dict(max_pool_size=0), "max_pool_size must be positive, got 0"),
    (dict(chunk_rows=0), "chunk_rows must be positive, got 0"),
    (dict(max_chunk_elements=0), "max_chunk_elements must be positive, got 0"),
    (dict(alpha=0.0), "alpha must be positive, got 0.0"),
    (dict(alpha=float("nan")), "alpha must be positive, got nan"),
    (dict(alpha="0.1"), "alpha must be positive, got '0.1'"),
    (dict(jitter=-1e-6), "jitter must be positive, got -1e-06"),
    (dict(output_rows=0), "output_rows must be positive, got 0"),
    (dict(output_rows=8.0), "output_rows must be positive, got 8.0"),
    (dict(input_rank=0), "input_rank must be positive, got 0"),
    (dict(noise_scale=0.0), "noise_scale must be positive, got 0.0"),
    (dict(hidden_target_scale=-1.0), "hidden_target_scale must be positive, got -1.0"),
    (dict(max_scale_ratio=0), "max_scale_ratio must be positive, got 0"),
    (dict(center_targets="yes"), "center_targets must be None, True or False, got 'yes'"),
    (dict(alternate_hidden_signs=0.5),
     "alternate_hidden_signs must be None, True or False, got 0.5"),
    (dict(estimate_noise="auto"), "estimate_noise must be None, True or False, got 'auto'"),
    (dict(strict=None), "strict must be a bool, got None"),
    (dict(strict=1), "strict must be a bool, got 1"),
    (dict(hidden_columns="any"),
     "hidden_columns must be one of ('cyclic', 'random'), got 'any'"),
    (dict(hidden_batches="slab"), "hidden_batches must be one of ('local', 'random'), got 'slab'"),
    (dict(propagate="mode"), "propagate must be one of ('mean', 'sample'), got 'mode'"),
    (dict(solver="lu"), "solver must be one of ('auto', 'primal', 'dual'), got 'lu'"),
    (dict(noise_scale=0.3, estimate_noise=True),
     "pass either noise_scale (a fixed regression noise) or estimate_noise=True, not both"),
])
def test_bad_option_is_refused_with_its_name_and_value(kwargs, message):
    with pytest.raises(ValueError) as error:
        IBLMOptions(**kwargs)
    assert str(error.value) == _PREFIX + message
    with pytest.raises(ValueError) as error:
        IBLMGuideInitializer(**kwargs)
    assert str(error.value) == _PREFIX + message


@pytest.mark.parametrize("kwargs", [
    dict(batch_size=1, max_pool_size=1, chunk_rows=1, max_chunk_elements=1, output_rows=1,
         input_rank=1),
    dict(alpha=1, jitter=1e-300, noise_scale=1e-300, hidden_target_scale=2,
         max_scale_ratio=1e-300),  # (an int for a float option)
    dict(output_rows=None, input_rank=None, noise_scale=None, hidden_target_scale=None,
         max_scale_ratio=None),
    dict(center_targets=False, alternate_hidden_signs=True, estimate_noise=True),
    dict(noise_scale=0.3, estimate_noise=False),
])
def test_edge_options_are_accepted(kwargs):
    options = IBLMOptions(**kwargs)
    assert all(getattr(options, name) == value for name, value in kwargs.items())


@pytest.mark.parametrize("center, alternate", [(None, None), (False, False), (True, True),
                                               (True, False), (False, True)])
def test_center_and_alternate_defaults_follow_the_task(center, alternate):
    # None: centered for classification, alternating signs for regression
    options = IBLMOptions(center_targets=center, alternate_hidden_signs=alternate)
    for classification in (True, False):
        assert options.center(classification) is (
            classification if center is None else center)
        assert options.alternate(classification) is (
            (not classification) if alternate is None else alternate)
