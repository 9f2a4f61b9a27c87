"""
I-BLM's ``standardize_hidden`` (``_standardize.py``): each hidden unit whose
pre-activation is on one side of zero on nearly every row (its regression's
intercept dominates) rescaled to mean 0 and std 1 on the data, its direction
and relative uncertainties kept; the others as fitted; by default for
classification only.
"""

import pyro
import pytest
import torch
import torch.nn.functional as F
from pyro.infer.autoguide import AutoNormal
from torch import nn

from pyro_vinit import IBLMGuideInitializer, init_guide_iblm
from pyro_vinit.data import load_digits, toy_regression
from pyro_vinit.initialization._collective import LocalCollective
from pyro_vinit.initialization._regressions import unit_statistics
from pyro_vinit.initialization._standardize import standardize_units
from pyro_vinit.initialization._tracing import Layer
from pyro_vinit.nn import BayesianClassifier, BayesianRegressor, bayesianize, mlp
from tests.common import assert_close


def _state(guide):
    return {k: v.detach().clone() for k, v in guide.state_dict().items()}


def _cnn(groups=1, bias=True):
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=bias), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=groups), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16 * 4 * 4, 10))


def _init(net, x, y, **options):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = BayesianClassifier(bayesianize(net).double())
    guide = AutoNormal(model)
    init_guide_iblm(guide, (x, y), batch_size=256, **options)
    return guide


@pytest.fixture(scope="module")
def images():
    x, y, _, _ = load_digits(image=True)
    return x[:600].double(), y[:600]


def _moments(z):
    """Per channel of a conv output: the mean and std over the images and positions."""
    return z.mean((0, 2, 3)), z.std((0, 2, 3), unbiased=False)


def _deep(module, name):
    for part in name.split("."):
        module = getattr(module, part)
    return module


def test_off_centre_units_are_standardized_and_the_others_kept(images):
    x, y = images
    plain = _init(_cnn(), x, y, standardize_hidden=False)
    standard = _init(_cnn(), x, y, standardize_hidden=True)
    p, q = plain.median(), standard.median()
    z0 = F.conv2d(x, p["net.0.weight"], p["net.0.bias"], padding=1)
    mu, sigma = _moments(z0)
    # the first layer's regressions: active on (nearly) every patch, their intercept
    # following the class rows' small noise
    assert (mu.abs() > 2 * sigma).all()
    factor = sigma.reciprocal()
    assert_close(q["net.0.weight"], factor[:, None, None, None] * p["net.0.weight"], rtol=1e-9)
    z1 = F.conv2d(x, q["net.0.weight"], q["net.0.bias"], padding=1)
    mu1, sigma1 = _moments(z1)
    assert_close(mu1, torch.zeros_like(mu), atol=1e-9)
    assert_close(sigma1, torch.ones_like(sigma), rtol=1e-9)
    assert 0.2 < (z1 > 0).double().mean() < 0.8
    # the standard deviations stay where a unit is scaled up (every unit here)
    assert (factor > 1).all()
    for name in ("net.0.weight", "net.0.bias"):
        assert torch.equal(_deep(standard.scales, name), _deep(plain.scales, name))
    # the second layer's units, on the standardized features: those on both sides of
    # zero as fitted, the others standardized
    z2 = F.conv2d(z1.relu(), q["net.2.weight"], q["net.2.bias"], stride=2, padding=1)
    mu2, sigma2 = _moments(z2)
    standardized = (mu2.abs() < 1e-9) & ((sigma2 - 1).abs() < 1e-9)
    assert ((mu2.abs() <= 2 * sigma2 + 1e-9) | standardized).all()


def _regression(x, y, standardize, bias=True):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    net = nn.Sequential(nn.Linear(1, 10, bias=bias), nn.Tanh(), nn.Linear(10, 1))
    model = BayesianRegressor(bayesianize(net).double(), noise_scale=0.1)
    guide = AutoNormal(model)
    init_guide_iblm(guide, (x, y), batch_size=20, standardize_hidden=standardize)
    return guide


def test_a_layer_without_a_latent_bias_is_left_as_fitted():
    # inputs in [4, 6]: a bias-free unit's pre-activation w x has one sign on every row,
    # and no bias can move its threshold
    x, y, _, _ = toy_regression(60)
    x, y = x.double() / 10 + 5.0, y.double() + 4.0
    plain, standard = (_state(_regression(x, y, s, bias=False)) for s in (False, True))
    w = plain["locs.net.0.weight_unconstrained"]
    z = x @ w.T
    assert (z.mean(0).abs() > 2 * z.std(0, unbiased=False)).any()
    assert plain.keys() == standard.keys()
    assert all(torch.equal(plain[k], standard[k]) for k in plain)


def test_grouped_convolutions_are_standardized_per_channel(images):
    x, y = images
    median = _init(_cnn(groups=2), x, y, standardize_hidden=True).median()
    z1 = F.conv2d(x, median["net.0.weight"], median["net.0.bias"], padding=1)
    z2 = F.conv2d(z1.relu(), median["net.2.weight"], median["net.2.bias"], stride=2, padding=1,
                  groups=2)
    for z in (z1, z2):
        mu, sigma = _moments(z)
        # every unit on both sides of zero on a good share of the rows
        assert (mu.abs() <= 2 * sigma + 1e-9).all()
        assert ((mu.abs() < 1e-9) & ((sigma - 1).abs() < 1e-9)).any()


def test_the_output_layer_is_never_standardized(images):
    x, y = images
    for output_rows in (4096, None):
        median = _init(_cnn(), x, y, standardize_hidden=True, output_rows=output_rows).median()
        h = F.conv2d(x, median["net.0.weight"], median["net.0.bias"], padding=1).relu()
        h = F.conv2d(h, median["net.2.weight"], median["net.2.bias"], stride=2, padding=1)
        out = F.linear(h.relu().flatten(1), median["net.5.weight"], median["net.5.bias"])
        assert out.std(0, unbiased=False).sub(1.0).abs().max() > 0.1


def test_default_is_for_classification_only(images):
    x, y = images
    states = [_state(_init(_cnn(), x, y, **options))
              for options in ({}, {"standardize_hidden": True}, {"standardize_hidden": False})]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not all(torch.equal(states[0][k], states[2][k]) for k in states[0])

    x, y, _, _ = toy_regression(60)
    # targets far from zero: hidden units fitted off centre, standardized only when asked
    states = [_state(_regression(x.double(), y.double() + 4.0, standardize))
              for standardize in (None, False, True)]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not all(torch.equal(states[0][k], states[2][k]) for k in states[0])


def test_constant_units_are_left_as_fitted():
    # every input zero: each hidden unit's pre-activation is its bias, a constant
    x = torch.zeros(40, 5, dtype=torch.float64)
    y = torch.arange(40) % 3
    runs = []
    for standardize in (False, True):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model = BayesianClassifier(bayesianize(mlp((5, 6, 3))).double())
        guide = AutoNormal(model)
        init_guide_iblm(guide, (x, y), batch_size=16, standardize_hidden=standardize)
        runs.append(_state(guide))
    assert runs[0].keys() == runs[1].keys()
    for name in runs[0]:
        assert torch.isfinite(runs[1][name]).all()
        assert torch.equal(runs[0][name], runs[1][name]), name


@pytest.mark.parametrize("value", [0.5, "yes"])
def test_standardize_hidden_must_be_none_or_a_bool(value):
    with pytest.raises(ValueError, match="standardize_hidden must be None, True or False"):
        IBLMGuideInitializer(standardize_hidden=value)


@pytest.mark.parametrize("spread", [0.5, 2.0])
def test_a_unit_is_standardized_where_its_level_exceeds_twice_its_spread(spread):
    # x = (1, t), t of mean 0 and std 1: unit j's pre-activation a_j + s_j t + 1 has level
    # a_j + 1 and spread |s_j|
    t = torch.tensor([-1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    inputs = torch.stack([torch.ones(4, dtype=torch.float64), t], 1)
    ratios = torch.tensor([0.5, 1.9, 2.1, 6.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    s = torch.full((7,), spread, dtype=torch.float64)
    s[4] = 0.0  # a constant unit, level 2
    s[6] = 1e-4  # and one constant to a ten-millionth, level 1000
    a = torch.where(s > 0, ratios * spread, torch.full_like(s, 2.0)) - 1.0
    a[6] = 999.0
    weight, bias = torch.stack([a, s], 1), torch.ones(7, dtype=torch.float64)
    layer = Layer("linear", "w", torch.Size([7, 2]), bias_name="b")
    mean = torch.cat([weight, bias[:, None]], 1)
    var = torch.rand_like(mean)
    out_mean, out_var = standardize_units(layer, inputs, mean, var, LocalCollective(), 64)
    # a row at a time: the moments summed over the chunks
    chunked = standardize_units(layer, inputs, mean, var, LocalCollective(), 1)
    assert_close(chunked[0], out_mean) and assert_close(chunked[1], out_var)
    for j in (0, 1, 4, 5, 6):  # level within twice the spread (5: exactly), or constant
        assert torch.equal(out_mean[j], mean[j]) and torch.equal(out_var[j], var[j]), j
    for j in (2, 3):
        assert_close(out_mean[j, :2], weight[j] / spread)
        assert_close(out_mean[j, 2], -a[j] / spread)
        assert_close(inputs @ out_mean[j, :2] + out_mean[j, 2], t)
        # the variances shrink with a unit scaled down, and stay where it is scaled up
        assert_close(out_var[j], var[j] / max(spread, 1.0) ** 2)


def test_a_fixed_bias_leaves_the_layer_as_fitted():
    inputs = torch.stack([torch.ones(4), torch.tensor([-1.0, 1.0, -1.0, 1.0])], 1)
    mean, var = torch.tensor([[5.0, 0.5]]), torch.ones(1, 2)
    layer = Layer("linear", "w", torch.Size([1, 2]), fixed_bias=torch.ones(1))
    out_mean, out_var = standardize_units(layer, inputs, mean, var, LocalCollective(), 64)
    assert torch.equal(out_mean, mean) and torch.equal(out_var, var)


def test_one_row_a_linear_unit_is_constant_and_a_convolution_has_its_positions():
    linear = Layer("linear", "w", torch.Size([2, 2]), bias_name="b")
    # (levels 6 and 0.5, far beyond a spread counted from two rows)
    mean = torch.tensor([[0.5, 0.25, 5.0], [0.5, -2.0, 4.0]], dtype=torch.float64)
    var = torch.ones_like(mean)
    row = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    out = standardize_units(linear, row, mean, var, LocalCollective(), 64)
    assert torch.equal(out[0], mean) and torch.equal(out[1], var)

    conv = Layer("conv2d", "w", torch.Size([1, 1, 2, 2]), bias_name="b",
                 kwargs={"stride": 1, "padding": 0, "dilation": 1, "groups": 1})
    image = torch.arange(9.0, dtype=torch.float64).reshape(1, 1, 3, 3)
    mean = torch.tensor([[1.0, 0.0, 0.0, 0.0, 10.0]], dtype=torch.float64)  # z: 10 + pixel
    out_mean, _ = standardize_units(conv, image, mean, torch.ones_like(mean),
                                    LocalCollective(), 64)
    z = F.conv2d(image, out_mean[:, :4].reshape(1, 1, 2, 2), out_mean[:, 4])
    assert_close(z.mean(), torch.zeros((), dtype=z.dtype), atol=1e-12)
    assert_close(z.std(unbiased=False), torch.ones((), dtype=z.dtype))


@pytest.mark.parametrize("op, spatial, kwargs", [
    ("conv1d", (9,), dict(stride=2, padding=1, dilation=1, groups=1)),
    ("conv2d", (6, 5), dict(stride=1, padding="same", dilation=2, groups=2)),
    ("conv3d", (4, 4, 3), dict(stride=(1, 2, 1), padding=0, dilation=1, groups=1)),
])
def test_moments_from_the_op_equal_those_of_the_patches(op, spatial, kwargs):
    # The standardization's moments of a convolution's outputs, from F.<op> (in chunks
    # of 3 rows), equal those of its patches times its weight: every position of every row.
    groups, h, c, k = kwargs["groups"], 4, 4, (3,) * len(spatial)
    shape = torch.Size((h, c // groups) + k)
    layer = Layer(op, "w", shape, kwargs)
    x = torch.randn((7, c) + spatial, dtype=torch.float64)
    weight = torch.randn(h, shape[1:].numel(), dtype=torch.float64)
    sumsq, (first, second), rows = unit_statistics(layer, x, weight, 3)
    none, (first_op, second_op), rows_op = unit_statistics(layer, x, weight, 3, squares=False)
    out = getattr(F, op)(x, weight.reshape(shape), None, **kwargs)
    assert sumsq is not None and none is None
    assert rows == rows_op == out[:, 0].numel()
    assert_close(first_op, out.transpose(0, 1).reshape(h, -1).sum(1), rtol=1e-12, atol=1e-12)
    assert_close(first_op, first, rtol=1e-12, atol=1e-12)
    assert_close(second_op, second, rtol=1e-12, atol=1e-12)
