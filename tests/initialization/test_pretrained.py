import copy
import os
import re
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal, init_guide_pretrained
from pyro_vinit.data import load_digits
from pyro_vinit.guides.site_params import get_loc_and_scale
from pyro_vinit.initialization.iblm import extract_patches
from pyro_vinit.nn import BayesianClassifier, BayesianRegressor, bayesianize, mlp
from tests.common import assert_close

GUIDES = [AutoNormal, AutoDiagonalNormal, AutoKTiedNormal, AutoRadialNormal]


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def _train(net, x, y, steps=300, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(steps):
        batch = torch.randint(len(x), (128,))
        opt.zero_grad()
        F.cross_entropy(net(x[batch]), y[batch]).backward()
        opt.step()
    return net


@pytest.fixture(scope="module")
def trained_mlp(digits):
    x, y, _, _ = digits
    torch.manual_seed(0)
    return _train(mlp((64, 32, 10)), x, y)


def _trained_cnn(digits, channels, groups):
    x, y, _, _ = digits
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(),
                        nn.Conv2d(4, channels, 3, stride=2, groups=groups),
                        nn.ReLU(), nn.Flatten(), nn.Linear(channels * 2 * 2, 10))
    return _train(net, x.reshape(-1, 1, 8, 8), y)


@pytest.fixture(scope="module")
def trained_cnn(digits):
    return _trained_cnn(digits, 8, groups=2)


def _snapshot(guide):
    store = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    return {k: v.detach().clone() for k, v in guide.state_dict().items()}, store


def _assert_unchanged(guide, before):
    state, store = before
    after = guide.state_dict()
    assert after.keys() == state.keys()
    for k in state:
        assert torch.equal(after[k], state[k]), k
    assert set(pyro.get_param_store().keys()) == set(store)
    for k, v in pyro.get_param_store().items():
        assert torch.equal(v.detach(), store[k]), k


def _median_logits(model, guide, x, y):
    with torch.no_grad():
        median = guide.median(x[:2], y[:2])
        return pyro.poutine.condition(model, data=median)(x)


# ---------------------------------------------------------------- the trained predictions


@pytest.mark.parametrize("guide_class", GUIDES)
@pytest.mark.parametrize("scale", ["iblm", "moped"])
def test_median_is_the_trained_network(digits, trained_mlp, guide_class, scale):
    x, y, x_test, y_test = digits
    net = copy.deepcopy(trained_mlp)
    with torch.no_grad():
        expected = net(x_test)
    model = BayesianClassifier(bayesianize(net, keep_weights=True), num_data=len(x))
    guide = guide_class(model)
    assert init_guide_pretrained(guide, (x, y), scale=scale) is guide
    logits = _median_logits(model, guide, x_test, y_test)
    assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    # the predictive of posterior draws: within a small margin of the trained net
    with torch.no_grad():
        draws = Predictive(model, guide=guide, num_samples=32,
                           return_sites=["_RETURN"])(x_test)["_RETURN"]
    probs = draws.softmax(-1).mean(0)
    error = (probs.argmax(-1) != y_test).double().mean()
    trained_error = (expected.argmax(-1) != y_test).double().mean()
    assert error <= trained_error + 0.02
    nll = -probs[torch.arange(len(y_test)), y_test].log().mean()
    assert nll <= F.cross_entropy(expected, y_test) + 0.05


def test_conv_median_is_the_trained_network(digits, trained_cnn):
    x, y, x_test, y_test = digits
    x, x_test = x.reshape(-1, 1, 8, 8), x_test.reshape(-1, 1, 8, 8)
    net = copy.deepcopy(trained_cnn)
    with torch.no_grad():
        expected = net(x_test)
    model = BayesianClassifier(bayesianize(net, keep_weights=True), num_data=len(x))
    guide = AutoKTiedNormal(model, rank=2)
    init_guide_pretrained(guide, (x, y))
    logits = _median_logits(model, guide, x_test, y_test)
    assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_batch_norm_median_is_the_trained_network_in_eval_mode(digits):
    # The running statistics of a trained BatchNorm (a momentum average over the
    # training batches) differ from its input's statistics over the data; they are the
    # trained network's, and stay: the median in eval mode predicts as it does.
    x, y, x_test, y_test = digits
    x, x_test = x.reshape(-1, 1, 8, 8), x_test.reshape(-1, 1, 8, 8)
    torch.manual_seed(0)
    net = _train(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                               nn.Linear(4 * 6 * 6, 10)), x, y, steps=100)
    net.eval()
    with torch.no_grad():
        expected = net(x_test)
    running = {k: v.clone() for k, v in net[1].state_dict().items()}
    model = BayesianClassifier(bayesianize(net, keep_weights=True), num_data=len(x))
    # in train mode, each run of the model on the data would move them too
    for train, scale in [(False, "iblm"), (False, "moped"), (True, "iblm"), (True, "moped")]:
        guide = AutoNormal(model.train(train))
        init_guide_pretrained(guide, (x, y), scale=scale)
        assert model.training == train
        for k, v in net[1].state_dict().items():
            assert torch.equal(v, running[k]), k
        model.eval()
        assert_close(_median_logits(model, guide, x_test, y_test), expected, atol=1e-5,
                     rtol=1e-5)


# ---------------------------------------------------------------- the standard deviations


@pytest.fixture(scope="module")
def trained_depthwise(digits):
    # one unit per group: each output channel reads one input channel
    return _trained_cnn(digits, 4, groups=4)


@pytest.mark.parametrize("noise_ratio, network", [
    (None, "trained_cnn"),  # None: the default, 1
    (0.5, "trained_cnn"),
    (None, "trained_depthwise"),
])
def test_iblm_scales_closed_form(digits, noise_ratio, network, request):
    x, y, _, _ = digits
    x = x.reshape(-1, 1, 8, 8)[:300]
    net = copy.deepcopy(request.getfixturevalue(network))
    with torch.no_grad():
        hidden = F.relu(net[0](x))  # the second conv's input in the trained network
    w, b = net[2].weight.detach(), net[2].bias.detach()
    model = BayesianClassifier(bayesianize(net, keep_weights=True), num_data=len(x))
    guide = AutoNormal(model)
    kwargs = {} if noise_ratio is None else {"noise_ratio": noise_ratio}
    init_guide_pretrained(guide, (x, y[:300]), **kwargs)
    # By hand: unit j (group j // per_group) regresses from its group's 3x3 patches
    # (stride 2) of its group's input channels
    units, groups = net[2].out_channels, net[2].groups
    per_group, fan_in = units // groups, 4 // groups * 9
    patches = extract_patches(hidden, (3, 3), stride=2)  # (N, P, 4 * 9)
    expected_w, expected_b = torch.empty_like(w), torch.empty_like(b)
    prior_var = 1.0 / fan_in  # N(0, 1 / fan-in)
    for j in range(units):
        g = j // per_group
        rows = patches[..., g * fan_in:(g + 1) * fan_in].reshape(-1, fan_in)
        z = rows @ w[j].reshape(-1)
        noise_var = (noise_ratio or 1.0) ** 2 * z.var(unbiased=False)
        expected_w[j] = (1 / prior_var + rows.square().sum(0) / noise_var).reciprocal().sqrt() \
            .reshape(w[j].shape)
        expected_b[j] = (1 / prior_var + len(rows) / noise_var) ** -0.5
    loc, scale = get_loc_and_scale(guide, "net.2.weight")
    assert torch.equal(loc, w)
    assert_close(scale, expected_w, rtol=1e-4, atol=1e-7)
    loc, scale = get_loc_and_scale(guide, "net.2.bias")
    assert torch.equal(loc, b)
    assert_close(scale, expected_b, rtol=1e-4, atol=1e-7)


def test_iblm_scales_of_a_constant_unit_are_the_prior(digits):
    x, y, _, _ = digits
    net = mlp((64, 3, 10))
    with torch.no_grad():
        net[0].weight[1] = 0.0  # unit 1's output is its bias on every row
    model = BayesianClassifier(bayesianize(net, keep_weights=True), num_data=len(x))
    guide = AutoNormal(model)
    init_guide_pretrained(guide, (x, y))
    _, scale = get_loc_and_scale(guide, "net.0.weight")
    assert_close(scale[1], torch.full((64,), 64**-0.5))
    assert (scale[0] < 64**-0.5).any()


def test_iblm_scales_from_one_row_are_the_prior():
    # on one data row every unit's output is constant: the data tell nothing, the prior
    net = mlp((4, 3, 2))
    model = BayesianClassifier(bayesianize(net, keep_weights=True))
    guide = AutoNormal(model)
    init_guide_pretrained(guide, (torch.randn(1, 4), torch.tensor([1])))
    for name, fan_in in [("net.0.weight", 4), ("net.0.bias", 4), ("net.2.weight", 3)]:
        _, scale = get_loc_and_scale(guide, name)
        assert_close(scale, torch.full_like(scale, fan_in**-0.5), atol=0, rtol=1e-6)


def _linear_regression(sizes=None):
    """A function model y ~ N(x w^T, 1) with its weight site "w" (2, 3), summed over
    outputs; records the rows of every call in ``sizes``."""

    def model(x, y=None):
        if sizes is not None:
            sizes.append(x.shape[0])
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(F.linear(x, w).sum(-1), 1.0), obs=y)

    return model


def test_reads_at_most_10000_rows_in_chunks_of_4096():
    # the defaults max_pool_size=10_000 and chunk_rows=4096: of 10_001 rows, the pass over
    # the data (after the set-up's runs on 256) runs the model on 4096, 4096 and 1808
    sizes = []
    x, y = torch.randn(10_001, 3), torch.randn(10_001)
    guide = AutoNormal(_linear_regression(sizes))
    init_guide_pretrained(guide, (x, y), weights={"w": torch.ones(2, 3)})
    assert max(sizes) == 4096 and sizes[-3:] == [4096, 4096, 1808], sizes


@pytest.mark.parametrize("scale", ["iblm", "moped"])
def test_reads_at_most_max_pool_size_rows_in_chunks_of_chunk_rows(scale):
    # of 250 rows, a pool of 100: the set-up runs on at most all of them, and "iblm"'s pass
    # over the data runs the model on chunks of 30 (MOPED's scales need no pass)
    sizes = []
    x, y = torch.randn(250, 3), torch.randn(250)
    guide = AutoNormal(_linear_regression(sizes))
    init_guide_pretrained(guide, (x, y), weights={"w": torch.ones(2, 3)}, scale=scale,
                          max_pool_size=100, chunk_rows=30)
    assert max(sizes) == 100, sizes
    assert scale == "moped" or sizes[-4:] == [30, 30, 30, 10], sizes


def test_moped_scales_and_cap(digits, trained_mlp):
    x, y, _, _ = digits
    net = copy.deepcopy(trained_mlp)
    w = net[2].weight.detach().clone()
    model = BayesianClassifier(bayesianize(net, keep_weights=True), num_data=len(x))
    guide = AutoNormal(model)
    init_guide_pretrained(guide, (x, y), scale="moped", delta=0.5)
    assert_close(get_loc_and_scale(guide, "net.2.weight")[1], 0.5 * w.abs())
    init_guide_pretrained(guide, (x, y), scale="moped", delta=0.5, max_scale_ratio=0.1)
    cap = 0.1 * 32**-0.5
    assert_close(get_loc_and_scale(guide, "net.2.weight")[1], (0.5 * w.abs()).clamp_max(cap))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_moped_gives_an_exact_zero_weight_a_tiny_positive_scale(digits, trained_mlp, dtype):
    # a pruned weight or a bias that stayed at zero: its scale δ·0 was floored before it was
    # squared, so the variance underflowed to 0 and the write refused the scale
    x, y, _, _ = digits
    net = copy.deepcopy(trained_mlp).to(dtype)
    with torch.no_grad():
        net[0].bias[0] = 0.0
        net[2].weight[:, :3] = 0.0
    model = BayesianClassifier(bayesianize(net, keep_weights=True), num_data=len(x))
    guide = AutoNormal(model)
    init_guide_pretrained(guide, (x.to(dtype), y), scale="moped")
    for name in ("net.0.bias", "net.2.weight"):
        scale = get_loc_and_scale(guide, name)[1]
        assert bool((scale > 0).all()) and scale.dtype == dtype
    tiny = torch.finfo(dtype).tiny
    assert get_loc_and_scale(guide, "net.0.bias")[1][0] <= 2 * tiny ** 0.5
    assert get_loc_and_scale(guide, "net.2.weight")[1][:, :3].max() <= 2 * tiny ** 0.5


def test_weights_given_by_name(digits, trained_mlp):
    x, y, x_test, y_test = digits
    net = copy.deepcopy(trained_mlp)
    with torch.no_grad():
        expected = net(x_test)
    weights = {f"net.{k}": v.detach().clone() for k, v in net.named_parameters()}
    model = BayesianClassifier(bayesianize(net), num_data=len(x))  # the weights are not kept
    guide = AutoNormal(model)
    init_guide_pretrained(guide, (x, y), weights=weights)
    assert_close(_median_logits(model, guide, x_test, y_test), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_trained_values_of_the_root_module_and_of_a_permuted_layout(transposed):
    # a root PyroModule's own sites ("w", "b": no path before the name), with its trained
    # values as buffers; the bias site (2, 2) used transposed, flattened, and the weight
    # site as drawn or as its transpose (3, 4): the medians are the trained values, each
    # in its site's layout
    w, b = torch.randn(3, 4) if transposed else torch.randn(4, 3), torch.randn(2, 2)

    class Root(PyroModule):
        def __init__(self):
            super().__init__()
            self.w = PyroSample(dist.Normal(0.0, 1.0).expand(w.shape).to_event(2))
            self.b = PyroSample(dist.Normal(0.0, 1.0).expand([2, 2]).to_event(2))
            self.register_buffer("trained_w", w)
            self.register_buffer("trained_b", b)

        def forward(self, x, y=None):
            logits = F.linear(x, self.w.T if transposed else self.w, self.b.T.reshape(4))
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Categorical(logits=logits), obs=y)

    x, y = torch.randn(20, 3), torch.randint(4, (20,))
    guide = AutoNormal(Root())
    init_guide_pretrained(guide, (x, y))
    assert torch.equal(get_loc_and_scale(guide, "w")[0], w)
    assert torch.equal(get_loc_and_scale(guide, "b")[0], b)


def test_trained_values_of_layers_the_model_does_not_call_are_ignored():
    # bayesianize(net, keep_weights=True) keeps the trained values of every layer, also of
    # one the model leaves out (net[2] here): they are not an error, unlike unknown names
    # in weights=
    class FirstLayer(PyroModule):
        def __init__(self):
            super().__init__()
            self.net = bayesianize(mlp((3, 4, 2)), keep_weights=True)

        def forward(self, x, y=None):
            h = self.net[0](x)
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Normal(h.sum(-1), 1.0), obs=y)

    model = FirstLayer()
    guide = AutoNormal(model)
    init_guide_pretrained(guide, (torch.randn(20, 3), torch.randn(20)))
    assert torch.equal(get_loc_and_scale(guide, "net.0.weight")[0], model.net[0].trained_weight)


def test_weights_are_taken_in_the_sites_dtype(digits, trained_mlp):
    # float32 weights for a float64 model: the same guide as their exact float64 copies
    x, y, _, _ = digits
    x = x[:300].double()
    weights = {f"net.{k}": v.detach().clone() for k, v in trained_mlp.named_parameters()}
    params = []
    for given in (weights, {k: v.double() for k, v in weights.items()}):
        pyro.clear_param_store()
        model = BayesianClassifier(bayesianize(copy.deepcopy(trained_mlp).double()))
        guide = AutoNormal(model)
        init_guide_pretrained(guide, (x, y[:300]), weights=given)
        params.append({k: v.detach().clone() for k, v in guide.named_parameters()})
    assert params[0].keys() == params[1].keys()
    for k, v in params[0].items():
        assert v.dtype == torch.float64 and torch.equal(v, params[1][k]), k


def _trained_regressor(rows=300, noise=0.3, seed=0):
    """A ReLU MLP 3-8-1 trained by least squares on a noisy linear function; the data,
    and the root mean square residual."""
    torch.manual_seed(seed)
    x = torch.randn(rows, 3)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + noise * torch.randn(rows)
    net = mlp((3, 8, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(200):
        opt.zero_grad()
        F.mse_loss(net(x).squeeze(-1), y).backward()
        opt.step()
    with torch.no_grad():
        rms = (y - net(x).squeeze(-1)).pow(2).mean().sqrt()
    return net, x, y, rms


def test_regression_with_prior_at_the_weights(digits):
    net, x, y, _ = _trained_regressor(rows=200, noise=0.1)
    with torch.no_grad():
        expected = net(x).squeeze(-1)
    model = BayesianRegressor(bayesianize(net, keep_weights=True, prior_loc="weights"), 0.1)
    guide = AutoNormal(model)
    init_guide_pretrained(guide, (x, y))
    assert_close(_median_logits(model, guide, x, y), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("guide_class", GUIDES)
def test_learned_noise_param_starts_at_the_residuals_std(guide_class):
    # BayesianRegressor(learn_noise=True): a positive PyroParam, written as the
    # trained network's root mean square residual on the data
    net, x, y, rms = _trained_regressor()
    assert 0.2 < rms < 0.5  # about the data's noise, 0.3
    model = BayesianRegressor(bayesianize(net, keep_weights=True), num_data=300,
                              learn_noise=True)
    init_guide_pretrained(guide_class(model), (x, y))
    assert_close(model.noise_scale.detach(), rms, rtol=1e-4, atol=0)


def test_learned_noise_site_starts_at_the_residuals_std():
    # a functional model whose noise is a latent site: the guide's median at the
    # residuals' std, its spread min(0.1, 1 / sqrt(2 n)) on the log scale
    net, x, y, rms = _trained_regressor()
    weights = {f"{k}": v.detach() for k, v in net.named_parameters()}

    def model(x, y=None):
        sigma = pyro.sample("sigma", dist.LogNormal(0.0, 1.0))
        w0 = pyro.sample("0.weight", dist.Normal(0.0, 1.0).expand([8, 3]).to_event(2))
        b0 = pyro.sample("0.bias", dist.Normal(0.0, 1.0).expand([8]).to_event(1))
        w1 = pyro.sample("2.weight", dist.Normal(0.0, 1.0).expand([1, 8]).to_event(2))
        b1 = pyro.sample("2.bias", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
        mean = F.linear(torch.relu(F.linear(x, w0, b0)), w1, b1).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)

    guide = AutoNormal(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sigma is started: no site left uncovered
        init_guide_pretrained(guide, (x, y), weights=weights, strict=True)
    loc, scale = get_loc_and_scale(guide, "sigma")
    assert_close(loc.exp(), rms, rtol=1e-4, atol=0)
    assert_close(scale, torch.tensor(min(0.1, (2.0 * 300) ** -0.5)), rtol=1e-6, atol=0)
    assert_close(guide.median()["0.weight"], net[0].weight.detach(), rtol=0, atol=0)


# ---------------------------------------------------------------- bad input


def test_weights_not_kept_leaves_guide_and_store_unchanged(digits, trained_mlp):
    x, y, _, _ = digits
    model = BayesianClassifier(bayesianize(copy.deepcopy(trained_mlp)), num_data=len(x))
    guide = AutoNormal(model)
    guide(x[:2], y[:2])
    before = _snapshot(guide)
    message = ("init_guide_pretrained: no trained values for the layer sites ['net.0.weight', "
               "'net.0.bias', 'net.2.weight', 'net.2.bias']. Convert the trained network with "
               "bayesianize(net, keep_weights=True), or pass weights={site name: tensor}")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        init_guide_pretrained(guide, (x, y))
    _assert_unchanged(guide, before)


def test_fresh_guide_stays_unset_on_failure(digits, trained_mlp):
    x, y, _, _ = digits
    model = BayesianClassifier(bayesianize(copy.deepcopy(trained_mlp)), num_data=len(x))
    guide = AutoNormal(model)
    with pytest.raises(ValueError, match="keep_weights=True"):
        init_guide_pretrained(guide, (x, y))
    assert guide.prototype_trace is None
    assert not list(pyro.get_param_store().keys())


def test_untrained_network_is_refused(digits):
    x, y, _, _ = digits
    net = mlp((64, 8, 10))
    for p in net.parameters():
        nn.init.zeros_(p)
    model = BayesianClassifier(bayesianize(net, keep_weights=True), num_data=len(x))
    guide = AutoNormal(model)
    guide(x[:2], y[:2])
    before = _snapshot(guide)
    message = ("init_guide_pretrained: every layer's trained weights are zero: was the network "
               "trained? Train it before bayesianize(net, keep_weights=True), or start from "
               "scratch with init_guide_iblm")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        init_guide_pretrained(guide, (x, y))
    _assert_unchanged(guide, before)


@pytest.mark.parametrize("change, match", [
    (lambda w: w.update({"net.0.weight": torch.zeros(3, 3)}), "has shape"),
    (lambda w: w.update({"net.5.weight": torch.zeros(3, 3)}), "not weight or bias sites"),
    (lambda w: w.pop("net.2.bias"), "^" + re.escape(
        "init_guide_pretrained: no trained values for the layer sites ['net.2.bias']. Convert "
        "the trained network with bayesianize(net, keep_weights=True), or pass "
        "weights={site name: tensor}; the weights given are for ['net.0.bias', "
        "'net.0.weight', 'net.2.weight']") + "$"),
    (lambda w: w["net.0.bias"].fill_(float("nan")), "not finite"),
])
def test_bad_weights(digits, trained_mlp, change, match):
    x, y, _, _ = digits
    net = copy.deepcopy(trained_mlp)
    weights = {f"net.{k}": v.detach().clone() for k, v in net.named_parameters()}
    change(weights)
    model = BayesianClassifier(bayesianize(net), num_data=len(x))
    guide = AutoNormal(model)
    guide(x[:2], y[:2])
    before = _snapshot(guide)
    with pytest.raises(ValueError, match=match):
        init_guide_pretrained(guide, (x, y), weights=weights)
    _assert_unchanged(guide, before)


def test_trained_value_that_is_not_a_tensor_is_refused():
    guide = AutoNormal(_linear_regression())
    with pytest.raises(TypeError, match="^init_guide_pretrained: the trained value of 'w' must be "
                                        "a tensor, got list$"):
        init_guide_pretrained(guide, (torch.randn(8, 3), torch.randn(8)),
                              weights={"w": [[1.0] * 3] * 2})
    assert guide.prototype_trace is None


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(scale="map"), ValueError, "scale must be one of"),
    (dict(noise_ratio=0.0), ValueError, "noise_ratio must be a positive"),
    (dict(delta=float("nan")), ValueError, "delta must be a positive"),
    (dict(noise_ratio=True), ValueError,
     "^init_guide_pretrained: noise_ratio must be a positive finite number, got True$"),
    (dict(delta="0.1"), ValueError,
     "^init_guide_pretrained: delta must be a positive finite number, got '0.1'$"),
    (dict(max_scale_ratio=-1.0), ValueError, "max_scale_ratio must be a positive"),
    (dict(strict=1), TypeError, "strict must be a bool"),
    (dict(weights=[1.0]), TypeError,
     "^init_guide_pretrained: weights must be a dict of site name to tensor, got list$"),
    (dict(max_pool_size=0), ValueError,
     "^init_guide_pretrained: max_pool_size must be a positive int, got 0$"),
    (dict(max_pool_size=True), ValueError,
     "^init_guide_pretrained: max_pool_size must be a positive int, got True$"),
    (dict(chunk_rows=0), ValueError,
     "^init_guide_pretrained: chunk_rows must be a positive int, got 0$"),
    (dict(chunk_rows=-8), ValueError,
     "^init_guide_pretrained: chunk_rows must be a positive int, got -8$"),
    (dict(chunk_rows=64.0), ValueError,
     "^init_guide_pretrained: chunk_rows must be a positive int, got 64.0$"),
    (dict(chunk_rows="64"), ValueError,
     "^init_guide_pretrained: chunk_rows must be a positive int, got '64'$"),
])
def test_bad_options(digits, trained_mlp, kwargs, error, match):
    x, y, _, _ = digits
    net = bayesianize(copy.deepcopy(trained_mlp), keep_weights=True)
    model = BayesianClassifier(net, num_data=len(x))
    guide = AutoNormal(model)
    with pytest.raises(error, match=match):
        init_guide_pretrained(guide, (x, y), **kwargs)
    assert guide.prototype_trace is None


def test_other_normal_sites_are_capped_as_by_iblm(digits, trained_mlp):
    # (the same rule as I-BLM's, test_iblm_user_models: the started layers' median
    # fraction of their priors' stds)
    x, y, _, _ = digits
    net = bayesianize(copy.deepcopy(trained_mlp), keep_weights=True)

    def model(x, y=None):
        shift = pyro.sample("shift", dist.Normal(0.0, 1.0).expand([10]).to_event(1))
        logits = net(x) + shift
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)

    weights = {k.replace("trained_", ""): v for k, v in net.named_buffers()
               if "trained_" in k}
    guide = AutoNormal(model, init_scale=1.0)
    guide(x[:2], y[:2])
    loc = guide.locs.shift.detach().clone()
    with pytest.warns(UserWarning, match=r"\(\['shift'\]\) get their stds capped at the "
                      r"started layers' median fraction of their prior's"):
        init_guide_pretrained(guide, (x, y), weights=weights)
    scale = guide.scales.shift.detach()
    assert torch.equal(guide.locs.shift.detach(), loc)
    assert float(scale.max()) < 0.5 and torch.all(scale == scale[0])


def test_other_latent_sites_warn_or_raise(digits, trained_mlp):
    x, y, _, _ = digits
    net = bayesianize(copy.deepcopy(trained_mlp), keep_weights=True)

    def model(x, y=None):
        temperature = pyro.sample("temperature", dist.LogNormal(0.0, 1.0))
        logits = net(x) / temperature
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)

    # a function model: its sites are named after the net's own paths, and the
    # trained values are given by name
    weights = {k.replace("trained_", ""): v for k, v in net.named_buffers()
               if "trained_" in k}
    assert sorted(weights) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    guide = AutoNormal(model)
    guide(x[:2], y[:2])
    before = _snapshot(guide)
    message = ("init_guide_pretrained starts the weights and biases of the layers it sees "
               "(F.linear, F.conv1d/2d/3d and matrix products with a latent weight) from their "
               "trained values, and a regression's noise site from their residuals; these "
               "latent sites keep the guide's own initial values: ['temperature']")
    with pytest.raises(ValueError,
                       match=f"^{re.escape(message + '; the guide was left unchanged.')}$"):
        init_guide_pretrained(guide, (x, y), strict=True, weights=weights)
    _assert_unchanged(guide, before)
    with pytest.warns(UserWarning) as record:
        init_guide_pretrained(guide, (x, y), weights=weights)
    assert [str(w.message) for w in record] == [
        message + ". Pass strict=True to make this an error."]
    if "MUTANT_UNDER_TEST" not in os.environ:  # (mutmut's trampolines add frames)
        assert record[0].filename == __file__  # the warning points at the call


def test_guide_list_members_read_the_trained_values_through_their_block(digits, trained_mlp):
    # A member's model is poutine.block(model, ...): the trained buffers are read from the
    # module inside it, so each member starts from them, and the list's median is the
    # trained network. The list itself is refused with the way to start it.
    from pyro.infer.autoguide import AutoGuideList

    x, y, x_test, y_test = digits
    net = copy.deepcopy(trained_mlp)
    with torch.no_grad():
        expected = net(x_test)
    model = BayesianClassifier(bayesianize(net, keep_weights=True), num_data=len(x))
    first = ["net.0.weight", "net.0.bias"]
    guide = AutoGuideList(model)
    guide.append(AutoRadialNormal(pyro.poutine.block(model, expose=first)))
    guide.append(AutoNormal(pyro.poutine.block(model, hide=first)))
    # not set up: the list, and a member (Pyro sets members up through the list: it had
    # failed inside Pyro, on the list's prototype trace of None)
    names = set(pyro.get_param_store().keys())
    with pytest.raises(TypeError, match=re.escape(
            "init_guide_pretrained starts an AutoGuideList member by member: call it on "
            "each member, guide[0] to guide[1], with the same data, after setting the list "
            "up, guide(x, y)") + "$"):
        init_guide_pretrained(guide, (x, y))
    with pytest.raises(ValueError, match=re.escape(
            "the AutoRadialNormal is a member of an AutoGuideList that is not set up, through "
            "which Pyro sets its members up: call the list once on the data first, e.g. "
            "guide(x, y)") + "$"):
        init_guide_pretrained(guide[0], (x, y))
    assert set(pyro.get_param_store().keys()) == names and guide[0].prototype_trace is None
    guide(x[:2], y[:2])
    with pytest.raises(TypeError, match=re.escape(
            "init_guide_pretrained starts an AutoGuideList member by member: call it on "
            "each member, guide[0] to guide[1], with the same data") + "$"):
        init_guide_pretrained(guide, (x, y))
    for member in guide:
        init_guide_pretrained(member, (x, y))
    assert_close(_median_logits(model, guide, x_test, y_test), expected, atol=1e-5, rtol=1e-5)
