"""Autoguides for Bayesian neural networks, and one interface to read and
write any supported autoguide's per-site posterior (:mod:`pyro_vinit.guides.site_params`)."""

from pyro_vinit.guides import site_params
from pyro_vinit.guides._base import AutoSiteGuide
from pyro_vinit.guides.auto_k_tied_normal import AutoKTiedNormal
from pyro_vinit.guides.auto_mean_field_normal import AutoMeanFieldNormal
from pyro_vinit.guides.auto_radial_normal import AutoRadialNormal
from pyro_vinit.guides.priors import posterior_as_prior, set_priors

__all__ = [
    "AutoKTiedNormal",
    "AutoMeanFieldNormal",
    "AutoRadialNormal",
    "AutoSiteGuide",
    "posterior_as_prior",
    "set_priors",
    "site_params",
]
