"""The local reparameterization trick as an effect handler."""

import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.distributions import Normal

from pyro_vinit._pyro_compat import prefill_log_prob, scale_and_mask
from pyro_vinit._typing import SampleSite
from pyro_vinit.distributions import KTiedNormal
from pyro_vinit.poutine._site_value import SiteValue, unwrap
from pyro_vinit.poutine._tensor_ops import is_transpose
from pyro_vinit.poutine._weight_noise_messenger import (
    _WeightNoiseMessenger,
    spatial_dims,
    view_of,
)
from pyro_vinit.poutine.layer_call_messenger import LayerCall, base_distribution

__all__ = ["LocalReparamMessenger"]


def _factorized_normal(fn: object, shape: torch.Size) -> Optional[Normal]:
    base = base_distribution(fn)
    if isinstance(base, Normal) and base.batch_shape == shape:
        return base
    return None


class LocalReparamMessenger(_WeightNoiseMessenger):
    r"""
    Effect handler for the local reparameterization trick [1]: every layer
    whose weight is a sample site with a factorized Normal distribution
    gets its pre-activations sampled directly, independently per example,
    instead of through one weight sample shared by the minibatch.

    Usage::

        with LocalReparamMessenger():
            svi.step(x, y)

    For a layer :math:`b = f(x, W) + c` (``F.linear`` or ``F.conv1d/2d/3d``,
    so ``nn.Linear`` and ``nn.Conv*d`` too, or a matrix product with one
    weight operand: ``x @ w``, ``torch.matmul``, ``torch.mm``,
    ``torch.addmm(c, x, w)``, a two-operand ``torch.einsum`` with one
    contracted index) with
    :math:`W_{ij} \sim \mathcal N(\mu_{ij}, \sigma_{ij}^2)` and a bias
    :math:`c_i \sim \mathcal N(\nu_i, \tau_i^2)` (or a plain tensor, or
    None), each output element is drawn as

    .. math::

        b = f(x, \mu) + \nu + \sqrt{f(x^2, \sigma^2) + \tau^2}\ \odot \zeta,
        \qquad \zeta \sim \mathcal N(0, I),

    which has exactly the distribution of :math:`f(x, W) + c` for each
    example, with the examples independent: the ELBO's expectation and so
    its gradient are unchanged, and the gradient variance scales as
    :math:`1/M` in the minibatch size. Stride, padding, dilation and groups
    are honoured. The weight may be the sample as drawn or a view of it
    (transposed, reshaped, sliced or cast, e.g. ``x @ w.t()`` or the slices
    of :class:`~pyro.infer.autoguide.AutoDiagonalNormal`'s flat latent):
    :math:`\mu` and :math:`\sigma` are then viewed the same way.

    For :class:`~pyro_vinit.distributions.KTiedNormal` weights
    (:class:`~pyro_vinit.guides.AutoKTiedNormal`), :math:`\sigma = UV^\top`
    and so :math:`\sigma\circ\sigma = \sum_{a\le b} c_{ab}(u_a\circ u_b)(v_a\circ v_b)^\top`
    (:math:`c_{aa} = 1`, :math:`c_{ab} = 2`) has rank :math:`r = k(k+1)/2`:
    :math:`f(x^2, \sigma^2)` is computed as :math:`r` thin layers, without
    forming :math:`\sigma^2`, when that takes fewer multiplications
    (``low_rank=None``), always (``True``) or never (``False``).

    The handler must see both the guide and the model: wrap a whole SVI
    step, a :class:`~pyro.infer.Predictive` call (its predictions then get
    per-example noise), or a function running both; ``local_reparam(svi.step)``
    does the same. The distribution of a weight is the one that drew its
    value inside the handler: the guide's (for Pyro's
    :class:`~pyro.infer.autoguide.AutoNormal`, the auxiliary
    ``<name>_unconstrained`` Normal behind the ``Delta`` at the site), or the
    prior's when the model runs without a guide. Under ``Predictive``, which
    conditions the model on guide samples, it is the guide's last draw of the
    site inside the handler.

    *Work not done.* The weight sample drawn by the guide is deferred (a
    :class:`~pyro_vinit.poutine._site_value.SiteValue`) and so are the log
    densities of the weight sites: with
    :class:`~pyro.infer.TraceMeanField_ELBO` and a closed-form KL nothing
    needs them and they are never computed; with
    :class:`~pyro.infer.Trace_ELBO` they are computed from one sample when
    first used.

    *Where it does not apply* the weight's ordinary sample is used: a
    distribution other than a factorized Normal (e.g.
    :class:`~pyro_vinit.guides.AutoRadialNormal`'s; use
    :class:`~pyro_vinit.poutine.FlipoutMessenger` for those), a weight
    transformed before the layer call in a way that repeats or detaches
    elements (e.g. ``expand``), reinterprets their bits (``view(dtype)``) or
    picks them by tensor-valued bounds (``w[i:i + 1]`` with ``i`` a tensor,
    possibly computed from the draw), a weight used by another op (e.g.
    ``F.bilinear``, ``F.embedding``, ``F.conv_transpose2d``, ``torch.bmm``),
    a value set by a handler outside this one, and every use after the
    first of weight elements or a sampled bias that several layer calls share
    (tied weights: independent noise at each use would lose the correlation
    between the uses; a use of the kinds above claims the whole draw). A
    bias with another distribution is used as sampled.
    Weights that are plain parameters or conditioned values are used as
    they are. When the handler exits, one warning names the latent sites of
    the run that kept their ordinary sample, with the reasons, together with
    the weight-like sites (real-valued, two dims or more) that never reached
    a layer call it sees (e.g. :class:`~torch.nn.MultiheadAttention`'s
    projections, used inside ``F.multi_head_attention_forward``); each site
    is named once per handler instance. With ``strict=True`` this is one
    error instead, raised on exit (after the run: an SVI step has then been
    taken), which makes ``strict`` a check of a model, e.g. on its first step.

    Vectorized particles (``vectorize_particles=True``) are refused before
    the model runs: they give every weight a particle dim, which
    ``nn.Linear`` and ``nn.Conv*d`` do not take. Under
    :func:`torch.compile` the handler runs eagerly (a graph break at each of
    its operations), and the compiled step equals the eager one.

    :param bool strict: Raise one error instead of one warning, on exit,
        naming the latent sites the trick did not apply to.
    :param low_rank: Whether to use the low rank of a k-tied variance
        (None: when it is cheaper).
    :type low_rank: bool or None

    [1] Kingma, Salimans, Welling (2015) "Variational Dropout and the Local
    Reparameterization Trick"
    """

    bias_noise = True

    def __init__(self, strict: bool = False, low_rank: Optional[bool] = None) -> None:
        if low_rank not in (None, True, False):
            raise TypeError(
                f"LocalReparamMessenger: low_rank must be None or a bool, got {low_rank!r}"
            )
        super().__init__(strict=strict)
        self.low_rank = low_rank

    def _draw(self, msg: SampleSite) -> Optional[SiteValue]:
        fn = msg["fn"]
        shape = fn.batch_shape + fn.event_shape
        normal = _factorized_normal(fn, shape)
        if normal is None or msg["infer"].get("is_auxiliary"):
            return super()._draw(msg)
        return SiteValue.defer(fn, shape, like=normal.loc, dist=fn)

    def _post_site_value(self, msg: SampleSite, value: SiteValue) -> None:
        # Defer the site's log density with its value, in the form Trace.compute_log_prob
        # and compute_score_parts would store it (both skip sites that have it).
        if not value.is_deferred or msg["is_observed"]:
            return
        fn, scale, mask = msg["fn"], msg["scale"], msg["mask"]
        shape = fn.batch_shape
        if value.shape != fn.batch_shape + fn.event_shape:
            # torch.broadcast_shapes is unannotated.
            shape = torch.broadcast_shapes(  # type: ignore[no-untyped-call]
                shape, value.shape[: value.dim() - fn.event_dim]
            )
        # On the plain tensor: a log density is never a layer call, and each of its ops on
        # the stand-in would pay a __torch_function__ round trip through the handler.
        unscaled = scaled = SiteValue.defer(
            lambda: fn.log_prob(value.concrete), shape, like=value
        )
        if not (isinstance(scale, (int, float)) and scale == 1.0 and mask is None):
            scaled_shape = torch.broadcast_shapes(  # type: ignore[no-untyped-call]
                shape, *(t.shape for t in (scale, mask) if isinstance(t, torch.Tensor))
            )
            scaled = SiteValue.defer(
                lambda: scale_and_mask(unscaled, scale, mask), scaled_shape, like=value
            )
        total = SiteValue.defer(lambda: scaled.sum(), torch.Size(), like=value)
        prefill_log_prob(msg, unscaled, scaled, total)

    def _process_layer_call(self, call: LayerCall) -> Optional[torch.Tensor]:
        found = self._weight_distribution(call)
        if found is None:
            return None
        weight, fn = found
        normal = _factorized_normal(fn, weight.uses.shape)
        if normal is None:
            name = type(base_distribution(fn)).__name__
            self._fallback(
                weight,
                f"its distribution is {name}, not a factorized Normal (FlipoutMessenger "
                "gives per-example noise for sign-symmetric ones such as RadialNormal)",
            )
            return None
        weight_loc = view_of(weight, normal.loc)
        bias, bias_var = call.bias, None
        if isinstance(bias, SiteValue) and bias.msgs and bias.is_view:
            bias_normal = _factorized_normal(bias.site_dist, bias.uses.shape)
            if bias_normal is not None:
                bias_var = view_of(bias, bias_normal.scale).pow(2)
                bias = view_of(bias, bias_normal.loc)
        bias = unwrap(bias)
        x = unwrap(call.input)

        op = getattr(F, call.op)
        mean = op(x, weight_loc, bias, **call.kwargs)
        var = self._variance(call, weight, x * x, normal)
        if bias_var is not None:
            # A positive bias variance keeps sqrt away from 0, where its gradient is infinite.
            std = (var + bias_var.reshape(bias_var.shape + (1,) * spatial_dims(call))).sqrt()
        else:
            # An all-zero input patch gives var = 0.
            std = var.clamp_min(torch.finfo(var.dtype).tiny).sqrt()
        return torch.addcmul(mean, std, torch.randn_like(mean))

    def _variance(
        self, call: LayerCall, weight: SiteValue, x2: torch.Tensor, normal: Normal
    ) -> torch.Tensor:
        """:math:`f(x^2, \\sigma^2)`, through the low-rank factors where chosen."""
        factors = self._low_rank_factors(call, weight, normal)
        op = getattr(F, call.op)
        if factors is None:
            var: torch.Tensor = op(x2, view_of(weight, normal.scale).pow(2), None, **call.kwargs)
            return var
        # Row-major (r, m) and (r, n) factors: the thin products and their gradients then
        # run as (B, n) x (n, r)^T and (r, B) x (B, m) products, which BLAS does several
        # times faster than the column-major layouts autograd would otherwise pick.
        u2t, v2t = factors
        if call.op == "linear":
            return F.linear(x2, v2t) @ u2t
        r = u2t.shape[0]
        thin = op(x2, v2t.reshape((r,) + call.weight.shape[1:]), None, **call.kwargs)
        channel = thin.dim() - spatial_dims(call) - 1
        return torch.movedim(torch.movedim(thin, channel, -1) @ u2t, -1, channel)

    def _low_rank_factors(
        self, call: LayerCall, weight: SiteValue, normal: Normal
    ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        transposed = is_transpose(weight.view_ops, weight.uses.shape)
        # A weight that is the whole tied matrix (as drawn or transposed): then no batch dims,
        # so U and V are plain (m, k) and (n, k) matrices.
        if (
            self.low_rank is False
            or not isinstance(normal, KTiedNormal)
            or normal.tied_dims != weight.dim()
            or call.kwargs.get("groups", 1) != 1
            or (weight.view_ops and not transposed)
        ):
            return None
        u, v = (normal.scale_v, normal.scale_u) if transposed else (normal.scale_u, normal.scale_v)
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
