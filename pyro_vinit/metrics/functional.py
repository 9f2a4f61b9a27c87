"""Metrics of a whole test set held in memory as posterior samples."""

import math
from typing import Dict, NamedTuple, Optional, Tuple, Union, cast

import torch

from pyro_vinit.metrics._math import (
    _bin_edges,
    _brier,
    _calibration_sums,
    _check_not_nan,
    _check_num_bins,
    _class_log_probs,
    _class_nll,
    _entropy,
    _errors,
    _predictive_log_probs,
    _regression_inputs,
    _regression_nll,
    _squared_errors,
    _two_classes,
)

__all__ = [
    "Calibration",
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


def _calibration_from_sums(
    count: torch.Tensor, sum_conf: torch.Tensor, sum_correct: torch.Tensor
) -> Calibration:
    ece = (sum_correct - sum_conf).abs().sum() / count.sum()
    denom = count.to(sum_conf.dtype)
    empty = count == 0
    nan = sum_conf.new_full((), math.nan)
    confidence = torch.where(empty, nan, sum_conf / denom.clamp(min=1))
    accuracy = torch.where(empty, nan, sum_correct / denom.clamp(min=1))
    edges = _bin_edges(len(count), sum_conf.dtype, sum_conf.device)
    return Calibration(ece, edges, confidence, accuracy, count)


def _is_regression(logits: Optional[torch.Tensor], probs: Optional[torch.Tensor],
                   loc: Optional[torch.Tensor], scale: Union[float, torch.Tensor, None],
                   what: str) -> bool:
    """Whether a metric is asked for a regression (``loc=``, ``scale=``) rather
    than a classification (``logits=`` / ``probs=``); a mix, or one of ``loc``
    and ``scale`` alone, is refused, naming ``what`` needs them."""
    if loc is None and scale is None:
        return False
    if logits is not None or probs is not None:
        raise ValueError(
            "pass either logits=/probs= (classification) or loc=, scale= (regression)"
        )
    if loc is None or scale is None:
        raise ValueError(
            f"{what} needs both loc= (per-sample means) and scale= (the likelihood's "
            "standard deviation)"
        )
    return True


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
    if _is_regression(logits, probs, loc, scale, "regression MNLL"):
        assert loc is not None and scale is not None
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
    if _is_regression(logits, probs, loc, scale, "the regression decomposition"):
        assert loc is not None and scale is not None
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
    logits, probs, labels = _two_classes(logits, probs, y)  # (the entropy takes no labels)
    y = cast(torch.Tensor, labels)
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


