"""The k-tied Normal distribution of Swiatkowski et al. (2020)."""

import math
from typing import Optional

import pyro.distributions as dist
import torch
from pyro.distributions import constraints

__all__ = ["KTiedNormal"]


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
    rank of :math:`S \circ S`.

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
        scale = torch.matmul(scale_u, scale_v.transpose(-1, -2))
        scale = scale.reshape(scale.shape[:-2] + matrix_shape)
        super().__init__(loc, scale, validate_args=validate_args)

    @property
    def rank(self) -> int:
        """The number :math:`k` of tied components."""
        return self.scale_u.shape[-1]

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(KTiedNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        prefix = batch_shape[: len(batch_shape) - self.tied_dims]
        new.scale_u = self.scale_u.expand(prefix + self.scale_u.shape[-2:])
        new.scale_v = self.scale_v.expand(prefix + self.scale_v.shape[-2:])
        new.tied_dims = self.tied_dims
        return super().expand(batch_shape, _instance=new)
