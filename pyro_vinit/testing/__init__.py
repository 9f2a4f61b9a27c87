"""
Models written the way Pyro users write them, for checking that the library
works on models it was not written for (used by pyro-vinit's own tests and
benchmarks, and available to anyone testing a guide or initializer), and the
problems of the I-BLM paper's initializer comparison.
"""

from pyro_vinit.testing import paper_problems, user_models
from pyro_vinit.testing.user_models import UserModel

__all__ = ["UserModel", "paper_problems", "user_models"]
