"""
The training recipe after I-BLM keeps its head start: the KL term weighted
by 0.1, with I-BLM's standard deviations capped at a tenth of the prior's
(see ``benchmarks/bench_iblm_recipe.py``). Without it, SVI with the full
ELBO pulls the hidden layers' means towards the prior's zero and the test
error rises.
"""

import pyro
import pytest
import torch
from pyro.infer import SVI, TraceMeanField_ELBO

from pyro_vinit import AutoKTiedNormal, init_guide_iblm
from pyro_vinit.data import load_digits
from pyro_vinit.guides import site_params
from pyro_vinit.metrics import error_rate, mnll
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import KLAnnealingMessenger

STEPS = 200
MARGIN = 0.03  # the bar: test error at most that of the start + 0.03
SCALE_CAP = 0.1
KL_WEIGHT = 0.1


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def _cap_scales(guide, ratio):
    """Each site's std capped at ``ratio`` times its prior std, written back through
    the guide's projection (the proposed ``init_guide_iblm(..., max_scale=ratio)``)."""
    with torch.no_grad():
        for name, site in guide.prototype_trace.iter_stochastic_nodes():
            loc, scale = site_params.get_loc_and_scale(guide, name)
            prior_scale = site["fn"].base_dist.scale.expand(loc.shape)
            site_params.set_loc_and_scale(guide, name, loc.clone(),
                                          torch.minimum(scale, ratio * prior_scale))


@torch.no_grad()
def _test_metrics(model, guide, x, y, num_samples=32):
    """Test error and MNLL of the Monte Carlo predictive."""
    logits = torch.stack([
        pyro.poutine.replay(model, trace=pyro.poutine.trace(guide).get_trace(x))(x)
        for _ in range(num_samples)
    ])
    return error_rate(y, logits=logits).item(), mnll(y, logits=logits).item()


def _train(digits, recipe):
    """Test (error, MNLL) right after I-BLM and after STEPS steps, and the ratio of
    a hidden layer's mean |loc| after to before."""
    x, y, x_test, y_test = digits
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    model = BayesianClassifier(bayesianize(mlp((64,) + (100,) * 5 + (10,))), num_data=len(x))
    guide = init_guide_iblm(AutoKTiedNormal(model, rank=2), (x, y), batch_size=512)
    if recipe:
        _cap_scales(guide, SCALE_CAP)
    hidden = "net.4.weight"
    loc_before = site_params.get_loc_and_scale(guide, hidden)[0].detach().abs().mean()
    start = _test_metrics(model, guide, x_test, y_test)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), TraceMeanField_ELBO())
    annealing = KLAnnealingMessenger(KL_WEIGHT if recipe else 1.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        batch = torch.randint(len(x), (128,), generator=g)
        with annealing:
            svi.step(x[batch], y[batch])
    loc_after = site_params.get_loc_and_scale(guide, hidden)[0].detach().abs().mean()
    return start, _test_metrics(model, guide, x_test, y_test), (loc_after / loc_before).item()


def test_recipe_keeps_the_head_start(digits):
    with pyro.validation_enabled(False):  # speed; the guides' distributions are tested elsewhere
        start, end, shrink = _train(digits, recipe=True)
        # control: the same loop with the full ELBO and the guide as I-BLM wrote it
        start_full, end_full, shrink_full = _train(digits, recipe=False)
    assert start[0] < 0.15, "I-BLM should start well on digits"
    assert end[0] <= start[0] + MARGIN, (start, end)
    # the cap: I-BLM's per-unit regressions leave stds near the prior's, whose
    # weight noise costs the predictive's MNLL (0.19 against 0.15 capped, seed 0)
    assert start[1] < 0.9 * start_full[1], (start, start_full)
    # the mechanism: the full KL pulls the hidden means towards the prior's 0
    # (|loc| x0.54 in 200 steps against x0.69 with the recipe, seed 0) and the
    # head start is lost, so the assertions above are not vacuous
    assert shrink_full < shrink - 0.1, (shrink, shrink_full)
    assert end_full[0] > start_full[0] + MARGIN, (start_full, end_full)
