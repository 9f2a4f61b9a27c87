import math

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from pyro.nn import PyroModule, PyroSample
from pyro.optim import Adam

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal, posterior_as_prior, set_priors
from pyro_vinit.distributions import RadialNormal
from pyro_vinit.guides import site_params
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from tests.common import assert_close

GUIDES = [AutoNormal, AutoDiagonalNormal, AutoKTiedNormal, AutoRadialNormal]


def model():
    pyro.sample("w", dist.Normal(torch.zeros(6, 5), 1.0).to_event(2))
    pyro.sample("b", dist.Normal(torch.zeros(6), 1.0).to_event(1))
    pyro.sample("noise", dist.HalfNormal(1.0))
    with pyro.plate("plate", 3):
        pyro.sample("local", dist.Normal(torch.zeros(4), 1.0).to_event(1))


def trained(Guide, steps=20):
    guide = Guide(model)
    svi = SVI(model, guide, Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(steps):
        svi.step()
    return guide, svi


@pytest.mark.parametrize("Guide", GUIDES)
def test_shapes_and_families(Guide):
    guide, _ = trained(Guide)
    priors = posterior_as_prior(guide)
    trace = poutine.trace(model).get_trace()
    assert list(priors) == ["w", "b", "noise", "local"]
    for name, prior in priors.items():
        site = trace.nodes[name]
        assert prior.batch_shape + prior.event_shape == site["value"].shape, name
        assert len(prior.event_shape) == site["fn"].event_dim, name
        assert prior.support.check(prior.sample()).all()
    family = RadialNormal if Guide is AutoRadialNormal else dist.Independent
    assert isinstance(priors["w"], family)
    assert isinstance(priors["noise"], dist.TransformedDistribution)


@pytest.mark.parametrize("Guide", GUIDES)
def test_monte_carlo_moments_match_the_guide(Guide):
    # Each prior is the guide's posterior: its draws have the guide's locations and
    # marginal sds (4000 draws: pooled rms s.e. ~1.1 %, per-element sd s.e. <= 2.2 %).
    guide, _ = trained(Guide)
    priors = posterior_as_prior(guide)
    for name in ["w", "b", "local"]:
        loc, scale = site_params.get_loc_and_scale(guide, name)
        z = (priors[name].sample((4000,)) - loc.detach()) / scale.detach()
        assert abs(z.pow(2).mean().sqrt().item() - 1) < 0.04, name
        assert_close(z.std(0), torch.ones_like(loc), atol=0.12, rtol=0)
        assert z.mean(0).abs().max() < 5 * 2.5 / math.sqrt(4000)
    # The noise: exp of the unconstrained posterior, checked in log space.
    loc, scale = site_params.get_loc_and_scale(guide, "noise")
    logs = priors["noise"].sample((4000,)).log()
    assert abs(logs.mean().item() - loc.item()) < 5 * scale.item() / math.sqrt(4000)
    assert abs(logs.std().item() / scale.item() - 1) < 0.06
    if Guide is AutoRadialNormal:
        # Radial: the standardized draw z u r has squared norm r^2, r ~ N(0, 1), exactly.
        radial = priors["w"]
        z = (radial.sample((4000,)) - radial.loc) / radial.scale
        norms = z.pow(2).sum((-2, -1))
        assert abs(norms.mean().item() - 1) < 5 * math.sqrt(2 / 4000)


@pytest.mark.parametrize("Guide", GUIDES)
def test_independent_of_further_training(Guide):
    guide, svi = trained(Guide)
    priors = posterior_as_prior(guide)
    tensors = {
        (name, key): value.clone()
        for name, prior in priors.items()
        for key, value in _tensors(prior).items()
    }
    assert tensors and not any(t.requires_grad for t in tensors.values())
    for _ in range(5):
        svi.step()
    for (name, key), value in tensors.items():
        assert torch.equal(_tensors(priors[name])[key], value), (name, key)
    # ... while the guide itself moved.
    loc, _ = site_params.get_loc_and_scale(guide, "w")
    assert not torch.equal(loc.detach(), priors["w"].mean if Guide is not AutoRadialNormal
                           else priors["w"].loc)


def _tensors(d):
    while isinstance(d, (dist.Independent, dist.TransformedDistribution)):
        d = d.base_dist
    return {"loc": d.loc, "scale": d.scale}


def _classifier():
    return BayesianClassifier(bayesianize(mlp((4, 6, 3))))


@pytest.mark.parametrize("Guide", [AutoNormal, AutoKTiedNormal, AutoRadialNormal])
def test_bayesianized_model_takes_the_priors(Guide):
    x, y = torch.randn(30, 4), torch.randint(0, 3, (30,))
    old_model = _classifier()
    old_guide = Guide(old_model)
    svi = SVI(old_model, old_guide, Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(10):
        svi.step(x, y)
    priors = posterior_as_prior(old_guide)

    new_model = set_priors(_classifier(), priors)
    trace = poutine.trace(new_model).get_trace(x, y)
    for name, prior in priors.items():
        assert trace.nodes[name]["fn"] is prior

    # A guide equal to the prior has KL(q || p) = 0 at every site: TraceMeanField_ELBO's
    # closed form is exactly 0 for Normal posteriors; the radial pair has no closed
    # form, so its Monte Carlo estimate (log q - log p of one draw) is 0 too.
    pyro.clear_param_store()
    new_guide = Guide(new_model)
    new_guide(x, y)
    for name in priors:
        site_params.set_loc_and_scale(new_guide, name,
                                      *site_params.get_loc_and_scale(old_guide, name))
    prior_only = poutine.block(new_model, hide=["obs"])
    loss = TraceMeanField_ELBO().loss(prior_only, new_guide, x, y)
    assert abs(loss) < 1e-4
    # And it trains.
    svi = SVI(new_model, new_guide, Adam({"lr": 0.01}), TraceMeanField_ELBO())
    assert all(math.isfinite(svi.step(x, y)) for _ in range(3))


def test_set_priors_errors_change_nothing():
    model = _classifier()
    good = posterior_as_prior(_trained_classifier_guide())
    with pytest.raises(KeyError, match="'net.9.weight' is not a PyroSample"):
        set_priors(model, {**good, "net.9.weight": good["net.0.weight"]})
    with pytest.raises(ValueError, match="has shape"):
        set_priors(model, {"net.0.weight": good["net.2.weight"]})
    # bayesianize's prior makes the whole weight one event
    with pytest.raises(ValueError, match=r"^set_priors: the prior of 'net.0.weight' has event "
                       r"shape \(\), but the site's is \(6, 4\): pass prior.to_event\(2\)$"):
        set_priors(model, {**good, "net.0.weight": dist.Normal(0.0, 1.0).expand([6, 4])})
    with pytest.raises(TypeError, match="must be a Distribution"):
        set_priors(model, {"net.0.weight": torch.zeros(6, 4)})
    # A torch.distributions one passes the isinstance(Distribution) test, but PyroSample
    # cannot call it: refused up front rather than at the model's first run.
    with pytest.raises(TypeError, match="of pyro.distributions"):
        set_priors(model, {"net.0.weight": torch.distributions.Normal(0.0, 1.0).expand([6, 4])})
    trace = poutine.trace(model).get_trace(torch.randn(2, 4))
    assert trace.nodes["net.0.weight"]["fn"] is not good["net.0.weight"]


def _trained_classifier_guide():
    model = _classifier()
    guide = AutoNormal(model)
    guide(torch.randn(2, 4), torch.zeros(2, dtype=torch.long))
    return guide


def test_set_priors_error_messages_say_what_to_do():
    model = _classifier()
    with pytest.raises(KeyError) as error:
        set_priors(model, {"net.9.weight": dist.Normal(0.0, 1.0)})
    assert error.value.args[0] == (
        "set_priors: 'net.9.weight' is not a PyroSample site of the model; bayesianize the "
        "layer first, and use the model's site names (e.g. 'net.0.weight')"
    )
    with pytest.raises(TypeError, match=r"^set_priors: the prior of 'net.0.weight' must be a "
                                        r"Distribution of pyro.distributions \(e.g. "
                                        r"pyro.distributions.Normal\), got Tensor$"):
        set_priors(model, {"net.0.weight": torch.zeros(6, 4)})


class _Holder(PyroModule):
    def __init__(self):
        super().__init__()
        # a prior held as a distribution, and one computed by a callable without a shape
        self.w = PyroSample(dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2))
        self.v = PyroSample(lambda self: dist.Normal(0.0, 1.0).expand([4]).to_event(1))

    def forward(self):
        return self.w, self.v


def test_set_priors_checks_shapes_of_distribution_priors_and_takes_callables():
    model = _Holder()
    with pytest.raises(ValueError, match=r"has shape \(2, 3\), but the site has shape \(3, 2\)"):
        set_priors(model, {"w": dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2)})
    # (3,) batch + (2,) event is the site's shape, but the (3,) are batch dims outside
    # any plate, which Pyro's ELBO refuses at the first step (outside-user trial)
    with pytest.raises(ValueError, match=r"^set_priors: the prior of 'w' has event shape "
                       r"\(2,\), but the site's is \(3, 2\): pass prior.to_event\(1\)$"):
        set_priors(model, {"w": dist.Normal(torch.ones(3, 2), 1.0).to_event(1)})
    set_priors(model, {"w": dist.Normal(torch.ones(3, 2), 1.0).to_event(2)})
    # and an event over a site's batch dims, which would be drawn again in its plates
    batched = _Holder()
    batched.w = PyroSample(dist.Normal(0.0, 1.0).expand([3, 2]).to_event(1))
    with pytest.raises(ValueError, match=r"^set_priors: the prior of 'w' has event shape "
                       r"\(3, 2\), but the site's is \(2,\)$"):
        set_priors(batched, {"w": dist.Normal(torch.ones(3, 2), 1.0).to_event(2)})
    # a callable prior records no shape: any distribution is taken
    set_priors(model, {"v": dist.Normal(torch.full((4,), 2.0), 1.0).to_event(1)})
    trace = poutine.trace(model).get_trace()
    assert trace.nodes["w"]["fn"].mean.tolist() == [[1.0, 1.0]] * 3
    assert trace.nodes["v"]["fn"].mean.tolist() == [2.0] * 4


def _constrained_model():
    pyro.sample("noise", dist.HalfNormal(1.0))  # support nonnegative
    pyro.sample("rate", dist.Uniform(-1.0, 3.0))  # support interval(-1, 3)
    with pyro.plate("plate", 3):
        pyro.sample("scales", dist.HalfNormal(torch.ones(2)).to_event(1))


@pytest.mark.parametrize("Guide", GUIDES)
def test_constrained_priors_keep_the_site_support(Guide):
    # biject_to(nonnegative) and biject_to(interval) end in an AffineTransform, whose
    # codomain (hence a plain TransformedDistribution's support) is the real line: the
    # next task's guide would then treat the site as real-valued and init_to_feasible
    # start it at 0, where the model's Normal(mu, noise) fails.
    guide = Guide(_constrained_model)
    guide()
    priors = posterior_as_prior(guide)
    trace = poutine.trace(_constrained_model).get_trace()
    for name, prior in priors.items():
        assert str(prior.support) == str(trace.nodes[name]["fn"].support), name
        assert prior.support.check(prior.sample()).all(), name
    expanded = priors["noise"].expand((4,))
    assert expanded.batch_shape == (4,) and str(expanded.support) == str(priors["noise"].support)
    assert (expanded.sample() > 0).all()

    def next_model():
        for name, prior in priors.items():
            if name == "scales":
                with pyro.plate("plate", 3):
                    pyro.sample(name, prior)
            else:
                pyro.sample(name, prior)

    next_guide = AutoNormal(next_model)  # init_to_feasible: the unconstrained 0
    next_guide()
    samples = next_guide.median()
    assert_close(samples["noise"], torch.tensor(1.0))
    assert_close(samples["rate"], torch.tensor(1.0))
    assert_close(samples["scales"], torch.ones(3, 2))


def test_guide_list_gives_the_priors_of_its_parts():
    from pyro.infer.autoguide import AutoDelta, AutoGuideList

    def parts(second):
        guide = AutoGuideList(model)
        guide.append(AutoRadialNormal(poutine.block(model, expose=["w", "b"])))
        guide.append(second(poutine.block(model, hide=["w", "b"])))
        return guide

    guide = parts(AutoNormal)
    with pytest.raises(RuntimeError, match="not set up yet"):
        posterior_as_prior(guide)
    guide()
    priors = posterior_as_prior(guide)
    assert sorted(priors) == ["b", "local", "noise", "w"]
    radial, normal = guide[0], guide[1]
    for name, part in [("w", radial), ("b", radial), ("noise", normal), ("local", normal)]:
        expected = posterior_as_prior(part)[name]
        assert type(priors[name]) is type(expected), name
        if name in ("w", "b"):
            assert_close(priors[name].scale, radial.get_radial_scale(name))
        torch.manual_seed(0)
        draws = priors[name].sample((3,))
        torch.manual_seed(0)
        assert_close(draws, expected.sample((3,)))
    delta = parts(AutoDelta)
    delta()
    with pytest.raises(TypeError, match=r"^posterior_as_prior: part 1 of the AutoGuideList "
                                        r"\(AutoDelta\) has no per-site"):
        posterior_as_prior(delta)


def test_set_priors_refuses_a_model_function():
    def functional(x):
        return pyro.sample("w", dist.Normal(0.0, 1.0))

    with pytest.raises(TypeError, match="model must be a PyroModule, got function; a model "
                                        "written as a function takes its priors in its own"):
        set_priors(functional, {"w": dist.Normal(1.0, 1.0)})


@pytest.mark.parametrize("Guide", [AutoKTiedNormal, AutoRadialNormal, AutoNormal])
def test_constrained_priors_round_trip_saved_with_zero_kl(Guide):
    # The priors of constrained sites survive torch.save; a next guide set to the
    # posterior they came from has KL(q || p) = 0 there: TraceMeanField_ELBO's loss is
    # log q(v) - log p(v) of one draw, with log q(v) = log q(u) + log|du/dv|. AutoNormal
    # is the control: Pyro's kl_divergence(Delta, p) drops log|du/dv|.
    import io

    guide = Guide(_constrained_model)
    svi = SVI(_constrained_model, guide, Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(5):
        svi.step()
    buffer = io.BytesIO()
    torch.save(posterior_as_prior(guide), buffer)
    buffer.seek(0)
    priors = torch.load(buffer, weights_only=False)
    trace = poutine.trace(_constrained_model).get_trace()
    for name, prior in priors.items():
        assert type(prior).__name__ == "_ConstrainedPosterior", name
        assert str(prior.support) == str(trace.nodes[name]["fn"].support), name

    def next_model():
        pyro.sample("noise", priors["noise"])
        pyro.sample("rate", priors["rate"])
        with pyro.plate("plate", 3):
            pyro.sample("scales", priors["scales"])

    next_guide = Guide(next_model)
    next_guide()
    for name in priors:
        site_params.set_loc_and_scale(next_guide, name,
                                      *site_params.get_loc_and_scale(guide, name))
    losses = torch.tensor([TraceMeanField_ELBO().loss(next_model, next_guide) for _ in range(3)])
    if Guide is AutoNormal:
        assert (losses.abs() > 1e-2).all()
    else:
        assert_close(losses, torch.zeros(3), atol=1e-4, rtol=0)
