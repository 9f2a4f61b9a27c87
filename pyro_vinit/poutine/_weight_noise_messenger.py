"""Shared base of the handlers that give each example its own weight noise."""

import warnings
from typing import Optional, Set, Tuple

import torch
from torch.distributions import Distribution

from pyro_vinit.poutine._site_value import SiteValue
from pyro_vinit.poutine.layer_call_messenger import LayerCall, LayerCallMessenger

__all__: list = []


def rademacher(shape: Tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Independent random signs, +1 or -1 with probability 1/2 each."""
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(0.5).mul_(2).sub_(1)


def spatial_dims(call: LayerCall) -> int:
    """The number of spatial dims of the call's op (0 for linear)."""
    return 0 if call.op == "linear" else int(call.op[-2])


class _WeightNoiseMessenger(LayerCallMessenger):
    """
    Base of :class:`~pyro_vinit.poutine.LocalReparamMessenger` and
    :class:`~pyro_vinit.poutine.FlipoutMessenger`: site values are
    intercepted as :class:`~pyro_vinit.poutine._site_value.SiteValue`, and a
    weight the handler cannot treat is used as its ordinary sample, with a
    warning once per site, or an error if ``strict``.
    """

    interception = "site_values"
    #: Whether the handler gives a sampled bias per-example noise too (then a
    #: bias used by two layer calls is a shared sample like a weight).
    bias_noise = False

    def __init__(self, strict: bool = False) -> None:
        if not isinstance(strict, bool):
            raise TypeError(f"{type(self).__name__}: strict must be a bool, got {strict!r}")
        super().__init__()
        self.strict = strict
        self._warned: Set[str] = set()

    def _weight_distribution(self, call: LayerCall) -> Optional[Distribution]:
        """The distribution that drew the call's weight, or None if the call
        is to run unchanged (a plain weight, or a fallback already reported)."""
        weight = call.weight
        if not isinstance(weight, SiteValue) or not weight.msgs:
            return None
        noisy = [weight]
        if self.bias_noise and isinstance(call.bias, SiteValue) and call.bias.msgs:
            noisy.append(call.bias)
        reused = [value for value in noisy if value.uses[0]]
        for value in noisy:
            value.uses[0] += 1
        if reused:
            # Per-example noise drawn independently at each use would lose the correlation
            # between the uses of one sample (tied weights, a layer called twice).
            self._fallback(
                reused[0],
                "this sample was already used by an earlier layer call or matrix product "
                "in this run (a shared or tied weight); the uses are then not jointly "
                "exact. Give each layer its own sample site, or run such models without "
                "the handler",
            )
            return None
        if weight.derived is not None:
            self._fallback(
                weight,
                f"its value is transformed (by {weight.derived}) before the layer call; "
                "pass the sample to the layer as drawn",
            )
            return None
        if weight.dist is None:
            self._fallback(
                weight,
                "its value was set by an effect handler outside this one (e.g. a guide trace "
                "replayed from outside it), so the distribution that drew it is unknown; "
                "apply the handler to the whole step (e.g. to svi.step), not to the model",
            )
            return None
        return weight.dist

    def _on_custom_op(self, value: SiteValue, op_name: str) -> None:
        # A later layer call on the same sample must use it as drawn, too.
        value.uses[0] += 1
        self._fallback(
            value,
            f"it is used by {op_name}, which the handler does not intercept (it intercepts "
            "F.linear and F.conv1d/2d/3d, e.g. nn.Linear and nn.Conv2d)",
        )

    def _fallback(self, value: SiteValue, reason: str) -> None:
        site = value.site
        what = (
            f"{type(self).__name__}: the weight at sample site {site!r} keeps its ordinary "
            f"sample, shared by the whole minibatch, because {reason}"
        )
        if self.strict:
            raise ValueError(what + ".")
        if site not in self._warned:
            self._warned.add(site)
            warnings.warn(what + ". Pass strict=True to make this an error.", stacklevel=4)
