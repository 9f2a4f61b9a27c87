r"""
Writing a per-weight mean and variance into the parameters of an autoguide.

Given, for a real-support site, a mean :math:`\mu` and per-element variances
:math:`s^2` (the KL(q‖p) projection of a Gaussian posterior onto a fully
factorized Normal, supplement D of [1]), each guide family gets its closest
member:

* :class:`~pyro.infer.autoguide.AutoNormal` and
  :class:`~pyro.infer.autoguide.AutoDiagonalNormal`: ``loc = μ``,
  ``scale = s`` (exact).
* :class:`~pyro_vinit.guides.AutoKTiedNormal`: ``loc = μ`` and, for a site read
  as an :math:`m\times n` matrix, the positive rank-:math:`k` factors
  :math:`U, V` minimizing :math:`\lVert S - UV^\top\rVert_F` for the std matrix
  :math:`S` (the leading singular pair by power iteration, which is positive
  for a positive :math:`S`, split into :math:`k` distinct components and
  refined by multiplicative nonnegative-factorization updates). Sites with
  fewer than two event dims keep a per-element scale ``s``.
* :class:`~pyro_vinit.guides.AutoRadialNormal`: ``loc = μ`` and the stored
  marginal scale ``scales.<name> = s``, i.e. the radial scale
  :math:`\sqrt{D}\,s` for a site of :math:`D` elements, whose marginal
  variance is :math:`\text{scale}^2/D = s^2`: every element's marginal
  variance is matched exactly.

All values are validated and staged first; :meth:`GuideWriter.write` then
copies them in place into the guide's existing unconstrained parameters
(``param.copy_(transform.inv(value))``), so parameter identity and any
optimizer state survive.

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from torch.distributions import biject_to, transform_to

from pyro_vinit.distributions import RadialNormal
from pyro_vinit.guides import AutoKTiedNormal, AutoRadialNormal
from pyro_vinit.guides._base import AutoSiteGuide, is_real_support

__all__ = ["GuideWriter", "SiteValues", "fit_positive_low_rank"]

SUPPORTED_GUIDES = (AutoNormal, AutoDiagonalNormal, AutoKTiedNormal, AutoRadialNormal)


def fit_positive_low_rank(
    matrix: torch.Tensor, rank: int, num_iters: int = 50
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""
    Positive factors :math:`U \in \mathbb R_+^{m\times k}`, :math:`V \in
    \mathbb R_+^{n\times k}` with :math:`UV^\top \approx S` in Frobenius norm,
    for a positive matrix :math:`S` (batched over leading dims).

    Starts from the leading singular pair (power iteration from a positive
    vector stays positive, and equals the best rank-1 fit), splits it into
    ``rank`` distinct components with the same product, then runs up to
    ``num_iters`` multiplicative updates of Lee and Seung, which keep the
    factors positive and do not increase the error (stopping early when the
    error no longer decreases).

    :param torch.Tensor matrix: Positive, shape ``(..., m, n)``.
    :param int rank: The number :math:`k` of components.
    :rtype: tuple
    """
    m, n = matrix.shape[-2:]
    v = torch.ones(matrix.shape[:-2] + (n, 1), dtype=matrix.dtype, device=matrix.device)
    for _ in range(30):
        u = matrix @ v
        u = u / u.norm(dim=-2, keepdim=True)
        v = matrix.transpose(-1, -2) @ u
        sigma = v.norm(dim=-2, keepdim=True)
        v = v / sigma
    u, v = u * sigma.sqrt(), v * sigma.sqrt()
    # Distinct positive weights per row of U summing to 1: U V^T is still the rank-1 fit.
    weights = torch.rand(u.shape[:-1] + (rank,), dtype=u.dtype, device=u.device) + 0.5
    u = u * weights / weights.sum(-1, keepdim=True)
    v = v.expand(v.shape[:-1] + (rank,)).clone()
    # A floor keeps the factors positive and away from denormal numbers, whose
    # arithmetic is very slow, when an update drives a component towards zero.
    floor = (1e-6 * matrix.amax((-2, -1), keepdim=True)).sqrt()
    if rank == 1:
        return u.clamp_min(floor), v.clamp_min(floor)
    def residual():
        return (matrix - u @ v.transpose(-1, -2)).norm()

    # Stop early once the updates no longer help (at once for an exact rank-1 fit).
    tol, error = 1e-6 * matrix.norm(), residual()
    for i in range(num_iters):
        if error <= tol:
            break
        u = (u * (matrix @ v) / (u @ (v.transpose(-1, -2) @ v))).clamp_min(floor)
        v = (v * (matrix.transpose(-1, -2) @ u) / (v @ (u.transpose(-1, -2) @ u))).clamp_min(floor)
        if (i + 1) % 10 == 0:
            previous, error = error, residual()
            if error > (1 - 1e-4) * previous:
                break
    return u.clamp_min(floor), v.clamp_min(floor)


@dataclass
class SiteValues:
    """The constrained parameter values of one site in a guide family: ``loc`` and
    either a per-element ``scale`` (for a radial site the marginal standard
    deviation, which the guide stores; its radial scale is ``sqrt(D)`` times
    that) or k-tied factors ``u``, ``v``."""

    loc: torch.Tensor
    scale: Optional[torch.Tensor] = None
    u: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    radial_event_dim: Optional[int] = None

    def sample(self) -> torch.Tensor:
        """A draw from the guide's distribution at this site after the write."""
        if self.radial_event_dim is not None:
            event_shape = self.loc.shape[self.loc.dim() - self.radial_event_dim :]
            radial_scale = self.scale * math.sqrt(math.prod(event_shape))
            return RadialNormal(self.loc, radial_scale, self.radial_event_dim).sample()
        scale = self.scale
        if scale is None:
            scale = (self.u @ self.v.transpose(-1, -2)).reshape(self.loc.shape)
        return dist.Normal(self.loc, scale).sample()


class GuideWriter:
    """
    Projects per-site means and variances onto a guide's family and writes them
    into its parameters (see the module docstring).

    :param guide: A set-up :class:`~pyro.infer.autoguide.AutoNormal`,
        :class:`~pyro.infer.autoguide.AutoDiagonalNormal`,
        :class:`~pyro_vinit.guides.AutoKTiedNormal` or
        :class:`~pyro_vinit.guides.AutoRadialNormal`.
    :raises TypeError: for any other guide.
    """

    def __init__(self, guide):
        self.guide = guide
        self.family = self.family_of(guide)
        self._params = dict(guide.named_parameters())
        self._sites = {
            name: site for name, site in guide.prototype_trace.iter_stochastic_nodes()
        }
        if self.family == "diagonal":
            self._offsets: Dict[str, Tuple[int, int]] = {}
            pos = 0
            for name, site in self._sites.items():
                size = biject_to(site["fn"].support).inv(site["value"]).numel()
                self._offsets[name] = (pos, pos + size)
                pos += size

    @property
    def latent_names(self) -> List[str]:
        """The guide's latent sites, in the model's order."""
        return list(self._sites)

    @staticmethod
    def family_of(guide) -> str:
        """The guide family name, or TypeError for an unsupported guide."""
        if isinstance(guide, AutoKTiedNormal):
            return "ktied"
        if isinstance(guide, AutoRadialNormal):
            return "radial"
        if isinstance(guide, AutoNormal) and not isinstance(guide, AutoSiteGuide):
            return "normal"
        if isinstance(guide, AutoDiagonalNormal):
            return "diagonal"
        raise TypeError(
            f"guide initialization supports {', '.join(g.__name__ for g in SUPPORTED_GUIDES)}; "
            f"got {type(guide).__name__}. Build the guide with one of these"
        )

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
        """The family's parameter values for a site with mean ``loc`` and per-element
        variance ``var``; raises ValueError if they are not finite and positive."""
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
        scale = var.sqrt()
        if self.family == "radial":
            event_dim = self._site(name)["fn"].event_dim
            if event_dim == 0:  # a scalar site is Normal in AutoRadialNormal
                return SiteValues(loc, scale)
            return SiteValues(loc, scale, radial_event_dim=event_dim)
        if self.family == "ktied" and len(shape) >= 2:
            matrix = scale.reshape(shape[0], -1)
            u, v = fit_positive_low_rank(matrix, self.guide.rank)
            return SiteValues(loc, u=u, v=v)
        return SiteValues(loc, scale)

    def _targets(self, name: str, values: SiteValues) -> List[Tuple[str, object, torch.Tensor]]:
        """(parameter name or flat slice key, constraint, value) triples."""
        scale_c = self.guide.scale_constraint
        if self.family == "diagonal":
            return [("loc", constraints.real, values.loc), ("scale", scale_c, values.scale)]
        out = [(f"locs.{name}", constraints.real, values.loc)]
        if values.u is not None:
            out += [(f"scale_u.{name}", scale_c, values.u), (f"scale_v.{name}", scale_c, values.v)]
        else:
            out.append((f"scales.{name}", scale_c, values.scale))
        return out

    def _param(self, key: str) -> torch.Tensor:
        for candidate in (key + "_unconstrained", key):
            if candidate in self._params:
                return self._params[candidate]
        raise KeyError(f"the guide has no parameter {key!r}")

    def write(self, staged: Dict[str, SiteValues]) -> None:
        """Copies the staged values into the guide's parameters in place. All
        unconstrained values are computed and checked before the first write."""
        writes = []
        for name, values in staged.items():
            for key, constraint, value in self._targets(name, values):
                param = self._param(key)
                raw = transform_to(constraint).inv(value).to(param)
                if not bool(torch.isfinite(raw).all()):
                    raise ValueError(f"site {name!r}: non-finite value for {key!r}")
                if self.family == "diagonal":
                    start, stop = self._offsets[name]
                    writes.append((param, slice(start, stop), raw.reshape(-1)))
                else:
                    if raw.shape != param.shape:
                        raise ValueError(
                            f"site {name!r}: {key!r} has shape {tuple(param.shape)}, "
                            f"computed {tuple(raw.shape)}"
                        )
                    writes.append((param, slice(None), raw))
        with torch.no_grad():
            for param, index, raw in writes:
                param[index].copy_(raw)
