"""
Models written the way Pyro users write them, for checking that the library
works on models it was not written for (used by pyro-vinit's own tests and
benchmarks, and available to anyone testing a guide or initializer).
"""

from pyro_vinit.testing import user_models
from pyro_vinit.testing.user_models import UserModel

__all__ = ["UserModel", "user_models"]
