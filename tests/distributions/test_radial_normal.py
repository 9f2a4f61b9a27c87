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


class _Shifted(RadialNormal):
    """A subclass with its own constructor, as Pyro's expand protocol allows."""

    def __init__(self, loc, scale, shift, event_dim=0, validate_args=None):
        self.shift = shift
        super().__init__(loc + shift, scale, event_dim, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(_Shifted, _instance)
        new.shift = self.shift
        return super().expand(batch_shape, _instance=new)


def test_expand_of_a_subclass():
    d = _Shifted(torch.zeros(3), torch.ones(3), shift=2.0, event_dim=1).expand([4])
    assert type(d) is _Shifted and d.shift == 2.0
    assert d.batch_shape == (4,) and d.event_shape == (3,)
    assert_close(d.mean, torch.full((4, 3), 2.0))


def test_expand_keeps_validate_args():
    # Validation is on globally (conftest): the expanded copy keeps the original's choice.
    loc, scale = torch.zeros(3), torch.ones(3)
    bad = torch.full((4, 3), float("nan"))
    with pytest.raises(ValueError):
        RadialNormal(loc, scale, event_dim=1, validate_args=True).expand([4]).log_prob(bad)
    unchecked = RadialNormal(loc, scale, event_dim=1, validate_args=False).expand([4])
    assert unchecked._validate_args is False
    assert torch.isnan(unchecked.log_prob(bad)).all()
    # ... and expanding does not validate the parameters again.
    nan_loc = RadialNormal(torch.full((3,), float("nan")), scale, 1, validate_args=False)
    assert nan_loc.expand([4]).batch_shape == (4,)


def test_log_prob_at_the_mean_one_dim():
    # D = 1 is Normal(loc, scale), finite at w = loc (where the radius is 0).
    loc, scale = torch.tensor([0.3, -1.0]), torch.tensor([2.0, 0.5])
    assert_close(RadialNormal(loc, scale).log_prob(loc), dist.Normal(loc, scale).log_prob(loc))


@pytest.mark.parametrize("numel", [1, 5])
def test_marginal_icdf_matches_samples(numel):
    loc = torch.linspace(-1.0, 1.0, numel)
    scale = torch.linspace(0.5, 2.0, numel)
    d = RadialNormal(loc, scale, event_dim=1)
    q = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.95])
    quantiles = d.marginal_icdf(q.unsqueeze(-1))  # (5, numel)
    assert quantiles.shape == (5, numel) and quantiles.dtype == torch.float32
    if numel == 1:
        assert_close(quantiles, dist.Normal(loc, scale).icdf(q.unsqueeze(-1)), atol=1e-5)
    samples = d.sample((40000,))
    empirical = torch.quantile(samples, q, dim=0)
    assert_close(quantiles, empirical, atol=0.03 * scale.max().item() / math.sqrt(numel), rtol=0)


@pytest.mark.parametrize("numel", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_standard_icdf_keeps_dtype(numel, dtype):
    q = torch.tensor([0.1, 0.9], dtype=dtype)
    assert radial_standard_icdf(q, numel).dtype == dtype
    assert RadialNormal(torch.zeros(numel, dtype=dtype), torch.ones(numel, dtype=dtype),
                        event_dim=1).marginal_icdf(q.unsqueeze(-1)).dtype == dtype


def _reference_cdf(t, numel, num_points=100_001):
    # P(u_i r <= t) from the density of s = |u_i|, prop. to (1 - s^2)^((D - 3)/2) on
    # (0, 1): a different integral from the implementation's, by the trapezoid rule in
    # log s, which is dense where the mass is (s ~ 1/sqrt(D)) for any D.
    log_s = torch.linspace(math.log(1e-9), 0.0, num_points, dtype=torch.float64)[:-1]
    s = log_s.exp()
    log_w = (numel - 3) / 2 * torch.log1p(-s * s) + log_s
    w = (log_w - log_w.max()).exp()
    return (dist.Normal(0.0, 1.0).cdf(t / s) * w).sum() / w.sum()


@pytest.mark.parametrize("numel", [4, 50, 10_000, 1_000_000])
def test_standard_icdf_accuracy(numel):
    # The documented accuracy, about 1e-6 in F, up to a million-weight layer.
    q = torch.tensor([0.01, 0.1, 0.3, 0.7, 0.95], dtype=torch.float64)
    z = radial_standard_icdf(q, numel)
    cdf = torch.stack([_reference_cdf(t, numel) for t in z])
    assert_close(cdf, q, atol=1e-6, rtol=0)


def test_kl_to_a_prior_with_more_batch_dims():
    q = RadialNormal(torch.randn(3, 4), torch.rand(3, 4) + 0.5, event_dim=1)
    prior = dist.Normal(torch.randn(2, 3, 4), torch.rand(2, 3, 4) + 0.5).to_event(1)
    kl = kl_divergence(q, prior)
    assert kl.shape == (2, 3)
    for i in range(2):
        one = dist.Normal(prior.base_dist.loc[i], prior.base_dist.scale[i]).to_event(1)
        assert_close(kl[i], kl_divergence(q, one))


def test_device_and_dtype_follow_loc():
    # The meta device stands in for an accelerator: a tensor created on the default
    # device (the CPU) instead of loc's would fail to combine with it.
    loc = torch.zeros(3, 4, dtype=torch.float64, device="meta")
    d = RadialNormal(loc, torch.ones_like(loc), event_dim=1, validate_args=False)
    sample = d.rsample((2,))
    assert sample.device.type == "meta" and sample.dtype == torch.float64
    q = torch.tensor([0.1, 0.5])[:, None, None]
    for value in [d.log_prob(sample), d.entropy(), d.marginal_icdf(q),
                  d.marginal_icdf(q.to("meta"))]:
        assert value.device.type == "meta" and value.dtype == torch.float64
    for numel in [1, 2, 5]:
        z = radial_standard_icdf(torch.tensor([0.1, 0.5], device="meta"), numel)
        assert z.device.type == "meta" and z.dtype == torch.float32


def test_float64_samples_use_float64_noise():
    # With D = 1 a sample is +-r: float32 noise cast up would be exactly representable
    # in float32, float64 noise almost never is.
    d = RadialNormal(torch.zeros(1000, 1, dtype=torch.float64),
                     torch.ones(1000, 1, dtype=torch.float64), event_dim=1)
    sample = d.rsample()
    assert (sample != sample.float().double()).float().mean() > 0.99


def test_marginal_icdf_in_float64():
    # Probabilities given as a list are read in the distribution's dtype.
    d = RadialNormal(torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64),
                     event_dim=1)
    q = [0.1, 0.6, 0.9]
    z = radial_standard_icdf(torch.tensor(q, dtype=torch.float64), 3)
    assert_close(d.marginal_icdf(torch.tensor(q, dtype=torch.float64)[:, None]), z[:, None]
                 .expand(3, 3), atol=1e-14, rtol=0)
    assert_close(d.marginal_icdf([[0.1], [0.6], [0.9]]), z[:, None].expand(3, 3),
                 atol=1e-14, rtol=0)


@pytest.mark.parametrize("event_numel", [1, 2, 10])
def test_radial_icdf_at_and_beyond_the_ends_is_that_of_normal(event_numel):
    # the radial marginal is unbounded: -inf and inf at 0 and 1, nan outside [0, 1], as
    # Normal.icdf; the bisection's bracket gave -40 and 40 for all four (outside-user trial)
    from pyro_vinit.distributions.radial_normal import radial_standard_icdf

    q = torch.tensor([0.0, 1.0, 1.5, -0.1, float("nan")])
    z = radial_standard_icdf(q, event_numel)
    assert z[0] == -math.inf and z[1] == math.inf and z[2:].isnan().all()
