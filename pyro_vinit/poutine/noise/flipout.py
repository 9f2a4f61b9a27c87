"""Flipout as a weight-noise strategy."""

import math
from typing import Tuple, Union

import torch
from torch.distributions import Distribution

from pyro_vinit.distributions import is_sign_symmetric
from pyro_vinit.poutine._layer_ops import LayerCall, batch_shapes, run_layer, spatial_dims
from pyro_vinit.poutine._site_value import SiteValue, unwrap
from pyro_vinit.poutine.layer_call_messenger import base_distribution
from pyro_vinit.poutine.noise.strategy import (
    WeightNoise,
    _check_conv,
    point_mass_reason,
    view_of,
)

__all__ = ["Flipout"]


def rademacher(shape: Tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Independent random signs, +1 or -1 with probability 1/2 each."""
    # integers 0 or 1 drawn straight into the dtype: cheaper on the CPU than a float
    # bernoulli_(0.5), and as exact
    return torch.randint(0, 2, shape, dtype=like.dtype, device=like.device).mul_(2).sub_(1)


def _own_dims(call: LayerCall) -> Tuple[int, ...]:
    # The sizes of the input's dims left of its features (channels), less those that a
    # weight batch dim of size > 1 (a sample or particle dim, with its own weight) lines
    # up with.
    x_batch, w_batch = batch_shapes(call.op, unwrap(call.input), call.weight)
    return tuple(x_batch[-i] for i in range(len(x_batch), 0, -1)
                 if not (i <= len(w_batch) and w_batch[-i] > 1))


def shared_dims(call: LayerCall) -> int:
    """The number of dims of the call's input between its example dim and its
    feature or channel dim, whose outputs share the example's weight: a
    convolution's spatial dims, and of a linear layer's dims left of its
    features, those beyond the first (the example's) that no weight batch dim
    of size > 1 lines up with, e.g. the tokens of ``(batch, tokens,
    features)``."""
    if call.op != "linear":
        return spatial_dims(call.op)
    return max(0, len(_own_dims(call)) - 1)


def noise_rows(call: LayerCall) -> Tuple[int, Tuple[int, ...]]:
    """The number of the call's examples that per-example noise is drawn for
    independently, and the sizes of the dims that share an example's noise
    (:func:`shared_dims`) but a convolution's spatial ones: a linear layer's
    example dim (the first of its input's dims left of its features that no
    weight batch dim of size > 1 lines up with) and the dims after it; all
    those dims of a convolution (left of its channels) as its examples."""
    own = _own_dims(call)
    if call.op != "linear":
        return math.prod(own), ()
    return (own[0], own[1:]) if own else (1, ())


def flipout_layer(
    call: LayerCall, sample: torch.Tensor, mean: torch.Tensor, shared: int
) -> torch.Tensor:
    """The layer's output under Flipout's sign flips of the weight ``sample``
    about its ``mean`` (both as the call uses the weight), the signs drawn per
    example and shared by its ``shared`` (:func:`shared_dims`) dims; the bias
    used as sampled."""
    x, bias = unwrap(call.input), unwrap(call.bias)
    out = run_layer(call.op, x, mean, bias, call.kwargs)
    if call.op == "linear":  # the signs over the features, shared by the positions
        s_shape = x.shape[: x.dim() - 1 - shared] + (1,) * shared + x.shape[-1:]
        r_shape = out.shape[: out.dim() - 1 - shared] + (1,) * shared + out.shape[-1:]
    else:  # over the channels, shared by the spatial positions
        s_shape = x.shape[: x.dim() - shared] + (1,) * shared
        r_shape = out.shape[: out.dim() - shared] + (1,) * shared
    noise = run_layer(call.op, x * rademacher(s_shape, x), sample - mean, None, call.kwargs)
    return out + noise * rademacher(r_shape, out)


class Flipout(WeightNoise):
    r"""
    Flipout [1] for a layer whose weight has a distribution with
    perturbations symmetric under sign flips
    (:func:`~pyro_vinit.distributions.is_sign_symmetric`; the radial
    posterior [2] included): per-example pseudo-independent weight noise
    from one weight sample.

    Usage::

        with WeightNoiseMessenger(config=Flipout()):
            svi.step(x, y)

    With the weight sample :math:`W = \bar W + \Delta W`
    (:math:`\bar W` its mean), the output for example :math:`n` is

    .. math::

        b_n = f(x_n, \bar W) + c + \big(f(x_n \odot s_n, \Delta W)\big) \odot r_n,

    with independent random signs :math:`s_n` over the input features (for a
    convolution: input channels) and :math:`r_n` over the outputs (output
    channels), shared by the example's positions (a convolution's spatial
    positions, the tokens of a linear layer's ``(batch, tokens, features)``
    input), which is :math:`f(x_n, \bar W + \Delta W \odot r_n s_n^\top)`.
    When :math:`\Delta W \odot r s^\top` has the law of :math:`\Delta W` for
    every sign vectors, each example's output has exactly its ordinary
    distribution, and the examples are uncorrelated. It costs two layer
    evaluations instead of one. The bias is used as sampled.

    With ``conv=False`` the strategy leaves convolutions (transposed ones
    too) alone: their weights keep the ordinary sample, shared by the
    minibatch, and are not reported (as :class:`~pyro_vinit.poutine.LocalReparam`'s).

    :param bool conv: Whether convolutions get per-example noise too.

    [1] Wen, Vicol, Ba, Tran, Grosse (2018) "Flipout: Efficient
    Pseudo-Independent Weight Perturbations on Mini-Batches"

    [2] Farquhar, Osborne, Gal (2020) "Radial Bayesian Neural Networks:
    Beyond Discrete Support in Large-Scale Bayesian Deep Learning"
    """

    def __init__(self, conv: bool = True) -> None:
        self.conv = _check_conv("Flipout", conv)

    def apply(
        self, call: LayerCall, weight: SiteValue, fn: Distribution
    ) -> Union[torch.Tensor, str]:
        if not is_sign_symmetric(fn):
            return point_mass_reason(fn) or (
                f"its distribution is {type(base_distribution(fn)).__name__}, whose "
                "perturbations are not known to be symmetric under sign flips"
            )
        return flipout_layer(call, weight.concrete, view_of(weight, fn.mean), shared_dims(call))
