import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from torch.distributions import kl_divergence

from pyro_vinit.distributions import RadialNormal
from pyro_vinit.distributions.radial_normal import radial_standard_icdf
from tests.common import assert_close


def _gauss_legendre(a, b, n):
    x, w = np.polynomial.legendre.leggauss(n)
    x = torch.as_tensor((x + 1) * (b - a) / 2 + a, dtype=torch.float64)
    w = torch.as_tensor(w * (b - a) / 2, dtype=torch.float64)
    return x, w


def test_density_integrates_to_one_2d():
    loc = torch.tensor([0.3, -1.0], dtype=torch.float64)
    scale = torch.tensor([0.5, 2.0], dtype=torch.float64)
    d = RadialNormal(loc, scale, event_dim=1)
    # Polar coordinates in z = (w - loc) / scale: dw = prod(scale) * rho drho dtheta.
    rho, w_rho = _gauss_legendre(0.0, 12.0, 200)
    theta, w_theta = _gauss_legendre(0.0, 2 * math.pi, 64)
    r, t = torch.meshgrid(rho, theta, indexing="ij")
    z = torch.stack([r * t.cos(), r * t.sin()], -1)
    density = d.log_prob(loc + scale * z).exp() * scale.prod() * r
    total = (density * w_rho[:, None] * w_theta[None, :]).sum()
    assert_close(total, 1.0, atol=1e-8, rtol=0)


def test_density_integrates_to_one_3d():
    loc = torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64)
    scale = torch.tensor([1.5, 0.2, 1.0], dtype=torch.float64)
    d = RadialNormal(loc, scale, event_dim=1)
    rho, w_rho = _gauss_legendre(0.0, 12.0, 120)
    theta, w_theta = _gauss_legendre(0.0, math.pi, 48)
    phi, w_phi = _gauss_legendre(0.0, 2 * math.pi, 48)
    r, t, p = torch.meshgrid(rho, theta, phi, indexing="ij")
    z = torch.stack([r * t.sin() * p.cos(), r * t.sin() * p.sin(), r * t.cos()], -1)
    jacobian = scale.prod() * r.pow(2) * t.sin()
    density = d.log_prob(loc + scale * z).exp() * jacobian
    weights = w_rho[:, None, None] * w_theta[None, :, None] * w_phi[None, None, :]
    assert_close((density * weights).sum(), 1.0, atol=1e-8, rtol=0)


def test_one_dim_equals_normal():
    loc, scale = torch.randn(5), torch.rand(5) + 0.5
    radial, normal = RadialNormal(loc, scale), dist.Normal(loc, scale)
    x = torch.randn(5) * 3
    assert_close(radial.log_prob(x), normal.log_prob(x), atol=1e-5)
    assert_close(radial.entropy(), normal.entropy(), atol=1e-5)
    prior = dist.Normal(torch.zeros(5), 2 * torch.ones(5))
    assert_close(kl_divergence(radial, prior), kl_divergence(normal, prior), atol=1e-5)


@pytest.mark.parametrize("numel", [2, 10, 1000])
def test_radius_is_half_normal(numel):
    loc, scale = torch.randn(numel), torch.rand(numel) + 0.1
    w = RadialNormal(loc, scale, event_dim=1).sample((20000,))
    radius = ((w - loc) / scale).norm(dim=-1).sort().values
    # Kolmogorov-Smirnov distance to |N(0, 1)|; the 1% critical value at n=20000 is 0.0115.
    cdf = torch.erf(radius / math.sqrt(2))
    empirical = torch.arange(1, 20001) / 20000
    assert (cdf - empirical).abs().max() < 0.0115


@pytest.mark.parametrize("event_shape", [(5,), (3, 4)])
def test_marginal_moments(event_shape):
    loc = torch.randn(event_shape)
    scale = torch.rand(event_shape) + 0.5
    d = RadialNormal(loc, scale, event_dim=len(event_shape))
    w = d.sample((100000,))
    assert_close(d.variance, scale.pow(2) / math.prod(event_shape))
    # Relative standard error of a variance estimate here is below 1%: 5% is ~5 sigma.
    assert_close(w.var(0), d.variance, rtol=0.05, atol=0)
    assert_close(w.mean(0), loc, atol=5 * (d.variance / 100000).sqrt().max().item(), rtol=0)


def test_batch_dims_sample_independently():
    d = RadialNormal(torch.zeros(2, 3), torch.ones(2, 3), event_dim=1)
    assert d.batch_shape == (2,) and d.event_shape == (3,)
    w = d.sample((50000,))
    assert w.shape == (50000, 2, 3)
    # Each batch element has its own radius: the two norms are uncorrelated.
    norms = w.norm(dim=-1)
    corr = np.corrcoef(norms[:, 0].numpy(), norms[:, 1].numpy())[0, 1]
    assert abs(corr) < 0.02


@pytest.mark.parametrize("event_shape", [(4,), (3, 5)])
def test_entropy_matches_monte_carlo(event_shape):
    loc = torch.randn(event_shape, dtype=torch.float64)
    scale = torch.rand(event_shape, dtype=torch.float64) + 0.3
    d = RadialNormal(loc, scale, event_dim=len(event_shape))
    neg_log_q = -d.log_prob(d.sample((200000,)))
    se = neg_log_q.std() / math.sqrt(200000)
    assert abs(neg_log_q.mean() - d.entropy()) < 4 * se


@pytest.mark.parametrize("prior_event", ["independent", "expanded"])
def test_kl_closed_form_matches_monte_carlo(prior_event):
    shape = (3, 4)
    loc = torch.randn(shape, dtype=torch.float64)
    scale = torch.rand(shape, dtype=torch.float64) + 0.5
    q = RadialNormal(loc, scale, event_dim=2)
    if prior_event == "independent":
        p = dist.Normal(torch.randn(shape, dtype=torch.float64), torch.rand(shape).double() + 0.5)
    else:
        p = dist.Normal(torch.tensor(0.0, dtype=torch.float64), 0.7).expand(shape)
    p = p.to_event(2)
    kl = kl_divergence(q, p)
    w = q.sample((200000,))
    log_ratio = q.log_prob(w) - p.log_prob(w)
    se = log_ratio.std() / math.sqrt(200000)
    assert kl.shape == ()
    assert abs(log_ratio.mean() - kl) < 4 * se


def test_kl_requires_matching_event_dims():
    q = RadialNormal(torch.zeros(3, 4), torch.ones(3, 4), event_dim=2)
    with pytest.raises(NotImplementedError):
        kl_divergence(q, dist.Normal(torch.zeros(3, 4), 1.0).to_event(1))


def test_trace_mean_field_elbo_uses_closed_form_kl():
    # No likelihood: the ELBO is -KL. Closed form makes it exact and noise-free.
    q = RadialNormal(torch.full((4, 3), 0.5), torch.full((4, 3), 0.8), event_dim=2)
    prior = dist.Normal(0.0, 1.0).expand([4, 3]).to_event(2)

    def model():
        pyro.sample("w", prior)

    def guide():
        pyro.sample("w", q)

    losses = [TraceMeanField_ELBO().loss(model, guide) for _ in range(3)]
    assert losses[0] == losses[1] == losses[2]
    assert_close(torch.tensor(losses[0]), kl_divergence(q, prior), rtol=1e-6)
    # Trace_ELBO estimates the same quantity by Monte Carlo.
    mc = np.mean([Trace_ELBO().loss(model, guide) for _ in range(2000)])
    assert abs(mc - losses[0]) < 0.1 * abs(losses[0]) + 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_prob_finite_in_high_dimension(dtype):
    numel = 10**6
    d = RadialNormal(torch.zeros(1000, 1000, dtype=dtype), torch.ones(1000, 1000, dtype=dtype), 2)
    w = d.rsample()
    lp = d.log_prob(w)
    assert lp.dtype == dtype and torch.isfinite(lp) and torch.isfinite(d.entropy())
    # Against the density evaluated directly in float64.
    rho = w.double().norm()
    expected = (
        -0.5 * rho**2
        - 0.5 * math.log(2 * math.pi)
        + math.lgamma(numel / 2)
        - numel / 2 * math.log(math.pi)
        - (numel - 1) * rho.log()
    )
    assert_close(lp.double(), expected, rtol=1e-5, atol=0)


def test_rsample_is_reparameterized():
    loc = torch.zeros(3, requires_grad=True)
    scale = torch.ones(3, requires_grad=True)
    RadialNormal(loc, scale, event_dim=1).rsample().sum().backward()
    assert loc.grad is not None and scale.grad is not None
    assert_close(loc.grad, torch.ones(3))


@pytest.mark.parametrize("numel", [1, 2, 3, 10, 1000])
def test_marginal_quantiles_match_samples(numel):
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
    z = radial_standard_icdf(q, numel)
    samples = RadialNormal(torch.zeros(numel), torch.ones(numel), event_dim=1).sample((40000,))
    # Each element has the same marginal; pool the first column of every sample.
    empirical = torch.quantile(samples[:, 0], q)
    spread = samples[:, 0].std()
    assert_close(z, empirical, atol=0.03 * spread.item(), rtol=0)
    assert torch.all(z[1:] > z[:-1])
    assert_close(z[2], 0.0, atol=1e-6)


def test_invalid_event_dim():
    with pytest.raises(ValueError, match="event_dim"):
        RadialNormal(torch.zeros(3), torch.ones(3), event_dim=2)


def test_expand():
    d = RadialNormal(torch.zeros(3), torch.ones(3), event_dim=1).expand([4])
    assert d.batch_shape == (4,) and d.event_shape == (3,)
    assert d.sample().shape == (4, 3)
    assert d.log_prob(torch.zeros(4, 3) + 0.1).shape == (4,)
