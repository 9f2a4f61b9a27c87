"""Fails loudly if Pyro changes what pyro_vinit._pyro_compat and the flat-latent
layout of pyro_vinit.guides.site_params rely on."""

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoNormal

from pyro_vinit._pyro_compat import unconstrained_param
from pyro_vinit.guides import site_params


def model():
    pyro.sample("a", dist.Normal(torch.zeros(2, 3), 1.0).to_event(2))
    pyro.sample("simplex", dist.Dirichlet(torch.ones(4)))  # 3 unconstrained elements
    pyro.sample("b", dist.LogNormal(torch.zeros(5), 1.0).to_event(1))


def test_unconstrained_param_is_the_trained_parameter():
    guide = AutoNormal(model)
    guide()
    param = unconstrained_param(guide.scales, "a")
    assert param is dict(guide.named_parameters())["scales.a_unconstrained"]
    # ... and the tensor the param store (hence SVI's optimizer) holds.
    assert param is pyro.get_param_store().get_param("AutoNormal.scales.a").unconstrained()
    assert torch.allclose(torch.nn.functional.softplus(param), guide.scales.a)


def test_flat_latent_layout():
    # site_params slices AutoContinuous's flat latent in trace order; Pyro's own
    # median() unpacks it: the two must agree site by site.
    for Guide in (AutoDiagonalNormal, AutoLowRankMultivariateNormal):
        guide = Guide(model)
        guide()
        with torch.no_grad():
            guide.loc.copy_(torch.arange(guide.latent_dim, dtype=guide.loc.dtype) / 10)
        median = guide.median()
        for name, site in site_params.latent_sites(guide).items():
            loc, _ = site_params.get_loc_and_scale(guide, name)
            expected = torch.distributions.biject_to(site["fn"].support)(loc)
            assert torch.allclose(median[name], expected), name


def test_share_prototype_sets_up_a_guide_without_running_the_model():
    from pyro.infer.autoguide import AutoDelta

    from pyro_vinit._pyro_compat import share_prototype

    def plated():
        with pyro.plate("p", 4, subsample_size=2):
            pyro.sample("x", dist.Normal(0.0, 1.0))

    source = AutoNormal(plated)
    source()
    target = AutoDelta(plated)
    share_prototype(source, target)
    assert target.prototype_trace is source.prototype_trace
    # The plates AutoGuide builds from the frames match the source's.
    assert {n: p.subsample_size for n, p in target._create_plates().items()} == {"p": 2}


def test_pyro_sample_priors():
    from pyro.nn import PyroModule, PyroSample

    from pyro_vinit._pyro_compat import pyro_sample_priors

    module = PyroModule[torch.nn.Linear](2, 3)
    prior = dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2)
    module.weight = PyroSample(prior)
    assert pyro_sample_priors(module) == {"weight": prior}
    assert pyro_sample_priors(torch.nn.Linear(2, 3)) == {}
