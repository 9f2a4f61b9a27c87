"""I-BLM's fitted layers and noise, and step 4: writing them into the guide."""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from pyro.infer.autoguide import AutoDelta, AutoGuide

from pyro_vinit._pyro_compat import unconstrained_param
from pyro_vinit.guides.site_params import (
    get_loc_and_scale,
    is_supported,
    latent_sites,
    set_loc_and_scale,
)
from pyro_vinit.initialization._regressions import unit_priors
from pyro_vinit.initialization._rollback import write_param
from pyro_vinit.initialization._tracing import Layer, Prepared


@dataclass
class Fit:
    """A layer's fitted per-weight means and variances, in the op's layout
    (``(units, fan_in [+ 1 for a latent bias])``)."""

    layer: Layer
    mean: torch.Tensor
    var: torch.Tensor

    def site_values(
        self, site_shape: Callable[[str], torch.Size]
    ) -> Dict[str, Tuple[torch.Tensor, ...]]:
        """``{site: (mean, var)}`` in each site's layout."""
        layer, d = self.layer, self.layer.fan_in
        out = {
            layer.weight_name: tuple(
                layer.to_site(layer.weight_name, t[:, :d], site_shape(layer.weight_name))
                for t in (self.mean, self.var)
            )
        }
        if layer.bias_name is not None:
            out[layer.bias_name] = tuple(
                layer.to_site(layer.bias_name, t[:, d], site_shape(layer.bias_name))
                for t in (self.mean, self.var)
            )
        return out


@dataclass
class NoiseFit:
    """The unconstrained value that gives the estimated observation noise std
    to the noise site or param ``name``."""

    name: str
    level: torch.Tensor
    #: the std to give the unconstrained value, for a guide that has one: the
    #: posterior std of log sigma from n residuals, about 1 / sqrt(2 n), at most 0.1
    spread: torch.Tensor


def stage(site_shape: Callable[[str], torch.Size], values: Dict[str, torch.Tensor],
          fits: Dict[str, Fit], fit: Fit, propagate: str) -> None:
    """Records a fit and sets the layer's sites in ``values`` (its mean, or a
    draw with ``propagate="sample"``) for the model runs that follow."""
    fits[fit.layer.weight_name] = fit
    for name, (mean, var) in fit.site_values(site_shape).items():
        values[name] = torch.normal(mean, var.sqrt()) if propagate == "sample" else mean


def write_fits(prep: Prepared, fits: Dict[str, Fit], noise: Optional[NoiseFit],
               max_scale_ratio: Optional[float]) -> None:
    """Writes every fit (its stds capped at ``max_scale_ratio`` times the
    prior's) and the noise level into the guide, through
    :func:`~pyro_vinit.guides.site_params.set_loc_and_scale`, emptying ``fits``."""
    guide = prep.guide
    ratios = []  # (each fitted site's median std over its prior's)
    # One site at a time through the guide's own projection, so that only one site's
    # values are held twice in memory: a failure half-way is undone by GuideRollback.
    for key in list(fits):
        fit = fits.pop(key)
        units = torch.arange(fit.layer.num_units, device=fit.var.device)
        _, prior_scale = unit_priors(fit.layer, units)
        if max_scale_ratio is not None:
            cap = (max_scale_ratio * prior_scale).to(fit.var).square_()
            fit.var = torch.minimum(fit.var, cap)
        ratios.append(_median(fit.var.sqrt() / prior_scale.to(fit.var)))
        for name, (mean, var) in fit.site_values(prep.site_shape).items():
            set_loc_and_scale(guide, name, mean, var.sqrt_())
    if ratios:
        cap_uncovered(prep, _median(torch.stack(ratios)))
    if noise is not None:
        level = noise.level
        if prep.likelihood.noise == "site":
            set_loc_and_scale(guide, noise.name, level, noise.spread)
        elif prep.likelihood.noise == "param":
            write_param(noise.name, level)
        # (a "held" noise site: written by the guide list, write_held_noise)


def _median(values: torch.Tensor) -> torch.Tensor:
    # The median, the mean of the two middle values of an even count (torch.median takes
    # the lower one).
    flat = values.flatten()
    n = flat.numel()
    return (flat.kthvalue((n + 1) // 2).values + flat.kthvalue(n // 2 + 1).values) / 2


def cap_uncovered(prep: Prepared, ratio: torch.Tensor) -> None:
    """Caps the std of each latent site the regressions did not fit but took at
    its median (e.g. a projection used inside ``nn.MultiheadAttention``) that
    has a Normal prior and lies outside the likelihood's plates
    (``structure.uncovered_priors``), at ``ratio`` (the fitted layers' median
    std over their prior's) times its prior's at the guide's medians, its
    location kept: the network drawn at the start is then the one whose layers
    were fitted, as uncertain as they are."""
    for name, prior_scale in prep.structure.uncovered_priors.items():
        loc, scale = get_loc_and_scale(prep.guide, name)
        try:
            cap = (ratio * prior_scale).to(scale).expand(scale.shape)
        except RuntimeError:  # a prior of another shape than the guide's site: no weight
            continue
        if bool((scale > cap).any()):
            set_loc_and_scale(prep.guide, name, loc, torch.minimum(scale, cap))


def write_held_noise(members: List[AutoGuide], noise: NoiseFit) -> Optional[int]:
    """Writes a noise level that one member of a guide list fitted into the member
    that owns the noise site: through ``set_loc_and_scale`` (an I-BLM guide), or
    an ``AutoDelta``'s value. Returns that member's index, or None where no
    member can take it."""
    for i, member in enumerate(members):
        if member.prototype_trace is None or noise.name not in member.prototype_trace.nodes:
            continue
        if is_supported(member) and noise.name in latent_sites(member):
            set_loc_and_scale(member, noise.name, noise.level, noise.spread)
            return i
        if isinstance(member, AutoDelta):  # its value, unconstrained as the site's support
            param = unconstrained_param(member, noise.name)
            with torch.no_grad():
                param.copy_(noise.level.reshape(param.shape))  # copy_ casts
            return i
        return None
    return None
