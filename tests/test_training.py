import contextlib
import functools
import math
import re
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI, TraceMeanField_ELBO
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoGuideList,
    AutoMultivariateNormal,
    AutoNormal,
    init_to_sample,
)
from pyro.nn import PyroModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pyro_vinit
import pyro_vinit.training.loop as training_loop
from pyro_vinit import (
    AutoKTiedNormal,
    AutoMeanFieldNormal,
    AutoRadialNormal,
    fit,
    fit_config,
    init_guide_iblm,
    local_reparam,
)
from pyro_vinit.data import load_digits
from pyro_vinit.guides import site_params
from pyro_vinit.initialization._observed import error_text
from pyro_vinit.nn import BayesianClassifier, BayesianRegressor, bayesianize, mlp
from pyro_vinit.poutine import (
    AutoWeightNoise,
    FlipoutMessenger,
    LocalReparamMessenger,
    WeightNoiseMessenger,
)
from pyro_vinit.training import FitHistory, is_initialized, update_batch_norm


def blobs(n=240, d=5, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = 3 * torch.randn(k, d, generator=g)
    y = torch.arange(n) % k
    x = centers[y] + torch.randn(n, d, generator=g)
    return x, y


def classifier(d=5, k=3, num_data=240, hidden=16):
    return BayesianClassifier(bayesianize(mlp((d, hidden, k))), num_data=num_data)


def snapshot():
    store = pyro.get_param_store()
    return {name: store.get_param(name).detach().clone() for name in store.keys()}


def assert_identical(before, after):
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


# ---- the two data forms -----------------------------------------------------------------


def test_fit_on_a_tensor_pair():
    x, y = blobs()
    model = classifier()
    guide = AutoKTiedNormal(model, rank=2)
    history = fit(model, guide, (x, y), steps=30, batch_size=64, validation=(x, y),
                  eval_every=10, num_samples=4, progress=False)
    assert isinstance(history, FitHistory)
    assert history.initialized and is_initialized(guide)
    assert history.steps == len(history.loss) == 30
    assert all(math.isfinite(v) for v in history.loss)
    assert [v["step"] for v in history.validation] == [0, 10, 20, 30]
    assert all(type(v["step"]) is int for v in history.validation)  # (not 10.0)
    # well-separated blobs: I-BLM classifies them at once
    assert history.validation[0]["error_rate"] < 0.05
    assert history.validation[-1]["error_rate"] < 0.05


def test_fit_on_a_data_loader():
    x, y = blobs()
    loader = DataLoader(TensorDataset(x, y), batch_size=50, shuffle=True)
    model = classifier()
    guide = AutoKTiedNormal(model, rank=2)
    history = fit(model, guide, loader, epochs=2, validation=(x, y), num_samples=4,
                  progress=False)
    assert history.steps == 2 * 5  # 240 rows in batches of 50
    assert history.validation[-1]["error_rate"] < 0.05


def test_epochs_count_batches_of_a_pair():
    x, y = blobs()
    model = classifier()
    history = fit(model, AutoKTiedNormal(model), (x, y), epochs=1.5, batch_size=100,
                  progress=False)
    assert history.steps == round(1.5 * 3)


# ---- initialized guides are never re-initialized -----------------------------------------


@pytest.fixture
def count_iblm(monkeypatch):
    calls = []

    def counting(guide, data, **options):
        calls.append(options)
        return init_guide_iblm(guide, data, **options)

    monkeypatch.setattr(training_loop, "init_guide_iblm", counting)
    return calls


def test_second_fit_continues_without_reinit(count_iblm):
    x, y = blobs()
    model = classifier()
    guide = AutoKTiedNormal(model, rank=2)
    fit(model, guide, (x, y), steps=5, progress=False)
    assert len(count_iblm) == 1
    # 512 rows, at most N/2; the output layer's regressions untempered (kl_weight 1: the
    # tempered start trains worse, docs/methods/iblm.rst)
    assert count_iblm[0] == {"batch_size": 120, "max_scale_ratio": 0.1}
    trained = snapshot()
    history = fit(model, guide, (x, y), steps=1, lr=1e-4, progress=False)
    assert len(count_iblm) == 1 and not history.initialized
    # one Adam step of size 1e-4 from where the first call ended, not a fresh start
    for name, value in snapshot().items():
        assert (value - trained[name]).abs().max() <= 1.1e-4, name


@pytest.mark.parametrize("iblm_rows", [None, 200])
def test_iblm_rows_leave_the_hidden_units_distinct(iblm_rows):
    # A regression of one output on 200 points: fit's I-BLM gives each hidden unit a slab
    # of at most half the rows. With all of them (iblm_rows=200, what fit did before), the
    # units fit one regression, up to sign: copies of one feature.
    g = torch.Generator().manual_seed(0)
    x = 6 * torch.rand(200, 1, generator=g) - 3
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(200, generator=g)
    model = BayesianRegressor(bayesianize(mlp((1, 30, 1), nn.Tanh)), noise_scale=0.1,
                              num_data=200)
    guide = AutoNormal(model)
    options = None if iblm_rows is None else {"batch_size": iblm_rows}
    fit(model, guide, (x, y), steps=1, lr=1e-6, init_options=options, progress=False)
    w = guide.median(x, y)["net.0.weight"].abs().flatten()
    spread = (w.std() / w.mean()).item()
    if iblm_rows is None:
        assert fit_config(guide).iblm_options(200) == {"batch_size": 100,
                                                       "max_scale_ratio": 0.1}
        assert spread > 0.2
    else:
        assert spread < 1e-3


def test_guide_initialized_outside_fit_is_kept(count_iblm):
    x, y = blobs()
    model = classifier()
    guide = AutoKTiedNormal(model, rank=2)
    init_guide_iblm(guide, (x, y))
    fit(model, guide, (x, y), steps=2, progress=False)
    assert count_iblm == []
    # a set-up guide keeps its values in its own parameters, even without the param store
    pyro.clear_param_store()
    assert is_initialized(guide)
    fit(model, guide, (x, y), steps=2, progress=False)
    assert count_iblm == []


def test_fit_points_i_blms_warnings_at_its_caller():
    # I-BLM's warnings raised under fit name the user's call of fit, as under a call of
    # init_guide_iblm, not fit's own line in loop.py
    x = torch.randn(64, 3)
    y = x.sum(-1) + 0.3 * torch.randn(64)

    def model(x, y):
        w1 = pyro.sample("w1", dist.Normal(0.0, 1.0).expand([8, 3]).to_event(2))
        w2 = pyro.sample("w2", dist.Normal(0.0, 1.0).expand([1, 8]).to_event(2))
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        with pyro.plate("data", 64, subsample_size=x.shape[0]):
            mu = F.linear(torch.tanh(F.linear(x, w1)), w2).squeeze(-1)
            pyro.sample("obs", dist.Normal(mu, sigma), obs=y)

    guide = AutoGuideList(model)
    guide.append(AutoKTiedNormal(pyro.poutine.block(model, hide=["sigma"]), rank=2))
    guide.append(AutoNormal(pyro.poutine.block(model, expose=["sigma"])))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, guide, (x, y), steps=1, batch_size=16, init_options={"batch_size": 100},
            progress=False)
    messages = sorted(str(w.message)[:40] for w in caught)
    # (the AutoNormal member over 'sigma' gets I-BLM's noise estimate: no "does not own")
    assert messages == ["init_guide_iblm initialized the members ",  # the AutoNormal left
                        "init_guide_iblm: batch_size=100 is large"]  # than the 64 rows
    for w in caught:
        assert w.filename == __file__, (str(w.message)[:60], w.filename, w.lineno)


def test_guide_loaded_into_the_param_store_is_kept(count_iblm, tmp_path):
    x, y = blobs()
    model = classifier()
    guide = AutoKTiedNormal(model, rank=2)
    fit(model, guide, (x, y), steps=2, progress=False)
    pyro.get_param_store().save(tmp_path / "params.pt")
    saved = snapshot()
    pyro.clear_param_store()
    pyro.get_param_store().load(tmp_path / "params.pt")
    fresh = AutoKTiedNormal(model, rank=2)
    assert is_initialized(fresh)
    fit(model, fresh, (x, y), steps=1, lr=1e-6, progress=False)
    assert len(count_iblm) == 1  # the first fit's only
    for name, value in snapshot().items():
        assert (value - saved[name]).abs().max() <= 1e-5, name


SET_UP_GUIDES = {
    "AutoKTiedNormal": lambda model: AutoKTiedNormal(model, rank=2),
    "AutoRadialNormal": AutoRadialNormal,
    "AutoMeanFieldNormal": AutoMeanFieldNormal,
    "AutoNormal": AutoNormal,
    "AutoDiagonalNormal": AutoDiagonalNormal,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("make_guide", SET_UP_GUIDES.values(), ids=list(SET_UP_GUIDES))
def test_fit_starts_a_guide_only_set_up_by_a_call_with_iblm(count_iblm, make_guide, dtype):
    # a call guide(x, y) before fit (to look at the parameters, as Pyro's tutorials do)
    # made fit take the guide as initialized and train it from the prior's scale
    x, y = blobs()
    x = x.to(dtype)
    model = classifier().to(dtype)
    guide = make_guide(model)
    guide(x, y)
    assert not is_initialized(guide)
    with pytest.warns(UserWarning, match=r"^fit: the \w+ was set up \(e.g. by a call guide\(x, "
                      r"y\)\) but not initialized or trained: every scale was still its "
                      r"init_scale, so fit started it with I-BLM, replacing its set-up values; "
                      r"pass init=None to train from them$"):
        history = fit(model, guide, (x, y), steps=1, progress=False)
    assert history.initialized and len(count_iblm) == 1 and is_initialized(guide)


def test_a_set_up_guide_that_was_trained_loaded_or_initialized_is_kept(count_iblm):
    x, y = blobs()
    model = classifier()
    trained = AutoNormal(model)
    svi = pyro.infer.SVI(model, trained, pyro.optim.Adam({"lr": 1e-3}), pyro.infer.Trace_ELBO())
    svi.step(x, y)  # the user's own loop: one step moves every scale
    assert is_initialized(trained)
    state = trained.state_dict()
    pyro.clear_param_store()
    loaded = AutoNormal(model)
    loaded(x, y)
    assert not is_initialized(loaded)
    loaded.load_state_dict(state)
    assert is_initialized(loaded)
    # an initializer's values count even where every scale is init_scale (e.g. capped there)
    pyro.clear_param_store()
    guide = AutoKTiedNormal(model, rank=2)
    init_guide_iblm(guide, (x, y))
    for name in site_params.latent_sites(guide):
        loc, scale = site_params.get_loc_and_scale(guide, name)
        site_params.set_loc_and_scale(guide, name, loc, torch.full_like(scale, 0.1))
    assert is_initialized(guide)
    fit(model, guide, (x, y), steps=1, progress=False)
    assert count_iblm == []


def test_guide_list_only_set_up_by_a_call_is_started_with_iblm(count_iblm):
    x, y = blobs()
    model = classifier()
    guide = AutoGuideList(model)
    guide.append(AutoKTiedNormal(pyro.poutine.block(model, hide_fn=lambda m: m["name"].endswith(
        "bias")), rank=2))
    guide.append(AutoNormal(pyro.poutine.block(model, expose_fn=lambda m: m["name"].endswith(
        "bias"))))
    guide(x, y)
    assert not is_initialized(guide)
    with pytest.warns(UserWarning, match="was set up"):
        fit(model, guide, (x, y), steps=1, progress=False)
    assert len(count_iblm) == 1 and is_initialized(guide)
    trained = AutoGuideList(model)
    trained.append(AutoDelta(pyro.poutine.block(model, hide_fn=lambda m: m["name"].endswith(
        "bias"))))
    trained(x, y)
    assert is_initialized(trained)  # an AutoDelta's set-up values look like trained ones


def _scaled_regression(x, y=None):
    # a hierarchical prior scale and a learned noise, sampled before and after the weights
    tau = pyro.sample("tau", dist.LogNormal(0.0, 1.0))
    w1 = pyro.sample("w1", dist.Normal(0.0, tau).expand([8, x.shape[-1]]).to_event(2))
    w2 = pyro.sample("w2", dist.Normal(0.0, 1.0).expand([1, 8]).to_event(2))
    sigma = pyro.sample("sigma", dist.LogNormal(-1.0, 1.0))
    mean = F.linear(torch.tanh(F.linear(x, w1)), w2).squeeze(-1)
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal(mean, sigma), obs=y)


@pytest.mark.parametrize("member,warned", [(AutoDelta, False), (AutoNormal, False),
                                           (AutoMultivariateNormal, True)])
def test_guide_list_site_order_warning_only_where_a_member_is_not_mean_field(member, warned):
    # Pyro checks TraceMeanField_ELBO's restriction by the order of the sites, which a guide
    # list over (tau, sigma) and the weights does not keep; its members each drawing their
    # sites independently, fit does not pass the warning on
    x = torch.randn(64, 3)
    y = x[:, 0] - x[:, 1] + 0.1 * torch.randn(64)

    def guide_list():
        guide = AutoGuideList(_scaled_regression)
        guide.append(member(pyro.poutine.block(_scaled_regression, expose=["tau", "sigma"])))
        guide.append(AutoKTiedNormal(pyro.poutine.block(_scaled_regression,
                                                        hide=["tau", "sigma"]), rank=2))
        return guide

    control = guide_list()
    svi = SVI(_scaled_regression, control, pyro.optim.Adam({"lr": 1e-3}), TraceMeanField_ELBO())
    with pytest.warns(UserWarning, match="Failed to verify mean field restriction"):
        svi.step(x, y)  # Pyro's own loop warns
    pyro.clear_param_store()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(_scaled_regression, guide_list(), (x, y), steps=3, batch_size=64, progress=False)
    order = [w for w in record if "Failed to verify mean field" in str(w.message)]
    assert bool(order) == warned
    with pytest.warns(UserWarning, match="Failed to verify mean field restriction"):
        svi.step(x, y)  # and the filter ends with fit


def test_history_says_whether_the_call_trained_with_its_own_optim():
    # its config names the default optimizer's lr and warm-up, which did not train then
    x, y = blobs()
    model = classifier()
    guide = AutoKTiedNormal(model, rank=2)
    history = fit(model, guide, (x, y), steps=2, optim=pyro.optim.ClippedAdam({"lr": 1e-3}),
                  progress=False)
    assert history.own_optim
    assert history.config.kl_weight == fit_config(guide).kl_weight  # the rest as trained
    assert not fit(model, guide, (x, y), steps=2, progress=False).own_optim


def _trained_classifier(keep_weights=True):
    x, y = blobs()
    net = mlp((5, 16, 3))
    optim = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(100):
        optim.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optim.step()
    trained = {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}
    model = BayesianClassifier(bayesianize(net, keep_weights=keep_weights), num_data=len(x))
    return model, trained, (x, y)


def test_fit_init_pretrained_starts_from_the_kept_weights(count_iblm):
    model, trained, (x, y) = _trained_classifier()
    guide = AutoNormal(model)  # (a mean-field scale takes MOPED's exactly)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        history = fit(model, guide, (x, y), steps=1, lr=1e-6, init="pretrained",
                      init_options={"scale": "moped"}, progress=False)
    assert history.initialized and count_iblm == []
    # MOPED's scales, delta |w| (init_options reach init_guide_pretrained)
    _, scale = site_params.get_loc_and_scale(guide, "net.0.weight")
    assert torch.allclose(scale, 0.1 * trained["net.0.weight"].abs(), rtol=1e-2, atol=1e-4)
    median = guide.median(x, y)
    assert len(trained) == 4
    for name, value in trained.items():  # one step of 1e-6 from the trained ones
        assert torch.allclose(median[name], value, atol=1e-4), name


def test_fit_warns_that_iblm_does_not_start_from_kept_weights(count_iblm):
    # the trained weights were dropped without a word
    model, _, (x, y) = _trained_classifier()
    guide = AutoKTiedNormal(model, rank=2)
    with pytest.warns(UserWarning, match=r"^fit: the model keeps a trained network's weights "
                      r"\(bayesianize\(\.\.\., keep_weights=True\)\), which I-BLM does not start "
                      r"from: pass init='pretrained' to start the guide from them$"):
        fit(model, guide, (x, y), steps=1, progress=False)
    assert len(count_iblm) == 1
    pyro.clear_param_store()
    model, _, (x, y) = _trained_classifier(keep_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(model, AutoKTiedNormal(model, rank=2), (x, y), steps=1, progress=False)


def test_fit_init_pretrained_refuses_a_model_that_keeps_no_weights():
    model, trained, (x, y) = _trained_classifier(keep_weights=False)
    guide = AutoKTiedNormal(model, rank=2)
    with pytest.raises(ValueError, match=r"^fit: init='pretrained' starts the guide from a "
                       r"trained network's weights, and the model keeps none: .*keep_weights="
                       r"True\), or pass init_options=\{'weights': \{\.\.\.\}\}, the trained "
                       r"values by the model's sample site names \(e.g. 'net.0.weight'\)$"):
        fit(model, guide, (x, y), steps=1, init="pretrained", progress=False)
    assert snapshot() == {} and not is_initialized(guide)
    # the weights given instead: the guide starts from them
    fit(model, guide, (x, y), steps=1, lr=1e-6, init="pretrained",
        init_options={"weights": trained}, progress=False)
    assert torch.allclose(guide.median(x, y)["net.0.weight"], trained["net.0.weight"],
                          atol=1e-4)


def test_fit_init_pretrained_refuses_a_guide_list_before_anything_changes():
    model, trained, (x, y) = _trained_classifier()
    guide = AutoGuideList(model)
    guide.append(AutoKTiedNormal(model, rank=2))
    with pytest.raises(TypeError, match=r"^fit: init='pretrained' starts one guide, not an "
                       r"AutoGuideList: call init_guide_pretrained\(member, data\) on each "):
        fit(model, guide, (x, y), steps=1, init="pretrained", progress=False)
    assert snapshot() == {} and not is_initialized(guide)


def test_init_options_for_a_guide_initialized_already_are_warned_about(count_iblm):
    x, y = blobs()
    model = classifier()
    guide = AutoKTiedNormal(model, rank=2)
    fit(model, guide, (x, y), steps=1, progress=False)
    with pytest.warns(UserWarning, match=r"^fit: init_options are not used: the "
                      r"AutoKTiedNormal is initialized already"):
        fit(model, guide, (x, y), steps=1, init_options={"batch_size": 64}, progress=False)
    assert len(count_iblm) == 1


@pytest.mark.parametrize("given", [False, True])
def test_a_diverging_run_is_named_with_a_remedy(given):
    # Pyro's validation of a distribution's NaN argument, deep inside the model, was the
    # only word
    x = torch.randn(240, 5)
    y = x.sum(-1).sin()
    model = BayesianRegressor(bayesianize(mlp((5, 16, 1), nn.Tanh)), num_data=240,
                              learn_noise=True)
    guide = AutoKTiedNormal(model, rank=2)
    options = {"optim": pyro.optim.Adam({"lr": 50.0})} if given else {"lr": 50.0}
    remedy = ("lower the optimizer's learning rate" if given else
              "lower the learning rate (lr=50), e.g. lr=5")
    with pytest.raises(ValueError, match=r"^fit: training diverged: step \d+ failed on "
                       r"parameters that hold NaN or inf \(AutoKTiedNormal\.\S+.*\), which "
                       f"this call's earlier steps made; {re.escape(remedy)}, or check the "
                       "data's scale") as info:
        fit(model, guide, (x, y), steps=60, progress=False, **options)
    assert "constraint" in str(info.value.__cause__)  # Pyro's own error, chained


def _failing_at(step):
    calls = []

    def model(x, y=None):
        calls.append(None)
        if len(calls) > step:
            raise ValueError("a genuine error of the model")
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, x.shape[-1]]).to_event(2))
        with pyro.plate("data", 240, subsample=torch.arange(len(x))):
            pyro.sample("obs", dist.Categorical(logits=F.linear(x, w)), obs=y)

    return model


def test_an_error_of_a_run_that_did_not_diverge_is_raised_as_it_is():
    # a parameter left NaN by another run in the param store is no divergence of this call
    x, y = blobs()
    pyro.param("left_by_another_run", torch.tensor(float("nan")))
    model = _failing_at(8)
    with pytest.raises(ValueError, match="^a genuine error of the model"):
        fit(model, AutoNormal(model), (x, y), steps=20, init=None, progress=False)


def test_init_none_skips_iblm(count_iblm):
    x, y = blobs()
    model = classifier()
    history = fit(model, AutoKTiedNormal(model), (x, y), steps=2, init=None, progress=False)
    assert count_iblm == [] and not history.initialized


# ---- bad input changes nothing -----------------------------------------------------------


class _Once:
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return self

    def __next__(self):
        return next(iter(self.batches))


BAD = {
    "lengths": (lambda x, y: (x, y[:-1]), {}, ValueError, "same number of rows"),
    "float labels": (lambda x, y: (x, y.float()), {}, TypeError, "integer class labels"),
    # 1-based: Pyro's support error from inside the SVI step (init=None or set up)
    "label range": (lambda x, y: (x, y + 1), {}, ValueError,
                    r"^fit: y holds values outside the support of the likelihood 'obs' "
                    r"\(Categorical, .*\), e.g. 3: class labels must be 0 to 2 \(1-based "
                    r"labels: y - 1\)$"),
    # one bad label of 240, most likely not in the first batch of 8: all of y is checked
    "one label out of range": (lambda x, y: (x, torch.where(torch.arange(len(y)) == 200, 3, y)),
                               {"batch_size": 8}, ValueError, "outside the support .* e.g. 3"),
    "validation range": (lambda x, y: (x, y), {"validation": (torch.zeros(3, 5),
                                                              torch.tensor([0, 1, 3]))},
                         ValueError, "outside the support .* e.g. 3"),
    "empty loader": (lambda x, y: [], {}, ValueError, "no batches"),
    "iterator": (lambda x, y: _Once([(x, y)]), {}, TypeError, "read only once"),
    "not a pair": (lambda x, y: (x, y, y), {}, TypeError,
                   r"must be a pair \(x, y\) of tensors, got a tuple of 3 \(Tensor, Tensor, "
                   r"Tensor\): fit calls model\(x, y\), with two tensors"),
    # read as an iterable of two batches: "batch 0 of data must be a pair, got ndarray"
    "arrays": (lambda x, y: (x.numpy(), y.numpy()), {}, TypeError,
               r"^fit: data must be a pair \(x, y\) of tensors, got a tuple of 2 \(ndarray, "
               r"ndarray\): convert arrays with torch.as_tensor$"),
    # "got tuple of length 2", which it is
    "validation arrays": (lambda x, y: (x, y), {"validation": (torch.zeros(3, 5).numpy(),
                                                               torch.zeros(3).numpy())},
                          TypeError, r"validation must be a pair \(x, y\) of tensors, got a "
                          r"tuple of 2 \(ndarray, ndarray\): convert arrays"),
    # read as batches of rows: "batch 0 of data must be a pair (x, y), got ndarray"
    "an array": (lambda x, y: x.numpy(), {}, TypeError,
                 r"^fit: data must be an \(x, y\) pair of tensors or an iterable of \(x, y\) "
                 r"batches \(e.g. a DataLoader\), got ndarray$"),
    # its keys were read as batches: "batch 0 of data must be a pair (x, y), got str"
    "a dict": (lambda x, y: {"x": x, "y": y}, {}, TypeError,
               r"got dict with keys \['x', 'y'\]: pass the pair, e.g. \(data\['x'\], "
               r"data\['y'\]\)$"),
    "bad batch": (lambda x, y: [(x, y), (x,)], {}, TypeError, "batch 1"),
    "wrong width": (lambda x, y: (x[:, :4], y), {}, ValueError, "fails on the first batch"),
    "float64": (lambda x, y: (x.double(), y), {}, ValueError,
                r"fails on the first batch .* must have the same dtype, but got Double and "
                r"Float\. Give the data the network's dtype \(x\.float\(\) for a float32 "
                r"network\) or the network the data's \(model\.double\(\)\)$"),
    "steps": (lambda x, y: (x, y), {"steps": 0}, ValueError, "steps"),
    "both": (lambda x, y: (x, y), {"steps": 2, "epochs": 1}, ValueError, "not both"),
    "lr": (lambda x, y: (x, y), {"lr": -1.0}, ValueError, "lr"),
    "init": (lambda x, y: (x, y), {"init": "xavier"}, ValueError, "init"),
    # a typo was accepted, and for an initialized guide never even read
    "init option name": (lambda x, y: (x, y), {"init_options": {"batchsize": 64}}, TypeError,
                         r"^fit: init_options \['batchsize'\] are not options of "
                         r"init_guide_iblm \(init='iblm'\); its options: batch_size, "
                         r"output_rows, "),
    "validation": (lambda x, y: (x, y), {"validation": (x_ := torch.zeros(3, 5), x_[:2, 0])},
                   ValueError, "validation"),
}


@pytest.mark.parametrize("initialized", [False, True])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_changes_nothing(case, initialized):
    make_data, options, error, match = BAD[case]
    x, y = blobs()
    model = classifier()
    guide = AutoKTiedNormal(model, rank=2)
    if initialized:
        init_guide_iblm(guide, (x, y))
    before, rng = snapshot(), torch.get_rng_state()
    with pytest.raises(error, match=match):
        fit(model, guide, make_data(x, y), progress=False, **{"steps": 2, **options})
    assert_identical(before, snapshot())
    assert torch.equal(rng, torch.get_rng_state())
    assert is_initialized(guide) == initialized


def _no_layers(x, y=None):  # (a model I-BLM refuses, after fit's checks)
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Categorical(logits=x[:, :3] + b), obs=y)


@pytest.mark.parametrize("fails_in", ["checks", "I-BLM"])
@pytest.mark.parametrize("own_generator", [None, "loader", "sampler"])
def test_a_failed_fit_on_a_shuffling_loader_leaves_its_generator_where_it_was(own_generator,
                                                                            fails_in):
    # reading a shuffling DataLoader (its batches, and its iterator's seed) draws from its
    # generator, its own, its sampler's or the global one: a failed call moved them
    x, y = blobs()
    generator = torch.Generator().manual_seed(1) if own_generator else None
    data = TensorDataset(x[:, :4] if fails_in == "checks" else x, y)
    if own_generator == "sampler":
        loader = DataLoader(data, batch_size=32,
                            sampler=torch.utils.data.RandomSampler(data, generator=generator))
    else:
        loader = DataLoader(data, batch_size=32, shuffle=True, generator=generator)
    model = classifier() if fails_in == "checks" else _no_layers
    guide = AutoKTiedNormal(model, rank=2)
    rng = torch.get_rng_state()
    own = generator.get_state() if generator is not None else None
    with pytest.raises(ValueError, match="fails on the first batch" if fails_in == "checks"
                       else "no F.linear"):
        fit(model, guide, loader, steps=2, progress=False)
    assert torch.equal(rng, torch.get_rng_state())
    if generator is not None:
        assert torch.equal(own, generator.get_state())


def test_an_error_the_library_raises_in_the_model_comes_without_pyros_trace_shapes():
    # A regressor's (N, 1) targets: its own message and hint, which Pyro's poutine.trace
    # had followed with a dump of the trace's shapes; a user's error (in torch, here a
    # width mismatch) keeps the dump, which helps to find it
    x, y = blobs()
    model = BayesianRegressor(bayesianize(mlp((5, 16, 1))), num_data=240)
    with pytest.raises(ValueError, match=r"got \(128, 1\): pass y\.squeeze\(-1\)$"):
        fit(model, AutoNormal(model), (x, y.float()[:, None]), steps=2, progress=False)
    with pytest.raises(ValueError, match="Trace Shapes"):
        fit(model, AutoNormal(model), (x[:, :4], y.float()), steps=2, progress=False)
    # torch's error, raised where the library's handler runs the layer: the user's
    with pytest.raises(RuntimeError) as error, local_reparam():
        pyro.poutine.trace(model).get_trace(x[:, :4], y.float())
    assert "pyro_vinit" in str(error.traceback[-1].path)
    assert "Trace Shapes" in error_text(error.value)


def _bernoulli(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, x.shape[1]]).to_event(2))
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Bernoulli(logits=F.linear(x, w).squeeze(-1)), obs=y)


def test_fit_refuses_bernoulli_targets_of_an_integer_dtype_or_outside_zero_one():
    # long 0/1 labels failed deep in torch at the first step (binary_cross_entropy_with_
    # logits: "result type Float can't be cast to ... Long"); I-BLM had accepted them
    x, y = blobs()
    y = (y > 0).long()
    guide = AutoKTiedNormal(_bernoulli)
    with pytest.raises(TypeError, match=r"^fit: the likelihood 'obs' is Bernoulli, whose "
                       r"log-density takes floating-point 0/1 targets \(y.float\(\)\), got "
                       r"torch.int64$"):
        fit(_bernoulli, guide, (x, y), steps=2, progress=False)
    with pytest.raises(ValueError, match=r"outside the support .*Bernoulli.* e.g. 2.0$"):
        fit(_bernoulli, guide, (x, 2.0 * y), steps=2, progress=False)
    assert snapshot() == {} and not is_initialized(guide)
    assert fit(_bernoulli, guide, (x, y.float()), steps=2, progress=False).steps == 2


def _column_label_classifier(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 5]).to_event(2))
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Categorical(logits=F.linear(x, w)), obs=y)


@pytest.mark.parametrize("make_model", [classifier, lambda: _column_label_classifier],
                         ids=["BayesianClassifier", "functional"])
def test_fit_refuses_a_column_of_labels_before_anything_changes(make_model):
    # y of shape (N, 1) broadcast a Categorical's log-density to (batch, batch): it got
    # through I-BLM and failed in Pyro's shape check at the first step (silently wrong
    # with Pyro's validation off)
    x, y = blobs()
    model = make_model()
    message = (r"BayesianClassifier: y must hold one class label per row"
               if isinstance(model, BayesianClassifier) else
               r"^fit: y of shape \(64, 1\) does not fit the likelihood 'obs': its distribution, "
               r"of batch shape \(64,\) and event shape \(\), broadcasts y to \(64, 64\), which "
               r"would score each row against other rows' predictions; give y the batch shape "
               r"followed by the event shape \(y.squeeze\(-1\) for a column\)$")
    guide = AutoKTiedNormal(model)
    with pytest.raises(ValueError, match=message):
        fit(model, guide, (x, y[:, None]), steps=2, batch_size=64, progress=False)
    assert snapshot() == {} and not is_initialized(guide)
    # the same column as validation labels: scored as (64, 64), silently wrong metrics
    rows = len(x)
    with pytest.raises(ValueError, match=message if isinstance(model, BayesianClassifier) else
                       rf"^fit: the validation y of shape \({rows}, 1\) does not fit the "
                       rf"likelihood 'obs': .* broadcasts the validation y to \({rows}, {rows}\)"):
        fit(model, guide, (x, y), steps=2, batch_size=64, progress=False,
            validation=(x, y[:, None]))
    assert snapshot() == {} and not is_initialized(guide)
    history = fit(model, guide, (x, y), steps=2, batch_size=64, progress=False)
    assert history.steps == 2


def _regression(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1], 8]).to_event(2))
    out = pyro.sample("out", dist.Normal(0.0, 1.0).expand([8, 1]).to_event(2))
    with pyro.plate("data", 240, subsample_size=x.shape[0]):
        pyro.sample("obs", dist.Normal((torch.tanh(x @ w) @ out).squeeze(-1), 0.1), obs=y)


@pytest.mark.parametrize("batch_size", [240, 64])
def test_fit_refuses_a_conditioned_likelihood_before_anything_changes(batch_size):
    # fit shuffles and batches the rows of x; pyro.condition's y stays in its order: the
    # whole-data batch trained on scrambled pairs, silently (outside-user trial)
    x, _ = blobs()
    y = x[:, 0].sin()
    guide = AutoKTiedNormal(_regression)
    init_guide_iblm(guide, (x, y))  # on the unconditioned model, as the I-BLM page says
    before = snapshot()
    conditioned = pyro.poutine.condition(_regression, data={"obs": y})
    with pytest.raises(ValueError, match=r"^fit: the likelihood 'obs' is set by "
                       r"pyro.condition\(model, data=\{'obs': ...\}\), and fit draws "
                       r"minibatches .* Train the unconditioned model"):
        fit(conditioned, guide, (x, y), steps=2, batch_size=batch_size, progress=False)
    assert_identical(before, snapshot())


@pytest.mark.parametrize("guide_class", [AutoKTiedNormal, AutoNormal])
def test_fit_refuses_a_guide_set_up_without_y_before_anything_changes(guide_class):
    # the guide's prototype drew the likelihood as latent: Pyro's shape error in the step
    x, y = blobs()
    y = x.sum(-1)
    model = BayesianRegressor(bayesianize(mlp((5, 8, 1))), num_data=240)
    guide = guide_class(model)
    guide(x[:1])
    before = snapshot()
    message = (rf"^fit: the {guide_class.__name__} was set up without y: its prototype trace "
               r"drew the model's likelihood sites \['obs'\] as latent\. Make a fresh guide "
               r"\(after pyro.clear_param_store\(\)\) and let fit set it up, or set it up "
               r"with guide\(x, y\)$")
    with pytest.raises(ValueError, match=message):
        fit(model, guide, (x, y), steps=2, batch_size=64, progress=False)
    assert_identical(before, snapshot())
    pyro.clear_param_store()
    guide = guide_class(model)
    guide(x[:1], y[:1])
    assert fit(model, guide, (x, y), steps=2, batch_size=64, progress=False).steps == 2


@pytest.mark.parametrize("set_up", [False, True], ids=["fresh", "set_up"])
def test_fit_refuses_a_guide_built_on_another_model_before_anything_changes(set_up):
    # a notebook's model cell re-run with another width, the guide's cell not: I-BLM wrote
    # the guide for the old model, then Pyro refused the shapes at the first step
    x, y = blobs()
    old, model = classifier(hidden=16), classifier(hidden=12)
    guide = AutoKTiedNormal(old, rank=2)
    if set_up:
        guide(x, y)
    before = snapshot()
    message = (r"^fit: the AutoKTiedNormal was built on another model than the one passed to "
               r"fit: the latent site 'net\.0\.weight' has shape \(16, 5\) in the guide's "
               r"model and \(12, 5\) in fit's\. Build the guide on this model, e\.g\. "
               r"AutoKTiedNormal\(model\), after pyro\.clear_param_store\(\)$")
    with pytest.raises(ValueError, match=message):
        fit(model, guide, (x, y), steps=2, progress=False)
    assert_identical(before, snapshot())
    assert set_up or guide.prototype_trace is None
    # the usual notebook case: the input width changed, so the old model fails on the data
    pyro.clear_param_store()
    guide = AutoKTiedNormal(classifier(d=4), rank=2)
    with pytest.raises(ValueError, match=(
            r"^fit: the AutoKTiedNormal was built on another model than the one passed to fit "
            r"\(build the guide on this model, e\.g\. AutoKTiedNormal\(model\), after "
            r"pyro\.clear_param_store\(\)\): the guide's model fails on the first batch \(x "
            r"\(128, 5\) torch\.float32, y \(128,\) torch\.int64\): RuntimeError: mat1 and "
            r"mat2 shapes cannot be multiplied")):
        fit(model, guide, (x, y), steps=2, progress=False)
    assert snapshot() == {}
    # a guide over a wrapper of the model (another callable, the same shapes) trains
    pyro.clear_param_store()
    guide = AutoKTiedNormal(pyro.poutine.block(model, hide=[]), rank=2)
    assert fit(model, guide, (x, y), steps=2, progress=False).steps == 2


def _replicates(x, y=None):
    # three replicate targets a row, the free rightmost dim of a plate at dim -2 (Pyro's
    # shape rules allow it): the distribution broadcast up to y, not y broadcast
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, 5]).to_event(2))
    with pyro.plate("data", 240, subsample=torch.arange(len(x)), dim=-2):
        pyro.sample("obs", dist.Normal(F.linear(x, w), 1.0), obs=y)


def _event_column(x, y=None):
    # a (batch, 1) mean as a one-element event, y of shape (batch,): y broadcast to
    # (batch, batch) inside the event's sum, with the log-density of the batch's shape
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, 5]).to_event(2))
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Normal(F.linear(x, w), 1.0).to_event(1), obs=y)


def test_fit_takes_replicates_and_refuses_a_target_broadcast_inside_the_event():
    x, _ = blobs()
    y = x.sum(-1, keepdim=True) + torch.randn(240, 3)
    assert fit(_replicates, AutoNormal(_replicates), (x, y), steps=2, batch_size=64,
               progress=False, init=None).steps == 2  # (I-BLM: one target column a unit)
    pyro.clear_param_store()
    with pytest.raises(ValueError, match=r"^fit: y of shape \(64,\) does not fit the likelihood "
                                         r"'obs': its distribution, of batch shape \(64,\) and "
                                         r"event shape \(1,\), broadcasts y to \(64, 64\)"):
        fit(_event_column, AutoNormal(_event_column), (x, x.sum(-1)), steps=2, batch_size=64,
            progress=False)
    assert snapshot() == {}


def test_fit_refuses_a_weight_noise_factory_that_returns_no_handler():
    x, y = blobs()
    model = classifier()
    with pytest.raises(TypeError, match=r"^fit: weight_noise \(<lambda>\) returned a NoneType, "
                                        r"not a handler \(a context manager\)$"):
        fit(model, AutoKTiedNormal(model), (x, y), steps=2, progress=False,
            weight_noise=lambda: None)
    assert snapshot() == {}


def test_bad_regression_targets():
    x, y = blobs()
    model = BayesianRegressor(bayesianize(mlp((5, 8, 1))), num_data=240)
    with pytest.raises(TypeError, match="floating point"):
        fit(model, AutoKTiedNormal(model), (x, y), steps=2, progress=False)
    assert snapshot() == {}


# ---- num_data -----------------------------------------------------------------------------


@pytest.mark.parametrize("prior_scale", [1.0, 100.0], ids=["unit priors", "wide priors"])
@pytest.mark.parametrize("targets", ["raw", "standardized", "offset in the model"])
def test_targets_far_beyond_the_priors_scale_are_warned_of(targets, prior_scale):
    # raw targets of mean 150 and std 80 (diabetes): an outside user's network predicted
    # about 0, an RMSE of 2.05 times their std after I-BLM and fit, with no word said; a
    # model that adds their mean itself reaches them (its mean at the priors' medians)
    x = torch.randn(200, 4)
    y = x @ torch.tensor([12.0, -8.0, 4.0, 2.0]) + 40.0  # (of the order of 10 but > 10)
    y = (y - y.mean()) / y.std() if targets == "standardized" else y
    offset = 40.0 if targets == "offset in the model" else 0.0

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, prior_scale).expand([1, 4]).to_event(2))
        b = pyro.sample("b", dist.Normal(0.0, prior_scale).expand([1]).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(F.linear(x, w, b).squeeze(-1) + offset, 1.0),
                        obs=y)

    message = (r"^the targets of the likelihood 'obs' have a mean or std of the order of 10, "
               r"more than ten times the largest scale of the model's Normal priors, under "
               r"which a network's outputs stay near that scale: its fit is pulled toward 0 "
               r"and fits them poorly\. Standardize them, \(y - y\.mean\(\)\) / y\.std\(\), "
               r"and map the predictions back \(times y\.std\(\), plus y\.mean\(\)\), or give "
               r"the model priors on the targets' scale$")
    for seed, call in enumerate(2 * [
            lambda g: fit(model, g, (x, y), steps=2, batch_size=200, init=None,
                          progress=False),
            lambda g: pyro_vinit.init_guide_iblm(g, (x, y))]):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)  # (whatever the prior's draws)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call(AutoKTiedNormal(model, rank=1))
        said = [w for w in caught if "the targets of the likelihood" in str(w.message)]
        if targets == "raw" and prior_scale == 1.0:
            assert len(said) == 1 and re.match(message, str(said[0].message))
            assert said[0].filename == __file__  # (the user's line)
        else:
            assert said == []


def test_fit_refuses_vectorized_particles_through_a_batch_norm_before_any_change():
    # (refused by the handler at the first step, after I-BLM had set the guide up)
    x, y = blobs()
    net = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model = BayesianClassifier(bayesianize(net), num_data=len(x))
    guide = AutoKTiedNormal(model)
    with pytest.raises(ValueError, match=r"fit: num_particles > 1 runs the particles "
                       r"vectorized, and the BatchNorm 'net\.1' normalizes with the "
                       r"statistics of its batch.*num_particles=1"):
        fit(model, guide, (x, y), steps=2, num_particles=2, progress=False)
    assert snapshot() == {} and not is_initialized(guide)
    assert int(net[1].num_batches_tracked) == 0
    # a BatchNorm before every Bayesian layer sees one input for all the particles
    head = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model = BayesianClassifier(bayesianize(head, exclude=["0"]), num_data=len(x))
    fit(model, AutoKTiedNormal(model), (x, y), steps=2, num_particles=2, progress=False)


def test_a_refused_fit_leaves_the_batch_norm_statistics_as_they_were():
    # (the check of the guide's model ran it, through the guide's wrapper, in train mode)
    x, y = blobs()
    net = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model = BayesianClassifier(bayesianize(net), num_data=len(x))
    buffers = {k: b.clone() for k, b in net.named_buffers()}
    with pytest.raises(ValueError, match="validation y holds values outside the support"):
        fit(model, AutoKTiedNormal(model), (x, y), steps=2, progress=False,
            validation=(x[:5], torch.full((5,), 7)))
    assert all(torch.equal(b, buffers[k]) for k, b in net.named_buffers())


def test_fit_refuses_a_model_without_num_data_on_minibatches():
    x, y = blobs()
    model = BayesianClassifier(bayesianize(mlp((5, 16, 3))))
    guide = AutoKTiedNormal(model)
    with pytest.raises(ValueError, match="num_data=240"):
        fit(model, guide, (x, y), steps=2, batch_size=64, progress=False)
    assert snapshot() == {} and not is_initialized(guide)
    # full-batch training needs no scaling
    fit(model, guide, (x, y), steps=2, batch_size=240, progress=False)


def test_fit_refuses_an_unscaled_functional_model():
    x, y = blobs()

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 5]).to_event(2))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=F.linear(x, w)), obs=y)

    with pytest.raises(ValueError, match="not scaled to the data set"):
        fit(model, AutoNormal(model), (x, y), steps=2, batch_size=64, progress=False)


def test_fit_refuses_a_plate_subsampling_the_batch():
    # Pyro's tutorial spelling, the model indexing its own data: under fit's batches of
    # 64 of 240 rows the plate's scale is 64 / 16, the likelihood weighs one batch, and
    # a later batch of fewer than 16 rows fails inside Pyro after steps were taken
    x, y = blobs()

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 5]).to_event(2))
        with pyro.plate("data", x.shape[0], subsample_size=16) as ind:
            pyro.sample("obs", dist.Categorical(logits=F.linear(x[ind], w)), obs=y[ind])

    guide = AutoNormal(model)
    with pytest.raises(ValueError, match=r"plate\('data', 64, subsample_size=16\), a plate "
                                         r"over the batch's 64 rows.*pyro.plate\('data', 240, "):
        fit(model, guide, (x, y), steps=2, batch_size=64, progress=False)
    assert snapshot() == {} and not is_initialized(guide)
    # full-batch training: the plate is over the data set
    fit(model, guide, (x, y), steps=2, batch_size=240, progress=False)


class _TwoHeads(PyroModule):
    # a classification and a regression head: r is latent unless observed
    def __init__(self, num_data):
        super().__init__()
        self.num_data = num_data
        self.trunk = bayesianize(nn.Linear(5, 8))
        self.cls = bayesianize(nn.Linear(8, 3))
        self.reg = bayesianize(nn.Linear(8, 1))

    def forward(self, x, y=None, r=None):
        h = torch.tanh(self.trunk(x))
        logits, mean = self.cls(h), self.reg(h).squeeze(-1)
        with pyro.plate("data", x.shape[0]), pyro.poutine.scale(scale=self.num_data / len(x)):
            pyro.sample("y", dist.Categorical(logits=logits), obs=y)
            pyro.sample("r", dist.Normal(mean, 0.1), obs=r)


def test_fit_refuses_a_latent_site_in_the_plate_over_the_batch():
    # Regression: the second head's site, left unobserved, is a per-example latent whose
    # guide took the shape of I-BLM's batch, and the first SVI step failed inside Pyro
    # ("Shape mismatch inside plate('data') at site y dim -1, 240 vs 64").
    x, y = blobs()
    model = _TwoHeads(len(x))
    guide = AutoKTiedNormal(model)
    with pytest.raises(ValueError, match=r"'r' lies in plate 'data' over the batch's 64 rows"):
        fit(model, guide, (x, y), steps=2, batch_size=64, progress=False)
    assert snapshot() == {} and not is_initialized(guide)
    # on the full data set every call has the same rows: a per-example latent is fine
    fit(model, guide, (x, y), steps=2, batch_size=240, progress=False)


def test_fit_refuses_a_latent_site_with_batch_dims_outside_its_plates():
    # Regression (outside-user trial): a weight prior without .to_event(2) passed fit's
    # checks, I-BLM wrote the guide, then Pyro's ELBO refused the site's shape at the
    # first step ("at site "w", invalid log_prob shape Expected [], actual [3, 5]")
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 5]))
        with pyro.plate("data", 240, subsample=torch.arange(len(x))):
            pyro.sample("obs", dist.Categorical(logits=F.linear(x, w)), obs=y)

    x, y = blobs()

    def refused(model, batch, n, full):
        guide = AutoKTiedNormal(model, rank=2)
        with pytest.raises(ValueError, match="^" + re.escape(
                f"fit: the latent sample site 'w' has a distribution of batch shape {batch} "
                "outside any pyro.plate, which Pyro's ELBO refuses: make those dims the "
                f"sample's event, .to_event({n}) on its distribution (e.g. dist.Normal(0., 1.)"
                f".expand({list(full)}).to_event({len(full)}))") + "$"):
            fit(model, guide, (x, y), steps=2, batch_size=64, progress=False)
        assert snapshot() == {} and not is_initialized(guide)

    refused(model, (3, 5), 2, (3, 5))
    # a convolution's kernel made the event, its (out, in) channels left as batch dims,
    # which fit's check had ignored left of the model's one plate (as the ELBO's first step
    # does not: it checks with no plate nesting guessed yet)
    def conv(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 1, 2, 2]).to_event(2))
        with pyro.plate("data", 240, subsample=torch.arange(len(x))):
            logits = F.conv2d(x.reshape(-1, 1, 1, 5)[..., :4].reshape(-1, 1, 2, 2), w)
            pyro.sample("obs", dist.Categorical(logits=logits.flatten(1)), obs=y)

    refused(conv, (3, 1), 2, (3, 1, 2, 2))
    # in a plate over the weight's columns, a dim of rows left over: Pyro's own words then
    def in_a_plate(x, y=None):
        with pyro.plate("inputs", 5, dim=-1):
            w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 5]))
        with pyro.plate("data", 240, subsample=torch.arange(len(x)), dim=-2):
            pyro.sample("obs", dist.Categorical(logits=F.linear(x, w).unsqueeze(-2)),
                        obs=y[:, None])

    guide = AutoNormal(in_a_plate)
    with pytest.raises(ValueError, match=r"^fit: the latent sample site 'w' does not fit its "
                       r"plates: at site \"w\", invalid log_prob shape"):
        fit(in_a_plate, guide, (x, y), steps=2, batch_size=64, progress=False)
    assert snapshot() == {}
    # Pyro's ELBO checks the shapes only under validation, and so does fit
    with pyro.validation_enabled(False):
        fit(model, AutoNormal(model), (x, y), steps=2, batch_size=64, init=None,
            progress=False)


def test_fit_takes_a_latent_site_in_a_plate_as_large_as_the_batch_but_not_over_it():
    # Regression: a weight in a plate over its 16 units was refused as a per-example latent
    # when the minibatch also had 16 rows
    def model(x, y=None):
        with pyro.plate("hidden", 16):
            w1 = pyro.sample("w1", dist.Normal(0.0, 1.0).expand([16, 5]).to_event(1))
        w2 = pyro.sample("w2", dist.Normal(0.0, 1.0).expand([3, 16]).to_event(2))
        with pyro.plate("data", 240, subsample=torch.arange(len(x))):
            pyro.sample("obs", dist.Categorical(logits=torch.tanh(x @ w1.T) @ w2.T), obs=y)

    x, y = blobs()
    history = fit(model, AutoNormal(model), (x, y), steps=2, batch_size=16, init=None,
                  kl_weight=0.01, progress=False)
    assert len(history.loss) == 2 and all(math.isfinite(v) for v in history.loss)


def _functional_classifier(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 5]).to_event(2))
    z = pyro.sample("z", dist.Bernoulli(0.5))
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Categorical(logits=F.linear(x, w) * (1 + z)), obs=y)


@pytest.mark.parametrize("case", ["not reparameterized", "fails"])
def test_fit_checks_a_hand_written_guide_before_anything_changes(case):
    # Regression: a guide drawing a Bernoulli latent set itself up in the param store,
    # then failed inside Pyro at the first step ("All distributions in the guide must be
    # fully reparameterized"); a guide that raised did so from fit's set-up.
    def guide(x, y=None):
        loc = pyro.param("w_loc", torch.zeros(3, 5))
        pyro.sample("w", dist.Normal(loc, 0.1).to_event(2))
        if case == "fails":
            raise KeyError("oops")
        p = pyro.param("p", torch.tensor(0.5), constraint=dist.constraints.unit_interval)
        pyro.sample("z", dist.Bernoulli(p))

    x, y = blobs()
    pyro.param("someone_elses", torch.ones(2))
    before = snapshot()
    message = (r"the guide draws the sites \['z'\] \(Bernoulli\) without reparameterization"
               if case == "not reparameterized"
               else r"the guide fails on the first batch \(x \(64, 5\) torch.float32, y "
               r"\(64,\) torch.int64\): KeyError: 'oops'")
    with pytest.raises(ValueError, match=message):
        fit(_functional_classifier, guide, (x, y), steps=2, batch_size=64, init=None,
            progress=False)
    assert_identical(before, snapshot())


@pytest.mark.parametrize("init", ["iblm", None])
def test_fit_refuses_plain_module_parameters_under_module_local_params(init):
    # Regression: under module_local_params=True a plain nn.Parameter of a PyroModule
    # (BatchNorm's weight in a bayesianized net) has no .unconstrained(), on which Pyro's
    # SVI steps: fit ran I-BLM, then failed inside pyro/infer/svi.py with "AttributeError:
    # 'Parameter' object has no attribute 'unconstrained'"
    x, y = blobs()
    with pyro.settings.context(module_local_params=True):
        net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        model = BayesianClassifier(bayesianize(net), num_data=240)
        guide = AutoKTiedNormal(model)
        with pytest.raises(ValueError, match=r"fit: the model's parameters \['net.1.bias', "
                                             r"'net.1.weight'\] are not the param store's.*"
                                             "module_local_params=True"):
            fit(model, guide, (x, y), steps=2, batch_size=64, init=init, progress=False)
    assert guide.prototype_trace is None and not list(guide.parameters())
    assert not list(pyro.get_param_store().keys())


def test_fit_refuses_a_param_fixed_by_poutine_substitute():
    # Regression: SVI cannot step on a substituted param's value (no .unconstrained()):
    # fit failed in I-BLM saying that module_local_params=True, which was not set
    x = torch.randn(64, 3)
    y = x.sum(-1)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, 3]).to_event(2))
        sigma = pyro.param("sigma", torch.tensor(1.0), constraint=dist.constraints.positive)
        with pyro.plate("data", 64, subsample_size=x.shape[0]):
            pyro.sample("obs", dist.Normal(F.linear(x, w).squeeze(-1), sigma), obs=y)

    fixed = pyro.poutine.substitute(model, data={"sigma": torch.tensor(0.3)})
    with pytest.raises(ValueError, match=r"fit: the model's parameters \['sigma'\] are not "
                                         r"the param store's.*poutine.substitute"):
        fit(fixed, AutoKTiedNormal(fixed), (x, y), steps=2, batch_size=16, progress=False)
    assert not list(pyro.get_param_store().keys())


def test_fit_refuses_a_num_data_that_is_not_the_data_size():
    x, y = blobs()
    model = classifier(num_data=1000)
    with pytest.raises(ValueError, match="num_data=1000"):
        fit(model, AutoKTiedNormal(model), (x, y), steps=2, progress=False)


@pytest.mark.parametrize("where", ["y", "x", "loader", "validation"])
def test_fit_refuses_non_finite_data_before_anything_changes(where):
    # a guide that is initialized skips I-BLM's own check: before, fit trained until
    # the batch with the NaN row, then failed inside Pyro with the parameters changed
    x, y = blobs(n=400)
    x, y = x.clone(), y.float()
    model = BayesianRegressor(bayesianize(mlp((5, 8, 1))), num_data=400, learn_noise=True)
    guide = AutoKTiedNormal(model)
    fit(model, guide, (x, y), steps=1, progress=False)
    before = snapshot()
    (y if where != "x" else x)[300] = float("nan")
    data = (DataLoader(TensorDataset(x, y), batch_size=100) if where == "loader"
            else (x, y) if where != "validation" else (x[:300], y[:300]))
    validation = (x[250:], y[250:]) if where == "validation" else None
    name = "x" if where == "x" else "y"
    with pytest.raises(ValueError, match=rf"fit: {name} of .* contains NaN or inf \(row "):
        fit(model, guide, data, steps=10, validation=validation, progress=False)
    after = snapshot()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


# ---- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize("guide_class, handler", [
    (AutoKTiedNormal, LocalReparamMessenger), (AutoNormal, LocalReparamMessenger),
    (pyro_vinit.AutoMeanFieldNormal, LocalReparamMessenger),
    (AutoRadialNormal, FlipoutMessenger), (AutoDiagonalNormal, None),
])
def test_fit_config_handler(guide_class, handler):
    x, y = blobs()
    model = classifier()
    guide = guide_class(model)
    config = fit_config(guide)
    if handler is None:
        assert config.weight_noise is None
    else:
        made = config.weight_noise()
        assert type(made) is handler and made is not config.weight_noise()  # fresh
        # LRT on linear layers only: convolutions keep their weight sample (the race's CNN)
        assert made.conv is False
    assert (config.lr, config.kl_weight, config.num_particles) == (3e-3, 0.01, 1)
    assert (config.iblm_batch_size, config.max_scale_ratio) == (512, 0.1)
    # Adam warmed up over 50 steps (docs/methods/training.rst: its first steps undo I-BLM)
    assert config.warmup_steps == 50 and config.optimizer().warmup_steps == 50
    other = fit_config(guide, lr=3e-3, kl_weight=1.0, num_particles=2)
    assert (other.lr, other.kl_weight, other.num_particles) == (3e-3, 1.0, 2)
    with pytest.raises(ValueError, match="kl_weight"):
        fit_config(guide, kl_weight=0.0)


def test_fit_config_elbo_and_iblm_rows_at_their_edges():
    guide = AutoKTiedNormal(classifier())
    one, two = fit_config(guide).elbo(), fit_config(guide, num_particles=2).elbo()
    assert (one.num_particles, one.vectorize_particles) == (1, False)
    assert (two.num_particles, two.vectorize_particles) == (2, True)  # particles in one pass
    # at least one row per unit, even from two or three rows
    assert [fit_config(guide).iblm_options(n)["batch_size"] for n in (1, 2, 3, 4)] == [1, 1, 1, 2]


@pytest.mark.parametrize("option, value", [
    ("lr", 0.0), ("lr", True), ("lr", "0.1"), ("kl_weight", float("nan")),
    ("kl_weight", -1.0), ("num_particles", 1.5), ("num_particles", 0),
])
def test_fit_config_refuses_a_bad_override_naming_it(option, value):
    # a bool is not a number here, a string not compared, a particle count an int
    with pytest.raises(ValueError, match=f"^fit: {option} must be a positive number"):
        fit_config(AutoKTiedNormal(classifier()), **{option: value})


def test_is_initialized_reads_the_guides_own_params_only():
    model = classifier()
    guide = AutoKTiedNormal(model)
    pyro.param("other.scale", torch.ones(2))  # another program's parameter
    assert not is_initialized(guide)
    pyro.param("AutoKTiedNormal.locs.net.0.weight", torch.zeros(2))  # e.g. a loaded store
    assert is_initialized(guide)
    assert not is_initialized(lambda x, y=None: None)  # not an autoguide: never


def _functional_regression(x, y=None, learn=False):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, x.shape[-1]]).to_event(2))
    scale = pyro.param("noise", torch.tensor(0.5), constraint=dist.constraints.positive) \
        if learn else 0.5
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Normal(F.linear(x, w).squeeze(-1), scale), obs=y)


def _transformed_noise_regression(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, x.shape[-1]]).to_event(2))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        base = dist.Normal(F.linear(x, w).squeeze(-1), sigma)
        pyro.sample("obs", dist.TransformedDistribution(
            base, [dist.transforms.AffineTransform(1.0, 2.0)]), obs=y)


def _latent_noise_regression(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, x.shape[-1]]).to_event(2))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Normal(F.linear(x, w).squeeze(-1), sigma), obs=y)


def _hierarchical_classifier(x, y=None):
    # a learned prior scale, latent and a param: no likelihood noise scale at all
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    prior = pyro.param("prior", torch.tensor(1.0), constraint=dist.constraints.positive)
    w = pyro.sample("w", dist.Normal(0.0, tau * prior).expand([3, x.shape[-1]]).to_event(2))
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Categorical(logits=F.linear(x, w)), obs=y)


def _hierarchical_regression(x, y=None):
    # the same prior, a fixed noise scale
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    w = pyro.sample("w", dist.Normal(0.0, tau).expand([1, x.shape[-1]]).to_event(2))
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Normal(F.linear(x, w).squeeze(-1), 0.5), obs=y)


def _in_place_regression(x, y=None):
    # a fixed noise; the model clamps its weight sample in place
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, x.shape[-1]]).to_event(2))
    w.clamp_(-3.0, 3.0)
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Normal(F.linear(x, w).squeeze(-1), 0.5), obs=y)


def test_fit_config_kl_weight_where_the_model_learns_its_noise():
    # 0.3 where a BayesianRegressor learns its noise scale; explicit settings win
    def regressor(learn):
        return BayesianRegressor(bayesianize(mlp((5, 8, 1))), num_data=240, learn_noise=learn)

    assert fit_config(AutoKTiedNormal(regressor(True))).kl_weight == 0.3
    assert fit_config(AutoKTiedNormal(pyro.condition(regressor(True), data={}))).kl_weight == 0.3
    assert fit_config(AutoKTiedNormal(regressor(False))).kl_weight == 0.01
    assert fit_config(AutoKTiedNormal(classifier())).kl_weight == 0.01
    assert fit_config(AutoKTiedNormal(regressor(True)), learned_noise=False).kl_weight == 0.01
    assert fit_config(AutoKTiedNormal(regressor(True)), kl_weight=0.05).kl_weight == 0.05
    assert pyro.get_param_store().keys() == set()  # nothing read through the param store
    guide = AutoNormal(_functional_regression)
    with pytest.warns(UserWarning, match="pass learned_noise=True where it does"):
        assert fit_config(guide).kl_weight == 0.01
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit_config(guide, learned_noise=True).kl_weight == 0.3
        assert fit_config(guide, kl_weight=1.0).kl_weight == 1.0
    with pytest.raises(TypeError, match="learned_noise must be True, False or None"):
        fit_config(guide, learned_noise="yes")


@pytest.mark.parametrize("make_model, expected", [
    (lambda: _functional_regression, 0.01),  # a fixed noise
    (lambda: functools.partial(_functional_regression, learn=True), 0.3),  # a noise param
    (lambda: _latent_noise_regression, 0.3),  # a latent noise
    (lambda: BayesianRegressor(bayesianize(mlp((5, 8, 1))), num_data=240, learn_noise=True),
     0.3),
    (lambda: BayesianRegressor(bayesianize(mlp((5, 8, 1))), num_data=240), 0.01),
    (lambda: classifier(), 0.01),
    # Regression: the latent sites, conditioned on their values to read the gradients, were
    # taken for likelihoods, and a learned prior scale for a learned noise scale (0.3)
    (lambda: _hierarchical_classifier, 0.01),
    (lambda: _hierarchical_regression, 0.01),
    # Regression: the latent values given to the model were leaves that require gradients,
    # and torch refused the model's in-place op on its sample
    (lambda: _in_place_regression, 0.01),
    (lambda: _transformed_noise_regression, 0.3),  # a Normal's learned scale, transformed
], ids=["fixed", "param", "latent", "learn_noise", "regressor", "classifier",
        "hierarchical-classifier", "hierarchical-fixed-noise", "in-place", "transformed"])
def test_fit_reads_whether_the_model_learns_its_noise(make_model, expected):
    x, y = blobs()
    model = make_model()
    if not isinstance(model, BayesianClassifier) and model is not _hierarchical_classifier:
        y = y.float()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit(model, AutoNormal(model), (x, y), steps=1, init=None, progress=False)
    assert history.config.kl_weight == expected
    assert not any("cannot tell" in str(w.message) for w in caught)
    # the in-place clamp uses the draw as drawn: its layer keeps the ordinary sample (the
    # clamped one), which fit's weight-noise handler says; no other warning
    assert [str(w.message).split(":")[0] for w in caught] == (
        ["LocalReparamMessenger"] if model is _in_place_regression else [])
    pyro.clear_param_store()
    assert fit(model, AutoNormal(model), (x, y), steps=1, kl_weight=0.2, init=None,
               progress=False).config.kl_weight == 0.2


class _NoisyRegressor(PyroModule):
    """A Bayesian MLP regression with a latent noise scale (the forum's style)."""

    def __init__(self, num_data):
        super().__init__()
        self.net = bayesianize(mlp((5, 16, 1)))
        self.num_data = num_data

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        mean = pyro.deterministic("mean", self.net(x).squeeze(-1))
        with pyro.plate("data", self.num_data, subsample=torch.arange(len(x))):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)


def test_fit_config_guide_list_takes_each_sites_weight_noise():
    x = torch.randn(120, 5)
    y = x.sum(-1) + 0.1 * torch.randn(120)
    model = _NoisyRegressor(len(x))
    guide = AutoGuideList(model)
    guide.append(AutoKTiedNormal(pyro.poutine.block(model, hide=["sigma"]), rank=2))
    guide.append(AutoNormal(pyro.poutine.block(model, expose=["sigma"])))
    config = fit_config(guide, learned_noise=True)
    made = config.weight_noise()
    assert type(made) is WeightNoiseMessenger and isinstance(made.config, AutoWeightNoise)
    assert made.config.local_reparam.conv is False
    assert fit_config(AutoGuideList(model), learned_noise=True).weight_noise is None  # no member
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # I-BLM names the member it leaves alone
        history = fit(model, guide, (x, y), steps=20, batch_size=40, progress=False,
                      validation=(x[:40], y[:40]))
    assert all(math.isfinite(v) for v in history.loss)
    # pyro.deterministic's site is no likelihood: the one of "obs" gives the RMSE
    assert {"mnll", "rmse"} <= set(history.validation[-1])
    # under fit's handlers every example draws its own weights (LRT): one input
    # repeated gives different outputs; without them, one draw for the batch
    same = x[:1].expand(8, 5)
    means = []
    for handlers in (config.handlers, contextlib.nullcontext):
        with handlers():
            guide_trace = pyro.poutine.trace(guide).get_trace(same)
            means.append(pyro.poutine.trace(pyro.poutine.replay(model, trace=guide_trace))
                         .get_trace(same).nodes["mean"]["value"])
    assert means[0].std() > 1e-2 and means[1].std() < 1e-5


def test_fit_config_handlers_weight_the_kl_term():
    # the loss under config.handlers(): expected log-likelihood + λ KL, λ = 0.01
    x, y = blobs()
    model = classifier()
    guide = AutoDelta(model)  # no weight noise: the loss is deterministic
    guide(x, y)
    config = fit_config(guide)
    elbo = config.elbo()
    full = elbo.loss(model, guide, x, y)
    with pyro.poutine.block(hide_types=["param"]):
        data_only = -pyro.poutine.trace(pyro.poutine.replay(
            model, trace=pyro.poutine.trace(guide).get_trace(x, y))).get_trace(
                x, y).nodes["obs"]["fn"].log_prob(y).sum()
    with config.handlers():
        tempered = elbo.loss(model, guide, x, y)
    assert tempered == pytest.approx(float(data_only) + 0.01 * (full - float(data_only)),
                                     rel=1e-5)


def test_fit_config_handlers_refused_inside_a_layer_call_handler_leave_the_stack():
    # the KL weight is entered first: the weight-noise handler's refusal must unwind it,
    # or it would reweight every later ELBO in the process
    from pyro.poutine.runtime import _PYRO_STACK

    config = fit_config(AutoKTiedNormal(classifier()))
    handlers = config.handlers()
    assert _PYRO_STACK == []  # entered at the with, not when made
    with FlipoutMessenger() as outer:
        with pytest.raises(RuntimeError, match="cannot be entered while FlipoutMessenger"):
            with handlers:
                pass
        assert _PYRO_STACK == [outer]
    assert _PYRO_STACK == []


def _shared_weight_classifier(x, y=None):
    # one weight matrix used by two layer calls (a tied weight)
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([5, 5]).to_event(2))
    out = pyro.sample("out", dist.Normal(0.0, 1.0).expand([3, 5]).to_event(2))
    h = torch.tanh(F.linear(torch.tanh(F.linear(x, w)), w))
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Categorical(logits=F.linear(h, out)), obs=y)


def test_fit_refuses_a_handler_that_refuses_the_model_before_anything_changes():
    from pyro.poutine.runtime import _PYRO_STACK

    x, y = blobs()
    # inside another layer-call handler: fit's own cannot be entered
    model = classifier()
    with FlipoutMessenger() as outer:
        with pytest.raises(ValueError, match=r"^fit: under its weight-noise handler "
                           r"\(local_reparam\) the model and guide fail on the first batch; "
                           r"choose "
                           r"fit's handler with fit\(\.\.\., weight_noise=\.\.\.\).*\. "
                           r"RuntimeError: LocalReparamMessenger cannot be entered while "
                           r"FlipoutMessenger is active"):
            fit(model, AutoKTiedNormal(model), (x, y), steps=2, progress=False)
        assert _PYRO_STACK == [outer]
    assert len(pyro.get_param_store()) == 0
    # a shared weight given per-example noise at its first use: refused at its second
    guide = AutoKTiedNormal(_shared_weight_classifier)
    for init in ("iblm", None):
        with pytest.raises(ValueError, match=r"fail on the first batch; .* ValueError: "
                           r"LocalReparamMessenger: the sample of site 'w' is used a second"):
            fit(_shared_weight_classifier, guide, (x, y), steps=2, progress=False, init=init)
        assert len(pyro.get_param_store()) == 0 and guide.prototype_trace is None
    # strict=True against the guide's distributions (radial, not a factorized Normal):
    # refused before I-BLM writes, the guide not set up; a guide set up kept bit for bit
    model = classifier()
    guide = AutoRadialNormal(model)
    strict = functools.partial(local_reparam, strict=True)
    for _ in range(2):
        before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
        with pytest.raises(ValueError, match=r"(?s)fail on the first batch; .* ValueError: "
                           r"LocalReparamMessenger: 2 latent site\(s\) kept their ordinary "
                           r"sample.*'net\.0\.weight': its distribution is RadialNormal"):
            fit(model, guide, (x, y), steps=2, progress=False, weight_noise=strict)
        after = dict(pyro.get_param_store().items())
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert (guide.prototype_trace is None) == (not before)
        guide(x, y)  # the second time set up already


def test_fit_weight_noise_chooses_the_handler():
    x, y = blobs()
    guide = AutoKTiedNormal(_shared_weight_classifier)
    seen = []

    def leave_w_out():
        handler = WeightNoiseMessenger(
            config=lambda msg: None if msg["name"] == "w" else AutoWeightNoise())
        seen.append(handler)
        return handler

    history = fit(_shared_weight_classifier, guide, (x, y), steps=3, progress=False,
                  init=None, weight_noise=leave_w_out)
    # one handler for the check on the first batch, then a fresh one at each step
    assert history.config.weight_noise is leave_w_out and len(seen) == 4
    assert all(math.isfinite(loss) for loss in history.loss)
    # none of fit's: the handler around fit applies
    pyro.clear_param_store()
    model = classifier()
    with FlipoutMessenger():
        history = fit(model, AutoKTiedNormal(model), (x, y), steps=2, progress=False,
                      weight_noise=contextlib.nullcontext)
    assert history.config.weight_noise is contextlib.nullcontext


@pytest.mark.parametrize("value, message", [
    (LocalReparamMessenger(), "not a handler .LocalReparamMessenger."),
    ("local_reparam", "must be a callable that returns a fresh handler"),
])
def test_fit_refuses_a_bad_weight_noise_before_anything_changes(value, message):
    x, y = blobs()
    model = classifier()
    guide = AutoKTiedNormal(model)
    with pytest.raises(TypeError, match=f"^fit: weight_noise .*{message}"):
        fit(model, guide, (x, y), steps=2, progress=False, weight_noise=value)
    assert len(pyro.get_param_store()) == 0
    with pytest.raises(TypeError, match=f"^fit: weight_noise .*{message}"):
        fit_config(guide, weight_noise=value)


def test_fit_config_drives_an_own_loop_like_fit():
    # fit = I-BLM with FitConfig's options, then SVI steps under config.handlers()
    x, y = blobs()

    def own_loop():
        pyro.set_rng_seed(1)
        model = classifier()
        guide = AutoKTiedNormal(model)
        order = torch.Generator().manual_seed(int(torch.randint(2**62, ()).item()))
        config = fit_config(guide)
        init_guide_iblm(guide, (x, y), **config.iblm_options(len(x)))
        svi = pyro.infer.SVI(model, guide, config.optimizer(), config.elbo())
        losses, epoch = [], torch.randperm(240, generator=order)
        for idx in epoch.split(120):
            with config.handlers():
                losses.append(svi.step(x[idx], y[idx]))
        return losses

    def with_fit():
        pyro.set_rng_seed(1)
        model = classifier()
        return fit(model, AutoKTiedNormal(model), (x, y), steps=2, batch_size=120,
                   progress=False).loss

    own = own_loop()
    pyro.clear_param_store()
    assert with_fit() == own


# ---- validation metrics ------------------------------------------------------------------


@pytest.mark.parametrize("mnlls, warns", [
    ([1.0, 0.8, 1.2], True),     # ended 20% above its start
    ([1.0, 1.5, 1.05], False),   # within 10% of it
    ([1.0, 0.5, 0.4], False),
    ([1.0, 0.5, 0.6], True),     # 20% above its best, at step 2 (an outside user's trial:
    ([1.0, 0.5, 0.52], False),   # 1.09 to 1.17 from 400 to 2000 steps, unwarned)
    ([-0.5, -0.6, -0.55], False),  # a negative MNLL that fell, within 0.06 of its best
    ([-0.5, -0.6, -0.52], True),   # one 0.08 above its best, more than 10% of its size
    ([-0.5, -0.6, -0.4], True),    # one that rose by 20% of its size
    ([0.01, 0.0, 0.05], False),    # near zero: within 0.05 nats
    ([1.0, 0.5, float("nan")], True),  # no MNLL at the end
])
def test_fit_warns_when_training_made_the_validation_worse(monkeypatch, mnlls, warns):
    x, y = blobs()
    model = classifier()
    values = iter(mnlls)
    monkeypatch.setattr(training_loop, "_evaluate",
                        lambda *args: {"mnll": next(values), "error_rate": 0.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit(model, AutoKTiedNormal(model), (x, y), steps=4, eval_every=2,
                      validation=(x, y), progress=False)
    assert [v["mnll"] for v in history.validation] == mnlls
    worse = [w for w in caught if "validation MNLL rose" in str(w.message)]
    assert len(worse) == warns
    if warns and mnlls[-1] == 0.6:
        assert str(worse[0].message).startswith(
            "fit: the validation MNLL rose from its best, 0.5 at step 2, to 0.6 at step 4: "
            "training past step 2 made the model worse (e.g. overconfident); the tempered")
    if warns and mnlls[-1] == 1.2:
        assert "from 1 at step 0 to 1.2 at step 4" in str(worse[0].message)
        assert "(kl_weight=0.01) can overfit" in str(worse[0].message)
        assert "try a larger kl_weight (1 is the full ELBO)" in str(worse[0].message)
        assert worse[0].filename == __file__  # the caller's line


def test_the_warning_of_a_worse_validation_names_the_models_dropout(monkeypatch):
    # (the PyTorch tutorial's dropout, on in SVI and off in I-BLM's fit, undid its start
    # while the warning blamed the KL weight alone)
    x, y = blobs()
    net = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    model = BayesianClassifier(bayesianize(net), num_data=len(x))
    values = iter([1.0, 1.5, 2.0])
    monkeypatch.setattr(training_loop, "_evaluate",
                        lambda *args: {"mnll": next(values), "error_rate": 0.0})
    with pytest.warns(UserWarning, match=r"validation MNLL rose .*; the model's dropout "
                      r"\(net\.2\) is on in training and was off in the initializer's fit, "
                      r"whose start it can undo: train without it$") as record:
        fit(model, AutoKTiedNormal(model), (x, y), steps=4, eval_every=2,
            validation=(x, y), progress=False)
    assert [w.filename for w in record if "MNLL rose" in str(w.message)] == [__file__]


def test_fit_at_the_full_elbo_warns_without_naming_the_kl_weight(monkeypatch):
    x, y = blobs()
    model = classifier()
    values = iter([1.0, 1.5, 2.0])
    monkeypatch.setattr(training_loop, "_evaluate",
                        lambda *args: {"mnll": next(values), "error_rate": 0.0})
    with pytest.warns(UserWarning, match="worse than its start; try fewer steps$"):
        fit(model, AutoKTiedNormal(model), (x, y), steps=2, kl_weight=1.0, validation=(x, y),
            progress=False)


def test_validation_metrics_of_a_point_mass():
    # AutoDelta: the predictive is the network at the guide's values, in closed form
    x, y = blobs()
    model = classifier()
    guide = AutoDelta(model)
    history = fit(model, guide, (x, y), steps=3, init=None, validation=(x, y),
                  num_samples=3, progress=False)
    values = {k: v.detach() for k, v in guide.median(x, y).items()}
    logits = pyro.poutine.condition(model, values)(x)
    result = history.validation[-1]
    assert result["mnll"] == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-5)
    assert result["error_rate"] == pytest.approx(float((logits.argmax(-1) != y).float().mean()))


def _multi_label(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 5]).to_event(2))
    logits = F.linear(x, w)
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Bernoulli(logits=logits).to_event(1), obs=y)
    return logits


def test_validation_error_rate_of_a_bernoulli_likelihood():
    # two labels a row: the share of labels whose probability is on the wrong side of 0.5
    x, _ = blobs()
    y = torch.stack([x[:, 0] > 0, x[:, 1] + x[:, 2] > 0], -1).float()
    guide = AutoDelta(_multi_label)
    history = fit(_multi_label, guide, (x, y), steps=3, init=None, validation=(x, y),
                  num_samples=3, progress=False)
    logits = pyro.poutine.condition(_multi_label, {"w": guide.median(x, y)["w"].detach()})(x)
    result = history.validation[-1]
    assert result["mnll"] == pytest.approx(float(F.binary_cross_entropy_with_logits(
        logits, y, reduction="sum")) / len(x), rel=1e-5)
    assert 0 < result["error_rate"] == pytest.approx(float(((logits > 0) != (y > 0.5)).float()
                                                           .mean()))


def test_regression_with_learned_noise():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 5, generator=g)
    y = x @ torch.tensor([1.0, -0.5, 0.3, 0.0, 0.8]) + 0.3 * torch.randn(300, generator=g)
    model = BayesianRegressor(bayesianize(mlp((5, 32, 1))), num_data=300, learn_noise=True)
    guide = AutoKTiedNormal(model)
    init_guide_iblm(guide, (x, y), batch_size=300, max_scale_ratio=0.1)
    noise = float(model.noise_scale.detach())
    assert 0.25 < noise < 0.4  # I-BLM's residual std; the data's noise is 0.3
    assert pyro.get_param_store().get_param("noise_scale").item() == pytest.approx(noise)
    history = fit(model, guide, (x, y), steps=100, batch_size=100, validation=(x, y),
                  num_samples=8, progress=False)
    assert history.validation[0]["rmse"] == pytest.approx(noise, rel=0.1)
    learned = float(model.noise_scale.detach())
    assert learned != noise and 0.2 < learned < 0.45  # trained, and still near 0.3
    assert history.validation[-1]["rmse"] < 0.4


# ---- checkpoints ---------------------------------------------------------------------------


def _run(tmp_path, name, steps, every=None, **options):
    x, y = blobs()
    pyro.set_rng_seed(3)
    model = classifier()
    guide = AutoKTiedNormal(model, rank=2)
    return fit(model, guide, (x, y), steps=steps, batch_size=64, progress=False,
               checkpoint=tmp_path / name, checkpoint_every=every, **options)


@pytest.mark.parametrize("rng", ["generators", "cpu_state"])
def test_checkpoint_resumes_bit_identically(tmp_path, rng):
    straight = _run(tmp_path, "a.pt", 12)
    params = snapshot()
    pyro.clear_param_store()
    _run(tmp_path, "b.pt", 5)  # stops at step 5 (a checkpoint at the end)
    pyro.clear_param_store()
    if rng == "cpu_state":  # (a checkpoint holding the CPU generator's state alone)
        saved = torch.load(tmp_path / "b.pt", weights_only=False)
        saved["rng"] = saved["rng"]["cpu"]
        torch.save(saved, tmp_path / "b.pt")
    resumed = _run(tmp_path, "b.pt", 12)  # a fresh model and guide: resumes at step 6
    assert not resumed.initialized
    assert resumed.loss == straight.loss
    assert_identical(params, snapshot())


def test_evaluations_leave_training_as_it_was(tmp_path):
    # validation draws from the guide; each evaluation leaves the generator as it found
    # it, so that training does not depend on whether or how often it evaluates, and a
    # call resumed to train further continues as the uninterrupted one whatever its
    # default eval_every (a tenth of each call's steps: 1, then 2)
    x, y = blobs()
    plain = _run(tmp_path, "plain.pt", 20)
    params = snapshot()
    pyro.clear_param_store()
    validated = _run(tmp_path, "validated.pt", 20, validation=(x, y), eval_every=3)
    assert [v["step"] for v in validated.validation] == [0, 3, 6, 9, 12, 15, 18, 20]
    assert validated.loss == plain.loss
    assert_identical(params, snapshot())
    pyro.clear_param_store()
    _run(tmp_path, "resumed.pt", 10, validation=(x, y))
    pyro.clear_param_store()
    resumed = _run(tmp_path, "resumed.pt", 20, validation=(x, y))
    assert resumed.loss == plain.loss
    assert_identical(params, snapshot())


def test_a_checkpoint_resumed_with_another_batch_size_warns(tmp_path):
    x, y = blobs()
    _run(tmp_path, "d.pt", 5)  # batches of 64
    pyro.clear_param_store()
    model = classifier()
    with pytest.warns(UserWarning, match=r"^fit: the checkpoint was written with batch_size=64; "
                                         r"this call's batch_size=32 trains on from it, but not "
                                         r"as the uninterrupted run would$") as record:
        fit(model, AutoKTiedNormal(model, rank=2), (x, y), steps=7, batch_size=32,
            progress=False, checkpoint=tmp_path / "d.pt")
    assert record[0].filename == __file__
    pyro.clear_param_store()
    _run(tmp_path, "e.pt", 5)
    with warnings.catch_warnings():  # the same batch size: no warning
        warnings.simplefilter("error", UserWarning)
        pyro.clear_param_store()
        _run(tmp_path, "e.pt", 9)


def test_checkpoint_every(tmp_path):
    _run(tmp_path, "c.pt", 7, every=3)
    state = torch.load(tmp_path / "c.pt", weights_only=False)
    assert state["step"] == 7 and len(state["loss"]) == 7


def test_not_a_checkpoint(tmp_path):
    torch.save({"step": 3}, tmp_path / "x.pt")
    (tmp_path / "notes.txt").write_text("not a pickle")
    x, y = blobs()
    model = classifier()
    for path, match in [
        (tmp_path / "x.pt", "not a checkpoint"),
        # torch's UnpicklingError, IsADirectoryError and, after the whole run, the save's
        # RuntimeError (outside-user trial): each said by fit, before anything changes
        (tmp_path / "notes.txt", r"notes.txt' is not a checkpoint written by pyro_vinit.fit "
                                 r"\(UnpicklingError"),
        (tmp_path, "is a folder; pass a file path in it"),
        (tmp_path / "missing" / "run.pt", r"the checkpoint's folder .*missing' does not exist"),
    ]:
        with pytest.raises(ValueError, match=match):
            fit(model, AutoKTiedNormal(model), (x, y), steps=2, progress=False,
                checkpoint=path)
        assert snapshot() == {}


# ---- models a new user writes --------------------------------------------------------------


def test_functional_model_with_f_linear():
    x, y = blobs()

    def model(x, y=None):
        w1 = pyro.sample("w1", dist.Normal(0.0, 5**-0.5).expand([16, 5]).to_event(2))
        b1 = pyro.sample("b1", dist.Normal(0.0, 1.0).expand([16]).to_event(1))
        w2 = pyro.sample("w2", dist.Normal(0.0, 0.25).expand([3, 16]).to_event(2))
        logits = F.linear(torch.relu(F.linear(x, w1, b1)), w2)
        with pyro.plate("data", 240, subsample=torch.arange(x.shape[0])):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)

    guide = AutoKTiedNormal(model)
    history = fit(model, guide, (x, y), steps=20, batch_size=60, validation=(x, y),
                  num_samples=4, progress=False)
    assert history.initialized
    assert history.validation[-1]["error_rate"] < 0.1


def test_cnn_with_batchnorm():
    x, y = load_digits(image=True)[:2]
    x, y = x[:300], y[:300]
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.Flatten(), nn.Linear(4 * 64, 10))
    model = BayesianClassifier(bayesianize(net), num_data=300)
    guide = AutoKTiedNormal(model)
    history = fit(model, guide, (x, y), steps=10, batch_size=100, validation=(x, y),
                  num_samples=4, progress=False)
    assert history.initialized and len(history.validation) == 11
    assert history.validation[-1]["error_rate"] < 0.3


def test_small_data_head_start_survives():
    # digits, 400 training images, 64-100-100-10: fit's defaults keep I-BLM's start
    x, y, x_test, y_test = load_digits()
    x, y = x[:400], y[:400]
    model = BayesianClassifier(bayesianize(mlp((64, 100, 100, 10))), num_data=400)
    guide = AutoKTiedNormal(model, rank=2)
    history = fit(model, guide, (x, y), steps=400, validation=(x_test, y_test),
                  eval_every=400, num_samples=32, progress=False)
    start, end = history.validation[0], history.validation[-1]
    assert start["error_rate"] < 0.15
    assert end["error_rate"] <= start["error_rate"] + 0.01
    assert end["mnll"] <= start["mnll"] + 0.05


def test_validation_larger_than_the_training_set():
    # a model built with num_data takes no batch larger than that: fit evaluates in chunks
    x, y = blobs()
    x_val, y_val = blobs(n=600, seed=1)
    model = classifier()
    guide = AutoDelta(model)
    history = fit(model, guide, (x, y), steps=2, init=None, validation=(x_val, y_val),
                  num_samples=2, progress=False)
    values = {k: v.detach() for k, v in guide.median(x, y).items()}
    logits = torch.cat([pyro.poutine.condition(model, values)(x_val[i:i + 240])
                        for i in range(0, 600, 240)])
    assert history.validation[-1]["mnll"] == pytest.approx(
        float(F.cross_entropy(logits, y_val)), rel=1e-5)


def test_bad_input_leaves_a_batchnorm_model_alone():
    # the model runs once on the first batch to be checked: its deterministic params
    # (registered in the param store as it runs) and running statistics are undone
    x, y = blobs()
    net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model = BayesianClassifier(bayesianize(net), num_data=240)
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    with pytest.raises(TypeError, match="integer class labels"):
        fit(model, AutoKTiedNormal(model), (x + 5, y.float()), steps=2, progress=False)
    assert snapshot() == {}
    for k, b in model.named_buffers():
        assert torch.equal(b, buffers[k]), k


@pytest.mark.parametrize("guide_class", [AutoRadialNormal, AutoNormal,
                                         pyro_vinit.AutoMeanFieldNormal])
def test_fit_with_other_guides(guide_class, monkeypatch):
    # each guide family is started by I-BLM and trained under its handler
    used = []
    for name, cls in (("local_reparam", LocalReparamMessenger), ("flipout", FlipoutMessenger)):
        def spy(self, _enter=cls.__enter__, _name=name):
            used.append(_name)
            return _enter(self)
        monkeypatch.setattr(cls, "__enter__", spy)
    x, y = blobs()
    model = classifier()
    history = fit(model, guide_class(model), (x, y), steps=5, batch_size=60,
                  validation=(x, y), num_samples=4, progress=False)
    assert history.initialized and all(math.isfinite(v) for v in history.loss)
    assert history.validation[-1]["error_rate"] < 0.1
    assert set(used) == {"flipout" if guide_class is AutoRadialNormal else "local_reparam"}
    assert len(used) == 1 + 5  # the model run on the first batch under it, then each step


def test_a_guide_function_needs_init_none():
    x, y = blobs()
    model = classifier()

    def guide(x, y=None):
        pass

    with pytest.raises(TypeError, match="init=None"):
        fit(model, guide, (x, y), steps=2, progress=False)
    assert snapshot() == {}


def test_an_autoguide_i_blm_cannot_read_needs_init_none():
    # Regression: fit(model, AutoDelta(model), ...) raised site_params' "AutoDelta is not
    # a supported guide ... register the class", naming no init=None; with it, fit trains
    x, y = blobs()
    model = classifier()
    guide = AutoDelta(model)
    with pytest.raises(TypeError, match=r"^fit: I-BLM cannot initialize a guide of class "
                                        r"AutoDelta .*pass init=None"):
        fit(model, guide, (x, y), steps=2, progress=False)
    assert snapshot() == {} and guide.prototype_trace is None
    fit(model, guide, (x, y), steps=2, progress=False, init=None)


# ---- update_batch_norm -------------------------------------------------------------------


def _batchnorm_classifier(n):
    net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8, momentum=0.3), nn.ReLU(),
                        nn.Linear(8, 3))
    return BayesianClassifier(bayesianize(net), num_data=n)


@pytest.mark.parametrize("first_call", [True, False], ids=["first", "continued"])
def test_fit_trains_in_train_mode_and_returns_the_callers_modes(first_call):
    # model.eval() for predicting, then a second fit call: it trained with dropout off and
    # BatchNorm normalizing by running statistics
    x, y = blobs()
    model = _batchnorm_classifier(len(x))
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    guide = AutoKTiedNormal(model, rank=2)
    if not first_call:
        fit(model, guide, (x, y), steps=3, progress=False)
    model.eval()
    seen.clear()
    fit(model, guide, (x, y), steps=3, progress=False)
    svi_steps = 3 if not first_call else 3 + 1  # (a first call's I-BLM runs the model too)
    assert len(seen) >= svi_steps and all(seen), seen
    assert not any(m.training for m in model.modules())  # eval mode, as it was
    # a model in train mode keeps its submodules' own modes: a frozen BatchNorm stays frozen
    model.train()
    norm = model.net[1]
    norm.eval()
    frozen = norm.running_mean.clone()
    norm_seen = []
    norm.register_forward_pre_hook(lambda module, args: norm_seen.append(module.training))
    fit(model, guide, (x, y), steps=3, progress=False, validation=(x[:60], y[:60]))
    assert norm_seen and not any(norm_seen)
    assert model.training and not norm.training
    assert torch.equal(norm.running_mean, frozen)


def test_update_batch_norm_is_the_data_statistics_at_the_median():
    x, y = blobs()
    model = _batchnorm_classifier(len(x))
    guide = AutoNormal(model, init_loc_fn=init_to_sample, init_scale=0.3)
    guide(x, y)
    model.eval()
    params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    assert update_batch_norm(model, guide, (x, y), batch_size=len(x)) == 1
    norm = model.net[1]
    median = guide.median(x, y)
    h = F.linear(x, median["net.0.weight"], median["net.0.bias"])
    assert_close = torch.testing.assert_close
    assert_close(norm.running_mean, h.mean(0), rtol=1e-5, atol=1e-6)
    assert_close(norm.running_var, h.var(0), rtol=1e-5, atol=1e-6)  # unbiased, as torch's
    # batches of 60 rows: the average of the batch statistics (momentum=None)
    update_batch_norm(model, guide, (x, y), batch_size=60)
    chunks = h.split(60)
    assert_close(norm.running_mean, torch.stack([c.mean(0) for c in chunks]).mean(0),
                 rtol=1e-5, atol=1e-6)
    assert_close(norm.running_var, torch.stack([c.var(0) for c in chunks]).mean(0),
                 rtol=1e-5, atol=1e-6)
    # the layer's momentum and the model's mode are restored, no parameter moved
    assert norm.momentum == 0.3 and not model.training
    for k, v in pyro.get_param_store().items():
        assert torch.equal(v.detach(), params[k]), k


def test_update_batch_norm_leaves_a_frozen_batch_norm_as_it_is():
    # a BatchNorm in eval mode in a model in train mode is frozen: its statistics are kept
    # and it normalizes by them while the statistics of the layers after it are computed
    x, y = blobs()
    net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 6),
                        nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    model = BayesianClassifier(bayesianize(net), num_data=len(x))
    guide = AutoNormal(model, init_loc_fn=init_to_sample, init_scale=0.3)
    guide(x, y)
    frozen, later = model.net[1], model.net[4]
    frozen.running_mean.normal_()
    frozen.running_var.uniform_(0.5, 2.0)
    kept = frozen.running_mean.clone(), frozen.running_var.clone()
    frozen.eval()
    assert update_batch_norm(model, guide, (x, y), batch_size=len(x)) == 1
    assert torch.equal(frozen.running_mean, kept[0])
    assert torch.equal(frozen.running_var, kept[1])
    assert model.training and not frozen.training and later.training  # the modes restored
    median = guide.median(x, y)
    h = F.linear(x, median["net.0.weight"], median["net.0.bias"])
    h = F.linear(F.relu((h - kept[0]) / (kept[1] + frozen.eps).sqrt()),
                 median["net.3.weight"], median["net.3.bias"])
    torch.testing.assert_close(later.running_mean, h.mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(later.running_var, h.var(0), rtol=1e-5, atol=1e-6)


def test_update_batch_norm_takes_a_last_row_alone_into_the_batch_before_it():
    # 240 rows in batches of 239: the last row alone failed in train-mode BatchNorm
    x, y = blobs()
    model = _batchnorm_classifier(len(x))
    guide = AutoNormal(model, init_loc_fn=init_to_sample, init_scale=0.3)
    guide(x, y)
    update_batch_norm(model, guide, (x, y), batch_size=len(x))
    whole = model.net[1].running_mean.clone()
    update_batch_norm(model, guide, (x, y), batch_size=len(x) - 1)  # one batch of 240
    assert torch.equal(model.net[1].running_mean, whole)


def test_update_batch_norm_warns_where_the_median_gives_a_channel_no_variance():
    # a fresh AutoNormal's median weights are all 0: the running variances came out 0, and
    # eval mode divides by sqrt(eps) (test MNLL 2.31 -> 4.41 in an outside trial)
    x, y = blobs()
    model = _batchnorm_classifier(len(x))
    guide = AutoNormal(model)
    guide(x, y)
    with pytest.warns(UserWarning, match=re.escape(
            "update_batch_norm: the inputs of the BatchNorm layers ['net.1'] have channels of "
            "variance 0 at the guide's median (e.g. a guide neither initialized nor trained, "
            "whose median weights are all 0), which eval mode divides by sqrt(eps); "
            "initialize the guide (init_guide_iblm) or train it first") + "$") as record:
        update_batch_norm(model, guide, (x, y))
    assert record[0].filename == __file__
    pyro.clear_param_store()
    guide = AutoNormal(model, init_loc_fn=init_to_sample)
    guide(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        update_batch_norm(model, guide, (x, y))


def test_update_batch_norm_leaves_a_loaders_batches_of_one_row_out_and_says_so():
    x, y = blobs()
    model = _batchnorm_classifier(len(x))
    guide = AutoNormal(model, init_loc_fn=init_to_sample, init_scale=0.3)
    guide(x, y)
    update_batch_norm(model, guide, [(x[:120], y[:120]), (x[120:239], y[120:239])])
    expected = {k: b.clone() for k, b in model.named_buffers()}
    with pytest.warns(UserWarning, match=r"^update_batch_norm: the batches \[0, 3\] of data have "
                      r"a single row, from which BatchNorm computes no statistics; the "
                      r"statistics are those of the other batches$") as record:
        update_batch_norm(model, guide, [(x[239:], y[239:]), (x[:120], y[:120]),
                                         (x[120:239], y[120:239]), (x[:1], y[:1])])
    assert record[0].filename == __file__  # (it named torch's no_grad wrapper)
    for k, b in model.named_buffers():
        assert torch.equal(b, expected[k]), k
    with pytest.raises(ValueError, match=r"^update_batch_norm: every batch of data has a single "
                       r"row, from which BatchNorm computes no statistics; pass batches of two "
                       r"rows or more$"):
        update_batch_norm(model, guide, [(x[:1], y[:1]), (x[1:2], y[1:2])])
    for k, b in model.named_buffers():
        assert torch.equal(b, expected[k]), k


def test_update_batch_norm_leaves_models_without_batchnorm_alone():
    x, y = blobs()
    model = classifier()
    guide = AutoNormal(model)
    guide(x, y)
    assert update_batch_norm(model, guide, (x, y)) == 0


def test_update_batch_norm_bad_input_changes_nothing():
    x, y = blobs()
    model = _batchnorm_classifier(len(x))
    guide = AutoNormal(model)
    guide(x, y)
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        update_batch_norm(model, guide, (x, y), batch_size=0)
    with pytest.raises(TypeError, match="has no median"):
        update_batch_norm(model, lambda *a: None, (x, y))
    for data in (x, (x,), [(x, y), x]):  # not (x, y) batches: said before anything changes
        with pytest.raises(TypeError, match=r"an \(x, y\) pair of tensors or an iterable"):
            update_batch_norm(model, guide, data)
    # a batch the model cannot take: named, with torch's error; statistics restored
    with pytest.raises(ValueError, match=r"^update_batch_norm: the model fails on batch 0 of "
                       r"data \(x \(240, 3\) torch.float32, y \(240,\) torch.int64\): "
                       r"RuntimeError: mat1 and mat2 shapes cannot be multiplied"):
        update_batch_norm(model, guide, (x[:, :3], y))
    with pytest.raises(ValueError, match=r"^update_batch_norm: the model fails on batch 1 of "
                       r"data \(x \(40, 5\) torch.float64"):
        update_batch_norm(model, guide, [(x[:200], y[:200]), (x[200:].double(), y[200:])])
    with pytest.raises(ValueError, match=r"^update_batch_norm: the guide's median fails on the "
                       r"first batch \(x \(240, 3\) torch.float32, y \(240,\) torch.int64\): "):
        update_batch_norm(model, AutoNormal(model), (x[:, :3], y))  # (its set-up runs the model)
    for k, b in model.named_buffers():
        assert torch.equal(b, buffers[k]), k


def test_fit_leaves_running_statistics_for_the_trained_posterior():
    # eval mode predicts with running statistics: after fit they are the data's at the
    # guide's median, not the lagging average of the training batches
    x, y = blobs()
    model = _batchnorm_classifier(len(x))
    guide = AutoNormal(model)
    fit(model, guide, (x, y), steps=5, batch_size=60, init=None, progress=False)
    norm = model.net[1]
    trained = norm.running_mean.clone(), norm.running_var.clone()
    update_batch_norm(model, guide, (x, y), batch_size=len(x))
    assert torch.equal(trained[0], norm.running_mean)
    assert torch.equal(trained[1], norm.running_var)


def test_bad_validation_is_refused_before_anything_changes():
    x, y = blobs()
    model = classifier()
    guide = AutoKTiedNormal(model)
    with pytest.raises(ValueError, match="fails on the validation data"):
        fit(model, guide, (x, y), steps=2, validation=(torch.randn(50, 4), y[:50]),
            progress=False)
    with pytest.raises(TypeError, match="integer class labels"):
        fit(model, guide, (x, y), steps=2, validation=(x[:50], y[:50].float()),
            progress=False)
    assert snapshot() == {} and guide.prototype_trace is None


def test_validation_needs_one_log_density_per_row():
    # a functional model whose rows are an event dimension: its MNLL cannot be split
    # into rows, so validation is refused up front rather than reported N times too large
    x = torch.randn(200, 3)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(200)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        pyro.sample("obs", dist.Normal(x @ w, 0.1).to_event(1), obs=y)

    guide = AutoNormal(model)
    with pytest.raises(ValueError, match="one log-density per row"):
        fit(model, guide, (x, y), steps=2, batch_size=200, init=None, validation=(x, y),
            progress=False)
    assert snapshot() == {}


def test_checkpoint_of_another_model_is_refused_before_anything_changes(tmp_path):
    x, y = blobs()
    path = tmp_path / "run.ckpt"
    model = classifier()
    fit(model, AutoKTiedNormal(model), (x, y), steps=2, checkpoint=path, progress=False)
    pyro.clear_param_store()
    wider = classifier(hidden=7)
    guide = AutoKTiedNormal(wider)
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match="does not fit this model and guide"):
        fit(wider, guide, (x, y), steps=4, checkpoint=path, progress=False)
    assert snapshot() == {} and guide.prototype_trace is None
    assert torch.equal(rng, torch.get_rng_state())  # (the generator too)


def test_stale_param_store_is_said(count_iblm):
    x, y = blobs()
    model = classifier()
    fit(model, AutoNormal(model), (x, y), steps=1, progress=False)
    again = classifier()  # a new model and guide, the store not cleared
    with pytest.warns(UserWarning, match=r"clear_param_store\(\)"):
        history = fit(again, AutoNormal(again), (x, y), steps=1, progress=False)
    assert not history.initialized


def _tau_classifier(x, y=None):
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    w = pyro.sample("w", dist.Normal(0.0, tau).expand([3, x.shape[-1]]).to_event(2))
    with pyro.plate("data", 240, subsample=torch.arange(len(x))):
        return pyro.sample("obs", dist.Categorical(logits=F.linear(x, w)), obs=y)


def test_fit_takes_a_hyperparameter_fixed_by_pyro_condition_for_no_likelihood():
    # the conditioned site is observed in the trace, but it is no likelihood: no target
    # check, no validation term
    x, y = blobs()
    model = pyro.condition(_tau_classifier, data={"tau": torch.tensor(1.0)})
    history = fit(model, AutoNormal(model), (x, y), steps=2, init=None, validation=(x, y),
                  num_samples=2, progress=False)
    assert history.config.kl_weight == 0.01
    assert math.isfinite(history.validation[-1]["mnll"])
    assert 0.0 <= history.validation[-1]["error_rate"] <= 1.0


def test_fit_refuses_a_likelihood_given_by_pyro_condition():
    # the other use of pyro.condition: the observation itself, y passed and unused. It
    # was taken with the whole data as one batch, whose rows fit shuffles: x paired with
    # other rows' labels
    x, y = blobs()

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, x.shape[-1]]).to_event(2))
        with pyro.plate("data", 240, subsample=torch.arange(len(x))):
            return pyro.sample("obs", dist.Categorical(logits=F.linear(x, w)))

    conditioned = pyro.condition(model, data={"obs": y})
    with pytest.raises(ValueError, match="^fit: the likelihood 'obs' is set by pyro.condition"):
        fit(conditioned, AutoNormal(conditioned), (x, y), steps=2, batch_size=240,
            init=None, progress=False)
    assert snapshot() == {}


def test_a_classifier_is_not_run_again_to_read_its_noise():
    # the second trial run (latent values requiring gradients) is for continuous
    # likelihoods only: a classifier's model, its buffers and memory are left alone
    from pyro_vinit.training._checks import _learns_noise, _trial_trace
    from pyro_vinit.training._support import _likelihoods

    calls = []

    def model(x, y=None):
        calls.append(len(x))
        return _tau_classifier(x, y)

    x, y = blobs()
    trace = _trial_trace(model, x, y, "the first batch")
    observed = _likelihoods(trace, model)
    assert _learns_noise(model, x, y, trace, observed) is False and len(calls) == 1


def _batch_norm_regressor(num_data):
    net = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    return BayesianRegressor(bayesianize(net), num_data=num_data)


@pytest.mark.parametrize("num_data, sizes", [(257, [128, 129]), (129, [129]), (256, [128, 128]),
                                             (258, [128, 128, 2])])
def test_an_epochs_last_batch_of_one_row_joins_the_batch_before_it(num_data, sizes):
    # BatchNorm cannot train on one row: with 257 rows, batch 128, fit failed at step 3 with
    # torch's bare "Expected more than 1 value per channel when training"
    from pyro_vinit.training._support import _Batches

    x, y = torch.randn(num_data, 5), torch.randn(num_data)
    batches = _Batches((x, y), 128)
    batches.start()
    epoch = [next(batches)[0] for _ in range(batches.batches_per_epoch)]
    assert [len(b) for b in epoch] == sizes
    assert torch.equal(torch.cat(epoch).sort(0).values, x.sort(0).values)  # each row once
    assert len(next(batches)[0]) == sizes[0]  # the next epoch
    assert len(batches.first[0]) == sizes[0]  # the shape fit captures: every full batch's
    model = _batch_norm_regressor(num_data)
    history = fit(model, AutoKTiedNormal(model), (x, y), steps=2 * len(sizes) + 1,
                  progress=False)
    assert history.steps == 2 * len(sizes) + 1


def test_a_loaders_batch_of_one_row_is_refused_for_a_batch_norm_model():
    x, y = torch.randn(257, 5), torch.randn(257)
    loader = DataLoader(TensorDataset(x, y), batch_size=128)
    model = _batch_norm_regressor(257)
    guide = AutoKTiedNormal(model)
    with pytest.raises(ValueError, match=r"^fit: batch 2 of data has a single row, on which the "
                       r"model's BatchNorm \('net.1'\) cannot train \(in train mode it needs "
                       r"more than one value per channel\); leave such a batch out "
                       r"\(DataLoader\(\.\.\., drop_last=True\)\) or choose a batch size that "
                       r"leaves none$"):
        fit(model, guide, loader, steps=2, progress=False)
    assert snapshot() == {} and not is_initialized(guide)
    model.eval()  # fit trains a model in eval mode in train mode: the same refusal
    with pytest.raises(ValueError, match=r"^fit: batch 2 of data has a single row"):
        fit(model, guide, loader, steps=2, progress=False)
    assert not any(m.training for m in model.modules())  # its mode, as it was
    model.train()
    with pytest.raises(ValueError, match=r"^fit: batch 0 of data has a single row"):
        fit(model, AutoKTiedNormal(model), (x, y), batch_size=1, steps=2, progress=False)
    pyro.clear_param_store()
    plain = BayesianRegressor(bayesianize(mlp((5, 8, 1))), num_data=257)
    fit(plain, AutoKTiedNormal(plain), loader, steps=4, progress=False)  # no BatchNorm: kept


@pytest.mark.parametrize("num_data", [257, 256], ids=["data set", "one pass"])
def test_a_loader_that_drops_its_last_batch_takes_its_data_sets_rows(num_data):
    # the advice above: a shuffled DataLoader(..., drop_last=True) reads every one of the
    # 257 rows over the epochs, 256 a pass; the model may count either (it was refused
    # with "the data has 256 rows; build it with num_data=256", an outside user's trial)
    x, y = torch.randn(257, 5), torch.randn(257)
    loader = DataLoader(TensorDataset(x, y), batch_size=128, shuffle=True, drop_last=True)
    model = _batch_norm_regressor(num_data)
    history = fit(model, AutoKTiedNormal(model), loader, steps=2, progress=False)
    assert history.steps == 2
    pyro.clear_param_store()
    wrong = _batch_norm_regressor(300)
    with pytest.raises(ValueError, match=r"^fit: the model was built with num_data=300 but the "
                       r"data has 256 rows \(of a data set of 257 rows, whose last partial "
                       r"batch the loader drops\); build it with num_data=257$"):
        fit(wrong, AutoKTiedNormal(wrong), loader, steps=2, progress=False)


@pytest.mark.parametrize("second, message", [
    ((torch.randn(112, 3), torch.arange(112) % 3),
     r"^fit: batch 1 of the data has x of shape \(112, 3\) torch.float32, batch 0 of shape "
     r"\(128, 5\) torch.float32: every batch must have the shapes and dtypes of the first, "
     r"but for the number of rows$"),
    ((torch.randn(112, 5), (torch.arange(112) % 3).int()),
     r"^fit: batch 1 of the data has y of shape \(112,\) torch.int32, batch 0 of shape "
     r"\(128,\) torch.int64: every batch"),
])
def test_a_loader_batch_unlike_the_first_is_refused_by_name(second, message):
    # I-BLM's concatenation of the batches failed in torch ("Sizes of tensors must match")
    x, y = blobs()
    model = classifier()
    guide = AutoKTiedNormal(model)
    with pytest.raises(ValueError, match=message):
        fit(model, guide, [(x[:128], y[:128]), second], steps=2, progress=False)
    assert snapshot() == {} and not is_initialized(guide)


@pytest.mark.parametrize("options, message", [
    ({"init": None, "init_options": {"batch_size": 64}},
     "init_options is used only with init='iblm' or 'pretrained' (the initializer's "
     "options)"),
    ({"eval_every": 5}, "eval_every is used only with validation=(x_val, y_val)"),
    ({"checkpoint_every": 5}, "checkpoint_every is used only with checkpoint=path"),
])
def test_an_option_that_another_makes_idle_is_refused(options, message):
    # they were accepted and ignored
    x, y = blobs()
    model = classifier()
    guide = AutoKTiedNormal(model)
    with pytest.raises(ValueError, match=f"^fit: {re.escape(message)}, which this call does not "
                                         "pass$"):
        fit(model, guide, (x, y), steps=2, progress=False, **options)
    assert snapshot() == {} and not is_initialized(guide)


def test_validation_labels_outside_the_support_are_named_as_the_validation_ys():
    x, y = blobs()
    model = classifier()
    bad = y.clone()
    bad[3] = 7
    with pytest.raises(ValueError, match=r"^fit: the validation y holds values outside the "
                       r"support of the likelihood 'obs' .* e.g. 7"):
        fit(model, AutoKTiedNormal(model), (x, y), steps=2, progress=False,
            validation=(x, bad))


def test_the_advice_for_a_model_i_blm_cannot_start_works_through_fit(count_iblm):
    # a head whose two outputs set the mean and the log-scale: the message said
    # init_guide(..., method='xavier'), which without data fails, and fit(init='xavier') too
    x = torch.randn(200, 3)
    y = x[:, 0] + 0.1 * torch.randn(200)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))
        out = F.linear(x, w)
        with pyro.plate("data", 200, subsample_size=len(x)):
            pyro.sample("obs", dist.Normal(out[:, 0], out[:, 1].exp()), obs=y)

    guide = AutoKTiedNormal(model)
    with pytest.raises(ValueError, match=r"Initialize this model with init_guide\(guide, "
                                         r"\(x, y\), method='xavier'\), which fit then keeps$"):
        fit(model, guide, (x, y), steps=2, progress=False)
    pyro_vinit.init_guide(guide, (x, y), method="xavier")
    assert fit(model, guide, (x, y), steps=2, progress=False).steps == 2
    assert len(count_iblm) == 1  # the refused attempt only


def test_validation_of_a_one_hot_classifier_reports_its_error_rate():
    # it reported the MNLL only, where a Categorical model's reports the error rate too
    x, y = blobs()
    onehot = F.one_hot(y, 3).float()

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 5]).to_event(2))
        with pyro.plate("data", 240, subsample_size=len(x)):
            pyro.sample("obs", dist.OneHotCategorical(logits=F.linear(x, w)), obs=y)

    history = fit(model, AutoKTiedNormal(model), (x, onehot), steps=40, progress=False,
                  validation=(x, onehot), num_samples=8)
    last = history.validation[-1]
    assert set(last) == {"step", "mnll", "error_rate"}
    assert 0.0 <= last["error_rate"] < 0.2
    pyro.clear_param_store()  # the error rate is that of the labels' argmax:
    labels = fit(model, AutoKTiedNormal(model), (x, onehot), steps=40, progress=False,
                 validation=(x, F.one_hot((y + 1) % 3, 3).float()), num_samples=8)
    assert labels.validation[-1]["error_rate"] > 0.8  # the wrong labels: every row wrong
