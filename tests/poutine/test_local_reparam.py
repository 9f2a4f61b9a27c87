import contextlib
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from pyro.nn import PyroModule
from pyro.optim import Adam
from pyro.poutine.util import prune_subsample_sites

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal
from pyro_vinit.distributions import KTiedNormal
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from pyro_vinit.poutine import LocalReparamMessenger, flipout, local_reparam
from tests.common import assert_close


def _normal(loc, scale):
    return dist.Normal(loc, scale).to_event(loc.dim())


def _mc_check(samples, mean, var, z=5.0):
    """Sample mean and variance along dim 0 against ``mean`` and ``var``, each
    within ``z`` standard errors (Gaussian samples: SE of the variance is
    var * sqrt(2 / N))."""
    n = samples.shape[0]
    assert_close(samples.mean(0), mean, atol=z * (var / n).sqrt().max().item(), rtol=0)
    rel = (samples.var(0) / var - 1).abs().max().item()
    assert rel < z * (2 / n) ** 0.5, f"variance off by {rel:.3f}"


# ------------------------------------------------------------------- moments


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias_kind", ["site", "param", "none"])
def test_linear_moments(bias_kind, dtype):
    n, batch, d_in, d_out = 20000, 3, 5, 4
    like = {"dtype": dtype}
    x = torch.randn(batch, d_in, **like)
    w_loc, w_scale = torch.randn(d_out, d_in, **like), torch.rand(d_out, d_in, **like) + 0.2
    b_loc, b_scale = torch.randn(d_out, **like), torch.rand(d_out, **like) + 0.2

    def model(x):
        w = pyro.sample("w", _normal(w_loc, w_scale))
        b = None
        if bias_kind == "site":
            b = pyro.sample("b", _normal(b_loc, b_scale))
        elif bias_kind == "param":
            b = b_loc
        return F.linear(x, w, b)

    with local_reparam(strict=True):
        out = model(x.repeat(n, 1)).reshape(n, batch, d_out)
    assert out.dtype == dtype
    mean = F.linear(x, w_loc, None if bias_kind == "none" else b_loc)
    var = F.linear(x**2, w_scale**2) + (b_scale**2 if bias_kind == "site" else 0)
    _mc_check(out, mean, var)


def _calls(fn, n):
    """``fn()``'s outputs over ``n`` calls, stacked: one weight draw a call."""
    return torch.stack([fn() for _ in range(n)])


def _check_sums(outs, reference, dims, z=5.0):
    # The variance of each example's sum over its positions (``dims``), which holds their
    # covariances, against the reference's: two estimates of n calls each, relative
    # standard error sqrt(2 / n) apiece
    n = outs.shape[0]
    rel = (outs.sum(dims).var(0) / reference.sum(dims).var(0) - 1).abs().max().item()
    assert rel < z * (4 / n) ** 0.5, f"variance of the sums off by {rel:.3f}"


def test_conv2d_moments():
    # Tolerance: 5 standard errors of 2000 calls. A convolution's positions share the
    # kernel, so the outputs of one example are correlated: the handler takes Flipout's
    # signs, shared by the positions, and each example's output then has the layer's
    # distribution with a weight sample, its moments and the variance of its sum over the
    # positions (per-output draws, as for a linear layer, had made that 0.3 times as large).
    n = 2000
    x = torch.randn(2, 3, 7, 7)
    w_loc, w_scale = torch.randn(4, 3, 3, 3) * 0.3, torch.rand(4, 3, 3, 3) * 0.3 + 0.1
    b_loc, b_scale = torch.randn(4), torch.rand(4) + 0.1
    conv = PyroModule[torch.nn.Conv2d](3, 4, 3, stride=2, padding=2, dilation=2)
    conv.weight = pyro.nn.PyroSample(_normal(w_loc, w_scale))
    conv.bias = pyro.nn.PyroSample(_normal(b_loc, b_scale))
    with local_reparam(strict=True):
        outs = _calls(lambda: conv(x), n)
    kwargs = dict(stride=2, padding=2, dilation=2)
    mean = F.conv2d(x, w_loc, b_loc, **kwargs)
    var = F.conv2d(x**2, w_scale**2, **kwargs) + (b_scale**2)[:, None, None]
    _mc_check(outs, mean, var)
    reference = _calls(lambda: F.conv2d(x, dist.Normal(w_loc, w_scale).sample(),
                                        dist.Normal(b_loc, b_scale).sample(), **kwargs), n)
    _check_sums(outs, reference, (-2, -1))


def test_conv1d_groups_moments():
    n = 2000
    x = torch.randn(1, 4, 9)
    w_loc, w_scale = torch.randn(6, 2, 3), torch.rand(6, 2, 3) + 0.1

    def model(x):
        return F.conv1d(x, pyro.sample("w", _normal(w_loc, w_scale)), None, 1, 1, 1, 2)

    with local_reparam(strict=True):
        outs = _calls(lambda: model(x), n)
    mean = F.conv1d(x, w_loc, padding=1, groups=2)
    var = F.conv1d(x**2, w_scale**2, padding=1, groups=2)
    _mc_check(outs, mean, var)
    reference = _calls(lambda: F.conv1d(x, dist.Normal(w_loc, w_scale).sample(), padding=1,
                                        groups=2), n)
    _check_sums(outs, reference, -1)


def test_a_convolution_bias_used_twice_is_used_as_sampled():
    # Flipout's path, which convolutions take, uses a sampled bias as drawn: a second use
    # is no second use of per-example noise (it was refused as one)
    loc, scale = torch.randn(2, 2, 3, 3), torch.rand(2, 2, 3, 3) + 0.1

    def model(x):
        b = pyro.sample("b", _normal(torch.zeros(2), torch.ones(2)))
        h = F.conv2d(x, pyro.sample("w1", _normal(loc, scale)), b, padding=1)
        return F.conv2d(h, pyro.sample("w2", _normal(loc, scale)), b, padding=1), b

    with local_reparam(strict=True):
        out, b = model(torch.randn(3, 2, 5, 5))
    assert out.shape == (3, 2, 5, 5) and out.isfinite().all()


@pytest.mark.parametrize("handler", [local_reparam, flipout])
def test_tokens_of_one_example_share_its_weight(handler):
    # A linear layer on (batch, tokens, features): the tokens of one example share the
    # weight, so their outputs are correlated, which per-token draws lost (the variance of
    # a sum over 5 tokens came out about a fifth of the model's; a math review's find)
    n = 2000
    x = torch.rand(2, 5, 4) + 0.5
    loc, scale = torch.randn(3, 4), torch.rand(3, 4) + 0.2

    def model():
        return F.linear(x, pyro.sample("w", _normal(loc, scale)))

    with handler(strict=True):
        outs = _calls(model, n)
    _mc_check(outs, F.linear(x, loc), F.linear(x**2, scale**2))
    _check_sums(outs, _calls(lambda: F.linear(x, dist.Normal(loc, scale).sample()), n), -2)
    # under a particle dim (the weight (n, 1, 1, 3, 4): each particle its own weight, and
    # the plates' size-1 dims line up with the input's), the tokens still share it; a
    # fresh-eyes review found them drawn per token there
    with handler(strict=True), pyro.plate("particles", n, dim=-3):
        batched = F.linear(x, pyro.sample("w", _normal(loc, scale)))
    assert batched.shape == (n, 2, 5, 3)
    _mc_check(batched, F.linear(x, loc), F.linear(x**2, scale**2))
    _check_sums(batched, torch.einsum("btn,pon->pbto", x, dist.Normal(loc, scale).sample((n,))),
                -2)
    # and the examples still differ in one call: the signs are per example
    with handler(strict=True):
        out = F.linear(torch.ones(8, 5, 4), pyro.sample("w", _normal(loc, scale)))
    assert not all(torch.equal(out[0], row) for row in out[1:])


def test_rows_independent():
    # Two identical rows: with one shared weight sample their outputs are equal; with
    # local reparameterization they are independent draws (|corr| < 5 / sqrt(n)).
    n = 2000
    x = torch.randn(1, 5).expand(2, 5)
    loc, scale = torch.randn(3, 5), torch.ones(3, 5)

    def model():
        return F.linear(x, pyro.sample("w", _normal(loc, scale)))

    plain = torch.stack([model() for _ in range(10)])
    assert torch.equal(plain[:, 0], plain[:, 1])
    with local_reparam():
        out = torch.stack([model() for _ in range(n)])
    a, b = out[:, 0] - out[:, 0].mean(0), out[:, 1] - out[:, 1].mean(0)
    corr = (a * b).mean(0) / (a.std(0) * b.std(0))
    assert corr.abs().max() < 5 / n**0.5


@pytest.mark.parametrize("op", ["linear", "conv2d"])
def test_k_tied_low_rank_equals_dense(op):
    loc = torch.randn(6, 3, 3, 3) if op == "conv2d" else torch.randn(6, 5)
    u, v = torch.rand(6, 3) + 0.1, torch.rand(loc[0].numel(), 3) + 0.1
    x = torch.randn(4, 3, 6, 6) if op == "conv2d" else torch.randn(4, 5)
    kwargs = {"padding": 1, "stride": 2} if op == "conv2d" else {}

    def model():
        w = pyro.sample("w", KTiedNormal(loc, u, v, tied_dims=loc.dim()).to_event(loc.dim()))
        return getattr(F, op)(x, w, **kwargs)

    outs = []
    for low_rank in (True, False):
        pyro.set_rng_seed(1)
        with local_reparam(low_rank=low_rank, strict=True):
            outs.append(model())
    assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)
    pyro.set_rng_seed(1)
    with local_reparam(strict=True):
        assert_close(model(), outs[0], atol=1e-5, rtol=1e-4)


# (op, k, low_rank, weight use) -> whether the variance goes through the low-rank factors
_PATHS = {
    "linear, k=1, cheaper": ("linear", 1, None, "as drawn", True),
    "linear, k=3, dearer": ("linear", 3, None, "as drawn", False),
    "linear, k=3, forced": ("linear", 3, True, "as drawn", True),
    "linear, k=1, refused": ("linear", 1, False, "as drawn", False),
    # r = k(k+1)/2 = 3 thin layers of m + n against m n: the factors when strictly cheaper
    "5 x 5, k=2, dearer": ("5 x 5", 2, None, "as drawn", False),
    "6 x 6, k=2, as dear": ("6 x 6", 2, None, "as drawn", False),
    "7 x 7, k=2, cheaper": ("7 x 7", 2, None, "as drawn", True),
    "transposed, k=1": ("linear", 1, None, "transposed", True),
    "sliced rows, k=1": ("linear", 1, True, "sliced", False),
}


@pytest.mark.parametrize("case", sorted(_PATHS))
def test_k_tied_variance_path(case):
    # Which of U, V (low-rank) or sigma = U V^T (dense) the variance reads, seen by
    # poisoning the other with NaN: the low-rank path must not form sigma^2, the dense
    # one must be used where the factors do not apply or cost more.
    op, k, low_rank, use, expect_low_rank = _PATHS[case]
    # (convolutions take Flipout's signs: the trick's variance is a linear layer's)
    shapes = {"linear": ((6, 5), (4, 5)), **{f"{d} x {d}": ((d, d), (4, d)) for d in (5, 6, 7)}}
    loc_shape, x_shape = shapes[op]
    if use == "transposed":
        loc_shape = (5, 6)
    (m, n), loc, x = loc_shape, torch.randn(loc_shape), torch.randn(x_shape)
    u, v = torch.rand(m, k) + 0.1, torch.rand(n, k) + 0.1

    def model():
        d = KTiedNormal(loc, u, v)
        poisoned = "scale" if expect_low_rank else "scale_u"
        setattr(d, poisoned, torch.full_like(getattr(d, poisoned), float("nan")))
        w = pyro.sample("w", d.to_event(loc.dim()))
        if use == "transposed":
            return x @ w  # read as F.linear(x, w.mT)
        if use == "sliced":
            return F.linear(x, w[:4])
        return F.linear(x, w)

    with local_reparam(low_rank=low_rank, strict=True):
        out = model()
    assert out.isfinite().all()


# ---------------------------------------------------------------- unbiasedness


@pytest.mark.parametrize("elbo", [Trace_ELBO, TraceMeanField_ELBO])
def test_elbo_gradient_unbiased(elbo):
    # Linear-Gaussian model: the expected loss, and so its gradient, is known in
    # closed form. Both estimators' Monte Carlo means must match it within 5 standard
    # errors (over 1500 gradient samples each).
    x = torch.randn(8, 3)
    y = torch.randn(8, 2)
    loc0, scale0 = torch.randn(2, 3) * 0.5, torch.rand(2, 3) * 0.5 + 0.3

    def model(x, y):
        w = pyro.sample("w", _normal(torch.zeros(2, 3), torch.ones(2, 3)))
        with pyro.plate("data", 8):
            pyro.sample("y", dist.Normal(F.linear(x, w), 1.0).to_event(1), obs=y)

    def guide(x, y):
        loc = pyro.param("loc", loc0.clone())
        scale = pyro.param("scale", scale0.clone(), constraint=dist.constraints.positive)
        pyro.sample("w", _normal(loc, scale))

    def grads(loss_fn, n=1500):
        out = []
        for _ in range(n):
            loss = loss_fn(model, guide, x, y)
            params = [pyro.param("loc").unconstrained(), pyro.param("scale").unconstrained()]
            out.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
        return torch.stack(out)

    loss_fn = elbo().differentiable_loss
    ordinary = grads(loss_fn)
    with local_reparam(strict=True):
        local = grads(loss_fn)

    loc = loc0.clone().requires_grad_()
    raw_scale = dist.transforms.biject_to(dist.constraints.positive).inv(scale0).requires_grad_()
    scale = dist.transforms.biject_to(dist.constraints.positive)(raw_scale)
    mean = x @ loc.t()
    expected_nll = 0.5 * ((y - mean) ** 2 + (x**2) @ (scale**2).t()).sum()
    kl = torch.distributions.kl_divergence(_normal(loc, scale), _normal(torch.zeros(2, 3), 1.0))
    exact = torch.autograd.grad(expected_nll + kl, [loc, raw_scale])
    exact = torch.cat([g.reshape(-1) for g in exact])
    for g in (ordinary, local):
        se = g.std(0) / g.shape[0] ** 0.5
        assert ((g.mean(0) - exact).abs() < 5 * se + 1e-4).all()
    # and the trick lowers the variance of the gradient of the means
    assert local[:, :6].var(0).sum() < ordinary[:, :6].var(0).sum()


# ------------------------------------------------------------ guides and SVI


def _classifier(num_data=None):
    return BayesianClassifier(bayesianize(mlp((4, 8, 3))), num_data=num_data)


def _hand_written_guide(model, x, y):
    trace = prune_subsample_sites(pyro.poutine.trace(model).get_trace(x, y))
    sites = {name: site["fn"] for name, site in trace.iter_stochastic_nodes()}

    def guide(x, y=None):
        for name, fn in sites.items():
            loc = pyro.param(name + "_loc", torch.zeros(fn.event_shape))
            scale = pyro.param(
                name + "_scale", torch.full(fn.event_shape, 0.1),
                constraint=dist.constraints.positive,
            )
            pyro.sample(name, _normal(loc, scale))

    return guide


GUIDES = {
    "AutoDiagonalNormal": lambda model, x, y: AutoDiagonalNormal(model),
    "AutoKTiedNormal": lambda model, x, y: AutoKTiedNormal(model, rank=2),
    "AutoNormal": lambda model, x, y: AutoNormal(model),
    "hand-written": _hand_written_guide,
}


def _duplicated_rows_differ(model, guide, handler):
    # Within one posterior sample, identical inputs get different outputs only if each
    # example has its own weight noise.
    x = torch.randn(1, 4).expand(6, 4)
    with handler:
        out = Predictive(model, guide=guide, num_samples=2, return_sites=["_RETURN"])(x)
    out = out["_RETURN"]
    assert out.shape == (2, 6, 3)
    return not torch.allclose(out[:, 0], out[:, 1])


@pytest.mark.parametrize("elbo", [Trace_ELBO, TraceMeanField_ELBO])
@pytest.mark.parametrize("guide_name", sorted(GUIDES))
def test_svi_and_predictive_with_guides(guide_name, elbo):
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    model = _classifier()
    guide = GUIDES[guide_name](model, x, y)
    svi = SVI(model, guide, Adam({"lr": 0.01}), elbo())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = local_reparam(svi.step, strict=True)
        losses = [step(x, y) for _ in range(5)]
        assert all(torch.isfinite(torch.tensor(losses)))
        assert _duplicated_rows_differ(model, guide, LocalReparamMessenger(strict=True))
    assert not _duplicated_rows_differ(model, guide, pyro.poutine.block(hide=[]))


def test_mean_field_elbo_draws_no_weight_sample(monkeypatch):
    # Under a closed-form KL the weight samples are never used: none is drawn.
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    model = _classifier()
    guide = AutoKTiedNormal(model)
    guide(x, y)
    calls = []
    rsample = torch.distributions.Normal.rsample
    monkeypatch.setattr(
        torch.distributions.Normal, "rsample", lambda self, *a: calls.append(1) or rsample(self, *a)
    )
    elbo = TraceMeanField_ELBO()
    with local_reparam(strict=True):
        loss = elbo.differentiable_loss(model, guide, x, y)
    assert calls == []
    loss.backward()
    # ...while Trace_ELBO draws each site once, used by both log densities
    with local_reparam(strict=True):
        Trace_ELBO().differentiable_loss(model, guide, x, y).backward()
    assert len(calls) == 4


def test_subsampled_plate():
    data_x, data_y = torch.randn(100, 4), torch.randint(0, 3, (100,))

    class Model(PyroModule):
        def __init__(self):
            super().__init__()
            self.net = bayesianize(mlp((4, 8, 3)))

        def forward(self, x, y):
            data = pyro.plate("data", 100, subsample_size=10)
            with data as idx:
                pass
            logits = self.net(x[idx])  # the weights are outside the plate
            with data:
                pyro.sample("obs", dist.Categorical(logits=logits), obs=y[idx])
            return logits

    model = Model()
    guide = AutoKTiedNormal(model)
    svi = SVI(model, guide, Adam({"lr": 0.01}), TraceMeanField_ELBO())
    with local_reparam(strict=True):
        losses = [svi.step(data_x, data_y) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))

    # The subsampled examples get their own weight noise: identical inputs, different
    # outputs within one posterior sample (and equal outputs without the handler).
    same_x = torch.randn(1, 4).expand(100, 4)
    predictive = Predictive(model, guide=guide, num_samples=2, return_sites=["_RETURN"])
    with local_reparam(strict=True):
        out = predictive(same_x, data_y)["_RETURN"]
    assert out.shape == (2, 10, 3)
    assert not torch.allclose(out[:, 0], out[:, 1])
    out = predictive(same_x, data_y)["_RETURN"]
    assert torch.allclose(out[:, 0], out[:, 1])


# ------------------------------------------------------------------ fallbacks


def test_radial_guide_warns_once_per_run_and_strict_raises():
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    model = _classifier()
    guide = AutoRadialNormal(model)
    svi = SVI(model, guide, Adam({"lr": 0.01}), TraceMeanField_ELBO())
    handler = LocalReparamMessenger()
    with pytest.warns(UserWarning) as record:
        for _ in range(3):
            with handler:
                svi.step(x, y)
    messages = [str(w.message) for w in record if "LocalReparamMessenger" in str(w.message)]
    assert len(messages) == 1  # one warning naming both sites, once per handler
    reason = ("its distribution is RadialNormal, not a factorized Normal (FlipoutMessenger "
              "gives per-example noise for sign-symmetric ones such as RadialNormal);")
    assert f"  'net.0.weight': {reason}\n  'net.2.weight': {reason[:-1]}.\n" in messages[0]
    with pytest.raises(ValueError, match="'net.0.weight'.*RadialNormal"):
        with local_reparam(strict=True):
            svi.step(x, y)


def test_repeating_view_and_custom_op_fall_back():
    x = torch.randn(3, 4)

    def repeated(x):
        w = pyro.sample("row", _normal(torch.zeros(1, 4), torch.ones(1, 4)))
        return F.linear(x, w.expand(2, 4))  # both outputs share one weight row

    def custom(x):
        w = pyro.sample("w", _normal(torch.zeros(2, 4), torch.ones(2, 4)))
        return F.bilinear(x, x, w.unsqueeze(-1).expand(2, 4, 4))

    with pytest.warns(UserWarning, match="'row'.*by expand"):
        with local_reparam():
            out = repeated(x)
    assert torch.equal(out[:, 0], out[:, 1])  # the ordinary sample
    with pytest.raises(ValueError, match="'w'.*bilinear"):
        with local_reparam(strict=True):
            custom(x)
    with pytest.warns(UserWarning, match="'w'.*bilinear"):
        with local_reparam():
            out = custom(x)
    assert out.shape == (3, 2)


@pytest.mark.parametrize("handler", [local_reparam, flipout])
def test_shared_weight_is_refused(handler):
    # One sample used by two layer calls (tied weights): independent noise at each use
    # would lose the correlation between them, so the second use is refused, strict or
    # not (issue 23 item 6), before the second layer runs.
    x = torch.randn(5, 4)
    calls = []

    def tied():
        w = pyro.sample("w", _normal(torch.zeros(4, 4), torch.ones(4, 4)))
        h = F.linear(x, w)
        calls.append(1)
        return F.linear(h, w)

    for strict in (True, False):
        with pytest.raises(ValueError, match="'w' is used a second time.*shared or tied"):
            with handler(strict=strict):
                tied()
    assert len(calls) == 2  # each run reached the second use

    # An op the handler does not treat, before the layer call: both use the ordinary sample.
    def custom_then_layer():
        w = pyro.sample("w", _normal(torch.zeros(2, 4), torch.ones(2, 4)))
        return torch.tensordot(x, w, dims=([1], [1])) - F.linear(x, w)

    with pytest.warns(UserWarning, match="'w'.*tensordot"):
        with handler():
            out = custom_then_layer()
    assert_close(out, torch.zeros(5, 2), atol=1e-6)

    # A matrix product is a layer: the layer call after it is a second use.
    def matmul_then_layer():
        w = pyro.sample("w", _normal(torch.zeros(2, 4), torch.ones(2, 4)))
        return x @ w.t() - F.linear(x, w)

    with pytest.raises(ValueError, match="'w'.*shared or tied"):
        with handler(strict=True):
            matmul_then_layer()


def test_shared_bias_is_refused():
    # LRT gives a sampled bias per-example noise too, so a shared bias is a shared sample.
    x = torch.randn(5, 4)
    w_dist = _normal(torch.zeros(4, 4), torch.ones(4, 4))

    def model():
        b = pyro.sample("b", _normal(torch.zeros(4), torch.ones(4)))
        h = F.linear(x, pyro.sample("w1", w_dist), b)
        return F.linear(h, pyro.sample("w2", w_dist), b)

    with pytest.raises(ValueError, match="'b'.*shared or tied"):
        with local_reparam(strict=True):
            model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with flipout(strict=True):  # Flipout uses the bias as sampled
            model()


def test_plain_weights_untouched():
    linear = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with local_reparam(strict=True):
            assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))


# ----------------------------------------------------------- matrix products


def _exact_moments(monkeypatch, fn):
    """The mean and variance LRT gives each output element of ``fn()``: its
    outputs with the standard normal noise set to 0, then to 1."""
    monkeypatch.setattr(torch, "randn_like", torch.zeros_like)
    mean = fn()
    monkeypatch.setattr(torch, "randn_like", torch.ones_like)
    return mean, (fn() - mean) ** 2


# Linear layers written as matrix products. Each is linear in the drawn values, so
# its exact mean is the layer at the means (and the bias mean) and its exact variance
# the layer of x^2 at the variances (plus the bias variance).
MATMUL_LAYERS = {
    "x @ w": lambda x, d: x @ d("w", (5, 3)),
    "torch.matmul": lambda x, d: torch.matmul(x, d("w", (5, 3))),
    "Tensor.matmul": lambda x, d: x.matmul(d("w", (5, 3))),
    "torch.mm": lambda x, d: torch.mm(x, d("w", (5, 3))),
    "torch.addmm": lambda x, d: torch.addmm(d("b", (3,)), x, d("w", (5, 3))),
    "einsum bi,io->bo": lambda x, d: torch.einsum("bi,io->bo", x, d("w", (5, 3))),
    "einsum ...i,oi->...o": lambda x, d: torch.einsum("...i,oi->...o", x, d("w", (3, 5))),
    "x @ w.t()": lambda x, d: x @ d("w", (3, 5)).t(),
    "F.linear(x, w.reshape)": lambda x, d: F.linear(x, d("w", (15,)).reshape(3, 5)),
    "x @ w[1] (a slice)": lambda x, d: x @ d("w", (2, 5, 3))[1],
}


@pytest.mark.parametrize("layer", sorted(MATMUL_LAYERS))
def test_matmul_layer_exact_moments(layer, monkeypatch):
    # float64 against the closed form: x·μ (+ ν) and x²·σ² (+ τ²).
    fn = MATMUL_LAYERS[layer]
    like = {"dtype": torch.float64}
    x = torch.randn(4, 5, **like)
    locs, scales = {}, {}

    def draw(name, shape):
        if name not in locs:
            locs[name] = torch.randn(shape, **like)
            scales[name] = torch.rand(shape, **like) + 0.2
        return pyro.sample(name, _normal(locs[name], scales[name]))

    fn(x, draw)  # the parameters
    with local_reparam(strict=True):
        mean, var = _exact_moments(monkeypatch, lambda: fn(x, draw))
    assert mean.dtype == torch.float64
    assert_close(mean, fn(x, lambda name, shape: locs[name]), atol=1e-12, rtol=1e-12)
    assert_close(var, fn(x**2, lambda name, shape: scales[name] ** 2), atol=1e-12, rtol=1e-12)


def test_matmul_layer_rows_independent():
    # Pyro's modules tutorial style x @ w + b, w of shape (in, out): identical rows get
    # independent outputs (|corr| < 5 / sqrt(n)), with the right variance.
    n = 2000
    x = torch.randn(1, 5).expand(2, 5)
    loc, scale = torch.randn(5, 3), torch.rand(5, 3) + 0.5

    def model():
        w = pyro.sample("w", _normal(loc, scale))
        b = pyro.sample("b", _normal(torch.zeros(3), torch.ones(3)))
        return x @ w + b

    plain = torch.stack([model() for _ in range(10)])
    assert torch.equal(plain[:, 0], plain[:, 1])
    with local_reparam(strict=True):
        out = torch.stack([model() for _ in range(n)])
    a, b = out[:, 0] - out[:, 0].mean(0), out[:, 1] - out[:, 1].mean(0)
    corr = (a * b).mean(0) / (a.std(0) * b.std(0))
    assert corr.abs().max() < 5 / n**0.5
    _mc_check(out[:, 0], x[0] @ loc, (x[0] ** 2) @ scale**2 + 1)


def test_slices_of_one_draw_are_separate_layers(monkeypatch):
    # Disjoint slices of one sample (as AutoDiagonalNormal hands out) are two layers;
    # a slice used twice is a tied weight.
    x = torch.randn(4, 5, dtype=torch.float64)
    loc, scale = torch.randn(2, 3, 5).double(), torch.rand(2, 3, 5).double() + 0.2

    def two_layers():
        w = pyro.sample("w", _normal(loc, scale))
        return torch.stack([F.linear(x, w[0]), F.linear(x, w[1])])

    with local_reparam(strict=True):
        mean, var = _exact_moments(monkeypatch, two_layers)
    assert_close(mean, torch.stack([F.linear(x, loc[0]), F.linear(x, loc[1])]), atol=1e-12)
    expected = torch.stack([F.linear(x**2, scale[0] ** 2), F.linear(x**2, scale[1] ** 2)])
    assert_close(var, expected, atol=1e-12, rtol=1e-12)

    def tied():
        w = pyro.sample("w", _normal(loc, scale))
        return F.linear(x, w[0]) + F.linear(x, w[0, :, :])

    with pytest.raises(ValueError, match="'w'.*shared or tied"):
        with local_reparam(strict=True):
            tied()


@pytest.mark.parametrize("split", ["chunk", "split", "unbind"])
def test_pieces_of_a_split_draw_are_separate_layers(monkeypatch, split):
    # w.chunk(2) of a fused weight (an RNN cell's gates): each piece a view of the draw,
    # a layer of its own with the exact moments of its elements
    x = torch.randn(4, 5, dtype=torch.float64)
    loc, scale = torch.randn(6, 5).double(), torch.rand(6, 5).double() + 0.2
    pieces = {"chunk": lambda w: w.chunk(2), "split": lambda w: torch.split(w, [2, 4]),
              "unbind": lambda w: w.unflatten(0, (2, 3)).unbind()}[split]

    def two_layers():
        a, b = pieces(pyro.sample("w", _normal(loc, scale)))
        return torch.cat([F.linear(x, a), F.linear(x, b)], -1)

    with local_reparam(strict=True):
        mean, var = _exact_moments(monkeypatch, two_layers)
    assert_close(mean, F.linear(x, loc), atol=1e-12, rtol=0)
    assert_close(var, F.linear(x**2, scale**2), atol=1e-12, rtol=1e-12)


def test_k_tied_low_rank_transposed_weight():
    # x @ w with w of shape (in, out): the layer's scale is (U V^T)^T = V U^T.
    loc, u, v = torch.randn(7, 4), torch.rand(7, 2) + 0.1, torch.rand(4, 2) + 0.1
    x = torch.randn(6, 7)

    def model():
        return x @ pyro.sample("w", KTiedNormal(loc, u, v).to_event(2))

    outs = []
    for low_rank in (True, False):
        pyro.set_rng_seed(1)
        with local_reparam(low_rank=low_rank, strict=True):
            outs.append(model())
    assert outs[0].shape == (6, 4)
    assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)


def _loss_and_grads(guide_cls, elbo, seed, **handler_kwargs):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = BayesianClassifier(bayesianize(mlp((4, 6, 3))), num_data=40).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    guide = guide_cls(model)
    guide(x, y)
    params = list(guide.parameters())
    pyro.set_rng_seed(seed)
    with local_reparam(strict=True, **handler_kwargs):
        loss = elbo().differentiable_loss(model, guide, x, y)
    return loss.detach(), torch.autograd.grad(loss, params)


@pytest.mark.parametrize("guide_cls", [AutoNormal, AutoKTiedNormal])
def test_deferred_log_prob_equals_pyros(guide_cls, monkeypatch):
    # The deferred log densities (a fast path: on the plain tensor, computed only if
    # used) give Pyro's own loss and gradients, same seed, float64; Trace_ELBO uses them
    # all. AutoNormal is the control: its auxiliary sites are drawn, never deferred.
    fast = _loss_and_grads(guide_cls, Trace_ELBO, seed=1)
    intercepted = []
    op = LocalReparamMessenger._site_value_op
    monkeypatch.setattr(
        LocalReparamMessenger, "_site_value_op",
        lambda self, func, *a: intercepted.append(func) or op(self, func, *a),
    )
    # Plain path: no prefilled log densities; Pyro computes them from the site values.
    monkeypatch.setattr(LocalReparamMessenger, "_post_site_value", lambda *a: None)
    plain = _loss_and_grads(guide_cls, Trace_ELBO, seed=1)
    assert_close(fast[0], plain[0], rtol=1e-10, atol=0)
    for g_fast, g_plain in zip(fast[1], plain[1]):
        assert_close(g_fast, g_plain, rtol=1e-10, atol=1e-14)
    assert plain[1][0].abs().sum() > 0
    assert intercepted  # the plain path ran the log densities on the stand-ins


def test_deferred_log_prob_skips_the_handler(monkeypatch):
    # The deferred log density runs on the plain tensor: none of its ops reaches the
    # handler (each would pay a __torch_function__ round trip).
    intercepted = []
    op = LocalReparamMessenger._site_value_op
    monkeypatch.setattr(
        LocalReparamMessenger, "_site_value_op",
        lambda self, func, *a: intercepted.append(func) or op(self, func, *a),
    )
    monkeypatch.setattr(
        torch.distributions.Normal, "log_prob",
        _counting(torch.distributions.Normal.log_prob, intercepted),
    )
    _loss_and_grads(AutoKTiedNormal, Trace_ELBO, seed=1)
    # the log densities ran, and no op on a stand-in happened between their start and end
    # 4 sites (2 weights, 2 biases), each in the guide and the model
    assert intercepted.count("log_prob start") == 8
    inside = False
    for item in intercepted:
        if item == "log_prob start":
            inside = True
        elif item == "log_prob end":
            inside = False
        else:
            assert not inside, f"{item} of a log density went through the handler"


def _counting(log_prob, record):
    def wrapper(self, value):
        record.append("log_prob start")
        try:
            return log_prob(self, value)
        finally:
            record.append("log_prob end")

    return wrapper


_LOG_PROB_CASES = {
    # name: (shape of the draw, its event dims, prior's shape, scale, mask)
    "plain": ((3, 4), 2, (3, 4), None, None),
    "batch dims": ((3, 4), 1, (3, 4), None, None),
    "broadcast prior": ((3, 4), 2, (4,), None, None),
    "prior broadcasts the draw": ((4,), 1, (3, 4), None, None),
    "scale": ((3, 4), 2, (3, 4), 2.0, None),
    "scale tensor": ((3, 4), 1, (3, 4), torch.tensor([0.5, 2.0, 1.0]), None),
    "0-d scale tensor": ((3, 4), 1, (3, 4), torch.tensor(0.5), None),
    "broadcast scale": ((3, 4), 2, (3, 4), torch.tensor([0.5, 2.0]).reshape(2, 1), None),
    "mask": ((3, 4), 1, (4,), None, torch.tensor([True, False, True])),
    "scale and mask": ((3, 4), 2, (4,), 3.0, torch.tensor([True, False, True])),
}


@pytest.mark.parametrize("case", sorted(_LOG_PROB_CASES))
def test_deferred_log_prob_has_pyros_shape_scale_and_mask(case, monkeypatch):
    # The deferred log densities stored with a deferred draw are Pyro's own (what
    # Trace.compute_log_prob and compute_score_parts compute without them), also when the
    # prior broadcasts against the drawn value, under poutine.scale and poutine.mask.
    shape, event_dim, prior_shape, scale, mask = _LOG_PROB_CASES[case]
    loc, sd = torch.randn(shape, dtype=torch.float64), torch.rand(shape, dtype=torch.float64)

    def guide():
        pyro.sample("w", dist.Normal(loc, sd + 0.5).to_event(event_dim))

    def model():
        prior = dist.Normal(torch.zeros(prior_shape, dtype=torch.float64), 2.0)
        # one row and three rows broadcast against each other: log densities of shape (3,)
        one_row = len(prior_shape) == 1 or len(shape) == 1
        pyro.sample("w", prior.to_event(1 if one_row else event_dim))

    def traces():
        pyro.set_rng_seed(0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "LocalReparamMessenger: 1 latent site")
            guide_trace, model_trace = _traced(guide, model, scale, mask)
        guide_trace.nodes["w"]["value"].sum()  # the deferred draw, before the next seed
        for trace in (guide_trace, model_trace):
            prefilled = "log_prob" in trace.nodes["w"]
            trace.compute_log_prob()
            trace.compute_score_parts()
        return guide_trace, model_trace, prefilled

    ours = traces()
    monkeypatch.setattr(LocalReparamMessenger, "_post_site_value", lambda *a: None)
    pyros = traces()
    assert ours[2] and not pyros[2]
    for mine, theirs in zip(ours[:2], pyros[:2]):
        mine, theirs = mine.nodes["w"], theirs.nodes["w"]
        assert torch.equal(mine["value"], theirs["value"])
        for key in ("unscaled_log_prob", "log_prob", "log_prob_sum"):
            assert mine[key].shape == theirs[key].shape, key
            assert_close(mine[key] * 1, theirs[key], rtol=1e-12, atol=0)
        assert_close(mine["score_parts"].log_prob * 1, theirs["score_parts"].log_prob,
                     rtol=1e-12, atol=0)


def _traced(guide, model, scale, mask):
    # The guide's trace and the model's, replaying it, both under local_reparam.
    with contextlib.ExitStack() as stack:
        stack.enter_context(local_reparam())
        if scale is not None:
            stack.enter_context(poutine.scale(scale=scale))
        if mask is not None:
            stack.enter_context(poutine.mask(mask=mask))
        guide_trace = poutine.trace(guide).get_trace()
        model_trace = poutine.trace(poutine.replay(model, guide_trace)).get_trace()
    return guide_trace, model_trace


def test_k_tied_auxiliary_behind_a_delta_gets_the_low_rank_path():
    # A guide in AutoNormal's pattern (a Delta at the site whose value is an auxiliary
    # site's draw) with a KTiedNormal auxiliary: the weight is that draw, as drawn or
    # transposed, so the low-rank variance applies (sigma is poisoned: never read) and
    # the layer has the moments of the KTiedNormal.
    loc, u, v = torch.randn(7, 4), torch.rand(7, 2) + 0.1, torch.rand(4, 2) + 0.1
    x = torch.randn(1, 7).expand(4000, 7)  # 4000 independent draws of one example's outputs

    def guide_and_layer():
        d = KTiedNormal(loc, u, v)
        sigma = d.scale
        d.scale = torch.full_like(sigma, float("nan"))
        aux = pyro.sample("w_aux", d.to_event(2), infer={"is_auxiliary": True})
        w = pyro.sample("w", dist.Delta(aux, event_dim=2))
        return x @ w, sigma

    with local_reparam(low_rank=True, strict=True):
        out, sigma = guide_and_layer()
    _mc_check(out, x[0] @ loc, x[0].pow(2) @ sigma.pow(2))
