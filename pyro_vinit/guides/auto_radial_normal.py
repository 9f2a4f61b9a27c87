"""Autoguide with one radial posterior per latent site."""

import math
from operator import attrgetter
from typing import Any, Dict, List, Tuple, Union

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from torch.distributions import biject_to

from pyro_vinit._typing import stochastic_sites
from pyro_vinit.distributions import RadialNormal
from pyro_vinit.guides._base import AutoSiteGuide

__all__ = ["AutoRadialNormal"]


class AutoRadialNormal(AutoSiteGuide):
    r"""
    Autoguide with a radial posterior [1] over each latent site's
    unconstrained value (for a Bayesian neural network: one per layer tensor).

    Usage::

        guide = AutoRadialNormal(model)
        svi = SVI(model, guide, Adam({"lr": 1e-3}), TraceMeanField_ELBO())

    Each site of :math:`D` unconstrained elements gets a
    :class:`~pyro_vinit.distributions.RadialNormal`,

    .. math::

        w = \mu + \sigma \odot \frac{\epsilon}{\lVert\epsilon\rVert} r,\qquad
        \sigma = \sqrt{D}\, s,\qquad s = \mathrm{softplus}(\rho).

    Since the direction has :math:`\mathbb{E}[u_i^2] = 1/D`, each element's
    marginal standard deviation is :math:`\sigma_i/\sqrt{D} = s_i`. The stored
    positive parameter ``scales.<name>`` is therefore this marginal standard
    deviation :math:`s`, with AutoNormal's softplus constraint
    (:attr:`scale_constraint`), and it starts at ``init_scale`` exactly as
    AutoNormal's scales do. Keeping the :math:`\sqrt{D}` outside the softplus
    gives the optimizer AutoNormal's parameterization whatever the site's
    size: a step in :math:`\rho` changes :math:`s` by a roughly constant
    factor while :math:`s \ll 1`. (With :math:`\sigma = \mathrm{softplus}(\rho)`
    a wide layer's :math:`\sigma` would sit in the near-linear part of the
    softplus, where an Adam step moves :math:`s` by only about
    ``lr`` :math:`/\sqrt{D}`; see the methods page on the guides.) The event
    spans the site's event dims; plate dims sample independently. Sites with
    no event dims (:math:`D = 1`) have a Normal law (a random sign times a
    Normal radius), which :func:`~pyro_vinit.distributions.factorized_normal`
    reports; zero-size sites (e.g. a layer of width 0), which have nothing to
    sample, are Normal.

    Like every guide of :mod:`pyro_vinit.guides`, :meth:`get_loc_and_scale`
    and :meth:`set_loc_and_scale` speak the location :math:`\mu` and the
    marginal standard deviation :math:`s` (exact both ways);
    :meth:`get_radial_scale` returns the ``RadialNormal``'s own scale
    :math:`\sigma = \sqrt{D}\, s`, so that
    ``RadialNormal(loc, get_radial_scale(name), event_dim)`` is the posterior.

    :meth:`median` is exact (``loc``, mapped to the constrained space);
    :meth:`quantiles` are the exact marginal quantiles computed by numerical
    quadrature (:func:`~pyro_vinit.distributions.radial_normal.radial_standard_icdf`).
    With :class:`~pyro.infer.TraceMeanField_ELBO` the KL to a Normal prior is
    computed in closed form.

    .. note:: By design this guide differs from
        :class:`~pyro.infer.autoguide.AutoNormal` at real-support sites: the
        posterior is sampled at the site itself, so ``guide_trace.nodes[name]``
        carries the RadialNormal and a nonzero ``log_prob``, and there is no auxiliary
        ``<name>_unconstrained`` site (AutoNormal samples a Normal there and
        puts a ``Delta``, of log-density 0, at the site). Code that expects
        AutoNormal's trace layout (e.g. Pyro's ``test_scores``) sees the
        difference; ELBOs, ``Predictive`` and ``poutine.replay`` do not.

    :param callable model: A Pyro model.
    :param callable init_loc_fn: A per-site initialization function.
    :param float init_scale: Initial marginal standard deviation of every
        unconstrained latent element.
    :param callable create_plates: An optional function taking the model's
        ``*args, **kwargs`` and returning a :class:`pyro.plate` or iterable of
        plates, as for AutoNormal (useful for data subsampling).

    [1] Farquhar, Osborne, Gal (2020) "Radial Bayesian Neural Networks: Beyond
    Discrete Support in Large-Scale Bayesian Deep Learning"
    """

    def _setup_scales(self) -> None:
        # sqrt(D) per site, applied to the softplus output (see the class docstring).
        self._radial_factors: Dict[str, float] = {}
        for name, event_dim in self._event_dims.items():
            loc = attrgetter(name)(self.locs)
            self._radial_factors[name] = math.sqrt(math.prod(loc.shape[loc.dim() - event_dim :]))
        self._setup_normal_scales(self._event_dims)

    def _get_loc_and_scale(self, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
        return attrgetter(name)(self.locs), attrgetter(name)(self.scales)

    def _set_loc_and_scale(self, name: str, loc: torch.Tensor, scale: torch.Tensor) -> None:
        self._write_params(
            [
                (f"locs.{name}", constraints.real, loc),
                (f"scales.{name}", self.scale_constraint, scale),
            ]
        )

    def get_radial_scale(self, name: str) -> torch.Tensor:
        r"""
        Returns the scale :math:`\sigma = \sqrt{D}\, s` of the posterior
        ``RadialNormal(loc, scale, event_dim)`` at site ``name`` (``loc`` from
        :meth:`get_loc_and_scale`), at full (not subsampled) size.

        :param str name: A latent sample site of the model.
        :rtype: torch.Tensor
        """
        _, marginal_scale = self.get_loc_and_scale(name)
        return marginal_scale * self._radial_factors[name]

    def _unconstrained_posterior(self, name: str) -> dist.TorchDistribution:
        loc, marginal_scale = self._get_loc_and_scale(name)
        event_dim = self._event_dims[name]
        if loc.numel() == 0:  # a zero-size site: nothing to sample, as in AutoNormal
            empty: dist.TorchDistribution = dist.Normal(loc, marginal_scale).to_event(event_dim)
            return empty
        return RadialNormal(loc, marginal_scale * self._radial_factors[name], event_dim)

    @torch.no_grad()
    def quantiles(
        self, quantiles: Union[List[float], torch.Tensor], *args: Any, **kwargs: Any
    ) -> Dict[str, torch.Tensor]:
        """
        Returns the exact marginal posterior quantiles of each latent variable.
        Example::

            print(guide.quantiles([0.05, 0.5, 0.95]))

        :param quantiles: A list of requested quantiles between 0 and 1.
        :type quantiles: torch.Tensor or list
        :return: A dict mapping sample site name to a tensor of quantile values,
            with the quantiles along a new leftmost dim.
        :rtype: dict
        """
        self._setup_if_needed(*args, **kwargs)
        results = {}
        for name, site in stochastic_sites(self._prototype()):
            loc, marginal_scale = self._get_loc_and_scale(name)
            q = torch.as_tensor(quantiles, dtype=loc.dtype, device=loc.device)
            q = q.reshape((-1,) + (1,) * loc.dim())
            if loc.numel() == 0:
                values = loc.expand(q.shape[:1] + loc.shape)
            else:
                scale = marginal_scale * self._radial_factors[name]
                values = RadialNormal(loc, scale, self._event_dims[name]).marginal_icdf(q)
            results[name] = biject_to(site["fn"].support)(values)
        return results
