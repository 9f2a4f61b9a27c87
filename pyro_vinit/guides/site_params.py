r"""
One way to read and write the posterior of each latent site, whatever the
autoguide family.

Usage::

    from pyro_vinit.guides import site_params

    guide(x, y)  # set up
    for name in site_params.latent_sites(guide):
        loc, scale = site_params.get_loc_and_scale(guide, name)
        with site_params.rollback_on_error(guide):
            site_params.set_loc_and_scale(guide, name, loc, 2 * scale)

Every supported guide speaks the same parameterization: at each latent site,
the **unconstrained-space location** and the **per-element marginal standard
deviation** of the posterior, both at the site's full (not subsampled)
unconstrained shape. (For a real-support site that is the site's shape; a
constrained site, e.g. a ``HalfNormal`` noise scale, is described in the
space ``biject_to(support).inv`` maps it to.) Writes copy into the existing
parameters in place, so parameter identity and optimizer state survive, and
validate the values before writing anything.

Supported guides:

* every :class:`~pyro_vinit.guides.AutoSiteGuide`:
  :class:`~pyro_vinit.guides.AutoKTiedNormal` (which projects a scale onto
  its rank-:math:`k` family), :class:`~pyro_vinit.guides.AutoRadialNormal`, and
  any third-party subclass that implements ``get_loc_and_scale`` and
  ``set_loc_and_scale``;
* :class:`~pyro.infer.autoguide.AutoNormal` (its ``locs`` and ``scales``);
* :class:`~pyro.infer.autoguide.AutoDiagonalNormal` (the site's slice of its
  flat ``loc`` and ``scale``);
* :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal`, whose
  covariance is :math:`\operatorname{diag}(d)\,(FF^\top + I)\,\operatorname{diag}(d)`
  with :math:`d` = ``scale`` and :math:`F` = ``cov_factor``, so element
  :math:`i` has marginal standard deviation :math:`d_i \sqrt{1 + \lVert F_i\rVert^2}`
  while the correlation matrix depends on :math:`F` alone. Writing a marginal
  standard deviation :math:`s` keeps ``cov_factor`` and sets
  :math:`d_i = s_i / \sqrt{1 + \lVert F_i\rVert^2}`: the marginals become
  exactly :math:`s` and every learned correlation (within the site and with
  other sites) is kept, where zeroing the site's rows of :math:`F` would
  discard them and change the other sites' marginals.

Further guide classes are added with ``get_loc_and_scale.register(cls)`` and
``set_loc_and_scale.register(cls)`` (``functools.singledispatch``).
"""

import functools
from contextlib import contextmanager
from operator import attrgetter
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple, Union, cast

import torch
from pyro.distributions import constraints
from pyro.distributions.constraints import Constraint
from pyro.infer.autoguide import (
    AutoContinuous,
    AutoDiagonalNormal,
    AutoGuide,
    AutoLowRankMultivariateNormal,
    AutoNormal,
)
from pyro.poutine.trace_struct import Trace
from torch.distributions import biject_to, transform_to

from pyro_vinit._pyro_compat import unconstrained_param
from pyro_vinit._typing import SampleSite, stochastic_sites
from pyro_vinit.guides._base import AutoSiteGuide, check_loc_and_scale

if TYPE_CHECKING:
    from builtins import ellipsis  # the type of ..., for annotations only

__all__ = [
    "check_supported",
    "get_loc_and_scale",
    "is_supported",
    "latent_sites",
    "rollback_on_error",
    "set_loc_and_scale",
]


def _supported_names() -> List[str]:
    # The families users pick from first, then the bases and any registered later.
    names = ["AutoNormal", "AutoDiagonalNormal", "AutoKTiedNormal", "AutoRadialNormal",
             "AutoMeanFieldNormal", "AutoLowRankMultivariateNormal"]
    registered = sorted(cls.__name__ for cls in get_loc_and_scale.registry if cls is not object)
    return names + [name for name in registered if name not in names]


@functools.singledispatch
def get_loc_and_scale(guide: AutoGuide, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    Returns the unconstrained-space location and the per-element marginal
    standard deviation of ``guide``'s posterior at site ``name``, at the
    site's full unconstrained shape.

    :param guide: A set-up supported autoguide (see :func:`check_supported`).
    :param str name: A latent sample site of the model.
    :rtype: tuple
    :raises TypeError: for an unsupported guide.
    """
    check_supported(guide)
    raise AssertionError("unreachable")  # check_supported raised


@functools.singledispatch
def set_loc_and_scale(
    guide: AutoGuide, name: str, loc: torch.Tensor, scale: torch.Tensor
) -> None:
    """
    Sets ``guide``'s posterior at site ``name`` to the unconstrained-space
    location ``loc`` and per-element marginal standard deviation ``scale``
    (full unconstrained site shape), in place; the inverse of
    :func:`get_loc_and_scale` (up to the family's projection, for
    :class:`~pyro_vinit.guides.AutoKTiedNormal`).

    :param guide: A set-up supported autoguide (see :func:`check_supported`).
    :param str name: A latent sample site of the model.
    :param torch.Tensor loc: Finite, of the site's full unconstrained shape.
    :param torch.Tensor scale: Finite and positive, of the same shape.
    :raises TypeError: for an unsupported guide.
    :raises ValueError: for values of the wrong shape, or not finite (and
        positive); nothing is written then.
    """
    check_supported(guide)
    raise AssertionError("unreachable")


def is_supported(guide: object) -> bool:
    """
    Whether :func:`get_loc_and_scale` and :func:`set_loc_and_scale` support ``guide``.

    :param guide: An autoguide.
    """
    return all(fn.dispatch(type(guide)) is not fn.registry[object]
               for fn in (get_loc_and_scale, set_loc_and_scale))


def check_supported(guide: object) -> None:
    """
    Raises a :class:`TypeError` naming the supported guide classes unless
    :func:`get_loc_and_scale` and :func:`set_loc_and_scale` support ``guide``.

    :param guide: An autoguide.
    """
    if not is_supported(guide):
        raise TypeError(
            f"{type(guide).__name__} is not a supported guide: reading and writing "
            f"per-site posteriors supports {', '.join(_supported_names())} and their "
            "subclasses (a third-party AutoSiteGuide subclass is supported if it "
            "implements get_loc_and_scale and set_loc_and_scale); build the guide "
            "with one of these, or register the class with "
            "pyro_vinit.guides.site_params.get_loc_and_scale.register and "
            "set_loc_and_scale.register"
        )


def _require_setup(guide: AutoGuide) -> Trace:
    """The prototype trace of the set-up ``guide``."""
    trace: Optional[Trace] = guide.prototype_trace
    if trace is None:
        raise RuntimeError(
            f"{type(guide).__name__} is not set up yet: call the guide once with the "
            "model's arguments (e.g. guide(x, y), or one svi.step) first."
        )
    return trace


def latent_sites(guide: AutoGuide) -> Dict[str, SampleSite]:
    """
    Returns the latent sample sites of a set-up ``guide``'s model, in model
    order: site name to the site of the guide's prototype trace (with ``fn``,
    ``value`` and ``cond_indep_stack``).

    :param guide: A set-up supported autoguide.
    :rtype: dict
    """
    check_supported(guide)
    return dict(stochastic_sites(_require_setup(guide)))


@contextmanager
def rollback_on_error(guide: torch.nn.Module) -> Iterator[None]:
    """
    Restores every entry of ``guide.state_dict()`` to its value on entry, in
    place, if the block raises (and re-raises), so that a sequence of writes is
    all or nothing.

    Usage::

        with rollback_on_error(guide):  # all sites halved, or none
            for name in latent_sites(guide):
                loc, scale = get_loc_and_scale(guide, name)
                set_loc_and_scale(guide, name, loc, scale / 2)

    Entries created inside the block (e.g. by setting the guide up) are not
    removed.

    :param torch.nn.Module guide: The guide (any module).
    """
    snapshot = {key: value.detach().clone() for key, value in guide.state_dict().items()}
    try:
        yield
    except BaseException:
        current = guide.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, value in snapshot.items():
                if key in current:
                    current[key].copy_(value)
        raise


# ---- AutoSiteGuide: its own methods ---------------------------------------------------------


@get_loc_and_scale.register(AutoSiteGuide)
def _(guide: AutoSiteGuide, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    return guide.get_loc_and_scale(name)


@set_loc_and_scale.register(AutoSiteGuide)
def _(guide: AutoSiteGuide, name: str, loc: torch.Tensor, scale: torch.Tensor) -> None:
    guide.set_loc_and_scale(name, loc, scale)


# ---- AutoNormal: the locs and scales containers ---------------------------------------------




def _check_name(guide: AutoGuide, name: str) -> None:
    sites = latent_sites(guide)
    if name not in sites:
        raise KeyError(
            f"{name!r} is not a latent site of this guide; its sites are {sorted(sites)}"
        )


def _unconstrained(
    value: torch.Tensor, constraint: Constraint, param: torch.Tensor, what: str
) -> torch.Tensor:
    raw: torch.Tensor = transform_to(constraint).inv(value).to(param)
    if not bool(torch.isfinite(raw).all()):
        raise ValueError(
            f"cannot write {what}: its unconstrained value is not finite (a scale too close "
            "to 0 or too large for the dtype); nothing was written"
        )
    return raw


# A parameter's part to write: all of it (...) or a slice of a flat one.
_Index = Union[slice, "ellipsis"]


def _copy(writes: Sequence[Tuple[torch.Tensor, _Index, torch.Tensor]]) -> None:
    with torch.no_grad():
        for param, index, raw in writes:
            param[index].copy_(raw)


@get_loc_and_scale.register(AutoNormal)
def _(guide: AutoNormal, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_name(guide, name)
    return attrgetter(name)(guide.locs), attrgetter(name)(guide.scales)


@set_loc_and_scale.register(AutoNormal)
def _(guide: AutoNormal, name: str, loc: torch.Tensor, scale: torch.Tensor) -> None:
    _check_name(guide, name)
    loc_param = unconstrained_param(guide.locs, name)
    scale_param = unconstrained_param(guide.scales, name)
    loc, scale = check_loc_and_scale(name, loc_param.shape, loc, scale, loc_param)
    writes = [
        (loc_param, ..., _unconstrained(loc, constraints.real, loc_param, "loc")),
        (scale_param, ...,
         _unconstrained(scale, guide.scale_constraint, scale_param, "scale")),
    ]
    _copy(writes)


# ---- AutoDiagonalNormal, AutoLowRankMultivariateNormal: slices of a flat latent -------------


def _flat_slice(guide: AutoContinuous, name: str) -> Tuple[slice, torch.Size]:
    """The site's slice of the flat unconstrained latent and its unconstrained shape.

    AutoContinuous concatenates the flattened unconstrained values of the
    prototype trace's latent sites in trace order (its documented layout);
    the total is checked against ``guide.latent_dim``.
    """
    _check_name(guide, name)
    position = 0
    found: Optional[Tuple[slice, torch.Size]] = None
    for site_name, site in stochastic_sites(_require_setup(guide)):
        shape = biject_to(site["fn"].support).inv(site["value"]).shape
        size = shape.numel()
        if site_name == name:
            found = slice(position, position + size), shape
        position += size
    if position != guide.latent_dim:
        raise RuntimeError(
            f"{type(guide).__name__}: the latent sites' unconstrained sizes add up to "
            f"{position}, not the guide's latent_dim {guide.latent_dim}; this Pyro version "
            "lays out AutoContinuous's latent differently: update "
            "pyro_vinit/guides/site_params.py"
        )
    assert found is not None  # _check_name found the site
    return found


def _flat_scale(guide: Union[AutoDiagonalNormal, AutoLowRankMultivariateNormal]) -> torch.Tensor:
    # PyroModule.__getattr__ is annotated with every kind of attribute it can return;
    # these guides' scale is a PyroParam, so a tensor.
    return cast(torch.Tensor, guide.scale)


@get_loc_and_scale.register(AutoDiagonalNormal)
def _(guide: AutoDiagonalNormal, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    index, shape = _flat_slice(guide, name)
    return guide.loc[index].reshape(shape), _flat_scale(guide)[index].reshape(shape)


@set_loc_and_scale.register(AutoDiagonalNormal)
def _(guide: AutoDiagonalNormal, name: str, loc: torch.Tensor, scale: torch.Tensor) -> None:
    index, shape = _flat_slice(guide, name)
    scale_param = unconstrained_param(guide, "scale")
    loc, scale = check_loc_and_scale(name, shape, loc, scale, guide.loc)
    writes = [
        (guide.loc, index, loc.reshape(-1)),
        (scale_param, index,
         _unconstrained(scale.reshape(-1), guide.scale_constraint, scale_param, "scale")),
    ]
    _copy(writes)


def _low_rank_inflation(guide: AutoLowRankMultivariateNormal, index: slice) -> torch.Tensor:
    # marginal sd / scale = sqrt(1 + |F_i|^2) (see the module docstring)
    return (1 + guide.cov_factor[index].pow(2).sum(-1)).sqrt()


@get_loc_and_scale.register(AutoLowRankMultivariateNormal)
def _(guide: AutoLowRankMultivariateNormal, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    index, shape = _flat_slice(guide, name)
    scale = _flat_scale(guide)[index] * _low_rank_inflation(guide, index)
    return guide.loc[index].reshape(shape), scale.reshape(shape)


@set_loc_and_scale.register(AutoLowRankMultivariateNormal)
def _(
    guide: AutoLowRankMultivariateNormal, name: str, loc: torch.Tensor, scale: torch.Tensor
) -> None:
    index, shape = _flat_slice(guide, name)
    scale_param = unconstrained_param(guide, "scale")
    loc, scale = check_loc_and_scale(name, shape, loc, scale, guide.loc)
    with torch.no_grad():
        diag = scale.reshape(-1) / _low_rank_inflation(guide, index)
    writes = [
        (guide.loc, index, loc.reshape(-1)),
        (scale_param, index, _unconstrained(diag, guide.scale_constraint, scale_param, "scale")),
    ]
    _copy(writes)
