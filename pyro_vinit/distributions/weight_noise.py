r"""
What the weight-noise strategies of :mod:`pyro_vinit.poutine` need to know
about a distribution, registered beside it as
:func:`torch.distributions.kl.register_kl` registers KL divergences: each
query answers for the nearest registered class in the distribution's MRO
(cached per type: a query runs at every layer call), and a new distribution
opts in with the matching ``register_*`` decorator.

Usage::

    class SymmetricLaplace(dist.Laplace):
        pass

    @register_sign_symmetric(SymmetricLaplace)
    def _(d):
        return True
"""

from typing import Any, Callable, Dict, Generic, Optional, Tuple, Type, TypeVar

import torch
from pyro.distributions import MaskedDistribution
from torch.distributions import Independent, Normal

__all__ = [
    "factorized_normal",
    "is_sign_symmetric",
    "low_rank_scale",
    "register_factorized_normal",
    "register_low_rank_scale",
    "register_sign_symmetric",
]

_R = TypeVar("_R")
_Impl = Callable[[Any], Any]


class _Registry(Generic[_R]):
    # Implementations by class: the one for the nearest class of a type's MRO, else default.

    def __init__(self, default: _R) -> None:
        self._default = default
        self._impls: Dict[type, _Impl] = {}
        self._cache: Dict[type, _Impl] = {}

    def __call__(self, d: object) -> _R:
        impl = self._cache.get(type(d))
        if impl is None:
            impl = next((self._impls[c] for c in type(d).__mro__ if c in self._impls),
                        lambda d: self._default)
            self._cache[type(d)] = impl
        out: _R = impl(d)
        return out

    def register(self, cls: Type[Any]) -> Callable[[_Impl], _Impl]:
        def decorator(fn: _Impl) -> _Impl:
            self._impls[cls] = fn
            self._cache.clear()
            return fn

        return decorator


_FACTORIZED_NORMAL: _Registry[Optional[Normal]] = _Registry(None)
_SIGN_SYMMETRIC: _Registry[bool] = _Registry(False)
_LOW_RANK_SCALE: _Registry[Optional[Tuple[torch.Tensor, torch.Tensor]]] = _Registry(None)


def factorized_normal(d: object) -> Optional[Normal]:
    r"""
    The :class:`~torch.distributions.Normal` whose independent elements
    ``d``'s value has (:math:`W_{ij} \sim \mathcal N(\mu_{ij}, \sigma_{ij}^2)`,
    the local reparameterization trick's requirement), or None.
    ``Independent`` and mask wrappers are looked through.

    :param d: A distribution.
    """
    return _FACTORIZED_NORMAL(d)


def is_sign_symmetric(d: object) -> bool:
    r"""
    Whether the perturbation :math:`\Delta W = W - \mathbb E[W]` of a value
    of ``d`` keeps its law when any of its elements change sign (Flipout's
    requirement): true of factorized Normals and, registered beside it, of
    :class:`~pyro_vinit.distributions.RadialNormal`.

    :param d: A distribution.
    """
    return _SIGN_SYMMETRIC(d)


def low_rank_scale(d: object) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    r"""
    Factors :math:`U` of shape :math:`(m, k)` and :math:`V` of shape
    :math:`(n, k)` with :math:`\sigma = UV^\top` (reshaped to the batch
    shape) for a :func:`factorized_normal` ``d`` that is one matrix of such
    low-rank scales (registered beside
    :class:`~pyro_vinit.distributions.KTiedNormal`), or None.

    :param d: The Normal that :func:`factorized_normal` returned.
    """
    return _LOW_RANK_SCALE(d)


def register_factorized_normal(cls: Type[Any]) -> Callable[[_Impl], _Impl]:
    """Decorator registering the :func:`factorized_normal` of ``cls`` (and
    its subclasses): a function of the distribution.

    :param type cls: A distribution class."""
    return _FACTORIZED_NORMAL.register(cls)


def register_sign_symmetric(cls: Type[Any]) -> Callable[[_Impl], _Impl]:
    """Decorator registering :func:`is_sign_symmetric` for ``cls`` (and its
    subclasses): a function of the distribution.

    :param type cls: A distribution class."""
    return _SIGN_SYMMETRIC.register(cls)


def register_low_rank_scale(cls: Type[Any]) -> Callable[[_Impl], _Impl]:
    """Decorator registering the :func:`low_rank_scale` of ``cls`` (and its
    subclasses): a function of the distribution.

    :param type cls: A distribution class."""
    return _LOW_RANK_SCALE.register(cls)


@register_factorized_normal(Normal)
def _(d: Normal) -> Optional[Normal]:
    return d


@register_sign_symmetric(Normal)
def _(d: Normal) -> bool:
    return True


# Wrappers that change neither the values nor their element-wise distribution.
@register_factorized_normal(Independent)
@register_factorized_normal(MaskedDistribution)
def _(d: Any) -> Optional[Normal]:
    return _FACTORIZED_NORMAL(d.base_dist)


@register_sign_symmetric(Independent)
@register_sign_symmetric(MaskedDistribution)
def _(d: Any) -> bool:
    return _SIGN_SYMMETRIC(d.base_dist)
