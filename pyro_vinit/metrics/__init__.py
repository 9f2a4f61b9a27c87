"""
Test metrics of Bayesian predictive distributions estimated from posterior
samples.

Every function takes the targets ``y`` and the per-sample parameters of the
likelihood, with the posterior samples along the leftmost dimension (as
:class:`~pyro.infer.Predictive` stacks them):

- classification: ``logits`` (or ``probs``) of shape ``(S, N, C)`` and integer
  labels ``y`` of shape ``(N,)``; a binary classifier's one logit (or
  probability of class 1) a row, ``(S, N, 1)`` or, with labels, ``(S, N)``,
  is its Bernoulli's two classes;
- regression: means ``loc`` of shape ``(S,) + y.shape`` and, where a density is
  needed, the likelihood's standard deviation ``scale`` (a number or a tensor
  broadcastable to ``loc``).

Sampled labels, as :class:`~pyro.infer.Predictive` returns them for the
observed site of a classifier, carry less information than the per-sample
probabilities and are refused with a pointer to the logits.

Inputs that would give a plausible but wrong number are refused with an error
that says what to pass instead: ``logits`` whose every row is non-negative and
sums to 1 (probabilities: pass ``probs=``), NaN in any input (a diverged model
would otherwise get a finite error rate or entropy), ``+inf`` logits,
one-hot labels (pass class indices, ``y.argmax(-1)``), and a one-dimensional
``scale`` when there are as many samples as entries in ``loc``'s last dim,
the points or a multi-output model's outputs (per sample or per entry? pass
``scale[:, None]``, ``scale.reshape(-1, 1, 1)`` for multi-output, or
``scale[None]``). Labels may have any integer dtype, or be floats holding
whole numbers.

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

from pyro_vinit.metrics.functional import (
    Calibration,
    UncertaintyDecomposition,
    brier_score,
    calibration,
    classification_metrics,
    error_rate,
    expected_calibration_error,
    mnll,
    ood_auroc,
    predictive_entropy,
    predictive_probs,
    regression_metrics,
    rmse,
    uncertainty_decomposition,
)
from pyro_vinit.metrics.streaming import (
    OODAUROC,
    ClassificationMetrics,
    RegressionMetrics,
)

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
