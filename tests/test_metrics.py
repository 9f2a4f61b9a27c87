import math

import pytest
import torch
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoNormal

from pyro_vinit import metrics
from pyro_vinit.nn import BayesianClassifier, BayesianRegressor, bayesianize, mlp
from tests.common import assert_close

# Two posterior samples of the class probabilities of three points; their
# Monte Carlo average is p_bar = [[.85, .15], [.3, .7], [.38, .62]].
PROBS = torch.tensor(
    [
        [[0.9, 0.1], [0.4, 0.6], [0.5, 0.5]],
        [[0.8, 0.2], [0.2, 0.8], [0.26, 0.74]],
    ]
)
Y = torch.tensor([0, 0, 1])  # predictions are [0, 1, 1]: the second is wrong


def _inputs(kind, dtype):
    probs = PROBS.to(dtype)
    # log-probabilities plus a per-sample constant are valid logits of the same probs
    return {"probs": probs} if kind == "probs" else {"logits": probs.log() + 3.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["probs", "logits"])
def test_classification_hand_computed(kind, dtype):
    kw = _inputs(kind, dtype)
    assert_close(
        metrics.predictive_probs(**kw), [[0.85, 0.15], [0.3, 0.7], [0.38, 0.62]], atol=1e-6
    )

    nll = metrics.mnll(Y, **kw)
    assert nll.dtype == dtype and nll.shape == ()
    assert_close(nll, -(math.log(0.85) + math.log(0.3) + math.log(0.62)) / 3, atol=1e-6)

    assert_close(metrics.error_rate(Y, **kw), 1 / 3)

    # (0.15² + 0.15²) + (0.7² + 0.7²) + (0.38² + 0.38²), averaged over the 3 points
    assert_close(metrics.brier_score(Y, **kw), 2 * (0.15**2 + 0.7**2 + 0.38**2) / 3, atol=1e-6)

    h = metrics.predictive_entropy(**kw)
    expected = [-(p * math.log(p) + (1 - p) * math.log(1 - p)) for p in (0.85, 0.3, 0.38)]
    assert h.shape == (3,)
    assert_close(h, expected, atol=1e-6)


@pytest.mark.parametrize("kind", ["probs", "logits"])
def test_ece_hand_computed(kind):
    kw = _inputs(kind, torch.float64)
    # 15 bins of width 1/15: confidences .85, .7, .62 fall alone into bins 12, 10, 9
    cal = metrics.calibration(Y, **kw)
    assert_close(cal.ece, (0.15 + 0.7 + 0.38) / 3)
    assert_close(metrics.expected_calibration_error(Y, **kw), cal.ece)
    assert_close(cal.bin_edges, torch.arange(16, dtype=torch.float64) / 15)
    expected_count = torch.zeros(15, dtype=torch.long)
    expected_count[[9, 10, 12]] = 1
    assert torch.equal(cal.count, expected_count)
    assert_close(cal.confidence[[9, 10, 12]], [0.62, 0.7, 0.85])
    assert_close(cal.accuracy[[9, 10, 12]], [1.0, 0.0, 1.0])
    empty = expected_count == 0
    assert cal.confidence[empty].isnan().all() and cal.accuracy[empty].isnan().all()

    # 2 bins: all three points share the bin (.5, 1]; accuracy 2/3, mean confidence 2.17/3
    cal2 = metrics.calibration(Y, num_bins=2, **kw)
    assert_close(cal2.ece, abs(2 / 3 - 2.17 / 3))
    assert cal2.count.tolist() == [0, 3]


def test_ece_bin_edges_are_right_closed():
    # a confidence of exactly 1/2 belongs to the first of two bins (0, .5]; 1 to the last
    probs = torch.tensor([[[0.5, 0.5], [1.0, 0.0]]])
    cal = metrics.calibration(torch.tensor([0, 1]), probs=probs, num_bins=2)
    assert cal.count.tolist() == [1, 1]
    assert_close(cal.accuracy, [1.0, 0.0])
    assert_close(cal.ece, (0.5 + 1.0) / 2)


def test_perfectly_calibrated_has_zero_ece():
    # 4 points at confidence .75 of which 3 are right
    probs = torch.tensor([[0.75, 0.25]]).expand(4, 2).unsqueeze(0)
    assert_close(metrics.expected_calibration_error(torch.tensor([0, 0, 0, 1]), probs=probs), 0.0)


def test_mnll_uses_logsumexp():
    # Each sample gives the label probability e^-2000: underflows in float64,
    # yet the predictive log density is exactly -2000.
    logits = torch.tensor([[[0.0, -2000.0]], [[0.0, -2000.0]]], dtype=torch.float64)
    assert_close(metrics.mnll(torch.tensor([1]), logits=logits), 2000.0)
    # mixture of a sure-right and a sure-wrong sample: log(1/2)
    logits = torch.tensor([[[0.0, -2000.0]], [[-2000.0, 0.0]]], dtype=torch.float64)
    assert_close(metrics.mnll(torch.tensor([0]), logits=logits), math.log(2))


def test_entropy_of_certain_prediction_is_zero():
    probs = torch.tensor([[[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]])
    assert_close(metrics.predictive_entropy(probs=probs), [0.0, math.log(3)], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_regression_hand_computed(dtype):
    loc = torch.tensor([[0.0, 1.0], [2.0, 3.0]], dtype=dtype)  # predictive mean [1, 2]
    y = torch.tensor([1.0, 4.0], dtype=dtype)
    r = metrics.rmse(y, loc=loc)
    assert r.dtype == dtype
    assert_close(r, math.sqrt((0.0 + 4.0) / 2), atol=1e-6)

    c = -0.5 * math.log(2 * math.pi)
    # point 1: both samples at distance 1; point 2: distances 3 and 1
    log_p1 = c - 0.5
    log_p2 = c + math.log((math.exp(-4.5) + math.exp(-0.5)) / 2)
    assert_close(metrics.mnll(y, loc=loc, scale=1.0), -(log_p1 + log_p2) / 2, atol=1e-6)

    # scale 2: the density of each sample changes by the Normal's normalizer and exponent
    log_p1 = c - math.log(2) - 0.5 / 4
    log_p2 = c - math.log(2) + math.log((math.exp(-4.5 / 4) + math.exp(-0.5 / 4)) / 2)
    nll = metrics.mnll(y, loc=loc, scale=torch.tensor(2.0, dtype=dtype))
    assert_close(nll, -(log_p1 + log_p2) / 2, atol=1e-6)
    assert metrics.regression_metrics(y, loc=loc, scale=2.0) == pytest.approx(
        {"rmse": math.sqrt(2), "mnll": nll.item()}
    )


def test_regression_single_sample_is_gaussian_nll():
    torch.manual_seed(0)
    loc, y, scale = torch.randn(1, 20), torch.randn(20), torch.rand(20) + 0.5
    expected = torch.nn.functional.gaussian_nll_loss(
        loc[0], y, scale**2, full=True, reduction="mean"
    )
    assert_close(metrics.mnll(y, loc=loc, scale=scale), expected, atol=1e-5)


def test_regression_multi_output_sums_event():
    # y (N, 2): a point's density is the product over its two outputs
    loc = torch.zeros(1, 3, 2)
    y = torch.tensor([[0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])
    expected = (y.pow(2).sum(-1) / 2 + math.log(2 * math.pi)).mean()
    assert_close(metrics.mnll(y, loc=loc, scale=1.0), expected)
    assert_close(metrics.rmse(y, loc=loc), y.pow(2).mean().sqrt())


def test_classification_metrics_dict():
    out = metrics.classification_metrics(Y, probs=PROBS)
    assert set(out) == {"error_rate", "mnll", "ece", "brier", "mean_entropy"}
    assert all(isinstance(v, float) for v in out.values())
    assert out["error_rate"] == pytest.approx(1 / 3)
    assert out["ece"] == pytest.approx(1.23 / 3, abs=1e-6)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: metrics.mnll(Y), "exactly one of logits= or probs="),
        (lambda: metrics.mnll(Y, logits=PROBS, probs=PROBS), "exactly one"),
        (lambda: metrics.mnll(Y, logits=PROBS[0]), r"shape \(S,\) \+ y.shape \+ \(C,\)"),
        (lambda: metrics.error_rate(Y[:2], logits=PROBS), "y.shape = \\(2,\\)"),
        (lambda: metrics.error_rate(Y.float(), logits=PROBS), "integer labels"),
        (lambda: metrics.error_rate(torch.tensor([0, 2, 1]), logits=PROBS), r"\[0, 2\)"),
        (lambda: metrics.brier_score(Y, probs=PROBS * 2), "sum to 1"),
        (lambda: metrics.calibration(Y, probs=PROBS, num_bins=0), "num_bins"),
        (lambda: metrics.mnll(torch.zeros(3), loc=torch.zeros(2, 3)), "needs both"),
        (lambda: metrics.mnll(torch.zeros(3), loc=torch.zeros(2, 3), scale=-1.0), "positive"),
        (lambda: metrics.rmse(torch.zeros(3), loc=torch.zeros(2, 3, 1)), r"squeeze\(-1\)"),
        (lambda: metrics.mnll(Y, logits=PROBS, loc=PROBS, scale=1.0), "either"),
        (lambda: metrics.error_rate(Y, logits=Y.expand(4, 3)), "sampled labels"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_rejects_non_tensors():
    with pytest.raises(TypeError, match="expected tensors"):
        metrics.rmse([1.0, 2.0], loc=torch.zeros(2, 2))


def test_with_predictive_classifier():
    # the intended pipeline: Predictive's "_RETURN" of BayesianClassifier are logits (S, N, C)
    x, y = torch.randn(7, 4), torch.randint(0, 3, (7,))
    model = BayesianClassifier(bayesianize(mlp((4, 5, 3))))
    guide = AutoNormal(model)
    guide(x, y)  # set up from the conditioned model, as the first SVI step would
    samples = Predictive(model, guide=guide, num_samples=6, return_sites=["_RETURN", "obs"])(x)
    logits = samples["_RETURN"]
    assert logits.shape == (6, 7, 3)
    out = metrics.classification_metrics(y, logits=logits)
    assert 0.0 <= out["error_rate"] <= 1.0 and 0.0 <= out["ece"] <= 1.0
    # the MC predictive probabilities are the mean of the per-sample softmax
    assert_close(metrics.predictive_probs(logits=logits), logits.softmax(-1).mean(0), atol=1e-6)


def test_with_predictive_regressor():
    x, y = torch.randn(9, 2), torch.randn(9)
    model = BayesianRegressor(bayesianize(mlp((2, 4, 1))), noise_scale=0.5)
    guide = AutoNormal(model)
    guide(x, y)
    samples = Predictive(model, guide=guide, num_samples=5, return_sites=["_RETURN"])(x)
    means = samples["_RETURN"]
    assert means.shape == (5, 9)
    assert_close(metrics.rmse(y, loc=means), (means.mean(0) - y).pow(2).mean().sqrt())
    assert torch.isfinite(metrics.mnll(y, loc=means, scale=model.noise_scale))
