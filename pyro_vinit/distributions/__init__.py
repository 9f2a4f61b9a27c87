"""Distributions behind the guides of :mod:`pyro_vinit`."""

from pyro_vinit.distributions.k_tied_normal import KTiedIndependent, KTiedNormal
from pyro_vinit.distributions.radial_normal import RadialNormal

__all__ = ["KTiedIndependent", "KTiedNormal", "RadialNormal"]
