"""
pyro-vinit: variational inference for Bayesian neural networks in Pyro that
starts well and trains fast.
"""

from pyro_vinit import distributions, metrics, schedules
from pyro_vinit.guides import AutoKTiedNormal, AutoRadialNormal

__version__ = "0.1.0"

__all__ = [
    "AutoKTiedNormal",
    "AutoRadialNormal",
    "distributions",
    "metrics",
    "schedules",
]
