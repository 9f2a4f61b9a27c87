"""
Schedules of the KL weight λ for
:class:`~pyro_vinit.poutine.KLAnnealingMessenger`: callables mapping the
iteration ``0, 1, 2, ...`` to a factor ``λ >= 0``.
"""

import math

__all__ = ["LinearWarmup", "Schedule", "SigmoidSchedule"]


def _check_number(cls: type, name: str, value: float, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{cls.__name__}: {name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{cls.__name__}: {name} must be positive, got {value!r}")
    if not positive and value < 0:
        raise ValueError(f"{cls.__name__}: {name} must be non-negative, got {value!r}")
    return float(value)


class Schedule:
    """
    Base class of the KL weight schedules: ``schedule(iteration)`` returns λ.
    Any callable ``int -> float`` can serve as a schedule; subclassing this
    lets :func:`~pyro_vinit.poutine.kl_annealing` recognise a schedule passed
    positionally.
    """

    def __call__(self, iteration: int) -> float:
        raise NotImplementedError


class SigmoidSchedule(Schedule):
    r"""
    The sigmoid schedule of [1] (supplement E.9), which gradually includes the
    KL term in the negative ELBO,

    .. math::

        \lambda(t) = \frac{\gamma}{1 + \exp(-\alpha (t - \beta))},

    rising from nearly 0 to :math:`\gamma`, reaching :math:`\gamma / 2` at
    iteration :math:`\beta` with slope :math:`\alpha\gamma / 4` there. [1] used
    :math:`\alpha = 2 \cdot 10^{-3}`, :math:`\beta = 2.5 \cdot 10^4`,
    :math:`\gamma = 0.1` for VGG16 on CIFAR10.

    Usage::

        annealing = KLAnnealingMessenger(scale=SigmoidSchedule(alpha=0.01, beta=500))

    :param float alpha: Steepness (per iteration), positive.
    :param float beta: Iteration of the midpoint, non-negative.
    :param float gamma: Final weight of the KL term, positive (1 recovers the ELBO).

    [1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
    Bayes for Deep Models"
    """

    def __init__(self, alpha: float, beta: float, gamma: float = 1.0) -> None:
        self.alpha = _check_number(type(self), "alpha", alpha, positive=True)
        self.beta = _check_number(type(self), "beta", beta)
        self.gamma = _check_number(type(self), "gamma", gamma, positive=True)

    def __call__(self, iteration: int) -> float:
        z = -self.alpha * (iteration - self.beta)
        # for very negative t, exp overflows; the weight is then 0 to double precision
        return self.gamma / (1.0 + math.exp(z)) if z < 700 else 0.0

    def __repr__(self) -> str:
        return f"SigmoidSchedule(alpha={self.alpha}, beta={self.beta}, gamma={self.gamma})"


class LinearWarmup(Schedule):
    r"""
    Linear warm-up of the KL weight [1] from ``start`` to ``end`` over
    ``num_steps`` iterations, constant afterwards,

    .. math::

        \lambda(t) = \lambda_0 + (\lambda_1 - \lambda_0) \min(t / T, 1).

    Usage::

        annealing = KLAnnealingMessenger(scale=LinearWarmup(1000))

    :param int num_steps: Length :math:`T` of the warm-up, positive.
    :param float start: Weight :math:`\lambda_0` at iteration 0.
    :param float end: Weight :math:`\lambda_1` from iteration ``num_steps`` on.

    [1] Bowman, Vilnis, Vinyals, Dai, Jozefowicz, Bengio (2016) "Generating
    Sentences from a Continuous Space"
    """

    def __init__(self, num_steps: int, start: float = 0.0, end: float = 1.0) -> None:
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"LinearWarmup: num_steps must be a positive int, got {num_steps!r}")
        self.num_steps = num_steps
        self.start = _check_number(type(self), "start", start)
        self.end = _check_number(type(self), "end", end)

    def __call__(self, iteration: int) -> float:
        frac = min(max(iteration, 0) / self.num_steps, 1.0)
        return self.start + (self.end - self.start) * frac

    def __repr__(self) -> str:
        return f"LinearWarmup(num_steps={self.num_steps}, start={self.start}, end={self.end})"
