import math
import os
import re
import types
import warnings

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
import torch.nn.functional as F
from pyro.infer.autoguide import AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoNormal
from pyro.nn import PyroModule
from torch import nn

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal, init_guide, init_guide_iblm
from pyro_vinit.data import load_digits
from pyro_vinit.guides import AutoSiteGuide, site_params
from pyro_vinit.initialization import baselines
from pyro_vinit.initialization._runs import capture
from pyro_vinit.initialization._tracing import guide_values, prepare
from pyro_vinit.initialization.baselines import METHODS
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from tests.common import assert_close

GUIDES = [AutoNormal, AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoKTiedNormal,
          AutoRadialNormal]


def _model():
    return BayesianClassifier(bayesianize(mlp((64, 30, 20, 10))))


def _cnn_model():
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 10))
    return BayesianClassifier(bayesianize(net))


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def _site(guide, name):
    """(loc, per-element std) of a site, read independently of site_params where
    Pyro can tell: its Normal quantiles at +1 sd."""
    if isinstance(guide, AutoSiteGuide):
        return guide.get_loc_and_scale(name)
    median = guide.median()[name]
    q = guide.quantiles([0.5 + math.erf(1 / math.sqrt(2)) / 2])
    return median, q[name][0] - median


@pytest.mark.parametrize("guide_class", GUIDES)
@pytest.mark.parametrize("method", ["uninformative", "heuristic", "xavier", "orthogonal"])
def test_data_free_values(guide_class, method, digits):
    x, y, _, _ = digits
    model = _model()
    guide = guide_class(model)
    guide(x[:3], y[:3])
    init_guide(guide, method=method)
    for name, (d_in, d_out) in {"net.0": (64, 30), "net.2": (30, 20), "net.4": (20, 10)}.items():
        var = {"uninformative": 1.0, "xavier": 2 / (d_in + d_out)}.get(method, 1 / d_in)
        w_loc, w_std = _site(guide, f"{name}.weight")
        b_loc, b_std = _site(guide, f"{name}.bias")
        tol = dict(atol=1e-4, rtol=1e-3)
        assert_close(w_std, torch.full_like(w_std, math.sqrt(var)), **tol)
        assert_close(b_std, torch.full_like(b_std, math.sqrt(var)), **tol)
        assert_close(b_loc, torch.zeros_like(b_loc))
        if method == "orthogonal":
            rows = w_loc if d_out <= d_in else w_loc.T
            assert_close(rows @ rows.T, torch.eye(rows.shape[0]), atol=1e-4, rtol=0)
        else:
            assert_close(w_loc, torch.zeros_like(w_loc))


def test_conv_fans():
    x, y, _, _ = load_digits(image=True)
    model = _cnn_model()
    guide = AutoNormal(model)
    init_guide(guide, (x[:20], y[:20]), method="xavier")
    _, std = _site(guide, "net.0.weight")
    assert_close(std, torch.full_like(std, math.sqrt(2 / (9 + 36))), atol=1e-5, rtol=1e-4)


def test_lsuv_unit_output_variance(digits):
    x, y, _, _ = digits
    model = _model()
    guide = AutoNormal(model)
    init_guide(guide, (x, y), method="lsuv", batch_size=len(x))
    prep = prepare(guide, (x, y), 10_000, 4096, normal_priors=False)
    values = {**guide_values(guide, (x, y), prep.latent), **guide.median()}
    for layer in prep.layers:
        _, out = capture(guide.model, values, (x, y), prep.latent, layer.weight_name, output=True)
        assert abs(out.var().item() - 1) < 0.1, layer.weight_name


def test_map_fits_the_data(digits):
    x, y, x_test, y_test = digits
    model = _model()
    guide = AutoNormal(model)
    init_guide(guide, (x, y), method="map", map_steps=150)
    with torch.no_grad():
        logits = pyro.poutine.condition(model, data=guide.median())(x_test)
    assert (logits.argmax(-1) == y_test).float().mean() > 0.8
    _, std = _site(guide, "net.0.weight")
    assert_close(std, torch.full_like(std, math.exp(-5.5 / 2)), atol=1e-5, rtol=1e-4)


class _FakeClock:
    """A ``time`` module stand-in whose clock advances one second per reading."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1.0
        return self.now


def _count_adam_steps(monkeypatch):
    steps = []
    step = torch.optim.Adam.step

    def counting_step(self, *args, **kwargs):
        steps.append(None)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", counting_step)
    return steps


@pytest.mark.parametrize("map_seconds", [None, 5.5])
def test_map_time_budget(digits, monkeypatch, map_seconds):
    # With a clock that ticks once per reading, a budget of 5.5 "seconds" allows
    # a handful of steps; without one, all map_steps run. No wall-clock timing.
    from pyro_vinit.initialization import baselines

    x, y, _, _ = digits
    monkeypatch.setattr(baselines, "time", _FakeClock())
    steps = _count_adam_steps(monkeypatch)
    guide = AutoNormal(_model())
    init_guide(guide, (x[:200], y[:200]), method="map", map_steps=12, map_seconds=map_seconds,
               batch_size=32)
    # (the clock reads 1 at the start, 2 + k before step k: steps 0 to 4 start within 5.5)
    assert len(steps) == (12 if map_seconds is None else 5)


def test_map_time_budget_keeps_the_steps_taken(monkeypatch):
    from pyro_vinit.initialization import baselines

    x, y = torch.randn(20, 4, dtype=torch.float64), torch.randint(3, (20,))
    expected = _map_loc((x, y), map_steps=5)
    monkeypatch.setattr(baselines, "time", _FakeClock())
    for value, five_steps in zip(_map_loc((x, y), map_steps=12, map_seconds=5.5), expected):
        assert torch.equal(value, five_steps)


def _iblm_params(data, use_init_guide, **options):
    pyro.set_rng_seed(0)
    guide = AutoNormal(_model())
    if use_init_guide:
        init_guide(guide, data, method="iblm", **options)
    else:
        init_guide_iblm(guide, data, **options)
    return {name: p.detach().clone() for name, p in guide.named_parameters()}


def test_iblm_method_forwards_options(digits):
    x, y, _, _ = digits
    data = (x[:300], y[:300])
    options = dict(alpha=0.05, batch_size=64, max_pool_size=200)
    forwarded = _iblm_params(data, True, **options)
    direct = _iblm_params(data, False, **options)
    assert forwarded.keys() == direct.keys()
    for name in direct:
        assert_close(forwarded[name], direct[name], atol=0, rtol=0, msg=name)
    # Each option changes the result, so equality above means each was forwarded.
    for dropped in options:
        other = _iblm_params(data, False, **{k: v for k, v in options.items() if k != dropped})
        assert any(not torch.equal(other[n], direct[n]) for n in direct), dropped


def test_errors(digits):
    x, y, _, _ = digits
    guide = AutoNormal(_model())
    with pytest.raises(ValueError, match="valid methods are"):
        init_guide(guide, (x, y), method="kaiming")
    message = ("AutoNormal is not set up yet: pass data (e.g. init_guide(guide, (x, y), "
               "method=...)) or call the guide once first")
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        init_guide(guide, method="xavier")
    for method in ["lsuv", "map", "iblm"]:
        with pytest.raises(ValueError, match="needs data"):
            init_guide(guide, method=method)
    with pytest.raises(TypeError, match="unexpected options"):
        init_guide(guide, (x, y), method="xavier", alpha=0.1)
    assert set(METHODS) == {
        "uninformative", "heuristic", "xavier", "orthogonal", "lsuv", "map", "iblm"
    }


@pytest.mark.parametrize("option, value, what", [
    ("batch_size", 0, "positive"), ("batch_size", -1, "positive"),
    ("batch_size", 2.0, "positive"), ("max_pool_size", 0, "positive"),
    ("lsuv_tol", float("nan"), "non-negative"), ("lsuv_tol", -0.1, "non-negative"),
    ("lsuv_max_iters", -1, "non-negative"), ("map_steps", -5, "non-negative"),
    ("map_steps", 2.5, "non-negative"), ("map_steps", True, "non-negative"),
    ("map_lr", float("nan"), "positive"), ("map_lr", -1.0, "positive"),
    ("map_seconds", -1.0, "positive"), ("map_seconds", 0, "positive"),
])
@pytest.mark.parametrize("method", ["xavier", "lsuv", "map"])
def test_bad_options_are_refused_before_anything_changes(method, option, value, what):
    # they were accepted (and ignored, or failed in torch: Adam's "Invalid learning rate",
    # torch.cat of no batches) after the guide had been set up
    x, y = torch.randn(40, 4), torch.arange(40) % 3
    guide = AutoNormal(_linear(4, 3))
    with pytest.raises(ValueError, match=f"^init_guide: {option} must be {what}, got "
                                         f"{re.escape(repr(value))}$"):
        init_guide(guide, (x, y), method=method, **{option: value})
    assert guide.prototype_trace is None and list(pyro.get_param_store().keys()) == []


def test_data_free_layers_by_name():
    # without data: a weight without a bias site, and a "<module>.bias" whose size is not
    # the weight's output size (left at the guide's own values); no weight at all is refused
    def model(x, y=None):
        a = pyro.sample("a.weight", dist.Normal(0.0, 1.0).expand([3, 4]).to_event(2))
        b = pyro.sample("b.weight", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))
        c = pyro.sample("b.bias", dist.Normal(0.0, 1.0).expand([5]).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(F.linear(F.linear(x, a), b).sum(-1) + c.sum(), 1.0),
                        obs=y)

    x, y = torch.randn(6, 4), torch.randn(6)
    guide = AutoNormal(model)
    guide(x, y)
    bias_before = [t.clone() for t in site_params.get_loc_and_scale(guide, "b.bias")]
    init_guide(guide, method="heuristic")
    for name, fan_in in [("a.weight", 4), ("b.weight", 3)]:
        _, std = site_params.get_loc_and_scale(guide, name)
        assert_close(std, torch.full_like(std, fan_in**-0.5))
    for before, after in zip(bias_before, site_params.get_loc_and_scale(guide, "b.bias")):
        assert torch.equal(before, after)

    def no_weights(x, y=None):
        c = pyro.sample("c", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(x @ c, 1.0), obs=y)

    guide = AutoNormal(no_weights)
    guide(x, y)
    message = ("the guide has no real-support latent site with two or more dims (a layer "
               "weight) to initialize")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        init_guide(guide, method="xavier")


def test_data_free_bias_without_a_module_prefix_is_paired():
    # a functional model's sites "weight" and "bias" (no "<module>." prefix): the bias is
    # the layer's, set with it (mean 0, the weight's Xavier std) rather than left alone
    def model(x, y=None):
        w = pyro.sample("weight", dist.Normal(0.0, 1.0).expand([3, 5]).to_event(2))
        b = pyro.sample("bias", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=F.linear(x, w, b)), obs=y)

    x, y = torch.randn(6, 5), torch.arange(6) % 3
    guide = AutoNormal(model, init_loc_fn=lambda site: torch.ones(site["fn"].shape()))
    guide(x, y)
    init_guide(guide, method="xavier")
    std = math.sqrt(2.0 / (5 + 3))
    assert torch.equal(guide.locs.bias, torch.zeros(3))
    assert_close(guide.scales.bias, torch.full((3,), std), rtol=1e-6)
    assert_close(guide.scales.weight, torch.full((3, 5), std), rtol=1e-6)


@pytest.mark.parametrize("method", ["map", "lsuv"])
def test_data_methods_take_a_hyperparameter_fixed_by_condition(method):
    # pyro.condition fixes tau, an observed site of the trace that is no likelihood: the
    # baselines with data read the single likelihood through the same rule as fit and I-BLM
    def model(x, y=None):
        tau = pyro.sample("tau", dist.HalfNormal(1.0))
        w = pyro.sample("w", dist.Normal(0.0, tau).expand([3, 5]).to_event(2))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=F.linear(x, w)), obs=y)

    conditioned = pyro.condition(model, data={"tau": torch.tensor(1.0)})
    x, y = torch.randn(32, 5), torch.arange(32) % 3
    guide = AutoNormal(conditioned)
    guide(x, y)
    init_guide(guide, (x, y), method=method, map_steps=2)
    assert torch.isfinite(guide.locs.w).all() and not torch.equal(guide.locs.w,
                                                                  torch.zeros(3, 5))


def _matmul_model(x, y=None):
    # a functional model's x @ w: each weight is (in, out), the transpose of nn.Linear's
    w1 = pyro.sample("w1", dist.Normal(0.0, 1.0).expand([3, 8]).to_event(2))
    w2 = pyro.sample("w2", dist.Normal(0.0, 1.0).expand([8, 1]).to_event(2))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal((torch.tanh(x @ w1) @ w2).squeeze(-1), 1.0), obs=y)


@pytest.mark.parametrize("method", ["heuristic", "xavier", "orthogonal"])
def test_data_free_weights_not_named_weight_warn(method):
    # By name, w1 (3, 8) would get the variance 1/8 and w2 (8, 1) 1/1 (the fan-ins are 3
    # and 8): a warning names them and says to pass data, which traces the layers.
    x, y = torch.randn(6, 3), torch.randn(6)
    guide = AutoNormal(_matmul_model)
    guide(x, y)
    with pytest.warns(UserWarning, match="^" + re.escape(
            f"init_guide(method={method!r}): without data, layers are recognized by name, "
            "and the sites ['w1', 'w2'], not named '<module>.weight', are taken for weights "
            "in nn.Linear's (out, in) layout (fan-in: the last dims), which is wrong for e.g. "
            "x @ w; pass data (init_guide(guide, (x, y), method=...)) to find the layers by "
            "tracing the model") + "$") as caught:
        init_guide(guide, method=method)
    # at the caller, not inside the package (mutation testing adds frames of its own)
    assert "pyro_vinit" not in os.path.normpath(caught[0].filename).split(os.sep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        init_guide(guide, (x, y), method=method)
        init_guide(guide, method="uninformative")  # 0 and 1 whatever the layout
    if method == "heuristic":
        init_guide(guide, (x, y), method=method)
        for name, fan_in in [("w1", 3), ("w2", 8)]:
            _, std = site_params.get_loc_and_scale(guide, name)
            assert_close(std, torch.full_like(std, fan_in**-0.5))


@pytest.mark.parametrize("method", ["heuristic", "xavier", "orthogonal"])
def test_data_free_weights_named_weight_do_not_warn(method):
    # the names of bayesianize's layers ('0.weight', '2.weight'): taken as nn.Linear's
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    model = BayesianClassifier(bayesianize(mlp((3, 4, 2))))
    guide = AutoNormal(model)
    guide(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        init_guide(guide, method=method)


def test_guide_list_is_initialized_member_by_member():
    from pyro.infer.autoguide import AutoGuideList

    x, y = torch.randn(6, 3), torch.randn(6)
    guide = AutoGuideList(_matmul_model)
    guide.append(AutoNormal(poutine.block(_matmul_model, expose=["w1"])))
    guide.append(AutoNormal(poutine.block(_matmul_model, hide=["w1"])))
    message = ("init_guide(method='heuristic') initializes an AutoGuideList member by member: "
               "call it on each member, guide[0] to guide[1]")
    with pytest.raises(TypeError, match=re.escape(message + ", after setting the list up, "
                                                  "guide(x, y)") + "$"):
        init_guide(guide, (x, y), method="heuristic")
    with pytest.raises(ValueError, match="is a member of an AutoGuideList that is not set up"):
        init_guide(guide[0], (x, y), method="heuristic")  # (it failed inside Pyro)
    guide(x, y)
    with pytest.raises(TypeError, match=re.escape(message) + "$"):
        init_guide(guide, (x, y), method="heuristic")
    for member in guide:
        init_guide(member, (x, y), method="heuristic")
    for member, name, fan_in in [(guide[0], "w1", 3), (guide[1], "w2", 8)]:
        _, std = site_params.get_loc_and_scale(member, name)
        assert_close(std, torch.full_like(std, fan_in**-0.5))


class _NoisyRegressor(PyroModule):
    """A Bayesian MLP with a learned HalfNormal noise scale: a constrained latent."""

    def __init__(self):
        super().__init__()
        self.net = bayesianize(mlp((3, 8, 1)))

    def forward(self, x, y=None):
        noise = pyro.sample("noise", dist.HalfNormal(1.0))
        mean = self.net(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(mean, noise), obs=y)


@pytest.mark.parametrize("guide_class", GUIDES)
@pytest.mark.parametrize("method", ["xavier", "lsuv"])
def test_constrained_latent_is_left_alone(guide_class, method):
    # The layers are initialized as asked; the noise keeps the guide's own init.
    x, y = torch.randn(40, 3), torch.randn(40)
    guide = guide_class(_NoisyRegressor())
    guide(x, y)
    noise_before = [t.clone() for t in site_params.get_loc_and_scale(guide, "noise")]
    init_guide(guide, None if method == "xavier" else (x, y), method=method, batch_size=40)
    for before, after in zip(noise_before, site_params.get_loc_and_scale(guide, "noise")):
        assert torch.equal(before, after)
    _, w_std = _site(guide, "net.0.weight")
    expected = 2 / (3 + 8) if method == "xavier" else 1 / 3
    assert_close(w_std, torch.full_like(w_std, math.sqrt(expected)), atol=1e-4, rtol=1e-3)


def _linear(d_in, d_out):
    """One float64 Bayesian linear layer classifier (``net.0``)."""
    return BayesianClassifier(bayesianize(mlp((d_in, d_out)).double()))


def test_orthogonal_in_the_guides_dtype():
    guide = AutoNormal(_linear(6, 4))
    guide(torch.randn(5, 6, dtype=torch.float64), torch.randint(4, (5,)))
    init_guide(guide, method="orthogonal")
    w, _ = site_params.get_loc_and_scale(guide, "net.0.weight")
    assert w.dtype == torch.float64
    # orthogonal to float64's precision (a float32 matrix is only to ~1e-7)
    assert_close(w @ w.T, torch.eye(4, dtype=torch.float64), atol=1e-13, rtol=0)


def _paired_rows(output_var, rows=10, d=4):
    """Rows +z and -z scaled so that an orthogonal (d, d) layer's output (zero mean)
    has exactly ``output_var`` as its variance, whatever the matrix."""
    z = torch.randn(rows, d, dtype=torch.float64)
    x = torch.cat([z, -z])
    x = x * math.sqrt(output_var * (x.numel() - 1) / x.square().sum())
    return x, torch.randint(d, (len(x),))


def _output_var(guide, data):
    prep = prepare(guide, data, 10_000, 4096, normal_priors=False)
    values = {**guide_values(guide, data, prep.latent), **guide.median()}
    _, out = capture(guide.model, values, data, prep.latent, "net.0.weight", output=True)
    return out.var().item()


@pytest.mark.parametrize("start, expected", [(1.3, 1.3), (1.8, 1.0)])
def test_lsuv_rescales_only_outside_the_tolerance(start, expected):
    # within lsuv_tol = 0.5 of 1 the orthogonal mean is kept; else rescaled to exactly 1
    data = _paired_rows(start)
    guide = AutoNormal(_linear(4, 4))
    init_guide(guide, data, method="lsuv", batch_size=len(data[0]), lsuv_tol=0.5)
    w, _ = site_params.get_loc_and_scale(guide, "net.0.weight")
    assert_close(w @ w.T, torch.eye(4, dtype=w.dtype) * expected / start, atol=1e-12, rtol=0)
    assert _output_var(guide, data) == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("batch_size, rows", [(8, 30), (None, 200)])  # None: 128
def test_lsuv_reads_one_batch_of_batch_size_rows(monkeypatch, batch_size, rows):
    # and rescales a layer at most lsuv_max_iters times (10 by default: with a tolerance
    # that no output meets, exactly 10)
    from pyro_vinit.initialization import baselines

    x, y = torch.randn(rows, 4, dtype=torch.float64), torch.randint(4, (rows,))
    shapes = []

    def recording_capture(model, values, args, *rest, **kwargs):
        shapes.append(args[0].shape)
        return capture(model, values, args, *rest, **kwargs)

    monkeypatch.setattr(baselines, "capture", recording_capture)
    options = {} if batch_size is None else {"batch_size": batch_size}
    init_guide(AutoNormal(_linear(4, 4)), (x, y), method="lsuv", lsuv_tol=0.0, **options)
    assert shapes == [((batch_size or 128), 4)] * 10, shapes


def test_reads_at_most_10000_rows():
    # (the default max_pool_size, named by the warning about a larger batch)
    x, y = torch.randn(10_001, 4, dtype=torch.float64), torch.randint(4, (10_001,))
    message = ("init_guide(method='lsuv'): batch_size=20000 is larger than the 10000 rows of "
               "data; using batches of 10000")
    with pytest.warns(UserWarning, match=f"^{re.escape(message)}$"):
        init_guide(AutoNormal(_linear(4, 4)), (x, y), method="lsuv", batch_size=20_000)


def test_map_takes_500_steps_by_default(monkeypatch):
    steps = _count_adam_steps(monkeypatch)
    x, y = torch.randn(20, 4, dtype=torch.float64), torch.randint(3, (20,))
    _map_loc((x, y))
    assert len(steps) == 500


@pytest.mark.parametrize("fill, shown", [(0.0, "0.0"), (1e300, "inf")])
def test_lsuv_refuses_a_layer_output_without_finite_variance(fill, shown):
    # zero inputs and a zero bias: the layer's output is constant, it cannot be rescaled;
    # inputs of 1e300: its variance overflows
    x, y = torch.full((12, 4), fill, dtype=torch.float64), torch.randint(4, (12,))
    guide = AutoNormal(_linear(4, 4))
    message = f"LSUV: the output of layer 'net.0.weight' has variance {shown}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        init_guide(guide, (x, y), method="lsuv", batch_size=12)


@pytest.mark.parametrize("method", ["lsuv", "map"])
def test_batch_size_larger_than_the_data_is_named(method):
    x, y = torch.randn(20, 4, dtype=torch.float64), torch.randint(4, (20,))
    message = (f"init_guide(method='{method}'): batch_size=50 is larger than the 20 rows of "
               "data; using batches of 20")
    with pytest.warns(UserWarning, match=f"^{re.escape(message)}$"):
        init_guide(AutoNormal(_linear(4, 4)), (x, y), method=method, batch_size=50,
                   map_steps=1)


def _map_loc(data, **options):
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    guide = AutoNormal(_linear(4, 3))
    init_guide(guide, data, method="map", batch_size=len(data[0]), **options)
    return [site_params.get_loc_and_scale(guide, f"net.0.{p}")[0].detach()
            for p in ("weight", "bias")]


def test_map_takes_adam_steps_on_the_mean_negative_log_likelihood():
    # Adam's first step is lr * g / (|g| + eps), g the gradient of the mean NLL: inputs
    # of ~1e-8 make the weights' g comparable to eps = 1e-8 (so a sum, or any other
    # scaling of the loss, shows), the bias's g is not
    x = 1e-8 * torch.randn(20, 4, dtype=torch.float64)
    y = torch.randint(3, (20,))
    w0, b0 = _map_loc((x, y), map_steps=0)
    assert not b0.any()
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    torch.nn.functional.cross_entropy(x @ w.T + b, y).backward()
    w1, b1 = _map_loc((x, y), map_steps=1, map_lr=0.05)
    for start, grad, end in [(w0, w.grad, w1), (b0, b.grad, b1)]:
        assert_close(end, start - 0.05 * grad / (grad.abs() + 1e-8), atol=1e-12, rtol=1e-6)


def test_map_refuses_a_non_finite_likelihood():
    # (finite data: NaN would be refused first) whose logits overflow
    x, y = torch.full((10, 4), 1.7e308, dtype=torch.float64), torch.arange(10) % 3
    with pytest.raises(ValueError,
                       match=r"^MAP: the negative log-likelihood is (inf|nan) at step 0$"):
        _map_loc((x, y), map_steps=3)


@pytest.mark.parametrize("method", ["lsuv", "map"])
def test_a_failure_leaves_the_guide_store_and_batch_norm_statistics_as_they_were(method):
    # lsuv's and map's model runs (in train mode) move BatchNorm's running statistics,
    # and the guide was set up, before a later failure: it left both changed
    x = torch.randn(40, 6, dtype=torch.float64)
    y = torch.arange(40) % 3
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model = BayesianClassifier(bayesianize(net.double()), num_data=40)
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    guide = AutoNormal(model)
    options = {"map_steps": 2} if method == "map" else {}
    def refuse(*args):
        raise RuntimeError("refused write")

    # the last step, the writes, fails (site_params' own calls are left as they are)
    failing = types.SimpleNamespace(**{**vars(site_params), "set_loc_and_scale": refuse})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(baselines, "site_params", failing)
        with pytest.raises(RuntimeError, match="refused write"):
            init_guide(guide, (x, y), method=method, batch_size=20, **options)
    assert guide.prototype_trace is None and list(pyro.get_param_store().keys()) == []
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name
    init_guide(guide, (x, y), method=method, batch_size=20, **options)  # then it works
    mean = next(k for k in buffers if k.endswith("running_mean"))
    assert not torch.equal(dict(model.named_buffers())[mean], buffers[mean])  # moved


def test_a_failed_write_leaves_a_set_up_guide_as_it_was():
    # the second site's write fails: the first one's was kept (GuideRollback without
    # its checkpoint restores the values of a guide that was not set up only)
    x, y = torch.randn(40, 4, dtype=torch.float64), torch.arange(40) % 3
    guide = AutoNormal(_linear(4, 3))
    guide(x, y)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    writes = []

    def second_fails(guide, name, loc, scale):
        if writes:
            raise RuntimeError("refused write")
        writes.append(name)
        site_params.set_loc_and_scale(guide, name, loc, scale)

    failing = types.SimpleNamespace(**{**vars(site_params), "set_loc_and_scale": second_fails})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(baselines, "site_params", failing)
        with pytest.raises(RuntimeError, match="refused write"):
            init_guide(guide, (x, y), method="xavier")
    assert writes  # one site was written before the failure
    for k, v in pyro.get_param_store().items():
        assert torch.equal(v.detach(), before[k]), k


@pytest.mark.parametrize("method", ["lsuv", "map"])
@pytest.mark.parametrize("targets, error, match", [
    (lambda y: y[:, None], ValueError, r"y of shape \(40, 1\) does not fit the likelihood"),
    (lambda y: y.round().long(), TypeError, r"is Normal, continuous, so y must be floating"),
])
def test_targets_that_do_not_fit_the_likelihood_are_refused(method, targets, error, match):
    # map trained on (N, 1) targets broadcast against (N,) means without a word
    x = torch.randn(40, 4)
    y = x[:, 0] - x[:, 1]

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, 4]).to_event(2))
        with pyro.plate("data", 40, subsample_size=len(x)):
            pyro.sample("obs", dist.Normal(F.linear(x, w).squeeze(-1), 0.1), obs=y)

    guide = AutoNormal(model)
    with pytest.raises(error, match=match):
        init_guide(guide, (x, targets(y)), method=method, batch_size=20, map_steps=2)
    assert guide.prototype_trace is None and list(pyro.get_param_store().keys()) == []


def test_a_set_up_guide_takes_data_without_targets_to_find_its_layers():
    # the data-free methods read the data only to find x @ w layers: no likelihood needed
    x, y = torch.randn(40, 4), torch.randn(40)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([4, 1]).to_event(2))
        with pyro.plate("data", 40, subsample_size=len(x)):
            pyro.sample("obs", dist.Normal((x @ w).squeeze(-1), 0.1), obs=y)

    guide = AutoNormal(model)
    guide(x, y)
    init_guide(guide, (x,), method="xavier")
    loc, scale = site_params.get_loc_and_scale(guide, "w")
    assert torch.allclose(scale, torch.full_like(scale, math.sqrt(2 / 5)))
    with pytest.raises(ValueError, match="no observed sample site"):  # map fits it
        init_guide(guide, (x,), method="map", map_steps=1)
