"""Shared machinery of the per-site autoguides of :mod:`pyro_vinit.guides`."""

from contextlib import ExitStack
from operator import attrgetter
from typing import Callable, Dict, Optional, Tuple

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.distributions import constraints
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_feasible
from torch.distributions import biject_to

__all__: list = []


def is_real_support(support: constraints.Constraint) -> bool:
    """Whether ``support`` is (an independent product of) the real line."""
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support is constraints.real


def deep_delattr(obj: torch.nn.Module, name: str) -> None:
    """Deletes the dotted attribute ``name`` (e.g. ``"fc1.weight"``) of ``obj``."""
    parent, _, leaf = name.rpartition(".")
    delattr(attrgetter(parent)(obj) if parent else obj, leaf)


def check_init_scale(cls: type, init_scale: float) -> None:
    if isinstance(init_scale, bool) or not isinstance(init_scale, float) or not init_scale > 0:
        raise ValueError(
            f"{cls.__name__}: init_scale must be a positive float (the initial standard "
            f"deviation of each unconstrained latent element), but got {init_scale!r}; "
            "pass e.g. init_scale=0.1"
        )


class AutoSiteGuide(AutoNormal):
    """
    Base of the mean-field autoguides whose unconstrained posterior at each
    site is a family other than a fully factorized Normal.

    Subclasses build their scale parameters in :meth:`_setup_scales` (after
    :class:`~pyro.infer.autoguide.AutoNormal` has set up ``locs``) and return
    each site's unconstrained posterior from :meth:`_unconstrained_posterior`.

    Unlike :class:`~pyro.infer.autoguide.AutoNormal`, a real-support site gets
    its posterior at the site itself rather than a ``Delta`` behind an
    auxiliary ``<name>_unconstrained`` site, so that
    :class:`~pyro.infer.TraceMeanField_ELBO` can use a closed-form KL and
    effect handlers can see the posterior's parameters. Constrained sites go
    through the unconstrained space as in ``AutoNormal``.
    """

    def __init__(
        self,
        model: Callable,
        *,
        init_loc_fn: Callable = init_to_feasible,
        init_scale: float = 0.1,
        create_plates: Optional[Callable] = None,
    ):
        check_init_scale(type(self), init_scale)
        super().__init__(
            model, init_loc_fn=init_loc_fn, init_scale=init_scale, create_plates=create_plates
        )

    def _setup_prototype(self, *args, **kwargs) -> None:
        super()._setup_prototype(*args, **kwargs)
        if not self._event_dims:
            raise RuntimeError(
                f"{type(self).__name__} found no latent sample sites in the model: there is "
                "nothing to infer. Use an empty guide, or check that the model's sample "
                "sites are not all observed or blocked."
            )
        self._setup_scales()

    def _setup_scales(self) -> None:
        raise NotImplementedError

    def _unconstrained_posterior(self, name: str) -> dist.TorchDistribution:
        """The posterior of site ``name`` in unconstrained space, with
        ``self._event_dims[name]`` event dims."""
        raise NotImplementedError

    def get_loc_and_scale(self, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """
        Returns the unconstrained-space location and scale parameters of the
        posterior at site ``name``, at full (not subsampled) size outside a
        subsampled plate.

        :param str name: A latent sample site of the model.
        :rtype: tuple
        """
        if self.prototype_trace is None:
            raise RuntimeError(
                f"{type(self).__name__} is not set up yet: call the guide once with the "
                "model's arguments (e.g. guide(x, y), or one svi.step) first."
            )
        if name not in self._event_dims:
            raise KeyError(
                f"{name!r} is not a latent site of this guide; its sites are "
                f"{sorted(self._event_dims)}"
            )
        return self._get_loc_and_scale(name)

    def forward(self, *args, **kwargs) -> Dict[str, torch.Tensor]:
        """
        An automatic guide with the same ``*args, **kwargs`` as the base ``model``.

        :return: A dict mapping sample site name to sampled value.
        :rtype: dict
        """
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)

        plates = self._create_plates(*args, **kwargs)
        result = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
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
                    dist.Delta(value, log_density=log_density, event_dim=site["fn"].event_dim),
                )
        return result
