"""The k-tied Normal distribution of Swiatkowski et al. (2020)."""

import math
from typing import Any, Optional, Sequence, Tuple, Union

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.distributions.util import sum_rightmost
from torch.distributions import kl_divergence, register_kl

from pyro_vinit.distributions.weight_noise import register_low_rank_scale

__all__ = ["KTiedIndependent", "KTiedNormal"]


class KTiedNormal(dist.Normal):
    r"""
    Element-wise Normal whose standard deviations, viewed as a matrix, have
    rank at most :math:`k`: the k-tied Normal of [1].

    Usage::

        d = KTiedNormal(loc, scale_u, scale_v, tied_dims=2).to_event(2)
        w = d.rsample()

    The last ``tied_dims`` dims of ``loc``, of shape :math:`(m, n_1, n_2, \dots)`,
    are read as an :math:`m \times n` matrix with :math:`n = n_1 n_2 \cdots`
    (a conv kernel ``(out, in, kh, kw)`` is ``out × in·kh·kw``), and

    .. math::

        w_{ij} \sim \mathcal{N}(\mu_{ij}, S_{ij}^2), \qquad S = U V^\top
        = \sum_{a=1}^k u_a v_a^\top, \quad U \in \mathbb{R}_+^{m\times k},\
        V \in \mathbb{R}_+^{n\times k}.

    It is a :class:`~pyro.distributions.Normal` in every respect (KL
    divergences, ``log_prob``, ``entropy``); it also keeps the factors, so that
    e.g. :class:`~pyro_vinit.poutine.LocalReparamMessenger` can use the low
    rank of :math:`S \circ S`, and :meth:`to_event` returns a
    :class:`KTiedIndependent`, whose KL divergence to a Normal prior uses it
    too.

    :param torch.Tensor loc: Means, of shape ``batch_shape + (m, n1, ...)``.
    :param torch.Tensor scale_u: Positive factor :math:`U`, of shape
        ``batch_shape + (m, k)``.
    :param torch.Tensor scale_v: Positive factor :math:`V`, of shape
        ``batch_shape + (n, k)``.
    :param int tied_dims: How many rightmost dims of ``loc`` form the matrix.

    [1] Swiatkowski, Roth, Veeling, Tran, Dillon, Snoek, Mandt, Salimans,
    Jenatton, Nowozin (2020) "The k-tied Normal Distribution: A Compact
    Parameterization of Gaussian Mean Field Posteriors in Bayesian Neural
    Networks"
    """

    arg_constraints = {
        "loc": constraints.real,
        "scale": constraints.positive,
        "scale_u": constraints.positive,
        "scale_v": constraints.positive,
    }

    def __init__(
        self,
        loc: torch.Tensor,
        scale_u: torch.Tensor,
        scale_v: torch.Tensor,
        tied_dims: int = 2,
        validate_args: Optional[bool] = None,
    ):
        if tied_dims < 2 or loc.dim() < tied_dims:
            raise ValueError(
                f"KTiedNormal: tied_dims must be >= 2 and <= loc.dim() = {loc.dim()}, "
                f"but got {tied_dims}"
            )
        matrix_shape = loc.shape[loc.dim() - tied_dims :]
        m, n = matrix_shape[0], math.prod(matrix_shape[1:])
        k = scale_u.shape[-1]
        if scale_u.shape[-2] != m or scale_v.shape[-2] != n or scale_v.shape[-1] != k:
            raise ValueError(
                f"KTiedNormal: loc's last {tied_dims} dims {tuple(matrix_shape)} form an "
                f"({m} x {n}) matrix, so scale_u must end in ({m}, k) and scale_v in ({n}, k); "
                f"got {tuple(scale_u.shape)} and {tuple(scale_v.shape)}"
            )
        self.scale_u, self.scale_v, self.tied_dims = scale_u, scale_v, tied_dims
        # A contiguous (k, n) right factor: the backward products G V and G^T U then use
        # BLAS's fast layouts (half the time of the transposed view's on a 400 x 400 S).
        scale = torch.matmul(scale_u, scale_v.transpose(-1, -2).contiguous())
        scale = scale.reshape(scale.shape[:-2] + matrix_shape)
        super().__init__(loc, scale, validate_args=validate_args)

    @property
    def rank(self) -> int:
        """The number :math:`k` of tied components."""
        return self.scale_u.shape[-1]

    def expand(
        self, batch_shape: Sequence[int], _instance: Optional["KTiedNormal"] = None
    ) -> "KTiedNormal":
        new: KTiedNormal = self._get_checked_instance(  # type: ignore[no-untyped-call]
            KTiedNormal, _instance
        )
        batch_shape = torch.Size(batch_shape)
        prefix = batch_shape[: len(batch_shape) - self.tied_dims]
        new.scale_u = self.scale_u.expand(prefix + self.scale_u.shape[-2:])
        new.scale_v = self.scale_v.expand(prefix + self.scale_v.shape[-2:])
        new.tied_dims = self.tied_dims
        result: KTiedNormal = super().expand(  # type: ignore[no-untyped-call]
            batch_shape, _instance=new
        )
        return result

    def to_event(
        self, reinterpreted_batch_ndims: Optional[int] = None
    ) -> Union["KTiedNormal", "KTiedIndependent"]:
        """
        Reinterprets the rightmost batch dims as event dims, as
        :meth:`~pyro.distributions.torch_distribution.TorchDistributionMixin.to_event`
        does, but returns a
        :class:`KTiedIndependent` so that the KL to a Normal prior can use the
        low rank of :math:`S`.

        :param int reinterpreted_batch_ndims: Number of batch dims to
            reinterpret; all of them by default.
        :rtype: KTiedIndependent
        """
        result = super().to_event(reinterpreted_batch_ndims)  # type: ignore[no-untyped-call]
        if isinstance(result, dist.Independent) and result.base_dist is self:
            return KTiedIndependent(self, result.reinterpreted_batch_ndims)
        return self  # Pyro returns the distribution itself when no dim is reinterpreted


class KTiedIndependent(dist.Independent):
    r"""
    :class:`~pyro.distributions.Independent` over a :class:`KTiedNormal`,
    returned by :meth:`KTiedNormal.to_event`; it differs from Independent only
    in its KL divergence to a Normal prior whose scale is constant over each
    tied matrix (as the usual :math:`\mathcal{N}(0, s^2)` weight priors are).
    With :math:`N = mn` elements per matrix,

    .. math::

        \mathrm{KL} = N\left(\log s - \tfrac{1}{2}\right)
            - \sum_{ij}\log S_{ij}
            + \frac{1}{2s^2}\Big(\sum_{ab}(U^\top U)_{ab}(V^\top V)_{ab}
            + \sum_{ij}(\mu_{ij} - \mu^p_{ij})^2\Big),

    since :math:`\sum_{ij} S_{ij}^2 = \lVert UV^\top\rVert_F^2`. This
    needs three element-wise passes over the matrix instead of the dozen of
    the element-wise Normal-Normal KL (forward and backward), which is most of
    the KL's cost in a Bayesian neural network. Any other prior falls back to
    the element-wise KL.
    """


def _constant_over(t: torch.Tensor, dims: int) -> bool:
    # Only an expanded (stride-0) or size-1 dim is known constant without reading it.
    return all(t.stride(d) == 0 or t.shape[d] == 1 for d in range(t.dim() - dims, t.dim()))


# register_kl is untyped: the ignores keep the function's own signature checked.
@register_kl(KTiedIndependent, dist.Independent)  # type: ignore[untyped-decorator]
@register_kl(KTiedIndependent, torch.distributions.Independent)  # type: ignore[untyped-decorator]
def _kl_k_tied_independent(
    p: KTiedIndependent, q: "torch.distributions.Independent[Any]"
) -> torch.Tensor:
    base, prior = p.base_dist, q.base_dist
    ndims, tied = p.reinterpreted_batch_ndims, p.base_dist.tied_dims
    if not (
        q.reinterpreted_batch_ndims == ndims
        and ndims >= tied
        and isinstance(prior, torch.distributions.Normal)
        and prior.batch_shape == base.batch_shape
        and _constant_over(prior.scale, tied)
    ):
        return kl_divergence(dist.Independent(base, ndims), q)
    matrix = tuple(range(-tied, 0))
    numel = math.prod(base.batch_shape[-tied:])
    prior_scale = prior.scale[(Ellipsis,) + (0,) * tied]
    u, v = base.scale_u, base.scale_v
    sum_s2 = (torch.matmul(u.transpose(-1, -2), u) * torch.matmul(v.transpose(-1, -2), v)).sum(
        (-2, -1)
    )
    sum_log_s = base.scale.log().sum(matrix)
    # A dot product: one fused pass forward and backward, where pow(2).sum() takes three.
    d = (base.loc - prior.loc).flatten(-tied)
    sum_d2 = torch.linalg.vecdot(d, d)
    kl = (
        numel * (prior_scale.log() - 0.5)
        - sum_log_s
        + (sum_s2 + sum_d2) / (2 * prior_scale.pow(2))
    )
    result: torch.Tensor = sum_rightmost(kl, ndims - tied)
    return result


@register_low_rank_scale(KTiedNormal)
def _(d: KTiedNormal) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    # one tied matrix, with no batch dims: U and V are plain (m, k) and (n, k) matrices
    if d.tied_dims != len(d.batch_shape):
        return None
    return d.scale_u, d.scale_v
