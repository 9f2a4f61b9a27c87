"""
KL annealing: weighting the KL term of the ELBO by a factor λ.
"""

import math
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, Union, overload

import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

from pyro_vinit.schedules import Schedule

if TYPE_CHECKING:
    from pyro.poutine.runtime import Message

__all__ = ["KLAnnealingMessenger", "kl_annealing"]

_F = TypeVar("_F", bound=Callable[..., Any])
ScaleType = Union[float, Callable[[int], float]]


def _check_scale(scale: float, where: str) -> float:
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"KLAnnealingMessenger: {where} must be a finite number, got {scale!r}")
    if scale < 0:
        raise ValueError(f"KLAnnealingMessenger: {where} must be >= 0, got {scale!r}")
    return float(scale)


class KLAnnealingMessenger(Messenger):
    r"""
    Scales the log densities of all *latent* sample sites by a factor
    :math:`\lambda`, leaving observed sites (the likelihood) alone. Applied to
    the model and the guide alike, it turns the ELBO into

    .. math::

        \mathcal{L}_\lambda = \mathbb{E}_q[\log p(y \mid w)]
            - \lambda \, \mathrm{KL}(q(w) \,\|\, p(w)),

    the annealed objective of e.g. [1] (supplement E.9) and [2].

    Usage::

        annealing = KLAnnealingMessenger(scale=LinearWarmup(1000))
        for step in range(num_steps):
            with annealing:               # model *and* guide run inside
                svi.step(x, y)
            annealing.step()              # λ ← schedule(step + 1)

    **Apply it to the model and the guide.** The ELBO estimators read the
    KL term from both sides: :class:`~pyro.infer.Trace_ELBO` forms
    :math:`\log p(w) - \log q(w)` from each side's scaled log density, and
    :class:`~pyro.infer.TraceMeanField_ELBO` scales a closed-form
    :math:`\mathrm{KL}(q \| p)` by the *guide* site's scale. Scaling only the
    model would give :math:`\lambda \log p(w) - \log q(w)` under the first and
    an unannealed KL under the second. Running ``svi.step`` (or
    ``elbo.loss``) inside the context covers both. As a decorator, wrap both
    with the same instance, ``annealing(model)`` and ``annealing(guide)``, so
    that one λ and one schedule serve both (keep the unwrapped guide for
    :meth:`~pyro.infer.autoguide.AutoGuide.median` and the like).

    Sites count as observed if Pyro marks them so when the messenger sees
    them: ``obs=`` statements, :func:`pyro.factor`, or a
    :func:`~pyro.poutine.condition` applied *inside* this messenger. Local
    latent variables (e.g. inside a data plate) are latent and get scaled
    too. Composition with plates' subsampling scale and
    :func:`~pyro.poutine.scale` is multiplicative.

    :param scale: The factor :math:`\lambda \ge 0`, either a number or a
        schedule: a callable mapping the iteration (0, 1, ...) to
        :math:`\lambda`, e.g. :class:`~pyro_vinit.schedules.SigmoidSchedule`
        or :class:`~pyro_vinit.schedules.LinearWarmup`.
    :type scale: float or callable

    :ivar float scale: The current :math:`\lambda`; may be set between steps.
    :ivar int iteration: The schedule's current iteration; setting it (e.g.
        when resuming training) re-evaluates the schedule.

    [1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
    Bayes for Deep Models"

    [2] Bowman, Vilnis, Vinyals, Dai, Jozefowicz, Bengio (2016) "Generating
    Sentences from a Continuous Space"
    """

    def __init__(self, scale: ScaleType = 1.0) -> None:
        super().__init__()
        self._iteration = 0
        if callable(scale) and not isinstance(scale, torch.Tensor):
            self.schedule: Optional[Callable[[int], float]] = scale
            self.scale = _check_scale(scale(0), f"the schedule's value at iteration 0 ({scale!r})")
        else:
            self.schedule = None
            self.scale = _check_scale(scale, "scale")

    @property
    def scale(self) -> float:
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = _check_scale(value, "scale")

    @property
    def iteration(self) -> int:
        return self._iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"KLAnnealingMessenger: iteration must be an int >= 0, got {value!r}")
        if self.schedule is not None:
            # Checked before anything changes, so a bad schedule value leaves the state as it was.
            where = f"the schedule's value at iteration {value} ({self.schedule!r})"
            self._scale = _check_scale(self.schedule(value), where)
        self._iteration = value

    def step(self) -> float:
        """
        Advances the schedule by one iteration (a no-op on a constant
        :math:`\\lambda`, apart from the count) and returns the new
        :math:`\\lambda`.
        """
        self.iteration = self._iteration + 1
        return self._scale

    def _pyro_sample(self, msg: "Message[..., Any]") -> None:
        # a plate's subsample site carries no density
        if not msg["is_observed"] and not site_is_subsample(msg):
            msg["scale"] = self._scale * msg["scale"]


@overload
def kl_annealing(fn: None = None, scale: ScaleType = 1.0) -> KLAnnealingMessenger: ...


@overload
def kl_annealing(fn: Union[float, Schedule], scale: ScaleType = 1.0) -> KLAnnealingMessenger: ...


@overload
def kl_annealing(fn: _F, scale: ScaleType = 1.0) -> _F: ...


def kl_annealing(
    fn: Union[None, float, Schedule, Callable[..., Any]] = None, scale: ScaleType = 1.0
) -> Union[KLAnnealingMessenger, Callable[..., Any]]:
    """
    Handler function of :class:`KLAnnealingMessenger`: scales the log
    densities of the latent sites of ``fn`` by ``scale``, or, without ``fn``,
    returns the messenger to use as a context manager.

    Usage::

        with kl_annealing(scale=0.1):
            loss = svi.step(x, y)

    :param callable fn: A stochastic function (model or guide), optional.
    :param scale: The factor λ, a number or a schedule ``iteration -> λ``;
        pass a schedule by keyword unless it is a
        :class:`~pyro_vinit.schedules.Schedule` (any other callable in first
        place is taken as ``fn``).
    :type scale: float or callable
    :return: The wrapped ``fn``, or a :class:`KLAnnealingMessenger`.
    """
    if fn is not None and (isinstance(fn, (int, float, Schedule, torch.Tensor))):
        # kl_annealing(0.1) or kl_annealing(SigmoidSchedule(...)) as in poutine.scale(0.1)
        scale = fn
        fn = None
    messenger = KLAnnealingMessenger(scale=scale)
    return messenger if fn is None else messenger(fn)
