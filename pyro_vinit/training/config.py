"""
The training configuration of :func:`~pyro_vinit.training.fit`, its history,
and which guides count as initialized.
"""

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass, field, replace
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    List,
    Optional,
)

import pyro
import torch
from pyro.infer import TraceMeanField_ELBO
from pyro.infer.autoguide import AutoGuide, AutoGuideList, AutoNormal
from pyro.optim import PyroOptim
from pyro.poutine.messenger import Messenger
from torch import nn

from pyro_vinit._pyro_compat import handler_chain
from pyro_vinit.guides import AutoKTiedNormal, AutoMeanFieldNormal, AutoRadialNormal
from pyro_vinit.guides.site_params import get_loc_and_scale, is_supported, latent_sites
from pyro_vinit.initialization._marks import marked_initialized
from pyro_vinit.poutine import (
    AutoWeightNoise,
    KLAnnealingMessenger,
    flipout,
    local_reparam,
    weight_noise,
)
from pyro_vinit.training.averaging import ParamAverage, _check_decay
from pyro_vinit.training.optim import GroupedAdam

__all__ = ["FitConfig", "FitHistory", "fit_config", "is_initialized"]


@dataclass(frozen=True)
class FitConfig:
    """
    The training configuration :func:`fit` uses, for users who keep their own
    SVI loop (see :func:`fit_config`).

    Usage::

        config = fit_config(guide)
        svi = SVI(model, guide, config.optimizer(), config.elbo())
        average = config.averager()
        with config.handlers():
            svi.step(x, y)
        average.update()

    :param float lr: Adam's learning rate.
    :param int warmup_steps: Steps over which the learning rate rises
        linearly to ``lr`` (:class:`~pyro_vinit.training.GroupedAdam`), so
        that Adam's first steps keep the initialization's head start.
    :param float kl_weight: The weight :math:`\\lambda` of the KL term
        (:class:`~pyro_vinit.poutine.KLAnnealingMessenger`): 0.01, or 0.3
        for a model that learns its likelihood's noise scale (:func:`fit_config`).
    :param int num_particles: Monte Carlo samples per ELBO evaluation.
    :param callable weight_noise: Returns a fresh weight-noise handler
        (e.g. ``functools.partial(local_reparam, conv=False)``), or None.
    :param float max_scale_ratio: I-BLM's cap on the guide's standard
        deviations, relative to the prior's.
    :param int iblm_batch_size: I-BLM's rows per unit, at most half the
        data (:meth:`iblm_options`).
    :param float average: The decay of the moving average of the parameters
        (:class:`~pyro_vinit.training.ParamAverage`) that :func:`fit`
        evaluates and returns; 0 for the last step's values.
    """

    lr: float = 3e-3
    warmup_steps: int = 50
    kl_weight: float = 0.01
    num_particles: int = 1
    weight_noise: Optional[Callable[[], ContextManager[Any]]] = None
    max_scale_ratio: Optional[float] = 0.1
    iblm_batch_size: int = 512
    average: float = 0.99

    def iblm_options(self, num_data: int) -> Dict[str, Any]:
        """The options of :func:`~pyro_vinit.init_guide_iblm` for ``num_data``
        rows: ``max_scale_ratio``, and ``iblm_batch_size`` rows per unit but at
        most half of them, so that the hidden units' slabs differ (with every
        row, the units of a target column would fit one regression)."""
        return {"batch_size": max(1, min(self.iblm_batch_size, num_data // 2)),
                "max_scale_ratio": self.max_scale_ratio}

    def optimizer(self) -> PyroOptim:
        """A fresh :class:`~pyro_vinit.training.GroupedAdam` at :attr:`lr`, warmed
        up over :attr:`warmup_steps`: the values of ``pyro.optim.Adam`` (after the
        warm-up) with one fused step over all parameters."""
        return GroupedAdam({"lr": self.lr}, warmup_steps=self.warmup_steps)

    def averager(self, module: Optional[nn.Module] = None) -> ParamAverage:
        """A fresh :class:`~pyro_vinit.training.ParamAverage` with decay :attr:`average`,
        to update after each step: of the param store's parameters, or of ``module``'s
        (under ``module_local_params=True``, e.g. the loss module)."""
        return ParamAverage(self.average, module=module)

    def elbo(self) -> TraceMeanField_ELBO:
        """A fresh ``TraceMeanField_ELBO`` with :attr:`num_particles`."""
        return TraceMeanField_ELBO(
            num_particles=self.num_particles, vectorize_particles=self.num_particles > 1
        )

    def handlers(self) -> ContextManager[Any]:
        """A context in which to call ``svi.step``: the KL weight and the weight-noise
        handler, entered afresh at each use (at the ``with``; a handler that refuses
        to enter leaves Pyro's handler stack as it was)."""
        return self._handlers()

    @contextlib.contextmanager
    def _handlers(self) -> Iterator[None]:
        with KLAnnealingMessenger(self.kl_weight):
            if self.weight_noise is None:
                yield
            else:
                with self.weight_noise():
                    yield


# Per-example noise on linear layers; convolutions keep their weight sample, whose
# per-example noise costs more than it buys (docs/methods/training.rst).
_LINEAR_LRT = functools.partial(local_reparam, conv=False)
_LINEAR_FLIPOUT = functools.partial(flipout, conv=False)
_LINEAR_AUTO = functools.partial(weight_noise, config=AutoWeightNoise(conv=False))


def _default_weight_noise(guide: Callable[..., Any]) -> Optional[Callable[[], ContextManager[Any]]]:
    if isinstance(guide, AutoRadialNormal):
        return _LINEAR_FLIPOUT
    if isinstance(guide, (AutoKTiedNormal, AutoMeanFieldNormal, AutoNormal)):
        return _LINEAR_LRT
    if isinstance(guide, AutoGuideList) and any(
            _default_weight_noise(member) is not None for member in guide):
        return _LINEAR_AUTO  # each site its own strategy: LRT or Flipout by its family
    return None


def _chosen_weight_noise(
    guide: Callable[..., Any], weight_noise: Optional[Callable[[], ContextManager[Any]]]
) -> Optional[Callable[[], ContextManager[Any]]]:
    """``weight_noise`` (checked), or the guide's default where it is None."""
    if weight_noise is None:
        return _default_weight_noise(guide)
    if isinstance(weight_noise, Messenger):
        raise TypeError(
            f"fit: weight_noise takes a callable that returns a fresh handler, entered at "
            f"each step (e.g. local_reparam), not a handler ({type(weight_noise).__name__})")
    if not callable(weight_noise):
        raise TypeError(
            "fit: weight_noise must be a callable that returns a fresh handler (e.g. "
            "pyro_vinit.poutine.local_reparam, or lambda: weight_noise(config=...)), or "
            f"contextlib.nullcontext for none; got {type(weight_noise).__name__}")
    return weight_noise


#: fit's KL weight for a model that learns its likelihood's noise scale, where 0.01 lets
#: the noise collapse onto the training residuals (the "Training" method page).
_LEARNED_NOISE_KL_WEIGHT = 0.3


def _declared_noise(guide: Callable[..., Any]) -> Optional[bool]:
    # What the guide's model says of itself, where it can: None for any other model.
    from pyro_vinit.nn import BayesianClassifier, BayesianRegressor

    model = getattr(guide, "model", None)
    chain = handler_chain(model) if model is not None else []
    if chain:  # the model inside the guide's InitMessenger (and the user's handlers)
        model = chain[-1][1]
    if isinstance(model, BayesianRegressor):
        return model.learn_noise
    if isinstance(model, BayesianClassifier):
        return False
    return None


def _check_positive(name: str, value: Any, kind: Any = (int, float)) -> None:
    if (isinstance(value, bool) or not isinstance(value, kind)
            or not math.isfinite(value) or not value > 0):
        raise ValueError(f"fit: {name} must be a positive number, got {value!r}")


def fit_config(
    guide: Callable[..., Any],
    *,
    lr: Optional[float] = None,
    kl_weight: Optional[float] = None,
    num_particles: Optional[int] = None,
    learned_noise: Optional[bool] = None,
    average: Optional[float] = None,
    weight_noise: Optional[Callable[[], ContextManager[Any]]] = None,
) -> FitConfig:
    """
    The configuration :func:`fit` trains ``guide`` with: Adam at learning rate
    3e-3 (:class:`GroupedAdam`), reached by a linear warm-up over the first 50
    steps, ``TraceMeanField_ELBO`` with one particle,
    the KL term weighted by 0.01 (by 0.3 where the model learns its
    likelihood's noise scale), under
    ``local_reparam(conv=False)`` (:func:`~pyro_vinit.poutine.local_reparam`:
    per-example noise on linear layers and matrix products, convolutions on
    their weight sample) for factorized-Normal guides
    (AutoKTiedNormal, AutoMeanFieldNormal, AutoNormal),
    ``flipout(conv=False)`` for AutoRadialNormal,
    :func:`~pyro_vinit.poutine.weight_noise` with
    ``AutoWeightNoise(conv=False)`` (each site's strategy chosen by its
    distribution) for an ``AutoGuideList`` with a member of those, and
    no handler for other guides; before training, I-BLM with
    :meth:`FitConfig.iblm_options` (512 rows per unit, at most half the data,
    and the standard deviations capped at 0.1 times the prior's); after each
    step, a moving average of the parameters with decay 0.99
    (:meth:`FitConfig.averager`), which :func:`fit` evaluates and returns.

    Usage::

        config = fit_config(guide)
        init_guide_iblm(guide, (x, y), **config.iblm_options(len(x)))
        svi = SVI(model, guide, config.optimizer(), config.elbo())
        average = config.averager()
        with config.handlers():
            svi.step(x, y)
        average.update()
        average.write()  # at the end

    :param guide: The guide.
    :param float lr: Overrides the learning rate.
    :param float kl_weight: Overrides the KL weight.
    :param int num_particles: Overrides the number of particles.
    :param bool learned_noise: Whether the model learns its likelihood's
        noise scale (a param, a latent site or a network's output; KL weight
        0.3) or not (a classifier, a fixed noise; 0.01). None: read from the
        guide's model, a :class:`~pyro_vinit.nn.BayesianRegressor` (its
        ``learn_noise``) or :class:`~pyro_vinit.nn.BayesianClassifier`; for
        any other model, 0.01 with a warning (:func:`fit` reads it from the
        model's likelihood).
    :param float average: Overrides the decay of the parameters' moving
        average, in ``[0, 1)``; 0 keeps the last step's values.
    :param callable weight_noise: Overrides the weight-noise handler: a
        callable that returns a fresh one (e.g. ``lambda:
        weight_noise(config=...)`` leaving a shared weight's site out), or
        ``contextlib.nullcontext`` for none.
    """
    if learned_noise is not None and not isinstance(learned_noise, bool):
        raise TypeError(
            f"fit: learned_noise must be True, False or None, got {learned_noise!r}")
    if average is not None:  # before the learned-noise warning below
        _check_decay(average, "fit: average")
    changes: Dict[str, Any] = {"weight_noise": _chosen_weight_noise(guide, weight_noise)}
    if lr is not None:
        _check_positive("lr", lr)
        changes["lr"] = float(lr)
    if kl_weight is not None:
        _check_positive("kl_weight", kl_weight)
        changes["kl_weight"] = float(kl_weight)
    else:
        if learned_noise is None:
            learned_noise = _declared_noise(guide)
        if learned_noise is None:
            warnings.warn(
                "fit_config: cannot tell whether the guide's model learns its likelihood's "
                "noise scale, so the KL weight is 0.01; pass learned_noise=True where it does "
                f"(a noise param, latent site or network output: KL weight "
                f"{_LEARNED_NOISE_KL_WEIGHT:g}), learned_noise=False, or kl_weight",
                UserWarning, stacklevel=2)
        elif learned_noise:
            changes["kl_weight"] = _LEARNED_NOISE_KL_WEIGHT
    if num_particles is not None:
        _check_positive("num_particles", num_particles, int)
        changes["num_particles"] = num_particles
    if average is not None:
        changes["average"] = float(average)
    return replace(FitConfig(), **changes)


@dataclass
class FitHistory:
    """
    What :func:`fit` returns: the loss of every SVI step and the validation
    metrics at each evaluation.

    :ivar list loss: ``svi.step``'s loss (the KL-weighted negative ELBO
        estimate of the whole data set) at every step of this call, and of
        the run it resumed.
    :ivar list validation: One dict per evaluation, with ``"step"``,
        ``"mnll"`` and ``"error_rate"`` (a Categorical likelihood; for a
        Bernoulli one, the share of labels whose predictive probability is
        on the wrong side of 0.5) or ``"rmse"`` (a Normal one).
    :ivar bool initialized: Whether this call initialized the guide (``init``).
    :ivar bool captured: Whether this call took its steps through
        :class:`CapturedSVI` without falling back to the eager step (which
        it warns of).
    :ivar bool compiled: Whether its captured step ran compiled by inductor.
    :ivar FitConfig config: The configuration it trained with (its ``lr`` and
        ``warmup_steps`` unused where :attr:`own_optim`).
    :ivar bool own_optim: Whether the call trained with an ``optim`` it was
        given instead of :meth:`FitConfig.optimizer`.
    """

    loss: List[float] = field(default_factory=list)
    validation: List[Dict[str, float]] = field(default_factory=list)
    initialized: bool = False
    captured: bool = False
    compiled: bool = False
    config: FitConfig = field(default_factory=FitConfig)
    own_optim: bool = False

    @property
    def steps(self) -> int:
        """Number of SVI steps taken."""
        return len(self.loss)


def is_initialized(guide: Callable[..., Any]) -> bool:
    """
    Whether :func:`fit` takes ``guide`` as initialized (and so does not run
    I-BLM on it): an autoguide written by an initializer of this package,
    trained, or loaded (by ``load_state_dict``, or into Pyro's param store,
    e.g. by ``pyro.get_param_store().load``). An autoguide that a call only
    set up (``guide(x, y)``: every scale still ``init_scale``) is not, unless
    its class's set-up values cannot be told from trained ones (e.g.
    ``AutoLowRankMultivariateNormal``, ``AutoDelta``): such a guide counts as
    initialized. A
    guide that is not an :class:`~pyro.infer.autoguide.AutoGuide` is never
    taken as initialized (I-BLM cannot start it: train it with ``init=None``).

    Usage::

        is_initialized(AutoKTiedNormal(model))  # False

    :param guide: The guide.
    """
    if isinstance(guide, AutoGuide):
        if guide.prototype_trace is not None:
            return _marked(guide) or not only_set_up(guide)
        prefix = f"{type(guide).__name__}."  # an autoguide's params are named after its class
        return any(name.startswith(prefix) for name in pyro.get_param_store().keys())
    return False


def _marked(guide: nn.Module) -> bool:
    if isinstance(guide, AutoGuideList):
        return marked_initialized(guide) or all(_marked(part) for part in guide)
    return marked_initialized(guide)


@torch.no_grad()
def only_set_up(guide: AutoGuide) -> bool:
    """Whether every scale of the set-up autoguide ``guide`` is still its
    ``init_scale`` (of every member of an ``AutoGuideList``), as a call that
    only sets the guide up leaves it."""
    if isinstance(guide, AutoGuideList):
        return all(isinstance(part, AutoGuide) and only_set_up(part) for part in guide)
    init_scale = getattr(guide, "_init_scale", None)
    if not is_supported(guide) or not isinstance(init_scale, float):
        return False
    for name in latent_sites(guide):
        _, scale = get_loc_and_scale(guide, name)
        # a set-up scale is init_scale through the guide's transform (a few ulps off);
        # one Adam step moves it by about its learning rate
        tolerance = 64 * torch.finfo(scale.dtype).eps * init_scale
        if not bool(((scale - init_scale).abs() <= tolerance).all()):
            return False
    return True
