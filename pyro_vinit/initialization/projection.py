r"""
Writing a per-weight mean and variance into an autoguide, through
:mod:`pyro_vinit.guides.site_params`.

Given, for a real-support site, a mean :math:`\mu` and per-element variances
:math:`s^2` (the KL(q‖p) projection of a Gaussian posterior onto a fully
factorized Normal, supplement D of [1]), each guide family gets its closest
member by ``site_params.set_loc_and_scale(guide, name, μ, s)``: exact for
AutoNormal, AutoDiagonalNormal, AutoLowRankMultivariateNormal (marginals) and
AutoRadialNormal (every element's marginal variance is :math:`s^2`), the
positive rank-:math:`k` fit of the std matrix for AutoKTiedNormal.

:class:`GuideWriter` stages values and writes them all or nothing; new code
can call :mod:`~pyro_vinit.guides.site_params` directly inside
:func:`~pyro_vinit.guides.site_params.rollback_on_error`.

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"
"""

from dataclasses import dataclass
from typing import Dict, List

import pyro.distributions as dist
import torch

from pyro_vinit.guides import site_params
from pyro_vinit.guides._base import is_real_support

__all__ = ["GuideWriter", "SiteValues"]


@dataclass
class SiteValues:
    """A staged mean ``loc`` and marginal standard deviation ``scale`` of one site."""

    loc: torch.Tensor
    scale: torch.Tensor

    def sample(self) -> torch.Tensor:
        """A Normal draw with the staged mean and marginal standard deviation (the
        written guide's own draw has these moments; its family may differ)."""
        return dist.Normal(self.loc, self.scale).sample()


class GuideWriter:
    """
    Stages per-site means and variances of a guide's real-support sites and
    writes them all or nothing, through :mod:`~pyro_vinit.guides.site_params`.

    :param guide: A set-up guide that :mod:`~pyro_vinit.guides.site_params`
        supports.
    :raises TypeError: for any other guide.
    """

    def __init__(self, guide):
        self.family_of(guide)
        self.guide = guide
        self._sites = site_params.latent_sites(guide)

    @property
    def latent_names(self) -> List[str]:
        """The guide's latent sites, in the model's order."""
        return list(self._sites)

    @staticmethod
    def family_of(guide) -> str:
        """The guide's class name, or TypeError for an unsupported guide."""
        site_params.check_supported(guide)
        return type(guide).__name__

    def shape(self, name: str) -> torch.Size:
        return self._site(name)["value"].shape

    def _site(self, name: str) -> dict:
        site = self._sites.get(name)
        if site is None:
            raise KeyError(f"{name!r} is not a latent site of the guide")
        if not is_real_support(site["fn"].support):
            raise ValueError(
                f"site {name!r} does not have real support; only real-support sites "
                "(Normal-prior weights and biases) can be initialized"
            )
        return site

    def project(self, name: str, loc: torch.Tensor, var: torch.Tensor) -> SiteValues:
        """The staged values of a site with mean ``loc`` and per-element variance
        ``var``; raises ValueError if they are not finite and positive."""
        shape = self.shape(name)
        if loc.shape != shape or var.shape != shape:
            raise ValueError(
                f"site {name!r}: expected mean and variance of shape {tuple(shape)}, got "
                f"{tuple(loc.shape)} and {tuple(var.shape)}"
            )
        if not bool(torch.isfinite(loc).all()) or not bool(
            (torch.isfinite(var) & (var > 0)).all()
        ):
            raise ValueError(
                f"site {name!r}: the computed mean or variance is not finite and positive "
                "(the data or the prior may be degenerate); the guide was left unchanged"
            )
        return SiteValues(loc, var.sqrt())

    def write(self, staged: Dict[str, SiteValues]) -> None:
        """Writes the staged values in place; if any write fails, the guide is
        restored and the error re-raised."""
        with site_params.rollback_on_error(self.guide):
            for name, values in staged.items():
                site_params.set_loc_and_scale(self.guide, name, values.loc, values.scale)
