import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from pyro_vinit import init_guide, init_guide_iblm, init_guide_pretrained
from pyro_vinit.initialization._marks import mark_initialized, marked_initialized
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp


def _problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 4, generator=g)
    y = (x[:, 0] > 0).long()
    model = BayesianClassifier(bayesianize(mlp((4, 8, 2)), keep_weights=True), num_data=200)
    return model, x, y


INITIALIZERS = {
    "iblm": lambda guide, data: init_guide_iblm(guide, data),
    "pretrained": lambda guide, data: init_guide_pretrained(guide, data),
    "baseline": lambda guide, data: init_guide(guide, data, method="heuristic"),
}


@pytest.mark.parametrize("initialize", INITIALIZERS.values(), ids=list(INITIALIZERS))
def test_each_initializer_marks_the_guide_it_wrote(initialize):
    model, x, y = _problem()
    guide = AutoNormal(model)
    assert not marked_initialized(guide)
    initialize(guide, (x, y))
    assert marked_initialized(guide)


@pytest.mark.parametrize("initialize", INITIALIZERS.values(), ids=list(INITIALIZERS))
def test_a_failed_initializer_marks_nothing(initialize):
    model, x, y = _problem()
    guide = AutoNormal(model)
    with pytest.raises(ValueError, match="the model fails on the first rows of the data"):
        initialize(guide, (x[:, :3], y))  # the layer takes 4 features
    assert not marked_initialized(guide)


def test_the_mark_lives_no_longer_than_the_guide():
    import gc
    import weakref

    model, _, _ = _problem()
    guide = AutoNormal(model)
    mark_initialized(guide)
    ref = weakref.ref(guide)
    del guide
    gc.collect()
    assert ref() is None
