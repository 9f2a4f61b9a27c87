r"""
What the weight-noise strategies of :mod:`pyro_vinit.poutine` need to know
about a distribution, registered beside it (as :func:`torch.distributions.kl.register_kl`
registers KL divergences): each query is a
:func:`functools.singledispatch` function that dispatches on the
distribution's type, and a new distribution opts in with ``.register``.

Usage::

    class SymmetricLaplace(dist.Laplace):
        pass

    @is_sign_symmetric.register(SymmetricLaplace)
    def _(d):
        return True
"""

import functools
from typing import Any, Optional, Tuple

import torch
from pyro.distributions import MaskedDistribution
from torch.distributions import Independent, Normal

__all__ = ["factorized_normal", "is_sign_symmetric", "low_rank_scale"]


@functools.singledispatch
def factorized_normal(d: object) -> Optional[Normal]:
    r"""
    The :class:`~torch.distributions.Normal` whose independent elements
    ``d``'s value has (:math:`W_{ij} \sim \mathcal N(\mu_{ij}, \sigma_{ij}^2)`,
    the local reparameterization trick's requirement), or None.
    ``Independent`` and mask wrappers are looked through.

    :param d: A distribution.
    """
    return None


@factorized_normal.register(Normal)
def _(d: Normal) -> Optional[Normal]:
    return d


@functools.singledispatch
def is_sign_symmetric(d: object) -> bool:
    r"""
    Whether the perturbation :math:`\Delta W = W - \mathbb E[W]` of a value
    of ``d`` keeps its law when any of its elements change sign (Flipout's
    requirement): true of factorized Normals and, registered beside it, of
    :class:`~pyro_vinit.distributions.RadialNormal`.

    :param d: A distribution.
    """
    return False


@is_sign_symmetric.register(Normal)
def _(d: Normal) -> bool:
    return True


@functools.singledispatch
def low_rank_scale(d: object) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    r"""
    Factors :math:`U` of shape :math:`(m, k)` and :math:`V` of shape
    :math:`(n, k)` with :math:`\sigma = UV^\top` (reshaped to the batch
    shape) for a :func:`factorized_normal` ``d`` that is one matrix of such
    low-rank scales (registered beside
    :class:`~pyro_vinit.distributions.KTiedNormal`), or None.

    :param d: The Normal that :func:`factorized_normal` returned.
    """
    return None


@factorized_normal.register(Independent)
@factorized_normal.register(MaskedDistribution)
def _(d: Any) -> Optional[Normal]:
    # wrappers that change neither the values nor their element-wise distribution
    return factorized_normal(d.base_dist)


@is_sign_symmetric.register(Independent)
@is_sign_symmetric.register(MaskedDistribution)
def _(d: Any) -> bool:
    return is_sign_symmetric(d.base_dist)
