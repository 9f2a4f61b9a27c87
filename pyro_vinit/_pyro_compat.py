"""
The only module that imports Pyro's private helpers, so that a Pyro upgrade
that moves or removes one touches this file alone.
"""

from pyro.infer.autoguide.utils import deep_setattr, helpful_support_errors

__all__ = ["deep_setattr", "helpful_support_errors"]
