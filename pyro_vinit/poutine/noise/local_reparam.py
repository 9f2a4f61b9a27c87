"""The local reparameterization trick as a weight-noise strategy."""

import functools
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch.distributions import Distribution, Normal

from pyro_vinit._typing import SampleSite
from pyro_vinit.distributions import factorized_normal, low_rank_scale
from pyro_vinit.poutine._layer_ops import LayerCall, is_batched, run_layer
from pyro_vinit.poutine._site_value import SiteValue, unwrap
from pyro_vinit.poutine._tensor_ops import is_transpose
from pyro_vinit.poutine.layer_call_messenger import base_distribution
from pyro_vinit.poutine.noise.flipout import flipout_layer, shared_dims
from pyro_vinit.poutine.noise.strategy import (
    WeightNoise,
    _check_conv,
    point_mass_reason,
    view_of,
)

__all__ = ["LocalReparam"]


def _normal(fn: Optional[Distribution], shape: torch.Size) -> Optional[Normal]:
    # The factorized Normal of fn if its elements are those of a value of shape.
    normal = factorized_normal(fn)
    return normal if normal is not None and normal.batch_shape == shape else None


class LocalReparam(WeightNoise):
    r"""
    The local reparameterization trick [1] for a layer whose weight has a
    factorized Normal distribution: the pre-activations are drawn directly,
    independently per example.

    Usage::

        with WeightNoiseMessenger(config=LocalReparam()):
            svi.step(x, y)

    For a layer :math:`b = f(x, W) + c` with
    :math:`W_{ij} \sim \mathcal N(\mu_{ij}, \sigma_{ij}^2)` and a bias
    :math:`c_i \sim \mathcal N(\nu_i, \tau_i^2)` (or a plain tensor, or
    None), each output element is drawn as

    .. math::

        b = f(x, \mu) + \nu + \sqrt{f(x^2, \sigma^2) + \tau^2}\ \odot \zeta,
        \qquad \zeta \sim \mathcal N(0, I),

    exact for each example whose outputs share no weight element (a row of a
    linear layer's input). Where they do (a convolution's positions, the
    tokens of a ``(batch, tokens, features)`` input), independent draws would
    lose their correlation: those layers take Flipout's sign flips of one
    weight sample, shared by the example's positions (as
    :class:`~pyro_vinit.poutine.Flipout` draws them), exact too.

    When :func:`~pyro_vinit.distributions.low_rank_scale` gives
    :math:`\sigma = UV^\top` (:class:`~pyro_vinit.distributions.KTiedNormal`),
    :math:`\sigma\circ\sigma = \sum_{a\le b} c_{ab}(u_a\circ u_b)(v_a\circ v_b)^\top`
    (:math:`c_{aa} = 1`, :math:`c_{ab} = 2`) has rank :math:`r = k(k+1)/2`, and
    a linear layer's :math:`f(x^2, \sigma^2)` is computed as :math:`r` thin layers when that
    takes fewer multiplications (``low_rank=None``), always (``True``) or
    never (``False``). The draw of a factorized Normal weight is deferred:
    the trick on a linear layer never needs it.

    With ``conv=False`` the strategy leaves convolutions (transposed ones
    too) alone: their weights keep the ordinary sample, shared by the
    minibatch, and are not reported (their per-example noise costs a second
    convolution).

    :param low_rank: Whether to use a low-rank scale (None: when cheaper).
    :type low_rank: bool or None
    :param bool conv: Whether convolutions get per-example noise too.

    [1] Kingma, Salimans, Welling (2015) "Variational Dropout and the Local
    Reparameterization Trick"
    """

    bias_noise = True

    def __init__(self, low_rank: Optional[bool] = None, conv: bool = True) -> None:
        if not (low_rank is None or isinstance(low_rank, bool)):
            raise TypeError(f"LocalReparam: low_rank must be None or a bool, got {low_rank!r}")
        self.conv = _check_conv("LocalReparam", conv)
        self.low_rank = low_rank

    def noises_bias(self, call: LayerCall) -> bool:
        # (where the example's positions share the weight, Flipout's path uses it as sampled)
        return not shared_dims(call)

    def draw(self, msg: SampleSite) -> Optional[SiteValue]:
        fn = msg["fn"]
        shape = fn.batch_shape + fn.event_shape
        normal = _normal(fn, shape)
        if normal is None:
            return None
        return SiteValue.defer(fn, shape, like=normal.loc, dist=fn)

    def apply(
        self, call: LayerCall, weight: SiteValue, fn: Distribution
    ) -> Union[torch.Tensor, str]:
        normal = _normal(fn, weight.uses.shape)
        if normal is None:
            point_mass = point_mass_reason(fn)
            if point_mass is not None:
                return point_mass
            name = type(base_distribution(fn)).__name__
            return (
                f"its distribution is {name}, not a factorized Normal "
                "(FlipoutMessenger gives per-example noise for sign-symmetric ones such as "
                "RadialNormal)"
            )
        weight_loc = view_of(weight, normal.loc)
        shared = shared_dims(call)
        if shared:
            # outputs of one example that share weight elements are correlated, which
            # draws per output would lose: Flipout's signs, shared by them, keep it
            return flipout_layer(call, weight.concrete, weight_loc, shared)
        bias, bias_var = call.bias, None
        if isinstance(bias, SiteValue) and bias.msgs and bias.is_view:
            bias_normal = _normal(bias.site_dist, bias.uses.shape)
            if bias_normal is not None:
                bias_var = view_of(bias, bias_normal.scale).pow(2)
                bias = view_of(bias, bias_normal.loc)
        bias = unwrap(bias)
        x = unwrap(call.input)

        mean = run_layer(call.op, x, weight_loc, bias, call.kwargs)
        var = self._variance(call, weight, x * x, normal)
        if bias_var is not None:
            # A positive bias variance keeps sqrt away from 0, where its gradient is infinite.
            std = (var + bias_var).sqrt()
        else:
            # An all-zero input patch gives var = 0.
            std = var.clamp_min(torch.finfo(var.dtype).tiny).sqrt()
        return torch.addcmul(mean, std, torch.randn_like(mean))

    def _variance(
        self, call: LayerCall, weight: SiteValue, x2: torch.Tensor, normal: Normal
    ) -> torch.Tensor:
        # f(x^2, sigma^2) of a linear layer, through the low-rank factors where chosen.
        factors = self._low_rank_factors(call, weight, normal)
        if factors is None:
            scale2 = view_of(weight, normal.scale).pow(2)
            return run_layer(call.op, x2, scale2, None, call.kwargs)
        # Row-major (r, m) and (r, n) factors: the thin products and their gradients then
        # run as (B, n) x (n, r)^T and (r, B) x (B, m) products, which BLAS does several
        # times faster than the column-major layouts autograd would otherwise pick.
        u2t, v2t = factors
        return F.linear(x2, v2t) @ u2t

    def _low_rank_factors(
        self, call: LayerCall, weight: SiteValue, normal: Normal
    ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        if self.low_rank is False or is_batched(call.op, call.weight, None):
            return None  # (batched: the dense path, one batched layer)
        transposed = is_transpose(weight.view_ops, weight.uses.shape)
        if weight.view_ops and not transposed:
            return None  # the whole matrix, as drawn or transposed
        scale = low_rank_scale(normal)
        if scale is None:
            return None
        u, v = scale[::-1] if transposed else scale
        (m, k), n = u.shape, v.shape[0]
        r = k * (k + 1) // 2
        if self.low_rank is None and r * (m + n) >= m * n:
            return None
        a, b, coef = _pairs(k, u.dtype, u.device)
        ut, vt = u.t(), v.t()
        return ut[a] * ut[b] * coef.unsqueeze(-1), vt[a] * vt[b]


@functools.lru_cache(maxsize=64)
def _pairs(
    k: int, dtype: torch.dtype, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The pairs a <= b of k components, and their multiplicity in (sum_a u_a v_a^T)^2.
    a, b = torch.triu_indices(k, k, device=device)
    return a, b, torch.where(a == b, 1.0, 2.0).to(dtype)
