import math

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer import SVI, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.optim import Adam
from torch.distributions import kl_divergence

from pyro_vinit import AutoRadialNormal
from pyro_vinit.distributions import RadialNormal
from tests.common import assert_close


def model():
    pyro.sample("w", dist.Normal(torch.zeros(8, 5), 1.0).to_event(2))
    pyro.sample("b", dist.Normal(torch.zeros(8), 1.0).to_event(1))
    pyro.sample("s", dist.Normal(0.0, 1.0))
    with pyro.plate("plate", 3):
        pyro.sample("local", dist.Normal(torch.zeros(4), 1.0).to_event(1))


def test_one_radial_per_site_and_scale_init():
    guide = AutoRadialNormal(model, init_scale=0.05)
    trace = poutine.trace(guide).get_trace()
    for name, numel, batch in [("w", 40, ()), ("b", 8, ()), ("s", 1, ()), ("local", 4, (3,))]:
        fn = trace.nodes[name]["fn"]
        assert isinstance(fn, RadialNormal) and fn.event_numel == numel
        assert fn.batch_shape == batch
        # scale = init_scale * sqrt(D): the marginal sd is init_scale.
        assert_close(fn.scale, torch.full_like(fn.scale, 0.05 * math.sqrt(numel)))
        assert_close(fn.variance, torch.full_like(fn.scale, 0.05**2))


def test_mean_field_elbo_is_closed_form():
    # With no likelihood TraceMeanField_ELBO is the sum of closed-form KLs: no noise.
    guide = AutoRadialNormal(model)
    guide()
    elbo = TraceMeanField_ELBO()
    losses = {elbo.loss(model, guide) for _ in range(3)}
    assert len(losses) == 1
    trace = poutine.trace(guide).get_trace()
    model_trace = poutine.trace(poutine.replay(model, trace)).get_trace()
    expected = sum(
        kl_divergence(trace.nodes[n]["fn"], model_trace.nodes[n]["fn"]).sum()
        for n in ["w", "b", "s", "local"]
    )
    assert_close(torch.tensor(losses.pop()), expected.detach(), rtol=1e-5)


def test_svi_reduces_kl_to_prior():
    # Without data the optimum of the KL is the prior's moments: loc -> 0, marginal sd -> 1.
    guide = AutoRadialNormal(model, init_scale=0.1)
    svi = SVI(model, guide, Adam({"lr": 0.05}), TraceMeanField_ELBO())
    for _ in range(600):
        svi.step()
    loc, scale = guide.get_loc_and_scale("w")
    assert_close(loc, torch.zeros_like(loc), atol=0.05, rtol=0)
    # The radial-to-Normal KL is minimized at marginal sd slightly below 1 for D = 40.
    assert 0.8 < scale.pow(2).mean().sqrt() < 1.05


def wide_model():
    # Sites of very different sizes: D = 1, 8, 40 and 2048 (a 32 x 64 layer).
    pyro.sample("s", dist.Normal(0.0, 1.0))
    pyro.sample("b", dist.Normal(torch.zeros(8), 1.0).to_event(1))
    pyro.sample("w", dist.Normal(torch.zeros(8, 5), 1.0).to_event(2))
    pyro.sample("wide", dist.Normal(torch.zeros(32, 64), 1.0).to_event(2))


WIDE_SITES = {"s": 1, "b": 8, "w": 40, "wide": 2048}


def _softplus_inv(x):
    return math.log(math.expm1(x))


def test_stored_parameter_is_the_marginal_scale():
    guide = AutoRadialNormal(wide_model, init_scale=0.05)
    guide()
    params = dict(guide.named_parameters())
    for name, numel in WIDE_SITES.items():
        # The stored positive parameter is the marginal sd, at init_scale whatever D,
        # with AutoNormal's unconstrained value softplus^-1(init_scale).
        marginal = getattr(guide.scales, name)
        assert_close(marginal, torch.full_like(marginal, 0.05))
        raw = params[f"scales.{name}_unconstrained"]
        assert_close(raw, torch.full_like(raw, _softplus_inv(0.05)), rtol=1e-5)
        # get_loc_and_scale returns s; get_radial_scale the RadialNormal's sqrt(D) * s.
        loc, scale = guide.get_loc_and_scale(name)
        assert_close(scale, marginal)
        radial_scale = guide.get_radial_scale(name)
        assert_close(radial_scale, marginal * math.sqrt(numel))
        fn = poutine.trace(guide).get_trace().nodes[name]["fn"]
        assert_close(fn.scale, radial_scale)
        assert_close(fn.variance.sqrt(), marginal, rtol=1e-5)
    normal = AutoNormal(wide_model, init_scale=0.05)
    normal()
    for name, value in normal.named_parameters():
        if name.startswith("scales."):
            assert_close(params[name], value)


def test_monte_carlo_marginal_std_matches():
    pyro.set_rng_seed(0)
    guide = AutoRadialNormal(model, init_scale=0.1)
    guide()
    with torch.no_grad():  # distinct per-element marginal sds in (0.05, 0.5)
        for name, p in guide.named_parameters():
            if name.startswith("scales."):
                p.copy_(torch.rand_like(p).mul(0.45).add(0.05).expm1().log())
    num_draws = 4000
    draws = [guide() for _ in range(num_draws)]
    for name, numel in [("w", 40), ("b", 8), ("s", 1), ("local", 4)]:
        loc, claimed = guide.get_loc_and_scale(name)
        assert_close(guide.get_radial_scale(name), claimed * math.sqrt(numel))
        z = (torch.stack([d[name] for d in draws]) - loc) / claimed
        # Pooled over a site's elements, each draw gives r^2 (r ~ N(0, 1)) exactly, so
        # the pooled sd has a standard error of about 1 / sqrt(2 * 4000) = 1.1 %: 4 %.
        assert abs(z.pow(2).mean().sqrt().item() - 1) < 0.04
        # Per element the radial marginal has heavy tails (kurtosis ~ 9 D / (D + 2)),
        # standard error up to 2.2 % for D = 40: 12 % bounds the largest of 40 elements.
        assert_close(z.std(0), torch.ones_like(loc), atol=0.12, rtol=0)


def test_adam_step_changes_marginal_scale_like_autonormal():
    # Adam's first step moves each unconstrained parameter by lr in the gradient's
    # direction, so the marginal scale s = softplus(rho) changes by a factor that
    # depends on s alone: the same as AutoNormal's, whatever the site's size D.
    # (With sigma = softplus(rho), a D = 2048 site changed by 4x less at init_scale=0.1.)
    lr, init_scale = 0.05, 0.1
    rho = _softplus_inv(init_scale)
    up = math.log1p(math.exp(rho + lr)) / init_scale - 1
    down = 1 - math.log1p(math.exp(rho - lr)) / init_scale
    for guide_cls in (AutoNormal, AutoRadialNormal):
        pyro.clear_param_store()
        pyro.set_rng_seed(1)
        guide = guide_cls(wide_model, init_scale=init_scale)
        svi = SVI(wide_model, guide, Adam({"lr": lr}), TraceMeanField_ELBO())
        svi.step()
        for name in WIDE_SITES:
            change = (getattr(guide.scales, name) / init_scale - 1).abs()
            expected = torch.where(change > (up + down) / 2, up, down)
            assert_close(change, expected, rtol=1e-3, atol=0)


def test_marginal_scales_move_alike_for_every_site_size():
    # Without data, the closed-form KL to N(0, 1) depends on each s_i through
    # s_i^2 / 2 - log s_i alone, so with this parameterization every site's
    # marginal scales follow the D = 1 (Normal) site's path exactly; with
    # sigma = softplus(rho) the 2048-element site would lag far behind.
    guide = AutoRadialNormal(wide_model, init_scale=0.01)
    svi = SVI(wide_model, guide, Adam({"lr": 0.05}), TraceMeanField_ELBO())
    for _ in range(100):
        svi.step()
    reference = guide.scales.s.item()
    assert 0.5 < reference < 1.0
    for name in WIDE_SITES:
        marginal = getattr(guide.scales, name)
        assert_close(marginal, torch.full_like(marginal, reference), rtol=1e-4, atol=0)
