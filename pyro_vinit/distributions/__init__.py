"""Distributions behind the guides of :mod:`pyro_vinit`."""

from pyro_vinit.distributions.k_tied_normal import KTiedIndependent, KTiedNormal
from pyro_vinit.distributions.radial_normal import RadialNormal
from pyro_vinit.distributions.weight_noise import (
    factorized_normal,
    is_sign_symmetric,
    low_rank_scale,
    register_factorized_normal,
    register_low_rank_scale,
    register_sign_symmetric,
)

__all__ = [
    "KTiedIndependent",
    "KTiedNormal",
    "RadialNormal",
    "factorized_normal",
    "is_sign_symmetric",
    "low_rank_scale",
    "register_factorized_normal",
    "register_low_rank_scale",
    "register_sign_symmetric",
]
