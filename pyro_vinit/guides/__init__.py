"""Autoguides for Bayesian neural networks."""

from pyro_vinit.guides.auto_k_tied_normal import AutoKTiedNormal
from pyro_vinit.guides.auto_radial_normal import AutoRadialNormal

__all__ = ["AutoKTiedNormal", "AutoRadialNormal"]
