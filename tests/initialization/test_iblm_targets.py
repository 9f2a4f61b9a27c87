"""I-BLM's regression targets: the refusals of observations that the
likelihood's targets cannot be made from, by message; the classification
targets and the first noise level of a regression, in closed form."""

import re

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer.autoguide import AutoNormal

from pyro_vinit import init_guide_iblm
from pyro_vinit.initialization.iblm import dirichlet_transform
from tests.common import assert_close

F64 = torch.float64


def _model(kind, k, dtype=torch.float32):
    """logits = x w^T + b, with w, b ~ N(0, 1), in ``dtype``, and the likelihood ``kind``."""

    def model(x, y=None):
        one = torch.ones((), dtype=dtype)
        w = pyro.sample("w", dist.Normal(0.0, one).expand([k, x.shape[1]]).to_event(2))
        b = pyro.sample("b", dist.Normal(0.0, one).expand([k]).to_event(1))
        out = F.linear(x, w, b)
        with pyro.plate("data", x.shape[0]):
            if kind == "categorical":
                pyro.sample("obs", dist.Categorical(logits=out), obs=y)
            elif kind == "onehot":
                pyro.sample("obs", dist.OneHotCategorical(logits=out), obs=y)
            elif kind == "bernoulli":
                pyro.sample("obs", dist.Bernoulli(logits=out[:, 0]), obs=y)
            else:
                pyro.sample("obs", dist.Normal(out.sum(-1), 1.0), obs=y)

    return model


_LABELS = torch.tensor([0, 1, 2, 1, 0, 2, 1, 0])


@pytest.mark.parametrize("kind, k, y, error, message", [
    ("categorical", 3, _LABELS + 0.5, TypeError,
     "the likelihood 'obs' is Categorical, so y must hold integer class labels (y.long()), "
     "got torch.float32"),
    ("categorical", 3, torch.where(_LABELS == 2, 3, _LABELS), ValueError,
     "y holds values outside the support of the likelihood 'obs' (Categorical, "
     "IntegerInterval(lower_bound=0, upper_bound=2)), e.g. 3: class labels must be 0 to 2 "
     "(1-based labels: y - 1)"),
    ("categorical", 3, _LABELS - 1, ValueError,
     "y holds values outside the support of the likelihood 'obs' (Categorical, "
     "IntegerInterval(lower_bound=0, upper_bound=2)), e.g. -1: class labels must be 0 to 2 "
     "(1-based labels: y - 1)"),
    ("onehot", 3, torch.tensor([1.0, 0.0, 1.0]).expand(8, 3), ValueError,
     "y holds values outside the support of the likelihood 'obs' (OneHotCategorical, "
     "OneHot()), e.g. 1.0"),
    ("onehot", 3, 2 * F.one_hot(_LABELS, 3).float(), ValueError,
     "y holds values outside the support of the likelihood 'obs' (OneHotCategorical, "
     "OneHot()), e.g. 2.0"),
    # class labels for one-hot rows (outside-user trial: no hint had said how)
    ("onehot", 3, _LABELS, ValueError,
     "y holds values outside the support of the likelihood 'obs' (OneHotCategorical, "
     "OneHot()), e.g. 0: it takes one-hot rows, F.one_hot(y, 3).float()"),
    ("bernoulli", 1, _LABELS.float(), ValueError,
     "y holds values outside the support of the likelihood 'obs' (Bernoulli, Boolean()), "
     "e.g. 2.0"),
    ("bernoulli", 1, (_LABELS > 0).long(), TypeError,
     "the likelihood 'obs' is Bernoulli, whose log-density takes floating-point 0/1 targets "
     "(y.float()), got torch.int64"),
    ("normal", 1, _LABELS, TypeError,
     "the likelihood 'obs' is Normal, continuous, so y must be floating point (y.float()), "
     "got torch.int64"),
    ("normal", 1, torch.randn(8, 1), ValueError,
     "y of shape (8, 1) does not fit the likelihood 'obs': its distribution, of batch shape "
     "(8,) and event shape (), broadcasts y to (8, 8), which would score each row against "
     "other rows' predictions; give y the batch shape followed by the event shape "
     "(y.squeeze(-1) for a column)"),
    ("normal", 2, torch.randn(8), ValueError,
     "the output layer ('w') has 2 outputs but the likelihood has 1 target columns; I-BLM "
     "needs them to match"),
], ids=["non_integer", "above", "below", "two_ones", "a_two", "labels", "bernoulli",
          "bernoulli_long",
        "normal_long", "column", "columns"])
def test_observations_the_targets_cannot_be_made_from_are_refused(kind, k, y, error, message):
    # the same checks as fit's (I-BLM had its own, and missed integer regression targets
    # and a column of targets that the likelihood broadcasts), before anything changes
    x = torch.randn(8, 4)
    guide = AutoNormal(_model(kind, k))
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        init_guide_iblm(guide, (x, y), batch_size=8)
    assert guide.prototype_trace is None and list(pyro.get_param_store().keys()) == []


def test_observations_without_the_rows_along_the_leading_dim_are_refused_by_name():
    # the observed value (1, 20) for 20 data rows: the rows are not along its leading dim
    x = torch.randn(20, 4)
    y = torch.randn(20)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, 4]).to_event(2))
        out = F.linear(x, w)
        pyro.sample("obs", dist.Normal(out.T, 1.0).to_event(2),
                    obs=None if y is None else y[None])

    guide = AutoNormal(model)
    with pytest.raises(ValueError, match=r"^the observed site has shape \(1, 20\) for 20 data "
                                         r"rows; I-BLM needs the data rows along the leading dim"):
        init_guide_iblm(guide, (x, y), batch_size=20)


@pytest.mark.parametrize("kl_weight", [1.0, 0.1])
@pytest.mark.parametrize("center_targets", [None, False])
@pytest.mark.parametrize("kind, k", [("categorical", 3), ("onehot", 3), ("bernoulli", 1)])
def test_output_layer_of_a_classification_equals_closed_form(kind, k, center_targets,
                                                             kl_weight):
    # The output layer's regressions onto the Dirichlet targets of the labels (Bernoulli:
    # the logit's, the difference of the two classes'), with their noise variances. By
    # default the targets are shifted to mean zero over all rows and columns where a
    # shift shared by the columns leaves the likelihood unchanged (the softmax of a
    # Categorical or OneHotCategorical), not for a Bernoulli logit; center_targets=False:
    # never. With kl_weight λ, the optimum of E_q[log p(y | w)] - λ KL(q || p): the
    # posterior with the likelihood counted 1 / λ times, i.e. the noise variances times λ.
    n, d, alpha = 30, 4, 0.01
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=F64)
    labels = torch.randint(k + (k == 1), (n,), generator=g)
    onehot = F.one_hot(labels, k + (k == 1)).to(F64)
    y = {"categorical": labels, "onehot": onehot, "bernoulli": labels.to(F64)}[kind]
    guide = AutoNormal(_model(kind, k, F64))
    init_guide_iblm(guide, (x, y), batch_size=n, alpha=alpha, center_targets=center_targets,
                    kl_weight=kl_weight)

    if kind == "bernoulli":
        (m1, v1), (m0, v0) = (dirichlet_transform(t, alpha) for t in (onehot[:, 1:], onehot[:, :1]))
        t, noise_var = m1 - m0, v1 + v0
    else:
        t, noise_var = dirichlet_transform(onehot, alpha)
    noise_var = kl_weight * noise_var
    if kind != "bernoulli" and center_targets is None:
        t = t - t.mean()
    design = torch.cat([x, torch.ones(n, 1, dtype=F64)], 1)
    for j in range(k):
        precision = torch.eye(d + 1, dtype=F64) + design.T @ (design / noise_var[:, j, None])
        mean = torch.linalg.solve(precision, design.T @ (t[:, j] / noise_var[:, j]))
        assert_close(guide.locs.w[j], mean[:d], atol=1e-10, rtol=1e-9)
        assert_close(guide.locs.b[j], mean[d], atol=1e-10, rtol=1e-9)
        assert_close(guide.scales.w[j].pow(2), 1 / precision.diagonal()[:d], atol=1e-12,
                     rtol=1e-9)


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_kl_weight_tempers_only_the_output_layer_of_a_classifier(task):
    # The hidden layers regress onto I-BLM's own targets, and a regression's output onto
    # the observations, with the noise level the learned noise then takes: kl_weight
    # changes neither.
    n, d, h = 60, 3, 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=F64)
    y = (x[:, 0] > 0).long() if task == "classification" else torch.sin(x[:, 0])

    def model(x, y=None):
        one = torch.ones((), dtype=F64)
        w1 = pyro.sample("w1", dist.Normal(0.0, one).expand([h, d]).to_event(2))
        k = 2 if task == "classification" else 1
        w2 = pyro.sample("w2", dist.Normal(0.0, one).expand([k, h]).to_event(2))
        out = F.linear(torch.relu(F.linear(x, w1)), w2)
        with pyro.plate("data", n):
            if task == "classification":
                pyro.sample("obs", dist.Categorical(logits=out), obs=y)
            else:
                sigma = pyro.sample("sigma", dist.LogNormal(0.0, one))
                pyro.sample("obs", dist.Normal(out[:, 0], sigma), obs=y)

    fits = []
    for kl_weight in (1.0, 0.05):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoNormal(model)
        init_guide_iblm(guide, (x, y), batch_size=n // 2, kl_weight=kl_weight)
        fits.append({name: value.detach().clone()
                     for name, value in pyro.get_param_store().items()})
    for name in fits[0]:
        same = torch.equal(fits[0][name], fits[1][name])
        assert same == (task == "regression" or "w2" not in name), name


def test_kl_weight_must_be_positive():
    x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 1, 0, 2, 1, 0])
    guide = AutoNormal(_model("categorical", 3))
    for bad in (0.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="kl_weight must be positive"):
            init_guide_iblm(guide, (x, y), batch_size=8, kl_weight=bad)
    assert guide.prototype_trace is None and not list(pyro.get_param_store().keys())


@pytest.mark.parametrize("noise_scale", [None, 0.2])
def test_hidden_layer_of_a_regression_with_a_learned_noise_is_fitted_with_its_first_level(
        noise_scale):
    # A learned noise starts at a tenth of the targets' std (or noise_scale): the noise
    # of the hidden units' regressions, whose precision diagonal, on every row, is
    # 1 / prior variance + sum_i x_i^2 / noise^2 for any targets. (Targets with std 0.3:
    # below 1, and not 1, where a tenth of the std is a tenth of its inverse; the hidden
    # targets, of std below hidden_target_scale = 1, are not shrunk.)
    n, d, h = 40, 3, 6
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=F64)
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(n, generator=g, dtype=F64)
    y = 0.3 * (y - y.mean()) / y.std()

    def model(x, y=None):
        one = torch.ones((), dtype=F64)
        w1 = pyro.sample("w1", dist.Normal(0.0, 0.5 * one).expand([h, d]).to_event(2))
        b1 = pyro.sample("b1", dist.Normal(0.0, 0.5 * one).expand([h]).to_event(1))
        w2 = pyro.sample("w2", dist.Normal(0.0, 0.5 * one).expand([1, h]).to_event(2))
        sigma = pyro.sample("sigma", dist.LogNormal(0.0, one))
        with pyro.plate("data", n):
            pyro.sample("obs", dist.Normal(F.linear(torch.tanh(F.linear(x, w1, b1)), w2)
                                           .squeeze(-1), sigma), obs=y)

    guide = AutoNormal(model)
    init_guide_iblm(guide, (x, y), batch_size=n, noise_scale=noise_scale)
    noise = 0.1 * y.std() if noise_scale is None else torch.tensor(noise_scale, dtype=F64)
    assert_close(guide.scales.w1.pow(2),
                 (4 + x.pow(2).sum(0) / noise**2).reciprocal().expand(h, d), atol=0, rtol=1e-12)
    assert_close(guide.scales.b1.pow(2),
                 (4 + n / noise**2).reciprocal().expand(h), atol=0, rtol=1e-12)


def test_a_distribution_with_a_dim_the_targets_lack_is_blamed_not_the_targets():
    # Regression (outside-user trial): one output column's logits, (8, 1) in the plate over
    # the 8 rows, broadcast to (8, 8), and the advice was to give y that shape
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,)).float()

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, 4]).to_event(2))
        with pyro.plate("data", 8):
            pyro.sample("obs", dist.Bernoulli(logits=F.linear(x, w)), obs=y)

    message = ("y of shape (8,) does not fit the likelihood 'obs': its distribution, of batch "
               "shape (8, 8) and event shape (), broadcasts y to (8, 8), which would score "
               "each row against other rows' predictions; give the distribution's parameters "
               "the shape of y (e.g. logits.squeeze(-1) for a network of one output column)")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        init_guide_iblm(AutoNormal(model), (x, y), batch_size=8)
    assert list(pyro.get_param_store().keys()) == []


def test_targets_that_do_not_broadcast_with_the_likelihood_are_refused_without_the_row_story():
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 4]).to_event(2))
        with pyro.plate("data", 8):
            pyro.sample("obs", dist.Normal(F.linear(x, w), 1.0).to_event(1), obs=y)

    message = ("y of shape (8, 2) does not fit the likelihood 'obs': its distribution, of "
               "batch shape (8,) and event shape (3,), does not broadcast with y; give y the "
               "batch shape followed by the event shape")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        init_guide_iblm(AutoNormal(model), (x, y), batch_size=8)
