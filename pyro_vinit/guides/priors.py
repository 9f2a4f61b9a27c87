r"""
A trained posterior as the prior of the next task (e.g. in continual learning).

Usage::

    from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

    priors = posterior_as_prior(guide)  # after training on task 1
    model2 = BayesianClassifier(bayesianize(mlp((64, 8, 10))))  # the same network
    set_priors(model2, priors)  # task 2's model starts from task 1's posterior
    guide2 = AutoNormal(model2)
"""

import functools
from typing import Dict, Mapping, Optional, Tuple, Union

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.distributions.torch_distribution import TorchDistributionMixin
from pyro.infer.autoguide import AutoGuide, AutoGuideList
from pyro.nn import PyroModule, PyroSample
from torch.distributions import Distribution, biject_to

from pyro_vinit._pyro_compat import pyro_sample_priors
from pyro_vinit.distributions import RadialNormal
from pyro_vinit.guides import site_params
from pyro_vinit.guides._base import is_real_support
from pyro_vinit.guides.auto_radial_normal import AutoRadialNormal

__all__ = ["posterior_as_prior", "set_priors"]


class _ConstrainedPosterior(dist.TransformedDistribution):  # type: ignore[misc]
    # The guide's unconstrained posterior pushed through biject_to(support), with the
    # site's support: torch derives a TransformedDistribution's support from its last
    # transform's codomain, which is the real line for e.g. biject_to(nonnegative) (a
    # HalfNormal's) and biject_to(interval(a, b)) (a Uniform's), both ending in an
    # AffineTransform. A guide of the next task would then treat the site as real-valued
    # (and init_to_feasible put it at 0).
    arg_constraints: Dict[str, constraints.Constraint] = {}

    def __init__(self, base: dist.TorchDistribution, support: constraints.Constraint,
                 validate_args: Optional[bool] = None) -> None:
        self._support = support
        super().__init__(base, [biject_to(support)], validate_args=validate_args)

    @constraints.dependent_property(is_discrete=False)
    def support(self) -> constraints.Constraint:
        return self._support

    def expand(self, batch_shape: Union[torch.Size, Tuple[int, ...]],
               _instance: Optional["_ConstrainedPosterior"] = None
               ) -> "_ConstrainedPosterior":
        new: _ConstrainedPosterior = self._get_checked_instance(_ConstrainedPosterior, _instance)
        super().expand(batch_shape, _instance=new)
        new._support = self._support
        return new


@functools.singledispatch
def _unconstrained_family(guide: AutoGuide, name: str, loc: torch.Tensor, scale: torch.Tensor,
                          event_dim: int) -> dist.TorchDistribution:
    # Every family but the radial one: the Normal of the guide's marginals.
    normal: dist.TorchDistribution = dist.Normal(loc, scale).to_event(event_dim)
    return normal


@_unconstrained_family.register(AutoRadialNormal)
def _(guide: AutoRadialNormal, name: str, loc: torch.Tensor, scale: torch.Tensor,
      event_dim: int) -> dist.TorchDistribution:
    if loc.numel() == 0:
        empty: dist.TorchDistribution = dist.Normal(loc, scale).to_event(event_dim)
        return empty
    return RadialNormal(loc, guide.get_radial_scale(name).detach().clone(), event_dim)


def posterior_as_prior(guide: AutoGuide) -> Dict[str, dist.TorchDistribution]:
    r"""
    Returns, for each latent site of a set-up ``guide``, its posterior as a
    distribution of fixed tensors, to be used as that site's prior in the next
    task's model (see :func:`set_priors`).

    Usage::

        priors = posterior_as_prior(guide)
        priors["net.0.weight"]  # Normal(loc, scale).to_event(2)

    Each distribution's ``batch_shape + event_shape`` is the site's shape, with
    the model site's event dims. Its tensors are detached copies: they do not
    require grad and further training of ``guide`` does not change them.

    * :class:`~pyro.infer.autoguide.AutoNormal`,
      :class:`~pyro_vinit.guides.AutoKTiedNormal` (and every other supported
      guide but the radial one): ``Normal(loc, scale).to_event(event_dim)`` with
      the guide's locations and per-element marginal standard deviations (for
      :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal` its
      correlations are dropped).
    * :class:`~pyro_vinit.guides.AutoRadialNormal`: the guide's own
      :class:`~pyro_vinit.distributions.RadialNormal` (a Normal at zero-size
      sites). No closed form of KL(RadialNormal‖RadialNormal) is known (the
      expected log-radius under a shifted radial has none), so
      :class:`~pyro.infer.TraceMeanField_ELBO` falls back to its Monte Carlo
      estimate at these sites, as it does for any pair without a registered KL;
      a Normal or k-tied posterior against a radial prior does the same.

    A constrained site (e.g. a ``HalfNormal`` noise scale) gets the guide's
    unconstrained posterior pushed through ``biject_to(support)``, a
    :class:`~pyro.distributions.TransformedDistribution` with the site's
    support (so that the next guide constrains the site as before). A site in a
    subsampled plate gets its full-size posterior; index it by the subsample
    in the model.

    An :class:`~pyro.infer.autoguide.AutoGuideList` gives the priors of its
    parts together; each part must be a supported guide.

    :param guide: A set-up guide :mod:`~pyro_vinit.guides.site_params`
        supports, or an AutoGuideList of such guides.
    :return: A dict mapping site name to distribution.
    :rtype: dict
    """
    if isinstance(guide, AutoGuideList):
        return _guide_list_priors(guide)
    priors: Dict[str, dist.TorchDistribution] = {}
    for name, site in site_params.latent_sites(guide).items():
        loc, scale = site_params.get_loc_and_scale(guide, name)
        loc, scale = loc.detach().clone(), scale.detach().clone()
        event_dim = site["fn"].event_dim + loc.dim() - site["value"].dim()
        posterior = _unconstrained_family(guide, name, loc, scale, event_dim)
        support = site["fn"].support
        if support is not None and not is_real_support(support):
            posterior = _ConstrainedPosterior(posterior, support)
        priors[name] = posterior
    return priors


def _guide_list_priors(guide: AutoGuideList) -> Dict[str, dist.TorchDistribution]:
    if guide.prototype_trace is None:
        raise RuntimeError(
            "AutoGuideList is not set up yet: call the guide once with the model's "
            "arguments (e.g. guide(x, y), or one svi.step) first."
        )
    priors: Dict[str, dist.TorchDistribution] = {}
    for i, part in enumerate(guide):
        if not isinstance(part, AutoGuide) or not (
                isinstance(part, AutoGuideList) or site_params.is_supported(part)):
            raise TypeError(
                f"posterior_as_prior: part {i} of the AutoGuideList "
                f"({type(part).__name__}) has no per-site Normal or radial posterior to "
                "become a prior; build that part with a guide site_params supports (e.g. "
                "AutoNormal, AutoKTiedNormal, AutoRadialNormal), or give its sites priors of "
                "your own"
            )
        priors.update(posterior_as_prior(part))
    return priors


def set_priors(
    model: PyroModule, priors: Mapping[str, TorchDistributionMixin]
) -> PyroModule:
    """
    Replaces the priors of sample sites of a :class:`~pyro.nn.PyroModule` model
    (e.g. a :func:`~pyro_vinit.nn.bayesianize` d network inside a
    :class:`~pyro_vinit.nn.BayesianClassifier`), in place, and returns it.

    Usage::

        set_priors(model, posterior_as_prior(guide))  # guide: the last task's

    Site names are the model's (``"net.0.weight"``), i.e. the guide's. Every
    name must be a :class:`~pyro.nn.PyroSample` attribute of the model whose
    shape and event shape (if the prior records them, as ``bayesianize``'s
    does: the whole weight is one event) match; nothing is changed unless all
    do. Call it before the model first runs under a guide,
    or re-create the guide afterwards.

    :param PyroModule model: The model.
    :param dict priors: Site name to distribution (of :mod:`pyro.distributions`).
    :rtype: PyroModule
    :raises TypeError: for a model that is not a module (e.g. a function).
    :raises KeyError: for a name that is not a PyroSample of the model.
    :raises ValueError: for a distribution of the wrong shape or event shape.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"set_priors: model must be a PyroModule, got {type(model).__name__}; a model "
            "written as a function takes its priors in its own pyro.sample statements, "
            "e.g. pyro.sample(name, priors[name])"
        )
    targets = []
    for name, prior in priors.items():
        parent_name, _, leaf = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
        except AttributeError:
            parent = None
        samples = pyro_sample_priors(parent) if parent is not None else {}
        if leaf not in samples:
            raise KeyError(
                f"set_priors: {name!r} is not a PyroSample site of the model; bayesianize "
                "the layer first, and use the model's site names (e.g. 'net.0.weight')"
            )
        # PyroSample calls its distribution, which a plain torch.distributions one cannot do.
        if not isinstance(prior, TorchDistributionMixin):
            raise TypeError(f"set_priors: the prior of {name!r} must be a Distribution of "
                            "pyro.distributions (e.g. pyro.distributions.Normal), got "
                            f"{type(prior).__name__}")
        current = samples[leaf]
        expected: Optional[torch.Size]
        event: Optional[torch.Size]  # the site's event shape, where the prior records it
        if isinstance(current, Distribution):
            expected, event = current.batch_shape + current.event_shape, current.event_shape
        else:  # bayesianize's prior: the whole weight is one event
            expected = getattr(current, "shape", None)
            event = expected
        shape = prior.batch_shape + prior.event_shape
        if expected is not None and tuple(shape) != tuple(expected):
            raise ValueError(
                f"set_priors: the prior of {name!r} has shape {tuple(shape)}, but the site "
                f"has shape {tuple(expected)}"
            )
        if event is not None and tuple(prior.event_shape) != tuple(event):
            # batch dims outside the site's plates, which Pyro's ELBO refuses, or a
            # plate's dims taken into the event
            missing = len(event) - len(prior.event_shape)
            raise ValueError(
                f"set_priors: the prior of {name!r} has event shape "
                f"{tuple(prior.event_shape)}, but the site's is {tuple(event)}"
                + (f": pass prior.to_event({missing})" if missing > 0 else "")
            )
        targets.append((parent, leaf, prior))
    for parent, leaf, prior in targets:
        setattr(parent, leaf, PyroSample(prior))
    return model
