import math

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer import SVI, TraceMeanField_ELBO
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
    assert 0.8 < (scale.pow(2).mean() / 40).sqrt() < 1.05
