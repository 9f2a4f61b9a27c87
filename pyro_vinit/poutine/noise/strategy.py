"""The base of the weight-noise strategies."""

from abc import ABC, abstractmethod
from typing import Optional, Union

import torch
from pyro.distributions import Delta
from torch.distributions import Distribution

from pyro_vinit._typing import SampleSite
from pyro_vinit.poutine._layer_ops import LayerCall
from pyro_vinit.poutine._site_value import SiteValue
from pyro_vinit.poutine._tensor_ops import replay
from pyro_vinit.poutine.layer_call_messenger import base_distribution

__all__ = ["WeightNoise"]


def _check_conv(owner: str, conv: object) -> bool:
    """``conv`` if it is a bool; else a ``TypeError`` naming ``owner``."""
    if not isinstance(conv, bool):
        raise TypeError(f"{owner}: conv must be a bool, got {conv!r}")
    return conv


def point_mass_reason(fn: Distribution) -> Optional[str]:
    """Why a weight drawn from ``fn`` keeps its ordinary sample where ``fn`` is a
    point mass (e.g. an ``AutoDelta`` guide's): exact, nothing to spread."""
    if not isinstance(base_distribution(fn), Delta):
        return None
    return ("its distribution is Delta (a point estimate, e.g. an AutoDelta guide's), "
            "which has no noise to give each example: its ordinary sample is exact "
            "(weight_noise()'s automatic choice leaves such sites alone, unreported)")




def view_of(value: SiteValue, param: torch.Tensor) -> torch.Tensor:
    """The parameter ``param`` of the distribution that drew ``value`` (of the
    drawn value's shape or broadcastable to it), viewed as ``value`` is."""
    return replay(value.view_ops, param.expand(value.uses.shape))


class WeightNoise(ABC):
    """
    Base class of the weight-noise strategies that
    :class:`~pyro_vinit.poutine.WeightNoiseMessenger` applies to a layer
    call whose weight is a sample site: :meth:`apply` returns the layer's
    output with per-example noise, or why the strategy does not apply (the
    layer then runs on the ordinary sample, and the handler reports the site).

    Derived classes implement :meth:`apply`, and may override :meth:`draw`
    (to defer a draw that :meth:`apply` may never need), :meth:`select` and
    :meth:`skips`.
    """

    #: Whether a sampled bias gets per-example noise too (then a bias used by two layer
    #: calls is a shared sample, like a weight).
    bias_noise: bool = False
    #: Whether convolutions get per-example noise (False: :meth:`skips` them, and the
    #: handler leaves transposed ones alone too, so their weights keep the ordinary
    #: sample; set by the strategies' ``conv`` argument).
    conv: bool = True

    def select(self, fn: Distribution) -> "WeightNoise":
        """The strategy to apply to a weight drawn by ``fn``: ``self``, or
        for a strategy that chooses per distribution, the one it chooses."""
        return self

    def noises_bias(self, call: LayerCall) -> bool:
        """Whether :meth:`apply` gives ``call``'s sampled bias per-example noise
        (then a second use of that bias is refused, as a weight's is): by
        default :attr:`bias_noise`."""
        return self.bias_noise

    def skips(self, call: LayerCall) -> bool:
        """Whether the strategy leaves ``call`` alone by design: its layer then
        runs on the ordinary sample, unreported, as for a site the config leaves
        alone. By default, the convolutions of a strategy with ``conv=False``."""
        return not self.conv and call.op != "linear"

    def draw(self, msg: SampleSite) -> Optional[SiteValue]:
        """The value of a weight site that nothing has set, drawn by
        ``msg["fn"]`` as a (possibly deferred)
        :class:`~pyro_vinit.poutine._site_value.SiteValue`, or None to draw
        it as usual."""
        return None

    @abstractmethod
    def apply(
        self, call: LayerCall, weight: SiteValue, fn: Distribution
    ) -> Union[torch.Tensor, str]:
        """
        The output of ``call`` with per-example weight noise, or a reason
        (completing "the site kept its ordinary sample: ...") why not.

        :param LayerCall call: The layer call (its ``input`` and ``bias``
            may be site values: :func:`~pyro_vinit.poutine._site_value.unwrap`).
        :param weight: The call's weight: a view of one draw of ``fn``
            (see :attr:`~pyro_vinit.poutine._site_value.SiteValue.view_ops`).
        :param fn: The distribution that drew the weight.
        """
        raise NotImplementedError
