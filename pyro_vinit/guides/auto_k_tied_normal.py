"""Mean-field Normal autoguide with rank-k tied standard deviations."""

import math
from operator import attrgetter
from typing import Any, Callable, Dict, List, Optional, Tuple

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.distributions.constraints import Constraint
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import init_to_feasible
from pyro.nn import PyroModule

from pyro_vinit._pyro_compat import share_prototype, unwrap_init_messenger
from pyro_vinit._warn import warn_at_caller
from pyro_vinit.distributions import KTiedNormal
from pyro_vinit.guides import site_params
from pyro_vinit.guides._base import AutoSiteGuide
from pyro_vinit.guides._low_rank import fit_positive_low_rank

__all__ = ["AutoKTiedNormal"]


class AutoKTiedNormal(AutoSiteGuide):
    r"""
    Mean-field Normal autoguide whose standard deviations are tied to rank
    :math:`k` per layer, the k-tied Normal of [1].

    Usage::

        guide = AutoKTiedNormal(model, rank=2)
        svi = SVI(model, guide, Adam({"lr": 1e-3}), TraceMeanField_ELBO())

    Every latent site whose unconstrained event shape :math:`(m, n_1, n_2, \dots)`
    has two or more dims (a weight matrix, a conv kernel) is read as an
    :math:`m \times n` matrix, :math:`n = n_1 n_2 \cdots`, and gets

    .. math::

        q(w) = \prod_{ij} \mathcal{N}(w_{ij} \mid \mu_{ij}, S_{ij}^2), \qquad
        S = U V^\top,\quad U = \mathrm{softplus}(\tilde U) \in \mathbb{R}_+^{m\times k},
        \ V = \mathrm{softplus}(\tilde V) \in \mathbb{R}_+^{n\times k},

    i.e. :math:`mn + k(m + n)` parameters instead of AutoNormal's :math:`2mn`.
    The factors are kept positive by the same softplus parameterization as
    AutoNormal's scales (:attr:`scale_constraint`). Sites with fewer than two
    event dims (biases, scalars) and zero-size sites get AutoNormal's
    per-element scale. Tying is
    over event dims only: each element of a plate gets its own factors.

    :meth:`get_loc_and_scale` returns each site's location and per-element
    standard deviation :math:`S` (reshaped to the site's shape);
    :meth:`set_loc_and_scale` projects a given standard deviation matrix onto
    the rank-:math:`k` family in Frobenius norm: exactly for a positive
    :math:`S` of rank 1 or 2 (or factors that already give :math:`S`), by the
    best rank-1 fit (the leading singular pair, positive for a positive
    :math:`S`) for :math:`k = 1`, else by the rank-1 fit refined with
    alternating nonnegative least squares. (A positive matrix of rank
    :math:`\ge 3` need not have exact positive rank-:math:`k` factors even
    for :math:`k \ge` its rank.)

    A ``rank`` of at least :math:`\min(m, n)` is allowed: it can represent any
    positive std matrix but has more parameters than AutoNormal.

    At initialization every standard deviation equals ``init_scale`` while the
    :math:`k` components differ (identical components would receive identical
    gradients forever, collapsing the guide to rank 1): each row of
    :math:`U` is a random positive vector with mean :math:`\sqrt{c/k}`, normalized so
    that :math:`\sum_a U_{ia} = \sqrt{ck}`, and :math:`V \equiv \sqrt{c/k}`, so
    :math:`S_{ij} = c` = ``init_scale`` exactly.

    Real-support sites are sampled from a :class:`~pyro_vinit.distributions.KTiedNormal`
    (or a ``Normal``) at the site itself, so :class:`~pyro.infer.TraceMeanField_ELBO`
    uses the closed-form KL to a Normal prior; constrained sites go through the
    unconstrained space as in :class:`~pyro.infer.autoguide.AutoNormal`.

    .. note:: By design this guide differs from
        :class:`~pyro.infer.autoguide.AutoNormal` at real-support sites: the
        posterior is sampled at the site itself, so ``guide_trace.nodes[name]``
        carries the KTiedNormal and a nonzero ``log_prob``, and there is no auxiliary
        ``<name>_unconstrained`` site (AutoNormal samples a Normal there and
        puts a ``Delta``, of log-density 0, at the site). Code that expects
        AutoNormal's trace layout (e.g. Pyro's ``test_scores``) sees the
        difference; ELBOs, ``Predictive`` and ``poutine.replay`` do not.

    :param callable model: A Pyro model.
    :param int rank: The number :math:`k \ge 1` of tied components.
    :param callable init_loc_fn: A per-site initialization function.
    :param float init_scale: Initial standard deviation of every unconstrained
        latent element.
    :param callable create_plates: An optional function taking the model's
        ``*args, **kwargs`` and returning a :class:`pyro.plate` or iterable of
        plates, as for AutoNormal (useful for data subsampling).

    [1] Swiatkowski, Roth, Veeling, Tran, Dillon, Snoek, Mandt, Salimans,
    Jenatton, Nowozin (2020) "The k-tied Normal Distribution: A Compact
    Parameterization of Gaussian Mean Field Posteriors in Bayesian Neural
    Networks"
    """

    def __init__(
        self,
        model: Callable[..., Any],
        *,
        rank: int = 2,
        init_loc_fn: Callable[..., torch.Tensor] = init_to_feasible,
        init_scale: float = 0.1,
        create_plates: Optional[Callable[..., Any]] = None,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(
                f"AutoKTiedNormal: rank must be a positive int (the number of tied "
                f"components k, typically 1 to 3), but got {rank!r}"
            )
        self.rank = rank
        super().__init__(
            model, init_loc_fn=init_loc_fn, init_scale=init_scale, create_plates=create_plates
        )

    def _setup_scales(self) -> None:
        self._tied_shapes: Dict[str, Tuple[int, int]] = {}
        self.scale_u = PyroModule()
        self.scale_v = PyroModule()
        untied = []
        for name, event_dim in self._event_dims.items():
            loc = attrgetter(name)(self.locs)
            # A zero-size site (e.g. a layer of width 0) has nothing to tie.
            if event_dim < 2 or loc.numel() == 0:
                untied.append(name)
                continue
            batch_shape = loc.shape[: loc.dim() - event_dim]
            event_shape = loc.shape[loc.dim() - event_dim :]
            m, n = event_shape[0], math.prod(event_shape[1:])
            self._tied_shapes[name] = (m, n)

            # Break the symmetry between components in U only; V constant keeps S exact.
            k, c = self.rank, self._init_scale
            weights = torch.empty(batch_shape + (m, k), dtype=loc.dtype, device=loc.device)
            weights.uniform_(0.5, 1.5)
            weights = weights * (k / weights.sum(-1, keepdim=True))
            u = math.sqrt(c / k) * weights
            v = torch.full(batch_shape + (n, k), math.sqrt(c / k), dtype=loc.dtype,
                           device=loc.device)
            self._new_param(self.scale_u, name, u, self.scale_constraint, 2)
            self._new_param(self.scale_v, name, v, self.scale_constraint, 2)
        self._setup_normal_scales(untied)
        # matrices whose dims are plate dims, not in a subsampled (data) plate: a per-example
        # latent is no weight matrix
        nodes = self.prototype_trace.nodes if self.prototype_trace is not None else {}
        in_plates = [name for name in untied if self._event_dims[name] < 2
                     and attrgetter(name)(self.locs).dim() >= 2
                     and not any(f.full_size is not None and f.full_size > f.size
                                 for f in nodes[name]["cond_indep_stack"])]
        if in_plates:
            warn_at_caller(
                f"AutoKTiedNormal: the latent sites {in_plates} have two or more dims, of which "
                "plate (batch) dims, so their standard deviations are not tied: they get "
                "AutoNormal's per-element scales. If one is a weight matrix, draw it as one "
                "event to tie it, e.g. dist.Normal(0, s).expand([m, n]).to_event(2) outside the "
                "plates over its dims", UserWarning)

    def _get_factors(self, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
        return attrgetter(name)(self.scale_u), attrgetter(name)(self.scale_v)

    def _get_loc_and_scale(self, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
        loc = attrgetter(name)(self.locs)
        if name not in self._tied_shapes:
            return loc, attrgetter(name)(self.scales)
        u, v = self._get_factors(name)
        scale = torch.matmul(u, v.transpose(-1, -2))
        return loc, scale.reshape(loc.shape)

    def _set_loc_and_scale(self, name: str, loc: torch.Tensor, scale: torch.Tensor) -> None:
        writes: List[Tuple[str, Constraint, torch.Tensor]] = [
            (f"locs.{name}", constraints.real, loc)
        ]
        if name not in self._tied_shapes:
            writes.append((f"scales.{name}", self.scale_constraint, scale))
            return self._write_params(writes)
        m, n = self._tied_shapes[name]
        matrix = scale.reshape(scale.shape[: scale.dim() - self._event_dims[name]] + (m, n))
        with torch.no_grad():
            u, v = self._get_factors(name)
            current = torch.matmul(u, v.transpose(-1, -2))
        # Factors that already give this scale stay as they are (get then set is a no-op).
        if not torch.allclose(current, matrix, rtol=1e-6, atol=0):
            u, v = fit_positive_low_rank(matrix, self.rank)
            writes += [
                (f"scale_u.{name}", self.scale_constraint, u),
                (f"scale_v.{name}", self.scale_constraint, v),
            ]
        self._write_params(writes)

    def _unconstrained_posterior(self, name: str) -> dist.TorchDistribution:
        event_dim = self._event_dims[name]
        loc = attrgetter(name)(self.locs)
        if name in self._tied_shapes:
            u, v = self._get_factors(name)
            base: dist.TorchDistribution = KTiedNormal(loc, u, v, tied_dims=event_dim)
        else:
            base = dist.Normal(loc, attrgetter(name)(self.scales))
        posterior: dist.TorchDistribution = base.to_event(event_dim)
        return posterior

    @classmethod
    def from_guide(
        cls,
        guide: AutoGuide,
        *,
        rank: int = 2,
        create_plates: Optional[Callable[..., Any]] = None,
    ) -> "AutoKTiedNormal":
        r"""
        Returns a new, set-up k-tied guide for the model of ``guide`` (e.g. a
        trained :class:`~pyro.infer.autoguide.AutoNormal`) with the same
        locations and, at each site, the positive rank-``rank`` fit of
        ``guide``'s per-element standard deviations (see
        :meth:`set_loc_and_scale`).

        Usage::

            normal = AutoNormal(model)
            svi = SVI(model, normal, Adam({"lr": 1e-3}), TraceMeanField_ELBO())
            svi.step(x, y)  # train
            guide = AutoKTiedNormal.from_guide(normal, rank=2)

        The fit is exact at full rank (:math:`k \ge \min(m, n)`) and for std
        matrices of rank at most 2; at rank 1 it is the best rank-1 fit in
        Frobenius norm. The model is not run: the new guide reuses ``guide``'s
        prototype trace, so ``guide`` must be set up (called once).

        :param guide: A set-up guide :mod:`~pyro_vinit.guides.site_params`
            supports, of any family.
        :param int rank: The number :math:`k` of tied components.
        :param callable create_plates: As for the constructor; defaults to
            ``guide``'s.
        :rtype: AutoKTiedNormal
        :raises ValueError: if the param store already holds parameters under
            this guide's name (e.g. of another AutoKTiedNormal), which the new
            guide would otherwise pick up at its first call.
        """
        site_params.check_supported(guide)
        sites = site_params.latent_sites(guide)  # raises if guide is not set up
        values = {}
        with torch.no_grad():
            for name in sites:
                loc, scale = site_params.get_loc_and_scale(guide, name)
                values[name] = loc.detach().clone(), scale.detach().clone()
        if create_plates is None:
            create_plates = guide.create_plates
        new = cls(unwrap_init_messenger(guide.model), rank=rank, create_plates=create_plates)
        prefix = new._pyro_name + "."
        taken = sorted(key for key in pyro.get_param_store().keys() if key.startswith(prefix))
        if taken:
            raise ValueError(
                f"AutoKTiedNormal.from_guide: the param store already holds {taken[:3]}..., "
                "which a new guide of this name would pick up at its first call instead of "
                "the values from_guide computes; save them if needed, then remove them "
                "(pyro.clear_param_store(), or del pyro.get_param_store()[name])"
            )
        share_prototype(guide, new)
        new._setup_params()
        for name, (loc, scale) in values.items():
            new.set_loc_and_scale(name, loc, scale)
        return new

    def get_scale_factors(self, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """
        Returns the positive factors :math:`(U, V)` of the std matrix of a tied
        site ``name``, of shapes ``batch_shape + (m, k)`` and ``batch_shape + (n, k)``.

        :param str name: A latent site with two or more unconstrained event dims.
        :rtype: tuple
        """
        self.get_loc_and_scale(name)  # validates set-up and name
        if name not in self._tied_shapes:
            raise KeyError(
                f"site {name!r} has fewer than two event dims, so its scale is not tied; "
                f"tied sites are {sorted(self._tied_shapes)}"
            )
        return self._get_factors(name)
