"""
Weight-noise strategies, in the shape of :mod:`pyro.infer.reparam`: each
takes one layer call whose weight is a sample site and returns its output
with per-example noise; :class:`~pyro_vinit.poutine.WeightNoiseMessenger`
finds the layer calls and picks a strategy per site from its ``config``.
"""

from pyro_vinit.poutine.noise.auto import AutoWeightNoise
from pyro_vinit.poutine.noise.flipout import Flipout
from pyro_vinit.poutine.noise.local_reparam import LocalReparam
from pyro_vinit.poutine.noise.strategy import WeightNoise

__all__ = ["AutoWeightNoise", "Flipout", "LocalReparam", "WeightNoise"]
