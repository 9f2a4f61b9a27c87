"""Shared machinery of the per-site autoguides of :mod:`pyro_vinit.guides`."""

import math
from contextlib import ExitStack
from operator import attrgetter
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.distributions import constraints
from pyro.distributions.constraints import Constraint
from pyro.distributions.distribution import Distribution as PyroDistribution
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_feasible
from pyro.nn import PyroModule, PyroParam
from pyro.ops.tensor_utils import periodic_repeat
from pyro.poutine.trace_struct import Trace
from torch.distributions import biject_to, register_kl, transform_to

from pyro_vinit._pyro_compat import (
    deep_setattr,
    discrete_site_error,
    helpful_support_errors,
    setup_prototype,
    unconstrained_param,
)
from pyro_vinit._typing import stochastic_sites

__all__ = ["AutoSiteGuide"]


class _ConstrainedDelta(dist.Delta):
    """The guide's point mass at a constrained site, at the transform of its auxiliary
    ``<name>_unconstrained`` draw, with the transform's log-density."""


# Pyro's kl_divergence(Delta, q) is -q.log_prob(v): it drops the Delta's log_density,
# so TraceMeanField_ELBO would miss E[log|det J|] of each constrained site (its loss at
# a HalfNormal noise site off by the location of log(noise)), which Trace_ELBO counts.
# The distribution class is Pyro's, as in its own registration, so that this one is
# the more specific match (not an ambiguous one).
@register_kl(_ConstrainedDelta, PyroDistribution)  # type: ignore[untyped-decorator]
def _kl_constrained_delta(p: _ConstrainedDelta, q: PyroDistribution) -> torch.Tensor:
    kl: torch.Tensor = p.log_density - q.log_prob(p.v)
    return kl


def is_real_support(support: Optional[constraints.Constraint]) -> bool:
    """Whether ``support`` is (an independent product of) the real line."""
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support is constraints.real


def check_init_scale(cls: type, init_scale: float) -> None:
    if (isinstance(init_scale, bool) or not isinstance(init_scale, float)
            or not 0 < init_scale < math.inf):
        raise ValueError(
            f"{cls.__name__}: init_scale must be a positive finite float (the initial standard "
            f"deviation of each unconstrained latent element), but got {init_scale!r}; "
            "pass e.g. init_scale=0.1"
        )


def check_loc_and_scale(
    name: str, shape: torch.Size, loc: object, scale: object, like: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Validated ``loc`` and ``scale`` in ``like``'s dtype and device."""
    values = []
    for what, value in (("loc", loc), ("scale", scale)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"site {name!r}: {what} must be a torch.Tensor, got "
                            f"{type(value).__name__}")
        if value.shape != shape:
            raise ValueError(
                f"site {name!r}: {what} must have the site's full unconstrained shape "
                f"{tuple(shape)}, got {tuple(value.shape)}"
            )
        values.append(value.detach().to(dtype=like.dtype, device=like.device))
    loc, scale = values
    if not bool(torch.isfinite(loc).all()):
        raise ValueError(f"site {name!r}: loc has non-finite entries; nothing was written")
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(
            f"site {name!r}: scale must be finite and positive (a marginal standard "
            "deviation), but has entries that are not; nothing was written"
        )
    return loc, scale


class AutoSiteGuide(AutoNormal):
    """
    Base of the mean-field autoguides whose unconstrained posterior at each
    site is a family other than a fully factorized Normal.

    Unlike :class:`~pyro.infer.autoguide.AutoNormal`, a real-support site gets
    its posterior at the site itself rather than a ``Delta`` behind an
    auxiliary ``<name>_unconstrained`` site, so that
    :class:`~pyro.infer.TraceMeanField_ELBO` can use a closed-form KL and
    effect handlers can see the posterior's parameters. Constrained sites go
    through the unconstrained space as in ``AutoNormal``.

    Every subclass speaks one parameterization through :meth:`get_loc_and_scale`
    and :meth:`set_loc_and_scale`: each site's unconstrained location and the
    per-element marginal standard deviation, at full site shape. A subclass
    creates its scale parameters in :meth:`_setup_scales` (``locs`` exist by
    then; :meth:`_setup_normal_scales` gives sites AutoNormal's per-element
    scales), returns each site's unconstrained posterior from
    :meth:`_unconstrained_posterior`, and implements :meth:`_get_loc_and_scale`
    and :meth:`_set_loc_and_scale`; the public methods validate before calling them.
    """

    def __init__(
        self,
        model: Callable[..., Any],
        *,
        init_loc_fn: Callable[[Dict[str, Any]], torch.Tensor] = init_to_feasible,
        init_scale: float = 0.1,
        create_plates: Optional[Callable[..., Any]] = None,
    ) -> None:
        check_init_scale(type(self), init_scale)
        # mypy attributes Pyro's unannotated __init__ to this class when reached via super().
        super().__init__(  # type: ignore[no-untyped-call]
            model, init_loc_fn=init_loc_fn, init_scale=init_scale, create_plates=create_plates
        )

    def _setup_prototype(self, *args: Any, **kwargs: Any) -> None:
        # AutoGuide's set-up, not AutoNormal's: that one would create a full-size
        # scale for every site, which a subclass may not use (k-tied sites).
        before = set(pyro.get_param_store().keys())
        self._stale: List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]] = []
        try:
            try:
                setup_prototype(self, *args, **kwargs)
            except ValueError as error:
                name = discrete_site_error(error)  # from the init strategy
                if name is None:
                    raise
                raise self._unobserved_discrete_error(name) from error
            self._setup_params()
            self._check_not_stored_elsewhere(before)
        except BaseException:
            # A failed set-up leaves the guide unset, so that a corrected call sets it up.
            self.prototype_trace = None
            raise

    def _new_param(self, module: PyroModule, name: str, value: torch.Tensor,
                   constraint: constraints.Constraint, event_dim: int) -> None:
        """Sets the PyroParam ``name`` of ``module`` to ``value``, noting where the
        global param store already held one of that name and another shape (which
        Pyro gives the guide in its place)."""
        deep_setattr(module, name, PyroParam(value, constraint, event_dim))
        held = attrgetter(name)(module)
        if held.shape != value.shape:
            stored = pyro.get_param_store().param_name(unconstrained_param(module, name))
            self._stale.append((str(stored), tuple(held.shape), tuple(value.shape)))

    def _check_not_stored_elsewhere(self, before: Set[str]) -> None:
        stale, self._stale = self._stale, []
        if stale:
            store = pyro.get_param_store()
            for new in set(store.keys()) - before:  # (the store as it was)
                del store[new]
            name, held, own = stale[0]
            raise ValueError(
                f"{type(self).__name__}: the param store already holds {name!r} with shape "
                f"{held}, where this guide's is {own} ({len(stale)} such params): another "
                f"{type(self).__name__} of the same site names (e.g. of another rank, or "
                "set up on another network) set it up, and Pyro would give this guide its "
                "params. Call pyro.clear_param_store() before making this guide, or keep "
                "each guide's params in it (pyro.settings.set(module_local_params=True)). "
                "The guide is left unset.")

    def _setup_if_needed(self, *args: Any, **kwargs: Any) -> None:
        """Sets the guide up from the model's ``*args, **kwargs`` if it is not yet,
        or says how to when none are given."""
        if self.prototype_trace is None and (args or kwargs):
            self._setup_prototype(*args, **kwargs)
        self._prototype()

    def _unobserved_discrete_error(self, name: str) -> ValueError:
        return ValueError(
            f"{type(self).__name__}: the model's sample site {name!r} is discrete and was "
            "not observed when the guide was set up, so this continuous guide cannot cover "
            f"it. If {name!r} is the observation, the guide's first call ran the model "
            "without it (e.g. Predictive(model, guide=guide)(x) or guide(x) before the guide "
            "had seen the targets): call the guide once with the data first (guide(x, y), "
            "one svi.step, or init_guide_iblm), then predict. If it is a discrete latent "
            "variable, hide it from this guide (poutine.block(model, hide=[...])) and "
            "enumerate it. The guide is left unset."
        )

    def _check_unobserved_discrete(self) -> None:
        for name, site in stochastic_sites(self._prototype()):
            support = site["fn"].support
            if support is not None and support.is_discrete:
                raise self._unobserved_discrete_error(name)

    def _setup_params(self) -> None:
        """Creates the parameters from ``self.prototype_trace``."""
        self._check_unobserved_discrete()
        self._event_dims: Dict[str, int] = {}
        self.locs = PyroModule()
        for name, site in stochastic_sites(self._prototype()):
            with helpful_support_errors(site):
                init_loc = biject_to(site["fn"].support).inv(site["value"].detach()).detach()
            # A copy: at a real-support site the bijection is the identity, and a
            # parameter sharing the prototype's value would share it with every guide
            # set up from this prototype (AutoKTiedNormal.from_guide).
            init_loc = init_loc.clone()
            # The unconstrained event dims may differ from the constrained ones (simplex).
            event_dim = site["fn"].event_dim + init_loc.dim() - site["value"].dim()
            self._event_dims[name] = event_dim
            # The parameters cover a subsampled plate's full size.
            for frame in site["cond_indep_stack"]:
                full_size = frame.full_size or frame.size
                if full_size != frame.size:
                    init_loc = periodic_repeat(init_loc, full_size, frame.dim - event_dim)
                    init_loc = init_loc.contiguous()
            self._new_param(self.locs, name, init_loc, constraints.real, event_dim)
        self.scales = PyroModule()
        self._setup_scales()

    def _setup_scales(self) -> None:
        raise NotImplementedError

    def _setup_normal_scales(self, names: Iterable[str]) -> None:
        """AutoNormal's per-element scale parameter, at ``init_scale``, for each site in
        ``names``."""
        for name in names:
            loc = attrgetter(name)(self.locs)
            scale = torch.full_like(loc, self._init_scale)
            self._new_param(self.scales, name, scale, self.scale_constraint,
                            self._event_dims[name])

    def _unconstrained_posterior(self, name: str) -> dist.TorchDistribution:
        """The posterior of site ``name`` in unconstrained space, with
        ``self._event_dims[name]`` event dims."""
        raise NotImplementedError

    def _set_loc_and_scale(self, name: str, loc: torch.Tensor, scale: torch.Tensor) -> None:
        """Writes validated ``loc`` and ``scale`` (full site shape, the guide's dtype and
        device) into the parameters of site ``name``, e.g. with :meth:`_write_params`."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement _set_loc_and_scale, so its "
            "parameters cannot be written"
        )

    def _prototype(self) -> Trace:
        """The prototype trace of the set-up guide."""
        trace: Optional[Trace] = self.prototype_trace
        if trace is None:
            raise RuntimeError(
                f"{type(self).__name__} is not set up yet: call the guide once with the "
                "model's arguments (e.g. guide(x, y), or one svi.step) first; median and "
                "quantiles take them too (guide.median(x, y))."
            )
        return trace

    def _check_site(self, name: str) -> None:
        self._prototype()
        if name not in self._event_dims:
            raise KeyError(
                f"{name!r} is not a latent site of this guide; its sites are "
                f"{sorted(self._event_dims)}"
            )

    @torch.no_grad()
    def median(self, *args: Any, **kwargs: Any) -> Dict[str, torch.Tensor]:
        """
        Returns the posterior median value of each latent variable.

        :param args: The model's arguments, needed only if the guide has not
            been called yet (it is then set up from them).
        :return: A dict mapping sample site name to median tensor.
        :rtype: dict
        :raises RuntimeError: if the guide is not set up and no arguments are given.
        """
        self._setup_if_needed(*args, **kwargs)
        # Pyro's method is unannotated; mypy attributes it to this class via super().
        medians: Dict[str, torch.Tensor] = super().median()  # type: ignore[no-untyped-call]
        return medians

    @torch.no_grad()
    def quantiles(
        self, quantiles: Union[List[float], torch.Tensor], *args: Any, **kwargs: Any
    ) -> Dict[str, torch.Tensor]:
        """
        Returns the marginal posterior quantiles of each latent variable.

        :param quantiles: A list of requested quantiles between 0 and 1.
        :type quantiles: torch.Tensor or list
        :param args: The model's arguments, needed only if the guide has not
            been called yet (it is then set up from them).
        :return: A dict mapping sample site name to a tensor of quantile values,
            with the quantiles along a new leftmost dim.
        :rtype: dict
        :raises RuntimeError: if the guide is not set up and no arguments are given.
        """
        self._setup_if_needed(*args, **kwargs)
        # Pyro's method is unannotated; mypy attributes it to this class via super().
        results: Dict[str, torch.Tensor] = super().quantiles(  # type: ignore[no-untyped-call]
            quantiles
        )
        return results

    def get_loc_and_scale(self, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """
        Returns the unconstrained-space location and the per-element marginal
        standard deviation of the posterior at site ``name``, both at the full
        (not subsampled) unconstrained site shape.

        :param str name: A latent sample site of the model.
        :rtype: tuple
        """
        self._check_site(name)
        return self._get_loc_and_scale(name)

    def _get_loc_and_scale(self, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """The location and marginal standard deviation of site ``name``, for
        :meth:`get_loc_and_scale` (which has checked ``name``); AutoNormal's
        per-element ``locs`` and ``scales`` unless a subclass overrides it."""
        # Pyro's method is unannotated; mypy attributes it to this class via super().
        loc, scale = super()._get_loc_and_scale(name)  # type: ignore[no-untyped-call]
        return loc, scale

    def set_loc_and_scale(self, name: str, loc: torch.Tensor, scale: torch.Tensor) -> None:
        """
        Sets the posterior at site ``name`` to the unconstrained-space location
        ``loc`` and per-element marginal standard deviation ``scale`` (the
        inverse of :meth:`get_loc_and_scale`; a family that cannot represent
        ``scale`` exactly takes its closest member, see the subclass).

        The values are copied in place into the existing parameters, so their
        identity and any optimizer state survive; they are validated first, and
        nothing is written if they are invalid.

        :param str name: A latent sample site of the model.
        :param torch.Tensor loc: Finite, of the site's full unconstrained shape.
        :param torch.Tensor scale: Finite and positive, of the same shape.
        :raises ValueError: if a value has the wrong shape or is not finite (and
            positive).
        """
        self._check_site(name)
        current = attrgetter(name)(self.locs)
        loc, scale = check_loc_and_scale(name, current.shape, loc, scale, current)
        self._set_loc_and_scale(name, loc, scale)

    def _write_params(self, writes: Sequence[Tuple[str, Constraint, torch.Tensor]]) -> None:
        """Copies constrained values into PyroParams in place: ``writes`` holds
        ``(dotted attribute of self, constraint, value)``. Every unconstrained value
        is computed and checked before the first copy."""
        staged = []
        for attr, constraint, value in writes:
            param = unconstrained_param(self, attr)
            raw = transform_to(constraint).inv(value).to(param)
            if raw.shape != param.shape or not bool(torch.isfinite(raw).all()):
                raise ValueError(
                    f"{type(self).__name__}: cannot write {attr!r}: the unconstrained value "
                    f"has shape {tuple(raw.shape)} (expected {tuple(param.shape)}) or "
                    "non-finite entries (a scale too close to 0 or too large for the "
                    "dtype); nothing was written"
                )
            staged.append((param, raw))
        with torch.no_grad():
            for param, raw in staged:
                param.copy_(raw)

    def forward(self, *args: Any, **kwargs: Any) -> Dict[str, torch.Tensor]:
        """
        An automatic guide with the same ``*args, **kwargs`` as the base ``model``.

        :return: A dict mapping sample site name to sampled value.
        :rtype: dict
        """
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)

        # Pyro's method is unannotated; mypy attributes it to this class via self.
        plates = self._create_plates(*args, **kwargs)  # type: ignore[no-untyped-call]
        result = {}
        for name, site in stochastic_sites(self._prototype()):
            with ExitStack() as stack:
                for frame in site["cond_indep_stack"]:
                    if frame.vectorized:
                        stack.enter_context(plates[frame.name])

                posterior = self._unconstrained_posterior(name)
                if is_real_support(site["fn"].support):
                    result[name] = pyro.sample(name, posterior)
                    continue

                transform = biject_to(site["fn"].support)
                unconstrained_latent = pyro.sample(
                    name + "_unconstrained", posterior, infer={"is_auxiliary": True}
                )
                value = transform(unconstrained_latent)
                if poutine.get_mask() is False:
                    log_density = 0.0
                else:
                    log_density = transform.inv.log_abs_det_jacobian(value, unconstrained_latent)
                    log_density = sum_rightmost(
                        log_density, log_density.dim() - value.dim() + site["fn"].event_dim
                    )
                result[name] = pyro.sample(
                    name,
                    _ConstrainedDelta(  # type: ignore[no-untyped-call]
                        value, log_density=log_density, event_dim=site["fn"].event_dim
                    ),
                )
        return result
