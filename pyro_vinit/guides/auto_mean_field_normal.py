"""Autoguide with a fully factorized Normal posterior at each latent site."""

from operator import attrgetter

import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from pyro_vinit.guides._base import AutoSiteGuide

__all__ = ["AutoMeanFieldNormal"]


class AutoMeanFieldNormal(AutoSiteGuide):
    r"""
    Autoguide with a fully factorized Normal posterior over each latent
    site's unconstrained value: :class:`~pyro.infer.autoguide.AutoNormal`'s
    family and parameters, with the Normal placed at the site itself.

    Usage::

        guide = AutoMeanFieldNormal(model)
        svi = SVI(model, guide, Adam({"lr": 1e-3}), TraceMeanField_ELBO())
        with local_reparam():
            svi.step(x, y)

    Each site of unconstrained value :math:`w` gets

    .. math::

        q(w) = \prod_i \mathcal{N}(w_i;\ \mu_i, s_i^2), \qquad
        s_i = \mathrm{softplus}(\rho_i),

    with ``locs.<name>`` :math:`\mu` and ``scales.<name>`` :math:`s`, both
    stored and initialized exactly as AutoNormal's (``init_loc_fn``,
    ``init_scale``, the softplus :attr:`scale_constraint`), so that
    :meth:`get_loc_and_scale` and :meth:`set_loc_and_scale` are exact both
    ways.

    Why not AutoNormal: AutoNormal samples the Normal at an auxiliary
    ``<name>_unconstrained`` site and puts a ``Delta`` at the model's site,
    so :class:`~pyro.infer.TraceMeanField_ELBO` estimates its KL by Monte
    Carlo, which needs a sample of every weight. Here the KL to a Normal
    prior is computed in closed form, and under
    :func:`~pyro_vinit.poutine.local_reparam` a weight that only enters layer
    calls is never sampled: the mean-field family at the cost of its
    arithmetic. As for :class:`~pyro_vinit.guides.AutoKTiedNormal`, the
    trace differs from AutoNormal's at real-support sites (the posterior and
    a nonzero ``log_prob`` at the site, no auxiliary site); ELBOs,
    ``Predictive`` and ``poutine.replay`` do not see it. Constrained sites
    go through the unconstrained space as in AutoNormal.

    :param callable model: A Pyro model.
    :param callable init_loc_fn: A per-site initialization function.
    :param float init_scale: Initial standard deviation of every unconstrained
        latent element.
    :param callable create_plates: An optional function taking the model's
        ``*args, **kwargs`` and returning a :class:`pyro.plate` or iterable of
        plates, as for AutoNormal (useful for data subsampling).

    [1] Kingma, Salimans, Welling (2015) "Variational Dropout and the Local
    Reparameterization Trick"
    """

    def _setup_scales(self) -> None:
        self._setup_normal_scales(self._event_dims)

    def _unconstrained_posterior(self, name: str) -> dist.TorchDistribution:
        loc = attrgetter(name)(self.locs)
        scale = attrgetter(name)(self.scales)
        posterior: dist.TorchDistribution = dist.Normal(loc, scale).to_event(
            self._event_dims[name]
        )
        return posterior

    def _set_loc_and_scale(self, name: str, loc: torch.Tensor, scale: torch.Tensor) -> None:
        self._write_params([
            (f"locs.{name}", constraints.real, loc),
            (f"scales.{name}", self.scale_constraint, scale),
        ])
