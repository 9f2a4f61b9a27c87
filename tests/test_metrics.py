import math
import re
import warnings

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
LOGITS = PROBS.log()


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
        (lambda: metrics.mnll(Y, logits=LOGITS, probs=PROBS), "exactly one"),
        (lambda: metrics.mnll(Y, logits=LOGITS[0]), r"shape \(S,\) \+ y.shape \+ \(C,\)"),
        (lambda: metrics.error_rate(Y[:2], logits=LOGITS), "y.shape = \\(2,\\)"),
        (lambda: metrics.error_rate(Y + 0.5, logits=LOGITS), "not whole numbers"),
        (lambda: metrics.error_rate(Y.bool(), logits=LOGITS), r"y\.long\(\)"),
        (lambda: metrics.error_rate(torch.tensor([0, 2, 1]), logits=LOGITS), r"\[0, 2\)"),
        (lambda: metrics.brier_score(Y, probs=PROBS * 2), "sum to 1"),
        (lambda: metrics.brier_score(Y, probs=LOGITS), "pass logits or log-probabilities"),
        (lambda: metrics.calibration(Y, probs=PROBS, num_bins=0), "num_bins"),
        (lambda: metrics.mnll(torch.zeros(3), loc=torch.zeros(2, 3)), "needs both"),
        (lambda: metrics.mnll(torch.zeros(3), loc=torch.zeros(2, 3), scale=-1.0), "positive"),
        (lambda: metrics.rmse(torch.zeros(3), loc=torch.zeros(2, 3, 1)), r"squeeze\(-1\)"),
        (
            lambda: metrics.mnll(torch.zeros(3), loc=torch.zeros(2, 3), scale=torch.ones(4, 1, 1)),
            "must broadcast to loc.shape",
        ),
        (  # Predictive's samples of a scalar noise site, one per sample: (S,)
            lambda: metrics.mnll(torch.zeros(3), loc=torch.zeros(2, 3), scale=torch.ones(2)),
            r"per-sample scale of shape \(S,\) = \(2,\): pass scale\[:, None\]",
        ),
        (  # ... and with as many samples as points (e.g. a streaming batch of S points),
            # where it would broadcast along the points: ambiguous, not silently per point
            lambda: metrics.mnll(torch.zeros(2), loc=torch.zeros(2, 2), scale=torch.ones(2)),
            r"ambiguous.*scale\[:, None\] for one scale per sample, or scale\[None\]",
        ),
        (
            lambda: metrics.RegressionMetrics().update(
                torch.zeros(2), loc=torch.zeros(2, 2), scale=torch.ones(2)),
            "ambiguous",
        ),
        (
            lambda: metrics.uncertainty_decomposition(loc=torch.zeros(2, 2), scale=torch.ones(2)),
            "ambiguous",
        ),
        (  # multi-output: (S,) or one scale per output dim?
            lambda: metrics.mnll(torch.zeros(3, 2), loc=torch.zeros(2, 3, 2), scale=torch.ones(2)),
            r"as many samples as elements in loc's last dim; pass scale.reshape\(-1, 1, 1\) "
            r"for one scale per sample, or scale\[None\] for one per element of that dim",
        ),
        (lambda: metrics.mnll(Y, logits=LOGITS, loc=PROBS, scale=1.0), "either"),
        (lambda: metrics.error_rate(Y, logits=Y.expand(4, 3)), "sampled labels"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_rejects_non_tensors():
    with pytest.raises(TypeError, match="expected tensors"):
        metrics.rmse([1.0, 2.0], loc=torch.zeros(2, 2))
    # naming only what the function takes (predictive_entropy takes no y), and the remedy
    with pytest.raises(TypeError, match=r"^expected a tensor for logits, got ndarray; "
                       r"convert arrays with torch\.as_tensor$"):
        metrics.predictive_entropy(logits=LOGITS.numpy())


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


# The classification metrics, each as a function of (y, inputs); the label-free
# ones ignore y.
CLASSIFICATION_METRICS = {
    "mnll": lambda y, kw: metrics.mnll(y, **kw),
    "error_rate": lambda y, kw: metrics.error_rate(y, **kw),
    "brier_score": lambda y, kw: metrics.brier_score(y, **kw),
    "calibration": lambda y, kw: metrics.calibration(y, **kw).ece,
    "expected_calibration_error": lambda y, kw: metrics.expected_calibration_error(y, **kw),
    "classification_metrics": lambda y, kw: metrics.classification_metrics(y, **kw),
    "predictive_probs": lambda y, kw: metrics.predictive_probs(**kw),
    "predictive_entropy": lambda y, kw: metrics.predictive_entropy(**kw),
    "uncertainty_decomposition": lambda y, kw: metrics.uncertainty_decomposition(**kw),
}
LABELLED = [k for k in CLASSIFICATION_METRICS if not k.startswith(("predictive", "uncertainty"))]


@pytest.mark.parametrize("name", CLASSIFICATION_METRICS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_probs_passed_as_logits_raise(name, dtype):
    # softmax(probs) is a flatter, wrong distribution: refused with a pointer to probs=
    with pytest.raises(ValueError, match="look like probabilities.*probs="):
        CLASSIFICATION_METRICS[name](Y, {"logits": PROBS.to(dtype)})
    # probabilities rounded to 3 decimals (rows sum to 1 within 1e-3) are caught too
    rounded = torch.tensor([[[0.333, 0.333, 0.333]], [[0.5, 0.25, 0.25]]], dtype=dtype)
    with pytest.raises(ValueError, match="look like probabilities"):
        CLASSIFICATION_METRICS[name](torch.tensor([0]), {"logits": rounded})


def _as_tensor(result):
    if isinstance(result, dict):
        return torch.tensor(list(result.values()))
    return torch.stack(list(result)) if isinstance(result, tuple) else result


@pytest.mark.parametrize("name", CLASSIFICATION_METRICS)
def test_nonnegative_logits_off_the_simplex_are_accepted(name):
    # the way out that the error names: a constant added keeps the softmax
    actual = CLASSIFICATION_METRICS[name](Y, {"logits": PROBS + 1.0})
    expected = CLASSIFICATION_METRICS[name](Y, {"probs": PROBS.softmax(-1)})
    assert_close(_as_tensor(actual), _as_tensor(expected), atol=1e-6)


def _nan_at(t, index):
    t = t.clone()
    t[index] = math.nan
    return t


@pytest.mark.parametrize("name", CLASSIFICATION_METRICS)
@pytest.mark.parametrize("kind", ["logits", "probs"])
def test_nan_predictions_raise(name, kind):
    # before: a finite error rate, entropy and ECE from NaN logits
    samples = LOGITS if kind == "logits" else PROBS
    with pytest.raises(ValueError, match=rf"{kind} contains NaN \(1 of 12 values.*\(1, 2, 0\)"):
        CLASSIFICATION_METRICS[name](Y, {kind: _nan_at(samples, (1, 2, 0))})
    whole_row = _nan_at(samples, (0, 1))
    with pytest.raises(ValueError, match=rf"{kind} contains NaN \(2 of 12"):
        CLASSIFICATION_METRICS[name](Y, {kind: whole_row})


@pytest.mark.parametrize("name", LABELLED)
def test_nan_labels_raise(name):
    with pytest.raises(ValueError, match="y contains NaN"):
        CLASSIFICATION_METRICS[name](_nan_at(Y.float(), 1), {"logits": LOGITS})


def test_nan_regression_inputs_raise():
    loc, y = torch.zeros(2, 3), torch.zeros(3)
    calls = {
        "rmse": lambda y, loc, scale: metrics.rmse(y, loc=loc),
        "mnll": lambda y, loc, scale: metrics.mnll(y, loc=loc, scale=scale),
        "regression_metrics": lambda y, loc, scale: metrics.regression_metrics(
            y, loc=loc, scale=scale
        ),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match=r"loc contains NaN .*\(1, 0\)"):
            call(y, _nan_at(loc, (1, 0)), 1.0)
        with pytest.raises(ValueError, match=r"y contains NaN .*\(2,\)"):
            call(_nan_at(y, 2), loc, 1.0)
    with pytest.raises(ValueError, match="not NaN"):
        metrics.mnll(y, loc=loc, scale=torch.tensor([1.0, math.nan, 1.0]))
    with pytest.raises(ValueError, match="loc contains NaN"):
        metrics.uncertainty_decomposition(loc=_nan_at(loc, (0, 0)), scale=1.0)
    with pytest.raises(ValueError, match="not NaN"):
        metrics.uncertainty_decomposition(loc=loc, scale=math.nan)


def test_infinite_logits():
    # -inf is probability 0 and fine; +inf and an all -inf row have no distribution
    logits = torch.tensor([[[0.0, -math.inf], [-math.inf, 0.0]]])
    assert_close(metrics.mnll(torch.tensor([0, 1]), logits=logits), 0.0)
    assert_close(metrics.predictive_entropy(logits=logits), [0.0, 0.0])
    with pytest.raises(ValueError, match=r"\+inf"):
        metrics.mnll(torch.tensor([0]), logits=torch.tensor([[[0.0, math.inf]]]))
    with pytest.raises(ValueError, match="every class"):
        metrics.predictive_entropy(logits=torch.full((1, 1, 2), -math.inf))


LABEL_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
LABEL_DTYPES += [getattr(torch, d) for d in ("uint16", "uint32", "uint64") if hasattr(torch, d)]


@pytest.mark.parametrize("name", LABELLED)
@pytest.mark.parametrize("dtype", LABEL_DTYPES + [torch.float32, torch.float64])
def test_every_integer_label_dtype(name, dtype):
    # before: int32 labels crashed brier_score inside one_hot; whole-number floats are
    # labels too (non-whole ones are refused in test_errors)
    expected = CLASSIFICATION_METRICS[name](Y, {"logits": LOGITS})
    actual = CLASSIFICATION_METRICS[name](Y.to(dtype), {"logits": LOGITS})
    if isinstance(expected, dict):
        assert actual == pytest.approx(expected)
    else:
        assert_close(actual, expected)


@pytest.mark.parametrize("name", LABELLED)
def test_one_hot_labels_name_argmax(name):
    one_hot = torch.nn.functional.one_hot(Y, 2)
    for y in (one_hot, one_hot.float()):
        with pytest.raises(ValueError, match=r"one-hot labels.*y\.argmax\(-1\)"):
            CLASSIFICATION_METRICS[name](y, {"logits": LOGITS})
    # probability targets get the same pointer without being called one-hot
    with pytest.raises(ValueError, match=r"a class dimension.*y\.argmax\(-1\)"):
        CLASSIFICATION_METRICS[name](PROBS[0], {"logits": LOGITS})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["probs", "logits"])
def test_uncertainty_equal_samples_have_no_epistemic(kind, dtype):
    # every sample predicts the same distribution: all of the entropy is aleatoric
    p = torch.tensor([[0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3]], dtype=dtype).expand(5, 2, 3)
    kw = {"probs": p} if kind == "probs" else {"logits": p.log()}
    u = metrics.uncertainty_decomposition(**kw)
    entropy = -(p[0] * p[0].log()).sum(-1)
    assert u.total.dtype == dtype and u.total.shape == (2,)
    assert_close(u.total, entropy, atol=1e-6)
    assert_close(u.aleatoric, entropy, atol=1e-6)
    assert_close(u.epistemic, [0.0, 0.0], atol=1e-6)
    assert (u.epistemic >= 0).all()


@pytest.mark.parametrize("kind", ["probs", "logits"])
def test_uncertainty_disagreeing_one_hot_samples_are_all_epistemic(kind):
    # samples certain of different classes: no aleatoric part, and I(y; w) = H[p_bar]
    probs = torch.zeros(4, 2, 3, dtype=torch.float64)
    probs[:, 0] = torch.eye(3, dtype=torch.float64)[[0, 1, 0, 1]]  # p_bar = (1/2, 1/2, 0)
    probs[:, 1] = torch.eye(3, dtype=torch.float64)[[0, 1, 2, 2]]  # p_bar = (1/4, 1/4, 1/2)
    kw = {"probs": probs} if kind == "probs" else {"logits": probs.log()}
    u = metrics.uncertainty_decomposition(**kw)
    expected = [math.log(2), 1.5 * math.log(2)]
    assert_close(u.aleatoric, [0.0, 0.0])
    assert_close(u.epistemic, expected)
    assert_close(u.total, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uncertainty_matches_predictive_entropy_and_mutual_information(dtype):
    logits = 3 * torch.randn(7, 50, 4, dtype=dtype)
    u = metrics.uncertainty_decomposition(logits=logits)
    assert_close(u.total, metrics.predictive_entropy(logits=logits))
    # the epistemic part is the mutual information, mean_s KL(p_s || p_bar), >= 0
    log_p = logits.log_softmax(-1)
    log_p_bar = metrics.predictive_probs(logits=logits).log()
    kl = (log_p.exp() * (log_p - log_p_bar)).sum(-1).mean(0)
    atol = 1e-5 if dtype == torch.float32 else 1e-10
    assert_close(u.epistemic, kl, atol=atol, rtol=1e-4)
    assert_close(u.aleatoric + u.epistemic, u.total, atol=atol)
    assert (u.epistemic >= 0).all() and (u.epistemic > 0.01).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uncertainty_regression_closed_form(dtype):
    loc = torch.tensor([[0.0, 1.0], [2.0, 1.0], [4.0, 1.0]], dtype=dtype)  # S=3, N=2
    scale = torch.tensor([[1.0], [2.0], [3.0]], dtype=dtype)  # per sample
    u = metrics.uncertainty_decomposition(loc=loc, scale=scale)
    assert u.total.dtype == dtype and u.total.shape == (2,)
    aleatoric = (1 + 4 + 9) / 3
    assert_close(u.aleatoric, [aleatoric, aleatoric])
    assert_close(u.epistemic, [8 / 3, 0.0])  # mean 2, squared deviations 4, 0, 4
    assert_close(u.total, [aleatoric + 8 / 3, aleatoric])
    u = metrics.uncertainty_decomposition(loc=loc, scale=0.5)
    assert_close(u.aleatoric, [0.25, 0.25])


def test_uncertainty_regression_monte_carlo():
    # the law of total variance against draws from the S-component mixture
    g = torch.Generator().manual_seed(1)
    S, N, M = 5, 3, 400_000
    loc = torch.randn(S, N, generator=g, dtype=torch.float64)
    scale = torch.rand(S, N, generator=g, dtype=torch.float64) + 0.2
    u = metrics.uncertainty_decomposition(loc=loc, scale=scale)
    s = torch.randint(0, S, (M, N), generator=g)
    cols = torch.arange(N).expand(M, N)
    y = loc[s, cols] + scale[s, cols] * torch.randn(M, N, generator=g, dtype=torch.float64)
    # the variance of a variance estimate from M draws is about 2 var^2 / M (a 0.3% std)
    assert_close(y.var(0), u.total, rtol=0.02, atol=0)
    assert_close(y.mean(0), loc.mean(0), atol=0.02, rtol=0)


def test_uncertainty_errors():
    with pytest.raises(ValueError, match="either"):
        metrics.uncertainty_decomposition(logits=LOGITS, loc=LOGITS[..., 0], scale=1.0)
    with pytest.raises(ValueError, match="needs both"):
        metrics.uncertainty_decomposition(loc=LOGITS[..., 0])
    with pytest.raises(ValueError, match="exactly one"):
        metrics.uncertainty_decomposition()


def _sklearn_auroc(scores_in, scores_out):
    roc_auc_score = pytest.importorskip("sklearn.metrics").roc_auc_score
    labels = [0] * len(scores_in) + [1] * len(scores_out)
    return roc_auc_score(labels, torch.cat([scores_in, scores_out]).double().numpy())


@pytest.mark.parametrize("n_in, n_out", [(1, 1), (5, 9), (200, 150), (1000, 37)])
@pytest.mark.parametrize("levels", [3, 20, None])  # few distinct values: many ties
def test_ood_auroc_matches_sklearn(n_in, n_out, levels):
    g = torch.Generator().manual_seed(n_in + n_out)
    if levels is None:
        scores_in = torch.randn(n_in, generator=g, dtype=torch.float64)
        scores_out = torch.randn(n_out, generator=g, dtype=torch.float64) + 0.5
    else:
        scores_in = torch.randint(0, levels, (n_in,), generator=g).double()
        scores_out = torch.randint(1, levels + 1, (n_out,), generator=g).double()
    auroc = metrics.ood_auroc(scores_in, scores_out)
    assert auroc.shape == () and auroc.dtype == torch.float64
    assert auroc.item() == pytest.approx(_sklearn_auroc(scores_in, scores_out), abs=1e-12)
    # integer and float32 scores give the same value
    if levels is not None:
        assert metrics.ood_auroc(scores_in.long(), scores_out.int()).item() == pytest.approx(
            auroc.item(), abs=1e-12
        )
    single = metrics.ood_auroc(scores_in.float(), scores_out.float())
    assert single.dtype == torch.float32
    assert single.item() == pytest.approx(auroc.item(), abs=1e-6)


def test_ood_auroc_closed_forms():
    a, b = torch.tensor([0.0, 1.0, 2.0]), torch.tensor([3.0, 4.0])
    assert metrics.ood_auroc(a, b).item() == 1.0
    assert metrics.ood_auroc(b, a).item() == 0.0
    assert metrics.ood_auroc(a, a).item() == 0.5  # every pair a tie or mirrored
    # one tie of 3 x 2 pairs: (5 + 1/2) / 6
    assert metrics.ood_auroc(a, torch.tensor([2.0, 5.0])).item() == pytest.approx(5.5 / 6)
    assert metrics.ood_auroc(torch.tensor([-math.inf, 0.0]), torch.tensor([math.inf])) == 1.0


@pytest.mark.parametrize(
    "scores_in, scores_out, error, match",
    [
        (torch.zeros(0), torch.ones(3), ValueError, r"scores_in must be a non-empty.*\(0,\)"),
        (torch.ones(3), torch.zeros(0), ValueError, "scores_out must be a non-empty"),
        (torch.ones(3, 1), torch.ones(3), ValueError, r"shape \(N,\).*\(3, 1\)"),
        (torch.tensor([0.0, math.nan]), torch.ones(3), ValueError, "scores_in contains NaN"),
        (torch.ones(3), torch.tensor([math.nan]), ValueError, "scores_out contains NaN"),
        ([0.0, 1.0], torch.ones(3), TypeError, "expected a tensor for scores_in"),
    ],
)
def test_ood_auroc_errors(scores_in, scores_out, error, match):
    with pytest.raises(error, match=match):
        metrics.ood_auroc(scores_in, scores_out)


# Streaming accumulators: the same numbers as the functions on all points at once.

# uneven batches, one of a single point
_BATCHES = [(0, 1), (1, 40), (40, 41), (41, 103)]


def _random_classification(dtype=torch.float64, num_samples=7, num_points=103, num_classes=4):
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(num_samples, num_points, num_classes, generator=g, dtype=dtype)
    y = torch.randint(0, num_classes, (num_points,), generator=g)
    return logits, y


@pytest.mark.parametrize("kind", ["logits", "probs"])
@pytest.mark.parametrize("num_bins", [1, 15, 40])
def test_classification_accumulator_equals_functions(kind, num_bins):
    logits, y = _random_classification()
    samples = logits if kind == "logits" else logits.softmax(-1)
    acc = metrics.ClassificationMetrics(num_bins=num_bins)
    for start, stop in _BATCHES:
        acc.update(y[start:stop], **{kind: samples[:, start:stop]})
    expected = metrics.classification_metrics(y, num_bins=num_bins, **{kind: samples})
    actual = acc.compute()
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, abs=1e-12, rel=0), key
    cal = acc.calibration()
    expected_cal = metrics.calibration(y, num_bins=num_bins, **{kind: samples})
    assert torch.equal(cal.count, expected_cal.count)
    assert torch.equal(cal.bin_edges, expected_cal.bin_edges)
    for name in ("ece", "confidence", "accuracy"):
        # nan in the same (empty) bins
        torch.testing.assert_close(getattr(cal, name), getattr(expected_cal, name), atol=1e-12,
                                   rtol=0, equal_nan=True, msg=name)


def test_classification_accumulator_single_precision():
    # float32 batches are summed in float64: as close to the float64 values as
    # the function on float32 inputs is
    logits, y = _random_classification()
    acc = metrics.ClassificationMetrics()
    for start, stop in _BATCHES:
        acc.update(y[start:stop], logits=logits[:, start:stop].float())
    expected = metrics.classification_metrics(y, logits=logits)
    for key, value in acc.compute().items():
        assert value == pytest.approx(expected[key], abs=1e-6), key


@pytest.mark.parametrize("scale_kind", ["number", "per_sample"])
@pytest.mark.parametrize("event", [(), (3,)])
def test_regression_accumulator_equals_functions(scale_kind, event):
    g = torch.Generator().manual_seed(1)
    y = torch.randn((103,) + event, generator=g, dtype=torch.float64)
    loc = y + 0.5 * torch.randn((7,) + y.shape, generator=g, dtype=torch.float64)
    scale = 0.3 if scale_kind == "number" else 0.1 + torch.rand(loc.shape, generator=g,
                                                                dtype=torch.float64)
    acc = metrics.RegressionMetrics()
    for start, stop in _BATCHES:
        batch_scale = scale if scale_kind == "number" else scale[:, start:stop]
        acc.update(y[start:stop], loc=loc[:, start:stop], scale=batch_scale)
    expected = metrics.regression_metrics(y, loc=loc, scale=scale)
    actual = acc.compute()
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, abs=1e-12, rel=0), key


def test_accumulator_reset_and_sync_without_distributed():
    logits, y = _random_classification()
    acc = metrics.ClassificationMetrics()
    acc.update(y[:10], logits=logits[:, :10])
    acc.reset()
    with pytest.raises(ValueError, match=r"compute\(\) before any test point"):
        acc.compute()
    acc.update(y[10:], logits=logits[:, 10:])
    acc.sync()  # no process group: a no-op
    acc.sync()
    acc.update(y[:10], logits=logits[:, :10])
    expected = metrics.classification_metrics(y, logits=logits)
    for key, value in acc.compute().items():
        assert value == pytest.approx(expected[key], abs=1e-12, rel=0), key


def test_accumulator_errors_leave_the_state_alone():
    logits, y = _random_classification()
    acc = metrics.ClassificationMetrics()
    acc.update(y[:50], logits=logits[:, :50])
    before = acc.compute()
    # the functions' checks, with their messages
    with pytest.raises(ValueError, match="look like probabilities"):
        acc.update(y[50:], logits=logits[:, 50:].softmax(-1))
    with pytest.raises(ValueError, match="contains NaN"):
        acc.update(y[50:], logits=torch.full_like(logits[:, 50:], math.nan))
    with pytest.raises(ValueError, match=r"this batch has 3 classes, the earlier ones 4"):
        acc.update(y[50:].clamp(max=2), logits=logits[:, 50:, :3])
    assert acc.compute() == before
    with pytest.raises(ValueError, match="num_bins must be a positive integer"):
        metrics.ClassificationMetrics(num_bins=0)
    reg = metrics.RegressionMetrics()
    with pytest.raises(ValueError, match="scale must be positive"):
        reg.update(y.double(), loc=logits[..., 0], scale=0.0)
    with pytest.raises(ValueError, match=r"RegressionMetrics.compute\(\) before any test point"):
        reg.compute()


def test_accumulator_ece_matches_torchmetrics():
    torchmetrics = pytest.importorskip("torchmetrics")
    logits, y = _random_classification(num_points=500)
    ours = metrics.ClassificationMetrics()
    theirs = torchmetrics.classification.MulticlassCalibrationError(num_classes=4, n_bins=15,
                                                                    norm="l1")
    for start, stop in [(0, 1), (1, 77), (77, 500)]:
        ours.update(y[start:stop], logits=logits[:, start:stop])
        theirs.update(metrics.predictive_probs(logits=logits[:, start:stop]), y[start:stop])
    assert ours.compute()["ece"] == pytest.approx(theirs.compute().item(), abs=1e-6)


def test_ood_auroc_accumulator_equals_function():
    g = torch.Generator().manual_seed(2)
    scores_in = torch.randint(0, 20, (103,), generator=g).double()  # ties across batches
    scores_out = torch.randint(3, 25, (57,), generator=g).double()
    acc = metrics.OODAUROC()
    acc.update(scores_in=scores_in[:1])
    acc.update(scores_in=scores_in[1:40], scores_out=scores_out[:30])
    acc.update(scores_out=scores_out[30:30])  # an empty batch
    acc.update(scores_in=scores_in[40:], scores_out=scores_out[30:].float())
    expected = metrics.ood_auroc(scores_in, scores_out).item()
    assert acc.compute() == pytest.approx(expected, abs=1e-12, rel=0)
    acc.sync()  # no process group: a no-op
    assert acc.compute() == pytest.approx(expected, abs=1e-12, rel=0)
    acc.reset()
    acc.update(scores_in=scores_in)
    with pytest.raises(ValueError, match="needs in- and out-of-distribution scores, got 103 and 0"):
        acc.compute()
    with pytest.raises(ValueError, match="pass scores_in=, scores_out= or both"):
        acc.update()
    with pytest.raises(ValueError, match="scores_out contains NaN"):
        acc.update(scores_in=scores_in, scores_out=torch.tensor([math.nan]))
    acc.update(scores_out=scores_out)  # the failed update added nothing
    assert acc.compute() == pytest.approx(expected, abs=1e-12, rel=0)


def test_ood_auroc_accumulator_matches_torchmetrics():
    torchmetrics = pytest.importorskip("torchmetrics")
    g = torch.Generator().manual_seed(3)
    scores_in = torch.randn(300, generator=g, dtype=torch.float64)
    scores_out = torch.randn(200, generator=g, dtype=torch.float64) + 0.7
    ours, theirs = metrics.OODAUROC(), torchmetrics.classification.BinaryAUROC()
    for start, stop in [(0, 1), (1, 120), (120, 300)]:
        ours.update(scores_in=scores_in[start:stop], scores_out=scores_out[start:stop])
        batch = torch.cat([scores_in[start:stop], scores_out[start:stop]])
        labels = torch.cat([torch.zeros(len(scores_in[start:stop])),
                            torch.ones(len(scores_out[start:stop]))]).long()
        theirs.update(batch, labels)
    assert ours.compute() == pytest.approx(theirs.compute().item(), abs=1e-6)


def test_accumulator_sums_half_precision_batches_in_float64():
    # 3001 is not a float16 number (its neighbours are 3000 and 3002)
    y = torch.zeros(3001, dtype=torch.long)
    y[:1001] = 1  # the prediction, class 0, is wrong for these
    probs = torch.tensor([0.75, 0.25]).expand(1, 3001, 2).half()
    acc = metrics.ClassificationMetrics()
    acc.update(y, probs=probs)
    assert acc.compute()["error_rate"] == 1001 / 3001
    # every point has confidence 3/4 (a float16 number); 2000 of 3001 are right
    assert acc.compute()["ece"] == pytest.approx(0.75 - 2000 / 3001, abs=1e-12, rel=0)
    reg = metrics.RegressionMetrics()
    reg.update(torch.zeros(3001).half(), loc=torch.ones(1, 3001).half(), scale=1.0)
    assert reg.compute()["rmse"] == 1.0


def test_unambiguous_scales_with_as_many_samples_as_points():
    # S == N: the explicit per-sample (S, 1) and per-point (1, N) forms give the closed
    # forms; one Normal(0, s) sample per scale, targets y = 0: -log p = log(s sqrt(2 pi))
    loc, y = torch.zeros(2, 2), torch.zeros(2)
    per_sample, per_point = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0])
    half_log_2pi = 0.5 * math.log(2 * math.pi)
    # per sample: each point's density is the mixture of N(0, 1) and N(0, 2) at 0
    mixture = -math.log(0.5 * (1.0 + 0.5)) + half_log_2pi
    assert_close(metrics.mnll(y, loc=loc, scale=per_sample[:, None]), torch.tensor(mixture))
    points = half_log_2pi + 0.5 * (math.log(1.0) + math.log(3.0))
    assert_close(metrics.mnll(y, loc=loc, scale=per_point[None]), torch.tensor(points))


@pytest.mark.parametrize("form", ["logits (S, N)", "logits (S, N, 1)", "probs (S, N)",
                                  "probs (S, N, 1)"])
def test_a_binary_classifiers_one_logit_a_row_is_scored_as_its_bernoulli(form):
    # (S, N) logits were refused with advice that failed next ("labels y must lie in [0, 1)")
    import pyro.distributions as dist

    torch.manual_seed(0)
    y = torch.randint(0, 2, (50,))
    logits = torch.randn(8, 50) + 2 * (y - 0.5)
    given = logits if form.startswith("logits") else torch.sigmoid(logits)
    given = given[..., None] if form.endswith("1)") else given
    kw = {form.split()[0]: given}
    got = metrics.classification_metrics(y, **kw)
    two = metrics.classification_metrics(y, logits=torch.stack([0 * logits, logits], -1))
    for name in two:
        assert got[name] == pytest.approx(two[name], rel=1e-5), name
    lp = dist.Bernoulli(logits=logits).log_prob(y.float())
    assert got["mnll"] == pytest.approx(float(math.log(8) - lp.logsumexp(0).mean()), rel=1e-5)
    streamed = metrics.ClassificationMetrics()
    streamed.update(y, **kw)
    assert streamed.compute()["mnll"] == pytest.approx(got["mnll"], rel=1e-5)


def test_a_binary_classifiers_labels_may_be_a_column_beside_its_one_logit_a_row():
    # (N, 1) labels beside (S, N, 1) logits, as a network and BCE's targets come: the
    # message named the converted (S, N, 2) and advised the shape already passed
    torch.manual_seed(0)
    y = torch.randint(0, 2, (50,))
    logits = torch.randn(8, 50, 1)
    column = metrics.classification_metrics(y[:, None], logits=logits)
    assert column == metrics.classification_metrics(y, logits=logits)
    assert metrics.mnll(y[:, None], logits=logits) == metrics.mnll(y, logits=logits)


def test_binary_probabilities_passed_as_logits_are_warned_about():
    # sigmoid outputs as logits= were scored silently as logits
    torch.manual_seed(0)
    y = torch.randint(0, 2, (50,))
    logits = torch.randn(8, 50) * 2
    with pytest.warns(UserWarning, match=r"^every binary logit lies in \[0, 1\], as "
                      r"probabilities of class 1 do: if they are \(e\.g\. torch\.sigmoid's\), "
                      r"pass them as probs=$"):
        metrics.classification_metrics(y, logits=torch.sigmoid(logits))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics.classification_metrics(y, logits=logits)  # genuine logits: no warning
        metrics.classification_metrics(y, probs=torch.sigmoid(logits))


@pytest.mark.parametrize("name", ["logits", "probs"])
def test_one_networks_square_outputs_without_a_sample_dim_are_named(name):
    # (N, C) with N == C read as binary (S, N): the message was about the labels' range
    torch.manual_seed(0)
    samples = torch.randn(10, 10)
    samples = samples if name == "logits" else samples.softmax(-1)
    y = torch.arange(10)
    with pytest.raises(ValueError, match=re.escape(
            f"{name} of shape (10, 10) beside 10 labels are read as the binary {name} of class "
            "1, one a sample and row, whose labels lie in [0, 2), but y holds 0 to 9: for one "
            f"network's (N, C) {name}, pass {name}.unsqueeze(0)") + "$"):
        metrics.classification_metrics(y, **{name: samples})
    metrics.classification_metrics(y, **{name: samples.unsqueeze(0)})  # as it says


def test_labels_of_shape_n_by_one_are_told_to_squeeze():
    # (the message had advised an unsqueeze of the samples, as BayesianClassifier's does not)
    logits, y = torch.randn(20, 10, 3), torch.randint(0, 3, (10, 1))
    with pytest.raises(ValueError, match=r"y\.shape = \(10, 1\); for labels of shape "
                                         r"\(N, 1\) pass y\.squeeze\(-1\)$"):
        metrics.classification_metrics(y, logits=logits)
    metrics.classification_metrics(y.squeeze(-1), logits=logits)  # as it says


def test_one_logit_a_row_without_labels_must_say_so():
    with pytest.raises(ValueError, match=r"for a binary classifier's one logit a row use "
                                         r"\.unsqueeze\(-1\) \(S, N, 1\)$"):
        metrics.predictive_entropy(logits=torch.randn(8, 50))
    assert metrics.predictive_entropy(logits=torch.randn(8, 50, 1)).shape == (50,)
