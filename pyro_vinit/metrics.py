"""
Test metrics of Bayesian predictive distributions estimated from posterior
samples.

Every function takes the targets ``y`` and the per-sample parameters of the
likelihood, with the posterior samples along the leftmost dimension (as
:class:`~pyro.infer.Predictive` stacks them):

- classification: ``logits`` (or ``probs``) of shape ``(S, N, C)`` and integer
  labels ``y`` of shape ``(N,)``;
- regression: means ``loc`` of shape ``(S,) + y.shape`` and, where a density is
  needed, the likelihood's standard deviation ``scale`` (a number or a tensor
  broadcastable to ``loc``).

Sampled labels, as :class:`~pyro.infer.Predictive` returns them for the
observed site of a classifier, carry less information than the per-sample
probabilities and are refused with a pointer to the logits.

Inputs that would give a plausible but wrong number are refused with an error
that says what to pass instead: ``logits`` whose every row is non-negative and
sums to 1 (probabilities: pass ``probs=``), NaN in any input (a diverged model
would otherwise get a finite error rate or entropy), ``+inf`` logits, and
one-hot labels (pass class indices, ``y.argmax(-1)``). Labels may have any
integer dtype, or be floats holding whole numbers.

The Monte Carlo predictive distribution is the mixture of the ``S``
likelihoods, :math:`p(y \\mid x) \\approx \\frac{1}{S} \\sum_s p(y \\mid x, w_s)`.

:class:`ClassificationMetrics` and :class:`RegressionMetrics` compute the
same metrics over batches of test points, holding sums instead of the
samples, and reduce them across the processes of :mod:`torch.distributed`.

Usage::

    predictive = Predictive(model, guide=guide, num_samples=100, return_sites=["_RETURN"])
    logits = predictive(x_test)["_RETURN"]            # (100, N, C) for BayesianClassifier
    metrics.classification_metrics(y_test, logits=logits)
"""

import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union, overload

import torch

__all__ = [
    "Calibration",
    "ClassificationMetrics",
    "OODAUROC",
    "RegressionMetrics",
    "UncertaintyDecomposition",
    "brier_score",
    "calibration",
    "classification_metrics",
    "error_rate",
    "expected_calibration_error",
    "mnll",
    "ood_auroc",
    "predictive_entropy",
    "predictive_probs",
    "regression_metrics",
    "rmse",
    "uncertainty_decomposition",
]

# How far from 1 the row sums of non-negative "logits" may be for them to be
# taken for probabilities (loose enough for probabilities saved in float16 or
# rounded to a few decimals).
_PROBS_ATOL = 1e-3


def _check_samples(
    name: str, samples: torch.Tensor, y: Optional[torch.Tensor], extra_dims: int
) -> None:
    if not isinstance(samples, torch.Tensor) or not isinstance(y, (torch.Tensor, type(None))):
        raise TypeError(
            f"expected tensors for {name} and y, "
            f"got {type(samples).__name__} and {type(y).__name__}"
        )
    expected = samples.shape[1 : samples.dim() - extra_dims]
    if samples.dim() < 1 + extra_dims + 1 or (y is not None and expected != y.shape):
        what = "(S,) + y.shape + (C,)" if extra_dims else "(S,) + y.shape"
        got = "" if y is None else f" and y.shape = {tuple(y.shape)}"
        raise ValueError(
            f"{name} must have shape {what} with the posterior samples on the left, "
            f"got {name}.shape = {tuple(samples.shape)}{got}; "
            "for a single prediction use .unsqueeze(0), "
            "for a (N, 1) network output use .squeeze(-1)"
        )


def _check_not_nan(name: str, value: torch.Tensor) -> None:
    # A NaN would otherwise come out as NaN from some metrics and as a plausible
    # number from others (argmax, binning, 0 * log 0 guards), so it is refused.
    if value.is_floating_point():
        nan = value.isnan()
        if nan.any():
            first = tuple(int(i) for i in nan.nonzero()[0])
            raise ValueError(
                f"{name} contains NaN ({int(nan.sum())} of {value.numel()} values, the first "
                f"at index {first}); a metric of it would be meaningless: check the model and "
                "the guide for divergence (e.g. a smaller learning rate), or drop those points"
            )


def _looks_one_hot(y: torch.Tensor) -> bool:
    return bool(((y == 0) | (y == 1)).all() and (y.sum(-1) == 1).all())


def _labels(y: torch.Tensor, samples: torch.Tensor, name: str) -> torch.Tensor:
    # Class indices (N,) as long, or a clear error; checked before the shape so
    # that one-hot labels get their own message.
    num_classes = samples.shape[-1]
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"expected a tensor of labels y, got {type(y).__name__}")
    if y.dim() >= 1 and y.shape == samples.shape[1:] and samples.dim() == 3:
        kind = "one-hot labels" if _looks_one_hot(y) else "a class dimension"
        raise ValueError(
            f"y has shape {tuple(y.shape)} = {name}.shape[1:], as {kind} would: the metrics "
            f"take class indices of shape (N,) in [0, {num_classes}); pass y.argmax(-1)"
        )
    if y.is_complex() or y.dtype == torch.bool:
        raise ValueError(
            f"classification targets y must be integer class indices, got dtype {y.dtype}; "
            "pass y.long()"
        )
    if y.is_floating_point():
        _check_not_nan("y", y)
        if not bool((y == y.round()).all()):
            raise ValueError(
                "classification targets y must be integer class indices, got floats that are "
                f"not whole numbers (dtype {y.dtype}); pass the class indices, e.g. "
                "probs.argmax(-1) for probability targets"
            )
    # every integer dtype (int32 from numpy, uint8 from image files, ...) becomes
    # long, the index type that gather and one_hot need
    return y.long()


@overload
def _class_log_probs(
    y: torch.Tensor, logits: Optional[torch.Tensor], probs: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]: ...


@overload
def _class_log_probs(
    y: None, logits: Optional[torch.Tensor], probs: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, None]: ...


def _class_log_probs(
    y: Optional[torch.Tensor], logits: Optional[torch.Tensor], probs: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    # Per-sample log class probabilities (S, N, C) and the labels as long.
    if logits is not None and probs is None:
        samples, name = logits, "logits"
    elif probs is not None and logits is None:
        samples, name = probs, "probs"
    else:
        raise ValueError("pass exactly one of logits= or probs= (shape (S, N, C))")
    if isinstance(samples, torch.Tensor) and not samples.is_floating_point():
        raise ValueError(
            f"{name} must be floating point of shape (S, N, C), got dtype {samples.dtype} and "
            f"shape {tuple(samples.shape)}; sampled labels (Predictive's observed site) are "
            "not class probabilities: return the logits (return_sites=['_RETURN'] for "
            "BayesianClassifier), or pass probs=F.one_hot(labels, C).float() for the cruder "
            "estimate from labels"
        )
    if y is not None and isinstance(samples, torch.Tensor):
        y = _labels(y, samples, name)
    _check_samples(name, samples, y, extra_dims=1)
    if samples.dim() != 3:
        raise ValueError(f"{name} must have shape (S, N, C), got {tuple(samples.shape)}")
    _check_not_nan(name, samples)
    if y is not None:
        num_classes = samples.shape[-1]
        if y.numel() and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(
                f"labels y must lie in [0, {num_classes}), "
                f"got min {int(y.min())} and max {int(y.max())}"
            )
    if logits is not None:
        if (logits == math.inf).any():
            raise ValueError(
                "logits contain +inf, which has no softmax; -inf (probability 0) is allowed"
            )
        if (logits == -math.inf).all(-1).any():
            raise ValueError("a row of logits is -inf for every class: no class has mass")
        if (
            logits.numel()
            and logits.shape[-1] > 1
            and (logits >= 0).all()
            and ((logits.sum(-1) - 1).abs() <= _PROBS_ATOL).all()
        ):
            # Softmax of probabilities is a flattened, wrong distribution; genuine
            # logits with every row on the simplex are all but impossible.
            raise ValueError(
                "logits look like probabilities (every row is non-negative and sums to 1): "
                "pass them as probs= instead; if they really are logits, add a constant "
                "(the softmax does not change)"
            )
        return torch.log_softmax(logits, dim=-1), y
    if (samples < 0).any() or not torch.allclose(samples.sum(-1), samples.new_ones(())):
        raise ValueError(
            "probs must be non-negative and sum to 1 over the last dimension; "
            "pass logits or log-probabilities as logits="
        )
    return samples.log(), y


@overload
def _regression_inputs(
    y: Optional[torch.Tensor], loc: torch.Tensor, scale: Union[float, torch.Tensor]
) -> torch.Tensor: ...


@overload
def _regression_inputs(y: Optional[torch.Tensor], loc: torch.Tensor, scale: None) -> None: ...


def _regression_inputs(
    y: Optional[torch.Tensor], loc: torch.Tensor, scale: Union[float, torch.Tensor, None]
) -> Optional[torch.Tensor]:
    # Checks the per-sample means (and targets); returns scale as a tensor.
    _check_samples("loc", loc, y, extra_dims=0)
    _check_not_nan("loc", loc)
    if y is not None:
        _check_not_nan("y", y)
    if scale is None:
        return None
    scale = torch.as_tensor(scale, dtype=loc.dtype, device=loc.device)
    if not (scale > 0).all():
        # NaN fails the comparison too
        raise ValueError(f"scale must be positive (and not NaN), got min {scale.min().item()}")
    try:
        # torch.broadcast_shapes is unannotated.
        shape = torch.broadcast_shapes(scale.shape, loc.shape)  # type: ignore[no-untyped-call]
    except RuntimeError:
        shape = None
    if shape != loc.shape:
        raise ValueError(
            f"scale of shape {tuple(scale.shape)} must broadcast to loc.shape = "
            f"{tuple(loc.shape)} (a number, a per-point (N,) tensor, or per sample (S, N))"
        )
    return scale


def _predictive_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    # log of the Monte Carlo mixture (N, C): logsumexp over samples minus log S
    return torch.logsumexp(log_probs, dim=0) - math.log(log_probs.shape[0])


def _entropy(log_p: torch.Tensor) -> torch.Tensor:
    # over the last dimension; xlogy-style: a class of zero probability adds 0, not nan
    return -torch.where(log_p > -math.inf, log_p.exp() * log_p, log_p.new_zeros(())).sum(-1)


# The math of each metric, once: per-point values (or per-bin sums) that the
# functions below average over one tensor of test points and the streaming
# accumulators sum over batches.


def _class_nll(log_probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # (N,): -log of the mixture probability of the label, from (S, N, C)
    log_p = log_probs.gather(-1, y.expand(log_probs.shape[:-1]).unsqueeze(-1)).squeeze(-1)
    return -_predictive_log_probs(log_p)


def _regression_nll(y: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # (N,): -log of the Normal mixture density; trailing dimensions of y are one event
    log_p = torch.distributions.Normal(loc, scale).log_prob(y)
    log_p = log_p.reshape(log_p.shape[:2] + (-1,)).sum(-1)  # (S, N)
    return -_predictive_log_probs(log_p)


def _squared_errors(y: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    # y.shape: squared error of the predictive mean, element-wise
    return (loc.mean(0) - y).pow(2)


def _errors(log_p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # (N,): 1 where the most probable class of the mixture (N, C) is not the label
    return (log_p.argmax(-1) != y).to(log_p.dtype)


def _brier(log_p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # (N,): squared distance of the mixture probabilities to the one-hot label
    p = log_p.exp()
    one_hot = torch.nn.functional.one_hot(y, p.shape[-1]).to(p.dtype)
    return (p - one_hot).pow(2).sum(-1)


def _check_num_bins(num_bins: int) -> None:
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive integer, got {num_bins!r}")


def _calibration_sums(
    log_p: torch.Tensor, y: torch.Tensor, num_bins: int, dtype: Optional[torch.dtype] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Per confidence bin: the number of points (long), the sum of their
    # confidences and the number of correct predictions (summed in dtype,
    # log_p's by default).
    log_conf, pred = log_p.max(-1)
    conf = log_conf.exp()
    correct = (pred == y).to(conf.dtype)
    edges = _bin_edges(num_bins, conf.dtype, conf.device)
    # right=False: bin b holds (edges[b], edges[b + 1]]
    index = torch.bucketize(conf, edges[1:-1]).clamp(max=num_bins - 1)
    count = torch.bincount(index, minlength=num_bins)
    dtype = dtype or conf.dtype
    sum_conf = conf.new_zeros(num_bins, dtype=dtype).index_add_(0, index, conf.to(dtype))
    sum_correct = conf.new_zeros(num_bins, dtype=dtype).index_add_(0, index, correct.to(dtype))
    return count, sum_conf, sum_correct


def _bin_edges(num_bins: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.linspace(0, 1, num_bins + 1, dtype=dtype, device=device)


def _calibration_from_sums(
    count: torch.Tensor, sum_conf: torch.Tensor, sum_correct: torch.Tensor
) -> "Calibration":
    ece = (sum_correct - sum_conf).abs().sum() / count.sum()
    denom = count.to(sum_conf.dtype)
    empty = count == 0
    nan = sum_conf.new_full((), math.nan)
    confidence = torch.where(empty, nan, sum_conf / denom.clamp(min=1))
    accuracy = torch.where(empty, nan, sum_correct / denom.clamp(min=1))
    edges = _bin_edges(len(count), sum_conf.dtype, sum_conf.device)
    return Calibration(ece, edges, confidence, accuracy, count)


def predictive_probs(
    *,
    logits: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""
    The Monte Carlo predictive class probabilities
    :math:`\bar p_{nc} = \frac{1}{S} \sum_s \mathrm{softmax}(f_s(x_n))_c`.

    Usage::

        p = predictive_probs(logits=logits)   # (N, C)

    :param torch.Tensor logits: Per-sample logits ``(S, N, C)``.
    :param torch.Tensor probs: Per-sample class probabilities ``(S, N, C)``
        (instead of ``logits``).
    :return: A tensor ``(N, C)``.
    """
    return _predictive_log_probs(_class_log_probs(None, logits, probs)[0]).exp()


def mnll(
    y: torch.Tensor,
    *,
    logits: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    loc: Optional[torch.Tensor] = None,
    scale: Union[float, torch.Tensor, None] = None,
) -> torch.Tensor:
    r"""
    Test mean negative log-likelihood (MNLL): the mean over test points of the
    negative log of the Monte Carlo predictive density, computed stably with
    ``logsumexp``,

    .. math::

        \mathrm{MNLL} = -\frac{1}{N} \sum_{n=1}^N \log \frac{1}{S} \sum_{s=1}^S
            p(y_n \mid x_n, w_s).

    The likelihood is Categorical given ``logits`` or ``probs``, and Normal
    given ``loc`` and ``scale`` (for ``y`` with more than one dimension the
    trailing dimensions are one event: their log densities add up per point).

    Usage::

        mnll(y_test, logits=logits)              # classification
        mnll(y_test, loc=means, scale=0.1)       # regression

    :param torch.Tensor y: Targets: labels ``(N,)`` or real values ``(N, ...)``.
    :param torch.Tensor logits: Per-sample logits ``(S, N, C)``.
    :param torch.Tensor probs: Per-sample class probabilities ``(S, N, C)``.
    :param torch.Tensor loc: Per-sample means ``(S,) + y.shape``.
    :param scale: The Normal likelihood's standard deviation, a positive number
        or a tensor broadcastable to ``loc`` (e.g. per-sample noise).
    :type scale: float or torch.Tensor
    :return: A 0-dim tensor.
    """
    if loc is not None or scale is not None:
        if logits is not None or probs is not None:
            raise ValueError(
                "pass either logits=/probs= (classification) or loc=, scale= (regression)"
            )
        if loc is None or scale is None:
            raise ValueError(
                "regression MNLL needs both loc= (per-sample means) and scale= (the likelihood's "
                "standard deviation)"
            )
        scale = _regression_inputs(y, loc, scale)
        return _regression_nll(y, loc, scale).mean()
    log_probs, y = _class_log_probs(y, logits, probs)
    return _class_nll(log_probs, y).mean()


def rmse(y: torch.Tensor, *, loc: torch.Tensor) -> torch.Tensor:
    r"""
    Root mean squared error of the predictive mean
    :math:`\bar\mu_n = \frac{1}{S}\sum_s \mu_s(x_n)`,

    .. math::

        \mathrm{RMSE} = \sqrt{\frac{1}{N} \sum_{n=1}^N (y_n - \bar\mu_n)^2}.

    Usage::

        rmse(y_test, loc=Predictive(model, guide=guide, num_samples=100,
                                    return_sites=["_RETURN"])(x_test)["_RETURN"])

    :param torch.Tensor y: Targets ``(N,)`` (or ``(N, ...)``: the mean runs over
        all elements).
    :param torch.Tensor loc: Per-sample means ``(S,) + y.shape`` (samples of
        ``y`` itself, e.g. Predictive's ``"obs"``, give the same predictive mean).
    :return: A 0-dim tensor.
    """
    _regression_inputs(y, loc, None)
    return _squared_errors(y, loc).mean().sqrt()


def error_rate(
    y: torch.Tensor, *, logits: Optional[torch.Tensor] = None, probs: Optional[torch.Tensor] = None
) -> torch.Tensor:
    r"""
    Fraction of test points whose most probable class under the Monte Carlo
    predictive distribution :math:`\bar p` is not the label.

    Usage::

        error_rate(y_test, logits=logits)

    :param torch.Tensor y: Labels ``(N,)``.
    :param torch.Tensor logits: Per-sample logits ``(S, N, C)``.
    :param torch.Tensor probs: Per-sample class probabilities ``(S, N, C)``.
    :return: A 0-dim tensor in [0, 1].
    """
    log_probs, y = _class_log_probs(y, logits, probs)
    return _errors(_predictive_log_probs(log_probs), y).mean()


def brier_score(
    y: torch.Tensor, *, logits: Optional[torch.Tensor] = None, probs: Optional[torch.Tensor] = None
) -> torch.Tensor:
    r"""
    Brier score [1] of the Monte Carlo predictive probabilities: the mean over
    points of the squared distance to the one-hot label,

    .. math::

        \mathrm{BS} = \frac{1}{N} \sum_{n=1}^N \sum_{c=1}^C (\bar p_{nc} - [y_n = c])^2
        \in [0, 2].

    Usage::

        brier_score(y_test, logits=logits)

    :param torch.Tensor y: Labels ``(N,)``.
    :param torch.Tensor logits: Per-sample logits ``(S, N, C)``.
    :param torch.Tensor probs: Per-sample class probabilities ``(S, N, C)``.
    :return: A 0-dim tensor.

    [1] Brier (1950) "Verification of forecasts expressed in terms of probability"
    """
    log_probs, y = _class_log_probs(y, logits, probs)
    return _brier(_predictive_log_probs(log_probs), y).mean()


def predictive_entropy(
    *, logits: Optional[torch.Tensor] = None, probs: Optional[torch.Tensor] = None
) -> torch.Tensor:
    r"""
    Entropy of the Monte Carlo predictive distribution at each test point (in
    nats), :math:`H_n = -\sum_c \bar p_{nc} \log \bar p_{nc}`: the total
    predictive uncertainty, e.g. to compare in- and out-of-distribution inputs.

    Usage::

        h = predictive_entropy(logits=logits)   # (N,); h.mean() for a summary

    :param torch.Tensor logits: Per-sample logits ``(S, N, C)``.
    :param torch.Tensor probs: Per-sample class probabilities ``(S, N, C)``.
    :return: A tensor ``(N,)``, one entropy per point (not averaged).
    """
    return _entropy(_predictive_log_probs(_class_log_probs(None, logits, probs)[0]))


class UncertaintyDecomposition(NamedTuple):
    """
    Total predictive uncertainty split into its aleatoric and epistemic parts
    (see :func:`uncertainty_decomposition`), one value per test point.

    :ivar torch.Tensor total: Total uncertainty.
    :ivar torch.Tensor aleatoric: Expected uncertainty of the likelihood (data noise).
    :ivar torch.Tensor epistemic: Uncertainty due to the posterior over the weights.
    """

    total: torch.Tensor
    aleatoric: torch.Tensor
    epistemic: torch.Tensor


def uncertainty_decomposition(
    *,
    logits: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    loc: Optional[torch.Tensor] = None,
    scale: Union[float, torch.Tensor, None] = None,
) -> UncertaintyDecomposition:
    r"""
    Split of the predictive uncertainty at each test point into an aleatoric
    part, expected under the posterior, and an epistemic part, due to the
    disagreement of the posterior samples [1, 2].

    For classification (``logits`` or ``probs``) the uncertainty is the entropy
    in nats, and the epistemic part is the mutual information between the label
    and the weights (the BALD score of [3]):

    .. math::

        \underbrace{H\Big[\frac{1}{S}\sum_s p_s\Big]}_{\text{total}}
        = \underbrace{\frac{1}{S}\sum_s H[p_s]}_{\text{aleatoric}}
        + \underbrace{I(y; w)}_{\text{epistemic}\ \ge 0},

    where the total equals :func:`predictive_entropy`. For regression (``loc``
    and ``scale`` of a Normal likelihood) it is the variance, split by the law
    of total variance:

    .. math::

        \underbrace{\mathrm{Var}[y]}_{\text{total}}
        = \underbrace{\frac{1}{S}\sum_s \sigma_s^2}_{\text{aleatoric}}
        + \underbrace{\frac{1}{S}\sum_s (\mu_s - \bar\mu)^2}_{\text{epistemic}}.

    Usage::

        u = uncertainty_decomposition(logits=logits)      # each (N,)
        ood_auroc(u.epistemic[:12], u.epistemic[12:])     # in- vs out-of-distribution
        v = uncertainty_decomposition(loc=means, scale=noise_scale)

    :param torch.Tensor logits: Per-sample logits ``(S, N, C)``.
    :param torch.Tensor probs: Per-sample class probabilities ``(S, N, C)``.
    :param torch.Tensor loc: Per-sample means ``(S, N)`` (or ``(S, N, ...)``).
    :param scale: The Normal likelihood's standard deviation, a positive number
        or a tensor broadcastable to ``loc`` (e.g. per-sample heteroscedastic
        noise).
    :type scale: float or torch.Tensor
    :return: An :class:`UncertaintyDecomposition` of tensors ``(N,)`` (regression:
        ``loc.shape[1:]``). The epistemic part is computed as the difference of
        the other two, with negatives from rounding set to 0.

    [1] Depeweg, Hernández-Lobato, Doshi-Velez, Udluft (2018) "Decomposition of
    Uncertainty in Bayesian Deep Learning for Efficient and Risk-sensitive
    Learning"

    [2] Kendall, Gal (2017) "What Uncertainties Do We Need in Bayesian Deep
    Learning for Computer Vision?"

    [3] Houlsby, Huszár, Ghahramani, Lengyel (2011) "Bayesian Active Learning
    for Classification and Preference Learning"
    """
    if loc is not None or scale is not None:
        if logits is not None or probs is not None:
            raise ValueError(
                "pass either logits=/probs= (classification) or loc=, scale= (regression)"
            )
        if loc is None or scale is None:
            raise ValueError(
                "the regression decomposition needs both loc= (per-sample means) and scale= "
                "(the likelihood's standard deviation)"
            )
        scale = _regression_inputs(None, loc, scale)
        aleatoric = scale.pow(2).expand(loc.shape).mean(0)
        # the variance of the S-sample mixture: divide by S, not S - 1
        epistemic = loc.var(0, correction=0)
        return UncertaintyDecomposition(aleatoric + epistemic, aleatoric, epistemic)
    log_probs = _class_log_probs(None, logits, probs)[0]
    total = _entropy(_predictive_log_probs(log_probs))
    aleatoric = _entropy(log_probs).mean(0)
    # Jensen makes the difference non-negative; only rounding can push it below 0
    epistemic = (total - aleatoric).clamp(min=0)
    return UncertaintyDecomposition(total, aleatoric, epistemic)


def _check_scores(name: str, scores: torch.Tensor, allow_empty: bool = False) -> None:
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"expected a tensor for {name}, got {type(scores).__name__}")
    if scores.dim() != 1 or not (scores.numel() or allow_empty):
        raise ValueError(
            f"{name} must be a {'' if allow_empty else 'non-empty '}tensor of shape (N,), one "
            f"score per point, got shape {tuple(scores.shape)}"
        )
    if scores.is_complex():
        raise ValueError(f"{name} must be real, got dtype {scores.dtype}")
    _check_not_nan(name, scores)


def ood_auroc(scores_in: torch.Tensor, scores_out: torch.Tensor) -> torch.Tensor:
    r"""
    Area under the ROC curve (AUROC) of flagging out-of-distribution points by a
    higher score [1], e.g. a higher :func:`predictive_entropy`: the probability
    that an out-of-distribution point scores higher than an in-distribution
    one, ties counting one half,

    .. math::

        \mathrm{AUROC} = \frac{1}{n_{in} n_{out}} \sum_{i, j}
            \Big([s^{out}_j > s^{in}_i] + \tfrac12 [s^{out}_j = s^{in}_i]\Big),

    computed in :math:`O(n \log n)` from the ranks of the pooled scores (the
    Mann-Whitney U statistic [2]). 1 separates perfectly, 0.5 is chance.

    Usage::

        # logits (S, N, C): the first 12 points in distribution, the rest not
        ood_auroc(predictive_entropy(logits=logits[:, :12]),
                  predictive_entropy(logits=logits[:, 12:]))

    :param torch.Tensor scores_in: Scores of in-distribution points ``(N_in,)``.
    :param torch.Tensor scores_out: Scores of out-of-distribution points
        ``(N_out,)``.
    :return: A 0-dim tensor in [0, 1] (floating point of the scores' dtype,
        float64 for integer scores).

    [1] Hendrycks, Gimpel (2017) "A Baseline for Detecting Misclassified and
    Out-of-Distribution Examples in Neural Networks"

    [2] Mann, Whitney (1947) "On a Test of Whether one of Two Random Variables
    is Stochastically Larger than the Other"
    """
    _check_scores("scores_in", scores_in)
    _check_scores("scores_out", scores_out)
    dtype = torch.promote_types(scores_in.dtype, scores_out.dtype)
    if not dtype.is_floating_point:
        dtype = torch.float64
    n_in, n_out = scores_in.numel(), scores_out.numel()
    pooled = torch.cat([scores_in.to(dtype), scores_out.to(dtype)])
    values, order = pooled.sort()
    # tied scores share the mean of the ranks they span (1-based)
    runs: Tuple[torch.Tensor, torch.Tensor, torch.Tensor] = torch.unique_consecutive(
        values, return_inverse=True, return_counts=True
    )
    _, group, counts = runs
    ends = counts.cumsum(0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    rank_sum_out = mean_rank[group][order >= n_in].sum()
    u = rank_sum_out - n_out * (n_out + 1) / 2
    return (u / (n_in * n_out)).to(dtype)


class Calibration(NamedTuple):
    """
    Expected calibration error with the data of a reliability diagram (see
    :func:`calibration`). Per-bin statistics are ``nan`` for empty bins.

    :ivar torch.Tensor ece: The expected calibration error (0-dim).
    :ivar torch.Tensor bin_edges: ``num_bins + 1`` edges from 0 to 1; bin ``b``
        is the interval ``(bin_edges[b], bin_edges[b + 1]]``.
    :ivar torch.Tensor confidence: Mean confidence of the points in each bin.
    :ivar torch.Tensor accuracy: Fraction of correct predictions in each bin.
    :ivar torch.Tensor count: Number of points in each bin (integers).
    """

    ece: torch.Tensor
    bin_edges: torch.Tensor
    confidence: torch.Tensor
    accuracy: torch.Tensor
    # The public field shadows tuple.count (a method), which a Calibration never needs.
    count: torch.Tensor  # type: ignore[assignment]


def calibration(
    y: torch.Tensor,
    *,
    logits: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    num_bins: int = 15,
) -> Calibration:
    r"""
    Expected calibration error (ECE) [1, 2] and the data of a reliability
    diagram [3].

    Each test point gets the confidence :math:`\hat c_n = \max_c \bar p_{nc}` of
    its predicted class :math:`\hat y_n = \arg\max_c \bar p_{nc}`; the points
    are grouped into ``num_bins`` equal-width bins :math:`B_b` of confidence
    :math:`((b - 1) / M, b / M]`, and

    .. math::

        \mathrm{ECE} = \sum_{b=1}^M \frac{|B_b|}{N}
            \left| \mathrm{acc}(B_b) - \mathrm{conf}(B_b) \right|.

    Usage::

        cal = calibration(y_test, logits=logits)
        plt.bar(cal.bin_edges[:-1], cal.accuracy, width=1 / 15, align="edge")

    :param torch.Tensor y: Labels ``(N,)``.
    :param torch.Tensor logits: Per-sample logits ``(S, N, C)``.
    :param torch.Tensor probs: Per-sample class probabilities ``(S, N, C)``.
    :param int num_bins: Number of equal-width confidence bins (15 as in [2]).
    :return: A :class:`Calibration` with the ECE and the per-bin statistics.

    [1] Naeini, Cooper, Hauskrecht (2015) "Obtaining Well Calibrated
    Probabilities Using Bayesian Binning"

    [2] Guo, Pleiss, Sun, Weinberger (2017) "On Calibration of Modern Neural
    Networks"

    [3] Niculescu-Mizil, Caruana (2005) "Predicting Good Probabilities with
    Supervised Learning"
    """
    _check_num_bins(num_bins)
    log_probs, y = _class_log_probs(y, logits, probs)
    if y.numel() == 0:
        raise ValueError("calibration needs at least one test point")
    count, sum_conf, sum_correct = _calibration_sums(_predictive_log_probs(log_probs), y, num_bins)
    return _calibration_from_sums(count, sum_conf, sum_correct)


def expected_calibration_error(
    y: torch.Tensor,
    *,
    logits: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    num_bins: int = 15,
) -> torch.Tensor:
    """
    The expected calibration error alone; see :func:`calibration`.

    Usage::

        expected_calibration_error(y_test, logits=logits)

    :param torch.Tensor y: Labels ``(N,)``.
    :param torch.Tensor logits: Per-sample logits ``(S, N, C)``.
    :param torch.Tensor probs: Per-sample class probabilities ``(S, N, C)``.
    :param int num_bins: Number of equal-width confidence bins.
    :return: A 0-dim tensor in [0, 1].
    """
    return calibration(y, logits=logits, probs=probs, num_bins=num_bins).ece


def classification_metrics(
    y: torch.Tensor,
    *,
    logits: Optional[torch.Tensor] = None,
    probs: Optional[torch.Tensor] = None,
    num_bins: int = 15,
) -> Dict[str, float]:
    """
    The classification metrics at once, as Python floats (e.g. for a JSON
    report): ``error_rate``, ``mnll``, ``ece``, ``brier`` and
    ``mean_entropy`` (the mean :func:`predictive_entropy`).

    Usage::

        classification_metrics(y_test, logits=logits)

    :param torch.Tensor y: Labels ``(N,)``.
    :param torch.Tensor logits: Per-sample logits ``(S, N, C)``.
    :param torch.Tensor probs: Per-sample class probabilities ``(S, N, C)``.
    :param int num_bins: Number of confidence bins of the ECE.
    :rtype: dict
    """
    kw = dict(logits=logits, probs=probs)
    return {
        "error_rate": error_rate(y, **kw).item(),
        "mnll": mnll(y, **kw).item(),
        "ece": expected_calibration_error(y, num_bins=num_bins, **kw).item(),
        "brier": brier_score(y, **kw).item(),
        "mean_entropy": predictive_entropy(**kw).mean().item(),
    }


def regression_metrics(
    y: torch.Tensor, *, loc: torch.Tensor, scale: Union[float, torch.Tensor]
) -> Dict[str, float]:
    """
    The regression metrics at once, as Python floats: ``rmse`` and ``mnll``.

    Usage::

        regression_metrics(y_test, loc=means, scale=noise_scale)

    :param torch.Tensor y: Targets ``(N,)``.
    :param torch.Tensor loc: Per-sample means ``(S,) + y.shape``.
    :param scale: The Normal likelihood's standard deviation.
    :type scale: float or torch.Tensor
    :rtype: dict
    """
    return {"rmse": rmse(y, loc=loc).item(), "mnll": mnll(y, loc=loc, scale=scale).item()}


def _check_not_synced(acc: Any, what: str) -> None:
    if acc._synced:
        raise RuntimeError(
            f"{type(acc).__name__}.{what}: the state already holds every process's data, "
            "which would count twice; call reset() to start a new evaluation"
        )


# The accumulators count and sum in float64, exact or nearly so where the
# batch's dtype (float16 above 2048, float32 above 2 ** 24) would not be.


def _count(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float(n), dtype=torch.float64, device=like.device)


def _sum64(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float64).sum()


class _StreamingMetrics:
    # Sums of per-point values over batches, in float64 (counts stay exact up
    # to 2 ** 53), all-reduced in one call by sync().

    _names: Tuple[str, ...] = ()

    def __init__(self) -> None:
        self.reset()

    def _sizes(self) -> Tuple[int, ...]:
        return (1,) * len(self._names)

    def reset(self) -> None:
        """
        Forgets every batch (and a previous :meth:`sync`).
        """
        self._state = {
            name: torch.zeros(size, dtype=torch.float64)
            for name, size in zip(self._names, self._sizes())
        }
        self._synced = False

    def _add(self, **sums: torch.Tensor) -> None:
        # called once per update() with every statistic, after all the checks
        _check_not_synced(self, "update() after sync()")
        for name, value in sums.items():
            state = self._state[name]
            if state.device != value.device:
                state = state.to(value.device)
            self._state[name] = state + value.detach().to(torch.float64)

    def sync(self, process_group: Optional[Any] = None) -> None:
        """
        Sums the statistics of every process of ``process_group`` (a collective
        call: every process must make it, after its last :meth:`update`). A
        no-op where :mod:`torch.distributed` is not initialized.

        :param process_group: The process group to reduce over (default: the
            whole world).
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        _check_not_synced(self, "sync() was already called")
        flat = torch.cat([value.reshape(-1) for value in self._state.values()])
        device = flat.device
        if dist.get_backend(process_group) == "nccl":
            flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group)
        flat = flat.to(device)
        state, start = {}, 0
        for name, value in self._state.items():
            state[name] = flat[start : start + value.numel()].reshape(value.shape)
            start += value.numel()
        self._state = state
        self._synced = True

    def _num_points(self) -> float:
        num_points = self._state["num_points"].item()
        if num_points == 0:
            raise ValueError(
                f"{type(self).__name__}.compute() before any test point: call update() with "
                "each batch first"
            )
        return num_points


class ClassificationMetrics(_StreamingMetrics):
    r"""
    The metrics of :func:`classification_metrics`, accumulated over batches of
    test points: each :meth:`update` keeps sums of per-point values (and the
    per-bin sums of the ECE), not the batch, so a test set of any size takes
    memory of one batch. :meth:`sync` adds up the sums of the processes of a
    :mod:`torch.distributed` group; :meth:`compute` then gives the values of
    the functions on all the test points at once.

    Usage::

        acc = ClassificationMetrics()
        for batch in torch.arange(len(y_test)).split(10):   # a test loader's batches
            acc.update(y_test[batch], logits=logits[:, batch])
        acc.sync()      # under torch.distributed: every rank, after its last batch
        acc.compute()   # classification_metrics(y_test, logits=logits), batch by batch

    :param int num_bins: Number of confidence bins of the ECE.
    """

    _names = (
        "num_points", "error", "nll", "brier", "entropy", "bin_count", "bin_conf", "bin_correct"
    )

    def __init__(self, num_bins: int = 15) -> None:
        _check_num_bins(num_bins)
        self.num_bins = num_bins
        self._num_classes: Optional[int] = None
        super().__init__()

    def _sizes(self) -> Tuple[int, ...]:
        return (1,) * 5 + (self.num_bins,) * 3

    def reset(self) -> None:
        super().reset()
        self._num_classes = None

    def update(
        self,
        y: torch.Tensor,
        *,
        logits: Optional[torch.Tensor] = None,
        probs: Optional[torch.Tensor] = None,
    ) -> None:
        """
        Adds a batch of test points.

        :param torch.Tensor y: Labels ``(B,)``.
        :param torch.Tensor logits: Per-sample logits ``(S, B, C)``.
        :param torch.Tensor probs: Per-sample class probabilities ``(S, B, C)``.
        """
        log_probs, y = _class_log_probs(y, logits, probs)
        num_classes = log_probs.shape[-1]
        if self._num_classes is not None and num_classes != self._num_classes:
            raise ValueError(
                f"this batch has {num_classes} classes, the earlier ones "
                f"{self._num_classes}: every batch needs the same classes (reset() between "
                "evaluations of different models)"
            )
        log_p = _predictive_log_probs(log_probs)
        count, sum_conf, sum_correct = _calibration_sums(log_p, y, self.num_bins, torch.float64)
        self._add(
            num_points=_count(y.numel(), log_p),
            error=_sum64(_errors(log_p, y)),
            nll=_sum64(_class_nll(log_probs, y)),
            brier=_sum64(_brier(log_p, y)),
            entropy=_sum64(_entropy(log_p)),
            bin_count=count,
            bin_conf=sum_conf,
            bin_correct=sum_correct,
        )
        self._num_classes = num_classes

    def calibration(self) -> Calibration:
        """
        The :class:`Calibration` of the test points so far (as :func:`calibration`).
        """
        self._num_points()
        state = self._state
        return _calibration_from_sums(
            state["bin_count"].round().long(), state["bin_conf"], state["bin_correct"]
        )

    def compute(self) -> Dict[str, float]:
        """
        The metrics of the test points so far, as :func:`classification_metrics`
        gives them: ``error_rate``, ``mnll``, ``ece``, ``brier`` and ``mean_entropy``.

        :rtype: dict
        """
        n = self._num_points()
        state = self._state
        return {
            "error_rate": state["error"].item() / n,
            "mnll": state["nll"].item() / n,
            "ece": self.calibration().ece.item(),
            "brier": state["brier"].item() / n,
            "mean_entropy": state["entropy"].item() / n,
        }


class RegressionMetrics(_StreamingMetrics):
    """
    The metrics of :func:`regression_metrics` (``rmse`` and ``mnll``),
    accumulated over batches of test points; see :class:`ClassificationMetrics`.

    Usage::

        acc = RegressionMetrics()
        for batch in torch.arange(len(y_test)).split(10):
            acc.update(y_test[batch], loc=means[:, batch], scale=noise_scale)
        acc.sync()
        acc.compute()   # {"rmse": ..., "mnll": ...}
    """

    _names = ("num_points", "num_elements", "squared_error", "nll")

    def update(
        self, y: torch.Tensor, *, loc: torch.Tensor, scale: Union[float, torch.Tensor]
    ) -> None:
        """
        Adds a batch of test points.

        :param torch.Tensor y: Targets ``(B,)`` (or ``(B, ...)``).
        :param torch.Tensor loc: Per-sample means ``(S,) + y.shape``.
        :param scale: The Normal likelihood's standard deviation, a positive
            number or a tensor broadcastable to ``loc``.
        :type scale: float or torch.Tensor
        """
        scale = _regression_inputs(y, loc, scale)
        self._add(
            num_points=_count(y.shape[0], loc),
            num_elements=_count(y.numel(), loc),
            squared_error=_sum64(_squared_errors(y, loc)),
            nll=_sum64(_regression_nll(y, loc, scale)),
        )

    def compute(self) -> Dict[str, float]:
        """
        The metrics of the test points so far, as :func:`regression_metrics`
        gives them.

        :rtype: dict
        """
        n = self._num_points()
        state = self._state
        return {
            "rmse": math.sqrt(state["squared_error"].item() / state["num_elements"].item()),
            "mnll": state["nll"].item() / n,
        }


class OODAUROC:
    r"""
    The AUROC of :func:`ood_auroc`, over batches of in- and out-of-distribution
    points. The AUROC ranks all the scores, so :meth:`update` keeps them: one
    number per point (e.g. its :func:`predictive_entropy`), not its samples.
    :meth:`sync` gathers the scores of the processes of a
    :mod:`torch.distributed` group.

    Usage::

        acc = OODAUROC()
        h = predictive_entropy(logits=logits)    # first 12 points in distribution
        acc.update(scores_in=h[:12])
        acc.update(scores_out=h[12:])
        acc.sync()      # under torch.distributed: every rank, after its last batch
        acc.compute()   # ood_auroc(h[:12], h[12:])
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """
        Forgets every batch (and a previous :meth:`sync`).
        """
        self._scores: Dict[str, List[torch.Tensor]] = {"scores_in": [], "scores_out": []}
        self._synced = False

    def update(
        self, scores_in: Optional[torch.Tensor] = None, scores_out: Optional[torch.Tensor] = None
    ) -> None:
        """
        Adds the scores of a batch of in-distribution points, of
        out-of-distribution points, or both.

        :param torch.Tensor scores_in: Scores of in-distribution points ``(B_in,)``.
        :param torch.Tensor scores_out: Scores of out-of-distribution points ``(B_out,)``.
        """
        _check_not_synced(self, "update() after sync()")
        batch = {"scores_in": scores_in, "scores_out": scores_out}
        given = {name: scores for name, scores in batch.items() if scores is not None}
        if not given:
            raise ValueError("pass scores_in=, scores_out= or both (shape (B,))")
        for name, scores in given.items():
            _check_scores(name, scores, allow_empty=True)
        for name, scores in given.items():
            self._scores[name].append(scores.detach())

    def _cat(self, name: str) -> torch.Tensor:
        parts = self._scores[name]
        if not parts:
            return torch.zeros(0, dtype=torch.float64)
        dtype = parts[0].dtype
        for part in parts[1:]:
            dtype = torch.promote_types(dtype, part.dtype)
        device = parts[0].device
        return torch.cat([part.to(dtype=dtype, device=device) for part in parts])

    def sync(self, process_group: Optional[Any] = None) -> None:
        """
        Gathers the scores of every process of ``process_group`` (a collective
        call, as :meth:`ClassificationMetrics.sync`); a no-op where
        :mod:`torch.distributed` is not initialized.

        :param process_group: The process group to gather over (default: the
            whole world).
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        _check_not_synced(self, "sync() was already called")
        world_size = dist.get_world_size(process_group)
        device = torch.device("cpu")
        if dist.get_backend(process_group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        for name in self._scores:
            # float64 holds every float32 and integer score exactly
            local = self._cat(name).to(device=device, dtype=torch.float64)
            size = torch.tensor([local.numel()], device=device)
            sizes = [torch.zeros_like(size) for _ in range(world_size)]
            dist.all_gather(sizes, size, group=process_group)
            longest = int(max(int(n) for n in sizes))
            padded = torch.cat([local, local.new_zeros(longest - local.numel())])
            gathered = [torch.zeros_like(padded) for _ in range(world_size)]
            dist.all_gather(gathered, padded, group=process_group)
            self._scores[name] = [
                part[: int(n)] for part, n in zip(gathered, sizes) if int(n)
            ]
        self._synced = True

    def compute(self) -> float:
        """
        The AUROC of the scores so far (see :func:`ood_auroc`).

        :rtype: float
        """
        scores_in, scores_out = self._cat("scores_in"), self._cat("scores_out")
        if not (scores_in.numel() and scores_out.numel()):
            raise ValueError(
                f"OODAUROC.compute() needs in- and out-of-distribution scores, got "
                f"{scores_in.numel()} and {scores_out.numel()}: call update() with each first"
            )
        return ood_auroc(scores_in, scores_out).item()
