"""Autoguide with one radial posterior per latent site."""

import math
from operator import attrgetter
from typing import Dict, List, Union

import pyro.distributions as dist
import torch
from pyro.nn import PyroParam
from torch.distributions import biject_to

from pyro_vinit._pyro_compat import deep_setattr
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
        \sigma = \mathrm{softplus}(\rho),

    with the same softplus parameterization as AutoNormal's scales
    (:attr:`scale_constraint`). Since each element's marginal variance is
    :math:`\sigma^2 / D`, the radial scale is initialized to
    :math:`\sigma = \text{init\_scale}\cdot\sqrt{D}`, so that the initial
    per-element marginal standard deviation is ``init_scale``, as in
    AutoNormal. The event spans the site's event dims; plate dims sample
    independently. Sites with no event dims (:math:`D = 1`) are Normal.

    :meth:`median` is exact (``loc``, mapped to the constrained space);
    :meth:`quantiles` are the exact marginal quantiles computed by numerical
    quadrature (:func:`~pyro_vinit.distributions.radial_normal.radial_standard_icdf`).
    With :class:`~pyro.infer.TraceMeanField_ELBO` the KL to a Normal prior is
    computed in closed form.

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
        for name, event_dim in self._event_dims.items():
            loc = attrgetter(name)(self.locs)
            numel = math.prod(loc.shape[loc.dim() - event_dim :])
            scale = torch.full_like(loc, self._init_scale * math.sqrt(numel))
            deep_setattr(self.scales, name, PyroParam(scale, self.scale_constraint, event_dim))

    def _unconstrained_posterior(self, name: str) -> dist.TorchDistribution:
        loc, scale = self._get_loc_and_scale(name)
        return RadialNormal(loc, scale, self._event_dims[name])

    @torch.no_grad()
    def quantiles(
        self, quantiles: Union[List[float], torch.Tensor], *args, **kwargs
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
        results = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            loc, scale = self._get_loc_and_scale(name)
            q = torch.as_tensor(quantiles, dtype=loc.dtype, device=loc.device)
            q = q.reshape((-1,) + (1,) * loc.dim())
            values = RadialNormal(loc, scale, self._event_dims[name]).marginal_icdf(q)
            results[name] = biject_to(site["fn"].support)(values)
        return results
