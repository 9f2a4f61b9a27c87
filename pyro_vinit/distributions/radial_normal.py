"""The radial Normal distribution of Farquhar et al. (2020)."""

import math
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from pyro.distributions import TorchDistribution, constraints
from torch.distributions import Independent, Normal, register_kl
from torch.distributions.utils import broadcast_all

from pyro_vinit.distributions.weight_noise import (
    register_factorized_normal,
    register_sign_symmetric,
)

__all__ = ["RadialNormal", "radial_standard_icdf"]

# The shapes torch.distributions accepts for sample_shape.
_Shape = Union[torch.Size, List[int], Tuple[int, ...]]

# Euler-Mascheroni constant; E[log|r|] = -(gamma + log 2) / 2 for r ~ N(0, 1).
_EULER_GAMMA = 0.5772156649015329


def _sum_rightmost(x: torch.Tensor, dim: int) -> torch.Tensor:
    # For dim = 0 this sums a trailing dim of size 1: x itself.
    return x.reshape(x.shape[: x.dim() - dim] + (-1,)).sum(-1)


class RadialNormal(TorchDistribution):
    r"""
    Radial posterior of [1]: a direction uniform on the unit sphere times a
    standard Normal radius, scaled and shifted element-wise.

    Usage::

        d = RadialNormal(torch.zeros(400, 64), torch.ones(400, 64), event_dim=2)
        w = d.rsample()                 # one layer's weight matrix
        d.log_prob(w), d.entropy()

    The event is the last ``event_dim`` dims of ``loc`` (one layer's tensor)
    with :math:`D` elements in all; every batch element samples independently:

    .. math::

        w = \mu + \sigma \odot \frac{\epsilon}{\lVert\epsilon\rVert} r,
        \qquad \epsilon \sim \mathcal{N}(0, I_D), \quad r \sim \mathcal{N}(0, 1).

    Because the direction :math:`u = \epsilon / \lVert\epsilon\rVert` has
    :math:`\mathbb{E}[u_i^2] = 1/D`, the **marginal variance of each element is
    scale² / D**, not scale²; for :math:`D = 1` this is exactly
    ``Normal(loc, scale)``.

    The density follows from the change of variables
    :math:`z = (w - \mu)/\sigma = u\,r`: the radius :math:`\rho = \lVert z\rVert = |r|`
    is half-Normal and the direction uniform on the sphere of area
    :math:`S_{D-1} = 2\pi^{D/2}/\Gamma(D/2)`, so

    .. math::

        \log q(w) = -\frac{\rho^2}{2} - \frac{1}{2}\log 2\pi + \log\Gamma(D/2)
            - \frac{D}{2}\log\pi - (D - 1)\log\rho - \sum_i \log\sigma_i,

    and the entropy is analytic,

    .. math::

        H[q] = \sum_i \log\sigma_i + \frac{1 + \log 2\pi}{2} - \log\Gamma(D/2)
            + \frac{D}{2}\log\pi - \frac{D - 1}{2}(\gamma + \log 2).

    The KL divergence to a factorized Normal prior is registered in closed form,
    so :class:`~pyro.infer.TraceMeanField_ELBO` needs no Monte Carlo for it.

    :param torch.Tensor loc: Mean :math:`\mu`.
    :param torch.Tensor scale: Positive radial scale :math:`\sigma` (same shape
        as ``loc`` after broadcasting).
    :param int event_dim: Number of rightmost dims forming one radial event.

    [1] Farquhar, Osborne, Gal (2020) "Radial Bayesian Neural Networks: Beyond
    Discrete Support in Large-Scale Bayesian Deep Learning"
    """

    arg_constraints = {"loc": constraints.real, "scale": constraints.positive}
    support: constraints.Constraint = constraints.real
    has_rsample = True
    loc: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self,
        loc: torch.Tensor,
        scale: torch.Tensor,
        event_dim: int = 0,
        validate_args: Optional[bool] = None,
    ):
        loc, scale = broadcast_all(loc, scale)
        shape = loc.shape
        if not isinstance(event_dim, int) or not 0 <= event_dim <= len(shape):
            raise ValueError(
                f"RadialNormal: event_dim must be an int in [0, {len(shape)}] for loc of "
                f"shape {tuple(shape)}, but got {event_dim!r}"
            )
        self.loc, self.scale = loc, scale
        split = len(shape) - event_dim
        super().__init__(shape[:split], shape[split:], validate_args=validate_args)
        self.support = constraints.independent(constraints.real, event_dim)

    @property
    def event_numel(self) -> int:
        """Number of elements :math:`D` in one event."""
        return math.prod(self.event_shape)

    def expand(
        self, batch_shape: Sequence[int], _instance: Optional["RadialNormal"] = None
    ) -> "RadialNormal":
        new: RadialNormal = self._get_checked_instance(  # type: ignore[no-untyped-call]
            RadialNormal, _instance
        )
        batch_shape = torch.Size(batch_shape)
        shape = batch_shape + self.event_shape
        new.loc = self.loc.expand(shape)
        new.scale = self.scale.expand(shape)
        super(RadialNormal, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new.support = self.support
        new._validate_args = self._validate_args
        return new

    @property
    def mean(self) -> torch.Tensor:
        return self.loc

    @property
    def mode(self) -> torch.Tensor:
        # The density is infinite at loc for D > 1 (the (D-1) log rho term), and maximal
        # there for D = 1, so loc is the mode in both cases.
        return self.loc

    @property
    def variance(self) -> torch.Tensor:
        return self.scale.pow(2) / self.event_numel

    def marginal_icdf(self, q: torch.Tensor) -> torch.Tensor:
        """
        Quantiles of each element's marginal distribution, computed
        numerically (see :func:`radial_standard_icdf`).

        :param torch.Tensor q: Probabilities in (0, 1), broadcastable against
            ``batch_shape + event_shape``.
        """
        z = radial_standard_icdf(torch.as_tensor(q, dtype=self.loc.dtype), self.event_numel)
        return self.loc + self.scale * z.to(self.loc.device)

    def rsample(self, sample_shape: _Shape = torch.Size()) -> torch.Tensor:
        shape = self._extended_shape(sample_shape)
        # new_empty: the noise takes loc's dtype and device by construction.
        eps = self.loc.new_empty(shape).normal_()
        event_dim = len(self.event_shape)
        batch = shape[: len(shape) - event_dim]
        norm: torch.Tensor = eps.reshape(batch + (-1,)).norm(dim=-1)
        norm = norm.reshape(batch + (1,) * event_dim)
        radius = eps.new_empty(norm.shape).normal_()
        return self.loc + self.scale * (eps / norm) * radius

    def _log_normalizer(self) -> float:
        # log Gamma(D/2) - D/2 log(pi) - 1/2 log(2 pi), in float64 so large D stays exact.
        d = self.event_numel
        return math.lgamma(d / 2) - d / 2 * math.log(math.pi) - 0.5 * math.log(2 * math.pi)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        event_dim = len(self.event_shape)
        z = (value - self.loc) / self.scale
        rho2 = _sum_rightmost(z.pow(2), event_dim)
        log_rho = 0.5 * rho2.log()
        d = self.event_numel
        log_det = _sum_rightmost(self.scale.log().expand(z.shape), event_dim)
        result = -0.5 * rho2 + self._log_normalizer() - log_det
        if d > 1:
            result = result - (d - 1) * log_rho
        return result

    def entropy(self) -> torch.Tensor:
        d = self.event_numel
        const = 0.5 - self._log_normalizer() - (d - 1) / 2 * (_EULER_GAMMA + math.log(2))
        return _sum_rightmost(self.scale.log(), len(self.event_shape)) + const


def radial_standard_icdf(q: torch.Tensor, event_numel: int, num_nodes: int = 512) -> torch.Tensor:
    r"""
    Quantile function of one element :math:`z_i = u_i r` of a standard radial
    variable in :math:`D` dims (:math:`u` uniform on the unit sphere,
    :math:`r \sim \mathcal{N}(0, 1)`).

    By symmetry :math:`z_i \overset{d}{=} |u_i|\,r` and, writing
    :math:`|u_i| = \sin\phi` with density :math:`\propto \cos^{D-2}\phi` on
    :math:`[0, \pi/2]`,

    .. math::

        F(t) = \int_0^{\pi/2} \Phi(t / \sin\phi)\, p(\phi)\, d\phi,

    integrated by Gauss-Legendre quadrature over the range that holds the mass
    of :math:`p(\phi)` (width :math:`\sim 1/\sqrt{D}`) and inverted by bisection,
    in float64. Accurate to about 1e-6 in :math:`F`.

    :param torch.Tensor q: Probabilities in [0, 1] (-inf and inf at 0 and 1; nan
        outside, as :meth:`torch.distributions.Normal.icdf`).
    :param int event_numel: :math:`D`.
    :param int num_nodes: Quadrature nodes.
    """
    q = torch.as_tensor(q)
    if event_numel == 1:
        z: torch.Tensor = Normal(0.0, 1.0).icdf(q.double())
        return z.to(q.dtype)
    import numpy as np

    upper = min(math.pi / 2, 12.0 / math.sqrt(event_numel - 2)) if event_numel > 2 else math.pi / 2
    nodes, weights = np.polynomial.legendre.leggauss(num_nodes)
    phi = torch.as_tensor((nodes + 1) * upper / 2, dtype=torch.float64, device=q.device)
    log_w = torch.as_tensor(weights, dtype=torch.float64, device=q.device).log()
    log_w = log_w + (event_numel - 2) * phi.cos().log()
    w = (log_w - log_w.logsumexp(0)).exp()
    sin_phi = phi.sin()
    # Constant, valid parameters: nothing to validate (validation would read them back).
    std_normal = Normal(
        torch.tensor(0.0, dtype=torch.float64, device=q.device), 1.0, validate_args=False
    )

    def cdf(t: torch.Tensor) -> torch.Tensor:
        probs: torch.Tensor = std_normal.cdf(t.unsqueeze(-1) / sin_phi)
        return (probs * w).sum(-1)

    flat = q.double().reshape(-1)
    lo = torch.full_like(flat, -40.0)
    hi = torch.full_like(flat, 40.0)
    for _ in range(80):
        mid = (lo + hi) / 2
        below = cdf(mid) < flat
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    # as Normal.icdf: -inf and inf at 0 and 1 (the radial marginal is unbounded), nan outside
    z = torch.where(flat <= 0, -math.inf, torch.where(flat >= 1, math.inf, (lo + hi) / 2))
    z = torch.where((flat < 0) | (flat > 1) | flat.isnan(), math.nan, z)
    return z.reshape(q.shape).to(q.dtype if q.is_floating_point() else torch.float64)


def _normal_cross_entropy(
    q: RadialNormal, p_loc: torch.Tensor, p_scale: torch.Tensor
) -> torch.Tensor:
    # E_q[-log N(w | p_loc, p_scale)] summed over the event, using
    # E_q[(w - p_loc)^2] = (loc - p_loc)^2 + scale^2 / D (of q's full shape, so the
    # terms cover every element of the event).
    second_moment = (q.loc - p_loc).pow(2) + q.variance
    terms = p_scale.log() + 0.5 * math.log(2 * math.pi) + 0.5 * second_moment / p_scale.pow(2)
    return _sum_rightmost(terms, len(q.event_shape))


# register_kl is untyped: the ignores keep the functions' own signatures checked.
@register_kl(RadialNormal, Normal)  # type: ignore[untyped-decorator]
def _kl_radial_normal(q: RadialNormal, p: Normal) -> torch.Tensor:
    if len(q.event_shape) != 0:
        raise NotImplementedError(
            "KL(RadialNormal || Normal) needs the prior's event dims to match: wrap the "
            f"Normal prior in .to_event({len(q.event_shape)})"
        )
    return _normal_cross_entropy(q, p.loc, p.scale) - q.entropy()


@register_kl(RadialNormal, Independent)  # type: ignore[untyped-decorator]
def _kl_radial_independent(q: RadialNormal, p: "Independent[Any]") -> torch.Tensor:
    base = p.base_dist
    if not isinstance(base, Normal) or p.event_shape != q.event_shape:
        raise NotImplementedError
    return _normal_cross_entropy(q, base.loc, base.scale) - q.entropy()


@register_factorized_normal(RadialNormal)
def _(d: RadialNormal) -> Optional[Normal]:
    # an event of one element (D = 1): a sign uniform on {-1, 1} times a standard Normal
    # radius is a standard Normal, and the marginal scale scale / sqrt(D) is the scale
    return Normal(d.loc, d.scale) if d.event_numel == 1 else None


@register_sign_symmetric(RadialNormal)
def _(d: RadialNormal) -> bool:
    # a direction uniform on the sphere times an independent radius: flipping the sign of
    # any elements of the direction keeps its law
    return True
