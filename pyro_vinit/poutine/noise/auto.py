"""The automatic choice of a weight-noise strategy per site."""

from typing import Optional, Union, cast

import torch
from torch.distributions import Distribution

from pyro_vinit._typing import SampleSite
from pyro_vinit.distributions import factorized_normal, is_sign_symmetric
from pyro_vinit.poutine._layer_ops import LayerCall
from pyro_vinit.poutine._site_value import SiteValue
from pyro_vinit.poutine.layer_call_messenger import base_distribution
from pyro_vinit.poutine.noise.flipout import Flipout
from pyro_vinit.poutine.noise.local_reparam import LocalReparam
from pyro_vinit.poutine.noise.strategy import WeightNoise, _check_conv, point_mass_reason

__all__ = ["AutoWeightNoise"]


class _PointMass(WeightNoise):
    """A point mass's weight (e.g. an AutoDelta member's): it has no noise to spread
    over the examples, so every call keeps its ordinary sample, which is exact,
    unreported."""

    def skips(self, call: LayerCall) -> bool:
        return True

    def apply(
        self, call: LayerCall, weight: SiteValue, fn: Distribution
    ) -> Union[torch.Tensor, str]:  # never called: it skips every call
        return cast(str, point_mass_reason(fn))


_POINT_MASS = _PointMass()


class AutoWeightNoise(WeightNoise):
    """
    The default weight-noise strategy, chosen per site by the distribution
    that drew the weight: :class:`~pyro_vinit.poutine.LocalReparam` for a
    :func:`~pyro_vinit.distributions.factorized_normal` (exact, and cheaper),
    :class:`~pyro_vinit.poutine.Flipout` for other
    :func:`~pyro_vinit.distributions.is_sign_symmetric` ones (e.g.
    :class:`~pyro_vinit.distributions.RadialNormal`); other distributions
    keep their ordinary sample, and the handler reports them, but a point mass
    (an ``AutoDelta`` member's weight), whose ordinary sample is exact,
    unreported.

    Usage::

        with WeightNoiseMessenger(config=AutoWeightNoise(low_rank=True)):
            svi.step(x, y)

    :param low_rank: See :class:`~pyro_vinit.poutine.LocalReparam`.
    :type low_rank: bool or None
    :param bool conv: Whether convolutions get per-example noise too (both
        strategies' ``conv``).
    """

    def __init__(self, low_rank: Optional[bool] = None, conv: bool = True) -> None:
        self.conv = _check_conv("AutoWeightNoise", conv)
        self.local_reparam = LocalReparam(low_rank=low_rank, conv=conv)
        self.flipout = Flipout(conv=conv)

    def select(self, fn: Distribution) -> WeightNoise:
        if factorized_normal(fn) is not None:
            return self.local_reparam
        if is_sign_symmetric(fn):
            return self.flipout
        if point_mass_reason(fn) is not None:
            return _POINT_MASS
        return self  # whose apply says that none applies

    def draw(self, msg: SampleSite) -> Optional[SiteValue]:
        strategy = self.select(msg["fn"])
        return None if strategy is self else strategy.draw(msg)

    def apply(
        self, call: LayerCall, weight: SiteValue, fn: Distribution
    ) -> Union[torch.Tensor, str]:
        strategy = self.select(fn)
        if strategy is self:
            name = type(base_distribution(fn)).__name__
            return (
                f"no weight-noise strategy is known for its distribution ({name}): it is "
                "neither a factorized Normal (LocalReparam) nor sign-symmetric (Flipout)"
            )
        return strategy.apply(call, weight, fn)
