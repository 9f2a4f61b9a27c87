import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Predictive, TraceMeanField_ELBO
from pyro.optim import Adam

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal
from pyro_vinit.distributions import RadialNormal
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import flipout, local_reparam
from tests.common import assert_close


def _weight(kind, loc, scale):
    if kind == "normal":
        return dist.Normal(loc, scale).to_event(loc.dim()), scale**2
    return RadialNormal(loc, scale, event_dim=loc.dim()), scale**2 / loc.numel()


def _moments(outs, mean, var, z=5.0):
    n = outs.shape[0]
    assert_close(outs.mean(0), mean, atol=z * (var / n).sqrt().max().item(), rtol=0)
    rel = (outs.var(0) / var - 1).abs().max().item()
    # Flipout draws are not Gaussian for radial weights: allow a wider band than 2/n.
    assert rel < z * (3 / n) ** 0.5, f"variance off by {rel:.3f}"


@pytest.mark.parametrize("kind", ["normal", "radial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_means_variances_and_decorrelation(kind, dtype):
    n = 4000
    x = torch.randn(2, 5, dtype=dtype).repeat(2, 1)  # rows 0 and 2 are the same input
    loc, scale = torch.randn(3, 5, dtype=dtype), torch.rand(3, 5, dtype=dtype) + 0.5
    fn, marginal_var = _weight(kind, loc, scale)
    bias = torch.ones(3, dtype=dtype)

    def model():
        return F.linear(x, pyro.sample("w", fn), bias)

    with flipout(strict=True):
        outs = torch.stack([model() for _ in range(n)])
    assert outs.dtype == dtype
    mean = F.linear(x, loc, bias)
    var = F.linear(x**2, marginal_var)
    _moments(outs, mean, var)
    a, b = outs[:, 0] - outs[:, 0].mean(0), outs[:, 2] - outs[:, 2].mean(0)
    corr = (a * b).mean(0) / (a.std(0) * b.std(0))
    assert corr.abs().max() < 5 / n**0.5


@pytest.mark.parametrize("kind", ["normal", "radial"])
def test_conv2d_means_and_variances(kind):
    n = 2000
    x = torch.randn(2, 3, 6, 6)
    loc, scale = torch.randn(4, 3, 3, 3) * 0.3, torch.rand(4, 3, 3, 3) * 0.3 + 0.3
    fn, marginal_var = _weight(kind, loc, scale)
    kwargs = dict(stride=2, padding=1, dilation=2)

    def model():
        return F.conv2d(x, pyro.sample("w", fn), **kwargs)

    with flipout(strict=True):
        outs = torch.stack([model() for _ in range(n)])
    _moments(outs, F.conv2d(x, loc, **kwargs), F.conv2d(x**2, marginal_var, **kwargs))


def test_radial_guide_gets_per_example_noise():
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    model = BayesianClassifier(bayesianize(mlp((4, 8, 3))))
    guide = AutoRadialNormal(model)
    svi = SVI(model, guide, Adam({"lr": 0.01}), TraceMeanField_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with flipout(strict=True):
            svi.step(x, y)
            out = Predictive(model, guide=guide, num_samples=1, return_sites=["_RETURN"])(
                torch.randn(1, 4).expand(2, 4)
            )["_RETURN"]
    assert not torch.allclose(out[0, 0], out[0, 1])


def test_k_tied_guide_and_fallback():
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    model = BayesianClassifier(bayesianize(mlp((4, 8, 3))))
    svi = SVI(model, AutoKTiedNormal(model), Adam({"lr": 0.01}), TraceMeanField_ELBO())
    with flipout(strict=True):
        assert torch.isfinite(torch.tensor(svi.step(x, y)))

    def model_mvn():
        w = pyro.sample("w", dist.MultivariateNormal(torch.zeros(4), torch.eye(4)))
        return F.linear(torch.randn(2, 4), w.unsqueeze(0))

    with pytest.raises(ValueError, match="'w'"):
        with flipout(strict=True):
            model_mvn()

    def model_studentt():
        w = pyro.sample("w", dist.StudentT(3.0, torch.zeros(2, 4), 1.0).to_event(2))
        return F.linear(torch.randn(2, 4), w)

    with pytest.warns(UserWarning, match="'w'.*StudentT"):
        with flipout():
            model_studentt()
    with pytest.warns(UserWarning, match="'w'.*StudentT"):
        with local_reparam():
            model_studentt()


@pytest.mark.parametrize("kind", ["normal", "radial"])
def test_output_signs_decorrelate_examples(kind):
    # Flipout's per-example weight is W̄ + ΔW ∘ r sᵀ. With the input signs s alone, two
    # examples' outputs are uncorrelated but not independent: they share the row signs,
    # so for outputs i, k the product c_i c_k of centred outputs is correlated across
    # examples, E[c_i c_k c'_i c'_k] = Σ_j Var(ΔW_ij) Var(ΔW_kj) x_j⁴ for a factorized
    # Normal (of the same order for a radial one). The output signs r make it 0, as for
    # independent weight draws. Over 3000 draws of 8 identical examples the mean product
    # must be within 5 standard errors of 0, while the Normal's value without r lies
    # beyond 10 of them (so the test has the power to see r missing).
    n, m = 3000, 8
    loc = torch.randn(2, 3)
    scale = torch.full((2, 3), 0.8) * (6**0.5 if kind == "radial" else 1.0)
    fn, marginal_var = _weight(kind, loc, scale)  # the same marginal variance
    x = torch.ones(m, 3)

    def model():
        return F.linear(x, pyro.sample("w", fn))

    with flipout(strict=True):
        c = torch.stack([model() for _ in range(n)]) - F.linear(x, loc)
    pairs = torch.triu_indices(m, m, offset=1)
    prod = c[:, :, 0] * c[:, :, 1]  # (draw, example)
    stat = (prod[:, pairs[0]] * prod[:, pairs[1]]).mean(1)  # one value per draw
    se = stat.std() / n**0.5
    assert stat.mean().abs() < 5 * se
    if kind == "normal":
        without_r = (marginal_var[0] * marginal_var[1] * x[0] ** 4).sum()
        assert without_r > 10 * se


@pytest.mark.parametrize("kind", ["normal", "radial"])
def test_matmul_layer_moments(kind):
    # x @ w with w of shape (in, out) is a layer: per-example noise, right moments.
    n = 4000
    x = torch.randn(2, 5).repeat(2, 1)
    loc, scale = torch.randn(5, 3), torch.rand(5, 3) + 0.5
    fn, marginal_var = _weight(kind, loc, scale)

    def model():
        return x @ pyro.sample("w", fn) + 1.0

    with flipout(strict=True):
        outs = torch.stack([model() for _ in range(n)])
    _moments(outs, x @ loc + 1.0, (x**2) @ marginal_var)
    a, b = outs[:, 0] - outs[:, 0].mean(0), outs[:, 2] - outs[:, 2].mean(0)
    corr = (a * b).mean(0) / (a.std(0) * b.std(0))
    assert corr.abs().max() < 5 / n**0.5


@pytest.mark.parametrize("op", ["linear", "conv2d"])
def test_each_output_is_the_layer_with_its_own_sign_flipped_weight(op, monkeypatch):
    # The identity Flipout rests on: example n's output is exactly the layer at the weight
    # mean + (W - mean) * r_n s_n^T, with one sign per output (channel) r_n and one per input
    # (channel) s_n, shared over the spatial positions.
    import pyro_vinit.poutine.noise.flipout as flipout_messenger

    signs = []

    def recorded(shape, like):
        signs.append(rademacher(shape, like))
        return signs[-1]

    rademacher = flipout_messenger.rademacher
    monkeypatch.setattr(flipout_messenger, "rademacher", recorded)
    fn_op = getattr(F, op)
    if op == "linear":
        shape, x = (4, 3), torch.randn(5, 3)
    else:
        shape, x = (4, 3, 2, 2), torch.randn(5, 3, 4, 4)
    loc, scale, bias = torch.randn(shape), torch.rand(shape) + 0.5, torch.randn(4)

    def model():
        return fn_op(x, pyro.sample("w", dist.Normal(loc, scale).to_event(len(shape))), bias)

    with flipout(strict=True):
        tr = pyro.poutine.trace(model).get_trace()
        out = tr.nodes["_RETURN"]["value"]
    weight = torch.as_tensor(tr.nodes["w"]["value"]).detach()
    s, r = signs
    spatial = (1,) * (len(shape) - 2)
    for n in range(x.shape[0]):
        flips = r[n].reshape((4, 1) + spatial) * s[n].reshape((1, 3) + spatial)
        flipped = loc + (weight - loc) * flips
        assert_close(out[n], fn_op(x[n : n + 1], flipped, bias)[0], atol=1e-5, rtol=1e-5)


def test_fallback_message_says_why():
    def model():
        w = pyro.sample("w", dist.StudentT(3.0, torch.zeros(2, 4), 1.0).to_event(2))
        return F.linear(torch.randn(2, 4), w)

    with pytest.warns(UserWarning, match="not known to be symmetric under sign flips"):
        with flipout():
            model()


def test_handler_function_wraps_a_callable():
    # flipout(fn) returns fn run under a fresh FlipoutMessenger, with fn's return value
    loc = torch.zeros(3, 5)
    x = torch.randn(2, 5)

    def model():
        w = pyro.sample("w", dist.Normal(loc, 1.0).to_event(2))
        return F.linear(x, w)

    wrapped = flipout(model, strict=True)
    assert not isinstance(wrapped, pyro.poutine.messenger.Messenger)
    out = wrapped()
    assert out.shape == (2, 3)
    # the two rows of one weight draw get different sign flips: with x's rows equal and the
    # weight's mean 0, the outputs differ in sign pattern on some draw
    x = torch.randn(1, 5).expand(2, 5)
    assert any(not torch.equal(*wrapped().unbind(0)) for _ in range(10))
