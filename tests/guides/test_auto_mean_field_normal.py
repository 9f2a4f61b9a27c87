import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_sample

from pyro_vinit import AutoMeanFieldNormal, init_guide_iblm, local_reparam
from pyro_vinit.guides import site_params
from pyro_vinit.nn import BayesianRegressor, bayesianize, mlp
from tests.common import assert_close


def linear_model(x, y=None):
    zero = x.new_zeros(())
    w = pyro.sample("w", dist.Normal(zero, 2.0).expand([3, 4]).to_event(2))
    b = pyro.sample("b", dist.Normal(zero, 1.5).expand([3]).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(zero + 1.0))
    # batched over leading (particle) dims of the latents
    mean = torch.matmul(x, w.transpose(-1, -2)) + b.unsqueeze(-2)
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Normal(mean, sigma[..., None, None]).to_event(1), obs=y)


def latent_only_model():
    pyro.sample("w", dist.Normal(0.0, 2.0).expand([3, 4]).to_event(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_parameters_and_marginals_as_auto_normal(dtype):
    x = torch.randn(5, 4, dtype=dtype)
    guides = {}
    for cls in (AutoNormal, AutoMeanFieldNormal):
        pyro.clear_param_store()
        pyro.set_rng_seed(3)
        guides[cls] = cls(linear_model, init_loc_fn=init_to_sample, init_scale=0.07)
        guides[cls](x)
    for name in ("w", "b", "sigma"):
        expected = site_params.get_loc_and_scale(guides[AutoNormal], name)
        actual = guides[AutoMeanFieldNormal].get_loc_and_scale(name)
        for e, a in zip(expected, actual):
            assert a.dtype == dtype
            assert_close(a, e, rtol=0, atol=0)
    # The Normal sits at the real-support site itself, with exactly those parameters.
    trace = poutine.trace(guides[AutoMeanFieldNormal]).get_trace(x)
    loc, scale = guides[AutoMeanFieldNormal].get_loc_and_scale("w")
    value = trace.nodes["w"]["value"]
    assert "w_unconstrained" not in trace.nodes
    assert_close(trace.nodes["w"]["fn"].log_prob(value),
                 dist.Normal(loc, scale).log_prob(value).sum())
    # A constrained site goes through the unconstrained space, as in AutoNormal.
    assert "sigma_unconstrained" in trace.nodes
    assert trace.nodes["sigma"]["value"] > 0


def test_kl_is_closed_form():
    # With no likelihood, TraceMeanField_ELBO's loss is KL(q || p): exact and
    # deterministic for this guide, a Monte Carlo estimate for AutoNormal.
    guide = AutoMeanFieldNormal(latent_only_model, init_loc_fn=init_to_sample)
    guide()
    with torch.no_grad():
        guide.set_loc_and_scale("w", torch.linspace(-1, 1, 12).reshape(3, 4),
                                torch.linspace(0.1, 3.0, 12).reshape(3, 4))
    loc, s = guide.get_loc_and_scale("w")
    expected = (math.log(2.0) - s.log() + (s ** 2 + loc ** 2) / (2 * 4.0) - 0.5).sum()
    elbo = TraceMeanField_ELBO()
    losses = [elbo.differentiable_loss(latent_only_model, guide) for _ in range(3)]
    for loss in losses:
        assert_close(loss, expected, rtol=1e-6)
    pyro.clear_param_store()
    normal = AutoNormal(latent_only_model)
    normal_losses = {elbo.differentiable_loss(latent_only_model, normal).item()
                     for _ in range(3)}
    assert len(normal_losses) == 3


def test_local_reparam_draws_no_weight_sample(monkeypatch):
    model = BayesianRegressor(bayesianize(mlp((4, 8, 1))))
    x, y = torch.randn(16, 4), torch.randn(16)
    calls = []
    rsample = torch.distributions.Normal.rsample
    monkeypatch.setattr(torch.distributions.Normal, "rsample",
                        lambda self, *a: calls.append(tuple(self.batch_shape)) or rsample(self, *a))
    for cls in (AutoNormal, AutoMeanFieldNormal):
        pyro.clear_param_store()
        guide = cls(model)
        guide(x, y)
        calls.clear()
        with local_reparam(strict=True):
            TraceMeanField_ELBO().differentiable_loss(model, guide, x, y).backward()
        if cls is AutoNormal:
            # its Monte Carlo KL needs every weight: the four sites are sampled
            assert len(calls) == 4
        else:
            assert calls == []


def test_local_reparam_moments():
    # Identical rows under local_reparam are independent draws of the layer's output:
    # mean x mu^T + b_mu, variance x^2 (s^2)^T + b_s^2 (Kingma et al. 2015).
    model = bayesianize(mlp((4, 3))).double()  # a model whose return value is the layer's
    guide = AutoMeanFieldNormal(model)
    x = torch.randn(1, 4, dtype=torch.float64)
    guide(x)
    w_loc = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4)
    w_scale = torch.linspace(0.2, 0.6, 12, dtype=torch.float64).reshape(3, 4)
    b_loc, b_scale = torch.tensor([0.5, -0.5, 0.0]).double(), torch.tensor([0.1, 0.2, 0.3]).double()
    guide.set_loc_and_scale("0.weight", w_loc, w_scale)
    guide.set_loc_and_scale("0.bias", b_loc, b_scale)
    n = 200_000
    rows = x.expand(n, 4)
    with torch.no_grad(), local_reparam(strict=True):
        trace = poutine.trace(guide).get_trace(rows)
        out = poutine.replay(model, trace=trace)(rows)
    mean = x @ w_loc.T + b_loc
    var = (x ** 2) @ (w_scale ** 2).T + b_scale ** 2
    # 5 standard errors of the mean and of the variance (Normal: var(s^2) = 2 var^2 / n)
    assert ((out.mean(0) - mean).abs() < 5 * (var / n).sqrt()).all()
    assert ((out.var(0) - var).abs() < 5 * var * math.sqrt(2 / n)).all()


def test_iblm_writes_what_it_writes_for_auto_normal():
    # A per-element family: I-BLM's solution is the same as for AutoNormal.
    x = torch.randn(64, 3)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(64)
    model = BayesianRegressor(bayesianize(mlp((3, 5, 1))), noise_scale=0.1)
    results = {}
    for cls in (AutoNormal, AutoMeanFieldNormal):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = cls(model)
        guide(x, y)
        pyro.set_rng_seed(1)
        init_guide_iblm(guide, (x, y))
        results[cls] = {name: site_params.get_loc_and_scale(guide, name)
                        for name in site_params.latent_sites(guide)}
    for name, (loc, scale) in results[AutoNormal].items():
        assert_close(results[AutoMeanFieldNormal][name][0], loc, rtol=1e-5, atol=1e-6)
        assert_close(results[AutoMeanFieldNormal][name][1], scale, rtol=1e-5, atol=1e-6)


def test_trace_elbo_equals_auto_normal_under_the_same_seed():
    # Same family, same parameters, same noise: AutoNormal's Normal at the auxiliary site
    # plus its Delta (and the Jacobian at the constrained site) give the same Monte Carlo
    # ELBO as this guide's Normal at the site, draw for draw.
    x = torch.randn(8, 4)
    y = torch.randn(8, 3)
    losses = {}
    for cls in (AutoNormal, AutoMeanFieldNormal):
        pyro.clear_param_store()
        pyro.set_rng_seed(5)
        guide = cls(linear_model, init_loc_fn=init_to_sample)
        guide(x, y)
        losses[cls] = Trace_ELBO(num_particles=10, vectorize_particles=True).loss(
            linear_model, guide, x, y)
    assert losses[AutoMeanFieldNormal] == pytest.approx(losses[AutoNormal], rel=1e-6)
