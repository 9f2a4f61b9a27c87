import math

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.optim import Adam
from pyro.poutine.util import site_is_subsample
from torch.distributions import kl_divergence

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal
from pyro_vinit.nn import BayesianRegressor, bayesianize, mlp
from pyro_vinit.poutine import KLAnnealingMessenger, kl_annealing
from pyro_vinit.schedules import LinearWarmup, SigmoidSchedule
from tests.common import assert_close

GUIDES = [AutoNormal, AutoKTiedNormal, AutoRadialNormal]


def toy_model(y):
    # a global latent, a local latent inside a subsampled plate (scale 10 / 2), and data
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", 10, subsample=torch.arange(2)):
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("y", dist.Normal(z, 1.0), obs=y)
    pyro.factor("penalty", -(mu**2))


def _setup(guide_cls, dtype=torch.float64):
    torch.manual_seed(1)
    x, y = torch.randn(5, 2, dtype=dtype), torch.randn(5, dtype=dtype)
    # num_data=20: the likelihood carries the minibatch scale 20 / 5
    model = BayesianRegressor(bayesianize(mlp((2, 3, 1)).to(dtype)), noise_scale=0.5, num_data=20)
    guide = guide_cls(model)
    guide(x, y)  # set up the parameters before seeding
    return model, guide, (x, y)


def _traces(model, guide, args, seed):
    pyro.set_rng_seed(seed)
    guide_tr = poutine.trace(guide).get_trace(*args)
    model_tr = poutine.trace(poutine.replay(model, trace=guide_tr)).get_trace(*args)
    guide_tr.compute_log_prob()
    model_tr.compute_log_prob()
    return model_tr, guide_tr


def _latent(trace):
    return [n for n, site in trace.iter_stochastic_nodes() if not site_is_subsample(site)]


def _decompose(model, guide, args, seed):
    """By hand, without annealing: the likelihood term, the Monte Carlo KL
    (log q - log p at the sample) and the closed-form KL where it exists."""
    model_tr, guide_tr = _traces(model, guide, args, seed)
    ll = sum(model_tr.nodes[n]["log_prob_sum"] for n in model_tr.observation_nodes)
    log_p = sum(model_tr.nodes[n]["log_prob_sum"] for n in _latent(model_tr))
    log_q = sum(guide_tr.nodes[n]["log_prob_sum"] for n in _latent(guide_tr))
    try:
        kl = sum(
            kl_divergence(guide_tr.nodes[n]["fn"], model_tr.nodes[n]["fn"]).sum()
            for n in _latent(model_tr)
        )
    except NotImplementedError:
        kl = None
    return ll, log_q - log_p, kl


def test_scales_latent_sites_only():
    with KLAnnealingMessenger(scale=0.3):
        tr = poutine.trace(toy_model).get_trace(torch.zeros(2))
    assert tr.nodes["mu"]["scale"] == pytest.approx(0.3)
    assert tr.nodes["z"]["scale"] == pytest.approx(0.3 * 5.0)  # λ times the plate's scale
    assert tr.nodes["y"]["scale"] == pytest.approx(5.0)  # observed: the plate's scale only
    assert tr.nodes["penalty"]["scale"] == 1.0  # a factor is an observed site
    # the trace's log density is λ times the latent part plus the observed part
    plain = poutine.trace(poutine.replay(toy_model, trace=tr)).get_trace(torch.zeros(2))
    plain.compute_log_prob()
    latent = plain.nodes["mu"]["log_prob_sum"] + plain.nodes["z"]["log_prob_sum"]
    observed = plain.nodes["y"]["log_prob_sum"] + plain.nodes["penalty"]["log_prob_sum"]
    assert_close(tr.log_prob_sum(), 0.3 * latent + observed, atol=1e-5)


def test_condition_inside_is_observed():
    conditioned = poutine.condition(toy_model, data={"mu": torch.tensor(0.5)})
    tr = poutine.trace(kl_annealing(conditioned, scale=0.3)).get_trace(torch.zeros(2))
    assert tr.nodes["mu"]["is_observed"] and tr.nodes["mu"]["scale"] == 1.0
    assert tr.nodes["z"]["scale"] == pytest.approx(1.5)


def test_handler_function_forms():
    y = torch.zeros(2)
    scales = [
        poutine.trace(kl_annealing(toy_model, scale=0.25)).get_trace(y).nodes["mu"]["scale"],
        poutine.trace(kl_annealing(toy_model, 0.25)).get_trace(y).nodes["mu"]["scale"],
    ]
    with kl_annealing(0.25):  # a number in first place is the scale, as in poutine.scale(0.25)
        scales.append(poutine.trace(toy_model).get_trace(y).nodes["mu"]["scale"])
    messenger = kl_annealing(SigmoidSchedule(alpha=1.0, beta=0.0))  # a Schedule too
    assert isinstance(messenger, KLAnnealingMessenger) and messenger.scale == pytest.approx(0.5)
    with kl_annealing(scale=lambda t: 0.25):
        scales.append(poutine.trace(toy_model).get_trace(y).nodes["mu"]["scale"])
    assert scales == pytest.approx([0.25] * 4)


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_model_and_guide_sites_scaled_alike(guide_cls):
    model, guide, args = _setup(guide_cls)
    with kl_annealing(scale=0.3):
        model_tr, guide_tr = _traces(model, guide, args, seed=0)
    assert model_tr.observation_nodes == ["obs"]
    assert model_tr.nodes["obs"]["scale"] == pytest.approx(4.0)  # num_data / batch, not annealed
    assert len(_latent(model_tr)) == 4
    for name in _latent(model_tr):
        assert model_tr.nodes[name]["scale"] == pytest.approx(0.3)
        assert guide_tr.nodes[name]["scale"] == pytest.approx(0.3)
    # including AutoNormal's auxiliary "<name>_unconstrained" sites
    assert all(guide_tr.nodes[n]["scale"] == pytest.approx(0.3) for n in _latent(guide_tr))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("guide_cls", GUIDES)
def test_trace_elbo_kl_part_scales(guide_cls, dtype):
    model, guide, args = _setup(guide_cls, dtype)
    ll, kl_mc, _ = _decompose(model, guide, args, seed=3)
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-8, rtol=1e-8)
    for lam in [0.0, 0.1, 1.0, 2.5]:
        pyro.set_rng_seed(3)  # the same draws as the decomposition
        with kl_annealing(scale=lam):
            loss = Trace_ELBO().loss(model, guide, *args)
        assert_close(loss, -(ll - lam * kl_mc).item(), **tol)


@pytest.mark.parametrize("guide_cls", [AutoKTiedNormal, AutoRadialNormal])
def test_mean_field_elbo_closed_form_kl_scales(guide_cls):
    # The guide puts a Normal / RadialNormal at each site: the KL is in closed
    # form and TraceMeanField_ELBO scales it by the guide site's scale.
    model, guide, args = _setup(guide_cls)
    ll, _, kl = _decompose(model, guide, args, seed=4)
    assert kl is not None and kl > 0
    for lam in [0.0, 0.1, 1.0, 2.5]:
        pyro.set_rng_seed(4)
        with kl_annealing(scale=lam):
            loss = TraceMeanField_ELBO().loss(model, guide, *args)
        assert_close(loss, -(ll - lam * kl).item(), atol=1e-8, rtol=1e-8)


def test_mean_field_elbo_autonormal_is_affine_in_lambda():
    # AutoNormal's Delta sites have no closed-form KL; TraceMeanField_ELBO falls
    # back to sampling, and the annealed loss is still  -ll + λ · KL_estimate.
    model, guide, args = _setup(AutoNormal)
    ll, _, _ = _decompose(model, guide, args, seed=5)
    losses = {}
    for lam in [0.0, 0.5, 1.0, 3.0]:
        pyro.set_rng_seed(5)
        with kl_annealing(scale=lam):
            losses[lam] = TraceMeanField_ELBO().loss(model, guide, *args)
    assert_close(losses[0.0], -ll.item(), atol=1e-8, rtol=1e-8)
    slope = losses[1.0] - losses[0.0]
    for lam in [0.5, 3.0]:
        assert_close(losses[lam], losses[0.0] + lam * slope, atol=1e-8, rtol=1e-8)


def test_scaling_only_the_model_is_wrong():
    # Why the messenger must cover the guide too: with the model alone,
    # Trace_ELBO computes  ll + λ log p - log q, not  ll - λ KL.
    model, guide, args = _setup(AutoKTiedNormal)
    model_tr, guide_tr = _traces(model, guide, args, seed=6)
    ll, kl_mc, _ = _decompose(model, guide, args, seed=6)
    log_q = guide_tr.log_prob_sum()
    pyro.set_rng_seed(6)
    loss = Trace_ELBO().loss(kl_annealing(model, scale=0.1), guide, *args)
    assert_close(loss, -(ll + 0.1 * (log_q - kl_mc) - log_q).item(), atol=1e-8, rtol=1e-8)
    assert abs(loss - (-(ll - 0.1 * kl_mc).item())) > 1e-3


def test_decorating_model_and_guide_equals_context():
    model, guide, args = _setup(AutoRadialNormal)
    annealing = KLAnnealingMessenger(scale=0.2)
    pyro.set_rng_seed(7)
    decorated = Trace_ELBO().loss(annealing(model), annealing(guide), *args)
    pyro.set_rng_seed(7)
    with annealing:
        context = Trace_ELBO().loss(model, guide, *args)
    assert_close(decorated, context, atol=1e-10, rtol=0)


def test_tensor_scale():
    # a one-element tensor (e.g. a schedule computed with torch) is taken as its number
    messenger = KLAnnealingMessenger(scale=torch.tensor([0.3], dtype=torch.float64))
    assert type(messenger.scale) is float and messenger.scale == pytest.approx(0.3)
    with kl_annealing(torch.tensor(0.25)):
        tr = poutine.trace(toy_model).get_trace(torch.zeros(2))
    assert tr.nodes["mu"]["scale"] == pytest.approx(0.25)
    messenger.scale = torch.tensor(0.5)
    assert messenger.scale == 0.5


def test_default_scale_is_one():
    # without a scale the handler is the identity, as poutine.scale() without one
    assert kl_annealing().scale == 1.0 and KLAnnealingMessenger().scale == 1.0
    tr = poutine.trace(kl_annealing(toy_model)).get_trace(torch.zeros(2))
    assert tr.nodes["mu"]["scale"] == 1.0 and tr.nodes["z"]["scale"] == pytest.approx(5.0)


def test_installing_twice_fails():
    # Pyro refuses a messenger installed twice, which rules out a silent λ²
    annealing = KLAnnealingMessenger(scale=0.5)
    with pytest.raises(ValueError, match="twice"):
        with annealing:
            annealing(toy_model)(torch.zeros(2))


def test_schedule_steps_in_svi():
    model, guide, args = _setup(AutoKTiedNormal)
    annealing = KLAnnealingMessenger(scale=LinearWarmup(4))
    svi = SVI(model, guide, Adam({"lr": 0.01}), TraceMeanField_ELBO())
    seen = []
    for _ in range(6):
        with annealing:
            tr = poutine.trace(guide).get_trace(*args)
            seen.append(tr.nodes["net.0.weight"]["scale"])
            assert math.isfinite(svi.step(*args))
        annealing.step()
    assert seen == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.0])
    assert annealing.iteration == 6
    annealing.iteration = 2  # resuming re-evaluates the schedule
    assert annealing.scale == pytest.approx(0.5)
    annealing.scale = 0.7  # a manual override until the next step
    assert annealing.scale == 0.7 and annealing.step() == pytest.approx(0.75)


def test_constant_scale_step():
    annealing = KLAnnealingMessenger(scale=0.4)
    assert annealing.step() == 0.4 and annealing.iteration == 1
    assert KLAnnealingMessenger().scale == 1.0


def test_sigmoid_schedule_values():
    s = SigmoidSchedule(alpha=0.01, beta=300.0, gamma=0.1)
    assert s(300) == pytest.approx(0.05)
    assert s(0) == pytest.approx(0.1 / (1 + math.exp(3.0)))
    assert s(500) == pytest.approx(0.1 / (1 + math.exp(-2.0)))
    assert s(10**6) == pytest.approx(0.1)
    # the paper's VGG16 setting: nearly 0 at the start, no overflow far before the midpoint
    paper = SigmoidSchedule(alpha=2e-3, beta=2.5e4, gamma=0.1)
    assert paper(0) == pytest.approx(0.1 / (1 + math.exp(50.0)), rel=1e-9)
    assert SigmoidSchedule(alpha=1.0, beta=1e4)(0) == 0.0
    values = [paper(t) for t in range(0, 60000, 5000)]
    assert values == sorted(values)


def test_linear_warmup_values():
    s = LinearWarmup(10)
    assert [s(t) for t in (0, 5, 10, 20)] == pytest.approx([0.0, 0.5, 1.0, 1.0])
    s = LinearWarmup(4, start=0.2, end=0.6)
    assert [s(t) for t in (0, 1, 4, 9)] == pytest.approx([0.2, 0.3, 0.6, 0.6])


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: KLAnnealingMessenger(scale=-0.1), "^KLAnnealingMessenger: scale must be >= 0"),
        (lambda: KLAnnealingMessenger(scale=float("nan")), "^KLAnnealingMessenger: scale must"),
        (lambda: KLAnnealingMessenger(scale="1"), "finite number"),
        (lambda: KLAnnealingMessenger(scale=torch.tensor([0.5, 0.5])), "finite number, got"),
        (lambda: KLAnnealingMessenger(scale=lambda t: -1.0), "iteration 0"),
        (lambda: KLAnnealingMessenger(scale=lambda t: None), "iteration 0"),
        (lambda: setattr(KLAnnealingMessenger(), "scale", -2.0), ">= 0"),
        (lambda: setattr(KLAnnealingMessenger(), "iteration", -1), "iteration"),
        (lambda: KLAnnealingMessenger(scale=lambda t: 1.0 - 2 * t).step(), "iteration 1"),
        (lambda: SigmoidSchedule(alpha=0.0, beta=1.0), "alpha must be positive"),
        (lambda: SigmoidSchedule(alpha=1.0, beta=-1.0), "beta must be non-negative"),
        (
            lambda: SigmoidSchedule(alpha=1.0, beta=1.0, gamma=math.inf),
            "gamma must be a finite number",
        ),
        (lambda: LinearWarmup(0), "num_steps"),
        (lambda: LinearWarmup(10, end=-1.0), "end must be non-negative"),
    ],
)
def test_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_failed_step_leaves_state_unchanged():
    annealing = KLAnnealingMessenger(scale=lambda t: 1.0 - 2 * t)
    with pytest.raises(ValueError, match="iteration 1"):
        annealing.step()
    assert annealing.iteration == 0 and annealing.scale == 1.0
