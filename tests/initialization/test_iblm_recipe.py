"""
The training recipe after I-BLM keeps its head start: the KL term weighted
by 0.1, with I-BLM's standard deviations capped at a tenth of the prior's
(``max_scale_ratio=0.1``; see ``benchmarks/bench_iblm_recipe.py``). Without it, SVI with the full
ELBO pulls the hidden layers' means towards the prior's zero and the test
error rises.
"""

import pyro
import pytest
import torch
from pyro.infer import SVI, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_vinit import AutoKTiedNormal, init_guide_iblm
from pyro_vinit.data import load_digits
from pyro_vinit.guides import site_params
from pyro_vinit.metrics import error_rate, mnll
from pyro_vinit.nn import BayesianClassifier, BayesianRegressor, bayesianize, mlp
from pyro_vinit.poutine import KLAnnealingMessenger

STEPS = 200
MARGIN = 0.03  # the bar: test error at most that of the start + 0.03
SCALE_CAP = 0.1
KL_WEIGHT = 0.1


@pytest.fixture(scope="module")
def digits():
    return load_digits()


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
    guide = init_guide_iblm(AutoKTiedNormal(model, rank=2), (x, y), batch_size=512,
                            max_scale_ratio=SCALE_CAP if recipe else None)
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
    # the predictive: the full ELBO's wash-out costs the MNLL too (0.12 against
    # 0.5-0.7 after 200 steps in benchmarks/bench_iblm_recipe.py)
    assert end[1] < 0.5 * end_full[1], (end, end_full)
    # the mechanism: the full KL pulls the hidden means towards the prior's 0
    # (|loc| x0.54 in 200 steps against x0.69 with the recipe, seed 0) and the
    # head start is lost, so the assertions above are not vacuous
    assert shrink_full < shrink - 0.1, (shrink, shrink_full)
    # (test error 0.033 -> 0.059, MNLL 0.11 -> 0.53 in 200 steps, seed 0)
    assert end_full[1] > 2 * start_full[1], (start_full, end_full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("Guide", [AutoNormal, AutoKTiedNormal])
def test_max_scale_ratio_caps_the_written_stds(Guide, dtype):
    """The cap is min(posterior std, ratio x prior std) per weight; the means are untouched."""
    pyro.set_rng_seed(0)
    x = torch.randn(40, 3, dtype=dtype)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=dtype) + 0.1 * torch.randn(40, dtype=dtype)
    net = bayesianize(mlp((3, 4, 1)), prior_scale=2.0).to(dtype)
    model = BayesianRegressor(net, num_data=40, noise_scale=1.0)

    def init(ratio):
        pyro.clear_param_store()
        pyro.set_rng_seed(1)
        guide = init_guide_iblm(Guide(model), (x, y), batch_size=40, max_scale_ratio=ratio)
        return {name: tuple(t.detach().clone() for t in site_params.get_loc_and_scale(guide, name))
                for name in site_params.latent_sites(guide)}

    free, capped = init(None), init(0.05)
    binding = 0
    for name, (loc, scale) in free.items():
        cap_loc, cap_scale = capped[name]
        assert torch.allclose(cap_loc, loc), name
        if Guide is AutoNormal:  # an exact projection: the cap itself
            assert torch.allclose(cap_scale, scale.clamp(max=0.05 * 2.0)), name
        else:  # rank-k refit of the capped matrix: no std above the cap, beyond round-off
            assert (cap_scale <= 0.1 * 1.01 + 1e-6).all(), name
        binding += int((scale > 0.1).sum())
    assert binding > 0, "the cap should bind somewhere, or the test is vacuous"


@pytest.mark.parametrize("ratio", [0.0, -1.0, float("nan"), True])
def test_max_scale_ratio_must_be_positive(ratio):
    with pytest.raises(ValueError, match="max_scale_ratio must be positive"):
        init_guide_iblm(AutoNormal(lambda: None), (torch.zeros(1),), max_scale_ratio=ratio)
