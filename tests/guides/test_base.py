"""AutoSiteGuide as a subclass sees it: the default hooks, what reaches them, and the
complete text of the errors the base raises for every guide."""

import re

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoNormal

from pyro_vinit import AutoKTiedNormal, AutoMeanFieldNormal, AutoRadialNormal
from pyro_vinit.guides import AutoSiteGuide
from tests.common import assert_close


class AutoPlainNormal(AutoSiteGuide):
    """The smallest subclass: AutoNormal's scales and the base's default hooks."""

    def _setup_scales(self):
        self._setup_normal_scales(self._event_dims)

    def _unconstrained_posterior(self, name):
        loc, scale = self._get_loc_and_scale(name)
        return dist.Normal(loc, scale).to_event(self._event_dims[name])


class AutoRecordingNormal(AutoPlainNormal):
    """Records what set_loc_and_scale hands to the hook, then writes it."""

    def _set_loc_and_scale(self, name, loc, scale):
        self.received = loc, scale
        self._write_params([(f"locs.{name}", constraints.real, loc),
                            (f"scales.{name}", self.scale_constraint, scale)])


def model():
    pyro.sample("w", dist.Normal(torch.zeros(6, 5), 1.0).to_event(2))
    pyro.sample("noise", dist.HalfNormal(1.0))
    with pyro.plate("plate", 3):
        pyro.sample("local", dist.Normal(torch.zeros(4), 1.0).to_event(1))


def test_default_hooks_are_autonormals():
    # A subclass that keeps the default _get_loc_and_scale reads AutoNormal's locs and
    # scales: with the same seed it has AutoNormal's parameters and draws the same values.
    guides = {}
    for Guide in (AutoNormal, AutoPlainNormal):
        pyro.clear_param_store()
        pyro.set_rng_seed(3)
        guides[Guide] = guide = Guide(model, init_scale=0.2)
        pyro.set_rng_seed(4)
        guide.draws = guide()
    normal, plain = guides[AutoNormal], guides[AutoPlainNormal]
    for name in ["w", "noise", "local"]:
        for actual, expected in zip(plain.get_loc_and_scale(name),
                                    normal._get_loc_and_scale(name)):
            assert_close(actual, expected, atol=0, rtol=0)
        assert_close(plain.draws[name], normal.draws[name], atol=1e-6, rtol=0)
    assert_close(plain.get_loc_and_scale("local")[1], torch.full((3, 4), 0.2))


def test_missing_set_hook_is_reported():
    guide = AutoPlainNormal(model)
    guide()
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    with pytest.raises(NotImplementedError, match=r"^AutoPlainNormal does not implement "
                                                  r"_set_loc_and_scale, so its parameters "
                                                  r"cannot be written$"):
        guide.set_loc_and_scale("w", torch.zeros(6, 5), torch.ones(6, 5))
    assert all(torch.equal(v, before[k]) for k, v in guide.state_dict().items())


def test_set_hook_receives_values_in_the_guides_dtype():
    # As documented for _set_loc_and_scale: validated, detached, the guide's dtype.
    guide = AutoRecordingNormal(model)
    guide()
    loc = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    scale = torch.full((6, 5), 3, dtype=torch.int64)
    guide.set_loc_and_scale("w", loc, scale)
    received_loc, received_scale = guide.received
    assert received_loc.dtype == received_scale.dtype == torch.float32
    assert not received_loc.requires_grad
    assert_close(received_loc, loc.detach().float(), atol=0, rtol=0)
    assert_close(received_scale, torch.full((6, 5), 3.0), atol=0, rtol=0)


def test_write_params_checks_the_value_in_the_parameters_dtype():
    # 1e39 is finite in float64 and overflows a float32 parameter: refused, not written
    # as inf.
    guide = AutoRecordingNormal(model)
    guide()
    before = guide.locs.w.detach().clone()
    too_large = torch.full((6, 5), 1e39, dtype=torch.float64)
    with pytest.raises(ValueError) as error:
        guide._write_params([("locs.w", constraints.real, too_large)])
    assert str(error.value) == (
        "AutoRecordingNormal: cannot write 'locs.w': the unconstrained value has shape "
        "(6, 5) (expected (6, 5)) or non-finite entries (a scale too close to 0 or too "
        "large for the dtype); nothing was written"
    )
    assert torch.equal(guide.locs.w.detach(), before)


@pytest.mark.parametrize("Guide", [AutoKTiedNormal, AutoRadialNormal])
def test_bad_init_scale_message(Guide):
    with pytest.raises(ValueError) as error:
        Guide(model, init_scale=-1.0)
    assert str(error.value) == (
        f"{Guide.__name__}: init_scale must be a positive finite float (the initial standard "
        "deviation of each unconstrained latent element), but got -1.0; pass e.g. "
        "init_scale=0.1"
    )


@pytest.mark.parametrize("Guide", [AutoKTiedNormal, AutoRadialNormal])
def test_not_set_up_message(Guide):
    guide = Guide(model)
    expected = (
        f"{Guide.__name__} is not set up yet: call the guide once with the model's "
        "arguments (e.g. guide(x, y), or one svi.step) first; median and quantiles take "
        "them too (guide.median(x, y))."
    )
    for read in (lambda: guide.get_loc_and_scale("w"), guide.median,
                 lambda: guide.quantiles([0.5])):
        with pytest.raises(RuntimeError) as error:
            read()
        assert str(error.value) == expected
    assert guide.prototype_trace is None


@pytest.mark.parametrize("Guide", [AutoKTiedNormal, AutoRadialNormal])
def test_bad_value_messages(Guide):
    guide = Guide(model)
    guide()
    loc, scale = torch.zeros(6, 5), torch.ones(6, 5)
    nan = torch.full((6, 5), float("nan"))
    cases = [
        ((1.0, scale), TypeError, "site 'w': loc must be a torch.Tensor, got float"),
        ((loc, [1.0]), TypeError, "site 'w': scale must be a torch.Tensor, got list"),
        ((torch.zeros(5, 6), scale), ValueError,
         "site 'w': loc must have the site's full unconstrained shape (6, 5), got (5, 6)"),
        ((loc, torch.ones(30)), ValueError,
         "site 'w': scale must have the site's full unconstrained shape (6, 5), got (30,)"),
        ((nan, scale), ValueError, "site 'w': loc has non-finite entries; nothing was written"),
        ((loc, -scale), ValueError,
         "site 'w': scale must be finite and positive (a marginal standard deviation), but "
         "has entries that are not; nothing was written"),
    ]
    for args, error_type, message in cases:
        with pytest.raises(error_type, match=f"^{re.escape(message)}$"):
            guide.set_loc_and_scale("w", *args)


def test_default_init_scale_is_autonormals():
    # AutoRadialNormal takes the base's defaults; AutoNormal is the control.
    for Guide in (AutoNormal, AutoRadialNormal):
        guide = Guide(model)
        guide()
        _, scale = guide._get_loc_and_scale("w")
        assert_close(scale, torch.full((6, 5), 0.1))


def test_masked_site_adds_no_log_density():
    # Under mask(False), as in AutoNormal, a constrained site's Delta carries no
    # log-density (the Jacobian is not even computed), before any masking.
    for Guide in (AutoNormal, AutoPlainNormal, AutoKTiedNormal, AutoRadialNormal):
        guide = Guide(model)
        with poutine.mask(mask=False):
            trace = poutine.trace(guide).get_trace()
        site = trace.nodes["noise"]
        assert_close(site["fn"].log_prob(site["value"]), 0.0, atol=0, rtol=0)
        unmasked = poutine.trace(guide).get_trace().nodes["noise"]
        # without the mask: log |d log(x) / dx| = -log(x)
        assert_close(unmasked["fn"].log_prob(unmasked["value"]), -unmasked["value"].log())


def _regression(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(1, 3), 1.0).to_event(2))
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal((x @ w.T).squeeze(-1), s), obs=y)


@pytest.mark.parametrize("Guide", [AutoKTiedNormal, AutoRadialNormal, AutoPlainNormal])
def test_median_and_quantiles_set_up_from_the_models_arguments(Guide):
    # As Pyro's AutoDelta.median(*args) does (AutoNormal's ignores them and fails on None).
    from pyro.infer.autoguide import init_to_sample

    x, y = torch.randn(5, 3), torch.randn(5)
    medians = []
    for setup in ("call", "median", "quantiles"):
        pyro.clear_param_store()
        pyro.set_rng_seed(1)
        guide = Guide(_regression, init_loc_fn=init_to_sample)
        if setup == "call":
            guide(x, y)
            medians.append(guide.median())
        elif setup == "median":
            medians.append(guide.median(x, y))
        else:
            medians.append({k: v[0] for k, v in guide.quantiles([0.5], x, y).items()})
        assert sorted(medians[-1]) == ["s", "w"]
    for other in medians[1:]:
        for name in medians[0]:
            assert_close(other[name], medians[0][name], atol=1e-6, rtol=1e-6)
    assert not torch.equal(medians[0]["w"], torch.zeros(1, 3))  # init_to_sample was used


@pytest.mark.parametrize("init", ["feasible", "sample"])  # fails in Pyro's set-up, or in ours
@pytest.mark.parametrize("Guide", [AutoKTiedNormal, AutoRadialNormal])
def test_unobserved_discrete_site_message_leaves_the_guide_unset(Guide, init):
    from pyro.infer.autoguide import init_to_feasible, init_to_sample

    # Predictive(model, guide=guide)(x) before the guide has seen y: Pyro's message would be
    # "Continuous inference cannot handle discrete sample site 'obs'".
    def classifier(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=x @ w.T), obs=y)

    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    guide = Guide(classifier, init_loc_fn=init_to_sample if init == "sample" else init_to_feasible)
    with pytest.raises(ValueError, match=re.escape(
            "sample site 'obs' is discrete and was not observed when the guide was set up")) as e:
        pyro.infer.Predictive(classifier, guide=guide, num_samples=2)(x)
    assert "guide(x, y)" in str(e.value)
    assert guide.prototype_trace is None
    guide(x, y)  # the corrected order works
    samples = pyro.infer.Predictive(classifier, guide=guide, num_samples=2)(x)
    assert samples["obs"].shape == (2, 6)


def _constrained_only():
    pyro.sample("noise", dist.HalfNormal(1.0))
    with pyro.plate("plate", 3):
        pyro.sample("rate", dist.Gamma(2.0, 2.0))


@pytest.mark.parametrize("Guide", [AutoKTiedNormal, AutoRadialNormal, AutoMeanFieldNormal])
def test_mean_field_elbo_counts_the_log_density_at_constrained_sites(Guide):
    # Constrained sites have no closed-form KL: TraceMeanField_ELBO's estimate on a draw
    # is then Trace_ELBO's, log q(v) - log p(v), with log q(v) = log q(u) + log|du/dv|.
    # Pyro's kl_divergence(Delta, p) drops the Delta's log_density, log|du/dv| = -u here:
    # the loss was off by u per site (its mean by the location of log(noise)).
    from pyro.infer import Trace_ELBO, TraceMeanField_ELBO

    from pyro_vinit.guides import site_params

    guide = Guide(_constrained_only)
    guide()
    site_params.set_loc_and_scale(guide, "noise", torch.tensor(1.5), torch.tensor(0.3))
    for seed in range(3):
        pyro.set_rng_seed(seed)
        mean_field = TraceMeanField_ELBO().differentiable_loss(_constrained_only, guide)
        pyro.set_rng_seed(seed)
        trace_elbo = Trace_ELBO().differentiable_loss(_constrained_only, guide)
        assert_close(mean_field, trace_elbo, atol=1e-5, rtol=1e-5)


def _constrained_events():
    # event dims of the model's own (.to_event) and of the transform (the simplex's
    # stick-breaking, whose log-Jacobian is already one number per event), in plates
    pyro.sample("scales", dist.HalfNormal(torch.ones(3)).to_event(1))
    with pyro.plate("outer", 2, dim=-2), pyro.plate("inner", 4):
        pyro.sample("rate", dist.Gamma(2.0 * torch.ones(2), 2.0).to_event(1))
        pyro.sample("probs", dist.Dirichlet(torch.ones(3)))
    pyro.sample("rho", dist.Uniform(-1.0, 2.0))


def _guide_list_of_events():
    from pyro.infer.autoguide import AutoGuideList

    guide = AutoGuideList(_constrained_events)
    guide.append(AutoKTiedNormal(poutine.block(_constrained_events, expose=["scales", "rate"])))
    guide.append(AutoRadialNormal(poutine.block(_constrained_events, hide=["scales", "rate"])))
    return guide


@pytest.mark.parametrize("make_guide", [
    AutoKTiedNormal, AutoRadialNormal, AutoMeanFieldNormal, lambda model: _guide_list_of_events(),
], ids=["k_tied", "radial", "mean_field", "guide_list"])
def test_mean_field_elbo_counts_the_log_density_of_events_annealed_and_captured(make_guide):
    # As above for sites with event dims, under a KL weight (the guide's scale), and in
    # CapturedSVI's traced and replayed steps: TraceMeanField_ELBO's loss on a draw is
    # Trace_ELBO's. AutoNormal is the control: its Delta drops log|du/dv|.
    from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO

    from pyro_vinit.poutine import KLAnnealingMessenger
    from pyro_vinit.training import CapturedSVI

    def losses(guide, svi_class, elbo):
        svi = svi_class(_constrained_events, guide, pyro.optim.SGD({"lr": 0.0}), elbo)
        out = []
        for seed in range(3):  # eager, traced, replayed
            pyro.set_rng_seed(seed)
            with KLAnnealingMessenger(0.3):
                out.append(svi.step())
        return torch.tensor(out), svi

    control = AutoNormal(_constrained_events)
    control()
    offset = losses(control, SVI, TraceMeanField_ELBO())[0] - losses(control, SVI, Trace_ELBO())[0]
    assert (offset.abs() > 0.1).all()  # the scenario shows Pyro's Delta's loss off

    guide = make_guide(_constrained_events)
    guide()
    mean_field, svi = losses(guide, CapturedSVI, TraceMeanField_ELBO())
    assert svi.num_traces == 1 and svi.fallback_reason is None  # traced once, replayed
    assert_close(mean_field, losses(guide, SVI, Trace_ELBO())[0], atol=1e-4, rtol=1e-5)


def _net_model(width, bias=False):
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([width, 3]).to_event(2))
        h = x @ w.T
        if bias:  # (a site the first guide had not: its params go again)
            h = h + pyro.sample("b", dist.Normal(0.0, 1.0).expand([width]).to_event(1))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(torch.tanh(h).sum(-1), 1.0), obs=y)
    return model


@pytest.mark.parametrize("make, again", [
    (lambda: AutoKTiedNormal(_net_model(5), rank=1),
     lambda: AutoKTiedNormal(_net_model(5, bias=True), rank=3)),
    (lambda: AutoMeanFieldNormal(_net_model(5)),
     lambda: AutoMeanFieldNormal(_net_model(7, bias=True))),
], ids=["another rank", "another width"])
def test_a_guide_whose_params_another_left_in_the_store_is_refused(make, again):
    # Pyro gives a guide the store's params of its names: a rank-3 guide made after a
    # rank-1 one had silently taken its (5, 1) factors (and loaded a rank-2 file)
    x, y = torch.randn(6, 3), torch.randn(6)
    make()(x, y)
    store = pyro.get_param_store()
    before = {name: value.detach().clone() for name, value in store.items()}
    guide = again()
    with pytest.raises(ValueError, match=r"the param store already holds '[\w.]+' with shape "
                       r"\(\d+, \d+\), where this guide's is \(\d+, \d+\) .*"
                       r"pyro\.clear_param_store\(\)"):
        guide(x, y)
    assert guide.prototype_trace is None  # (left unset, the store as it was)
    assert store.keys() == before.keys()
    assert all(torch.equal(store[name].detach(), value) for name, value in before.items())
    pyro.clear_param_store()
    guide(x, y)  # (as the message says)
