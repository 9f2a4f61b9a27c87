"""The fast paths of I-BLM's solves: the slab sort, the noise level's search,
and the projected solve of wide linear layers."""

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn
from torch.testing import assert_close

import pyro_vinit.initialization.bayesian_linear_regression as blr
from pyro_vinit import IBLMGuideInitializer, init_guide_iblm
from pyro_vinit.initialization import _regressions
from pyro_vinit.initialization._collective import argsort_rows
from pyro_vinit.initialization._noise import monotone_inverse
from pyro_vinit.initialization._regressions import (
    HiddenTargets,
    principal_directions,
    projects,
    solve_statistics,
    solve_units,
    unit_inputs,
)
from pyro_vinit.initialization._tracing import Layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argsort_rows_matches_torch(dtype):
    # distinct scores (a permutation per row), so that the order is unique
    scores = torch.stack([torch.randperm(200) for _ in range(5)]).to(dtype)
    order = argsort_rows(scores)
    assert order.dtype == torch.long and order.shape == (5, 200)
    assert torch.equal(order, scores.argsort(-1))



def test_hidden_targets_by_hand():
    # A hidden unit's targets (units x rows): centered over the rows, times the unit's
    # sign, and shrunk to std 0.5 where wider; the noise variance shrinks by the square.
    t = torch.tensor([[1.0, 3.0, 5.0, 7.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.2, 0.0, 0.2]],
                     dtype=torch.float64)
    noise = torch.full_like(t, 0.3)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0])
    units = torch.tensor([0, 1, 3])
    out, out_noise = HiddenTargets(signs, True, True, 0.5)(t, noise, units)
    expected = torch.tensor([[-3.0, -1.0, 1.0, 3.0], [0.0, 0.0, 0.0, 0.0],
                             [0.1, -0.1, 0.1, -0.1]], dtype=torch.float64)
    factor = torch.tensor([0.5 / expected[0].std().item(), 1.0, 1.0], dtype=torch.float64)
    assert_close(out, expected * factor[:, None], rtol=1e-12, atol=1e-15)
    assert_close(out_noise, (0.3 * factor[:, None] ** 2).expand(3, 4), rtol=1e-12, atol=0)
    assert_close(out[0].std(), torch.tensor(0.5, dtype=torch.float64), rtol=1e-12, atol=0)
    # each step off: the targets as they come
    same, same_noise = HiddenTargets(signs, False, False, None)(t, noise, units)
    assert torch.equal(same, t) and torch.equal(same_noise, noise)

@pytest.mark.parametrize("device, dtype, by_numpy", [
    ("cpu", torch.float32, True), ("cpu", torch.float64, True),
    ("cpu", torch.bfloat16, False), ("meta", torch.float32, False),
])
def test_argsort_rows_sorts_cpu_floats_with_numpy(monkeypatch, device, dtype, by_numpy):
    # as the docstring says: NumPy's sort for float32/64 on the CPU, torch's otherwise
    calls = []
    numpy_argsort = np.argsort
    monkeypatch.setattr(np, "argsort", lambda *a, **k: calls.append(1) or numpy_argsort(*a, **k))
    scores = torch.stack([torch.randperm(7) for _ in range(3)]).to(dtype).to(device)
    order = argsort_rows(scores)
    assert bool(calls) is by_numpy
    assert order.shape == (3, 7) and order.device.type == device


@pytest.mark.parametrize("link,max_calls", [
    (torch.exp, 3),  # log-linear: exact after the two ends and one false-position step
    (lambda u: torch.exp(-u), 3),  # decreasing
    (F.softplus, 16),
    (lambda u: 3 * torch.sigmoid(u), 24),
    (lambda u: 1e-4 * torch.exp(torch.exp(u / 5)), 24),  # log fn convex, not concave
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_monotone_inverse(link, max_calls, dtype):
    calls = []

    def fn(u):
        calls.append(u)
        return link(u)

    goal = torch.tensor([0.3, 1.7, 1e-3, 2.9], dtype=dtype)
    lo, hi = torch.full((4,), -15.0, dtype=dtype), torch.full((4,), 15.0, dtype=dtype)
    u, reached = monotone_inverse(fn, goal, lo, hi)
    assert len(calls) <= max_calls  # bisection to the same precision: 2 + 21 calls at least
    assert torch.equal(reached, link(u))
    assert_close(reached, goal, rtol=1e-6, atol=0)


def test_monotone_inverse_of_an_unreachable_goal_is_the_nearer_end():
    goal = torch.tensor([1e-3, 0.5, 3.0], dtype=torch.float64)
    lo = torch.full((3,), -15.0, dtype=torch.float64)
    hi = torch.full((3,), 15.0, dtype=torch.float64)
    u, reached = monotone_inverse(lambda u: 0.01 + torch.sigmoid(u), goal, lo, hi)
    assert_close(u[[0, 2]], torch.tensor([-15.0, 15.0], dtype=torch.float64), atol=1e-4, rtol=0)
    assert_close(reached[1], goal[1], rtol=1e-6, atol=0)


F64 = torch.float64


class _WideLinear(PyroModule):
    """One latent linear layer with a N(0.3, 0.7^2) weight prior, in the noise's dtype."""

    def __init__(self, d_in, d_out, noise):
        super().__init__()
        dtype = noise.dtype
        self.layer = PyroModule[nn.Linear](d_in, d_out).to(dtype)
        self.layer.weight = PyroSample(
            dist.Normal(torch.tensor(0.3, dtype=dtype), 0.7).expand([d_out, d_in]).to_event(2)
        )
        self.layer.bias = PyroSample(
            dist.Normal(torch.tensor(-0.2, dtype=dtype), 1.5).expand([d_out]).to_event(1)
        )
        self.noise = noise

    def forward(self, x, y=None):
        mean = self.layer(x)
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(mean, self.noise[:, None]).to_event(1), obs=y)


def _wide_fit(x, y, noise, **kwargs):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)  # the same minibatches for every call
    guide = AutoNormal(_WideLinear(x.shape[1], y.shape[1], noise))
    init_guide_iblm(guide, (x, y), batch_size=20, output_rows=None, **kwargs)
    return guide.locs.layer.weight.detach(), guide.scales.layer.weight.detach()


def test_projected_solve_is_exact_when_the_input_has_that_rank():
    # 30 inputs of rank 5, 20 rows per unit (the third unit's from two permutations of the
    # 50 rows: some twice): the dual form, projected for input_rank < 15
    n, d, k = 50, 30, 3
    x = torch.randn(n, 5, dtype=F64) @ torch.randn(5, d, dtype=F64)
    noise = torch.rand(n, dtype=F64) + 0.2
    y = x @ torch.randn(d, k, dtype=F64) / 5 + noise[:, None] * torch.randn(n, k, dtype=F64)
    loc, scale = _wide_fit(x, y, noise, input_rank=None)
    loc5, scale5 = _wide_fit(x, y, noise, input_rank=5)  # rank 5: the whole row space
    assert_close(loc5, loc, atol=1e-9, rtol=1e-7)
    assert_close(scale5, scale, atol=1e-12, rtol=1e-9)  # the exact precision diagonal
    loc2, scale2 = _wide_fit(x, y, noise, input_rank=2)  # projected: the mean moves
    assert (loc2 - loc).abs().max() > 1e-3
    assert_close(scale2, scale, atol=1e-12, rtol=1e-9)


def test_projected_solve_with_fewer_rows_than_input_rank():
    # 12 rows, 30 inputs, input_rank 14: the rows span at most 12 directions, which the
    # basis holds (it used to fail on the rank it did not get); the mean is then exact.
    n, d, k = 12, 30, 2
    x = torch.randn(n, d, dtype=F64)
    noise = torch.rand(n, dtype=F64) + 0.2
    y = x @ torch.randn(d, k, dtype=F64) / 5 + noise[:, None] * torch.randn(n, k, dtype=F64)
    loc, scale = _wide_fit(x, y, noise, input_rank=None)
    loc14, scale14 = _wide_fit(x, y, noise, input_rank=14)
    assert_close(loc14, loc, atol=1e-9, rtol=1e-7)
    assert_close(scale14, scale, atol=1e-12, rtol=1e-9)


def test_projected_solve_of_a_float32_layer_with_float64_targets():
    # NumPy's float64 targets for a float32 network, with a noise level to use: the targets
    # and their noise variances are in float64, the projected solve in float32
    n, d, k = 50, 30, 3
    x = (torch.randn(n, 5, dtype=F64) @ torch.randn(5, d, dtype=F64)).float()
    noise = torch.full((n,), 0.3)
    y = x.double() @ torch.randn(d, k, dtype=F64) / 5 + 0.3 * torch.randn(n, k, dtype=F64)
    loc, scale = _wide_fit(x, y, noise, input_rank=None, noise_scale=0.2)
    loc5, scale5 = _wide_fit(x, y, noise, input_rank=5, noise_scale=0.2)
    assert loc5.dtype == scale5.dtype == torch.float32
    assert_close(loc5, loc, atol=1e-5, rtol=1e-4)
    assert_close(scale5, scale, atol=0, rtol=1e-5)


def test_principal_directions_span_the_top_singular_vectors():
    u, _ = torch.linalg.qr(torch.randn(200, 40, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(50, 40, dtype=F64))
    x = u @ torch.diag(torch.logspace(2, -2, 40, dtype=F64)) @ v.T
    basis = principal_directions(x, 6)
    assert_close(basis.T @ basis, torch.eye(6, dtype=F64), atol=1e-12, rtol=0)
    top = v[:, :6]  # the projectors onto both spans agree
    assert_close(basis @ basis.T, top @ top.T, atol=1e-4, rtol=0)
    state = torch.get_rng_state()
    assert torch.equal(principal_directions(x, 6), basis)  # a fixed seed, not the global RNG
    assert torch.equal(torch.get_rng_state(), state)


def test_input_rank_must_be_positive():
    with pytest.raises(ValueError, match="input_rank must be positive"):
        IBLMGuideInitializer(input_rank=0)


def _unit_layer(h, d, bias, w0):
    """A linear layer's record with a N(w0, s_j^2) weight prior (s_j per unit),
    a latent N(m_j, 1.5^2) bias, a fixed bias or none."""
    scales = torch.linspace(0.5, 1.2, h, dtype=F64)[:, None].expand(h, d)
    layer = Layer("linear", "w", torch.Size([h, d]), prior_loc=torch.full((h, d), w0, dtype=F64),
                  prior_scale=scales)
    if bias == "latent":
        layer.bias_name = "b"
        layer.bias_prior_loc = torch.linspace(-0.5, 0.5, h, dtype=F64)
        layer.bias_prior_scale = torch.full((h,), 1.5, dtype=F64)
    elif bias == "fixed":
        layer.fixed_bias = torch.linspace(-1.0, 2.0, h, dtype=F64)
    return layer


def _unit_posterior(layer, j, xj, t, noise, hidden):
    """Unit j's Bayesian linear regression on its rows ``xj`` with the targets
    and noise of its column: made hidden targets, its prior, its bias."""
    if hidden is not None:
        t, noise = (v[0] for v in hidden(t[None], noise[None], torch.tensor([j])))
    loc, scale = layer.prior_loc[j], layer.prior_scale[j]
    if layer.bias_name is not None:
        xj = torch.cat([xj, torch.ones(len(xj), 1, dtype=xj.dtype)], 1)
        loc = torch.cat([loc, layer.bias_prior_loc[j, None]])
        scale = torch.cat([scale, layer.bias_prior_scale[j, None]])
    elif layer.fixed_bias is not None:
        t = t - layer.fixed_bias[j]
    return blr.bayesian_linear_regression(xj, t, noise, loc, scale)


@pytest.mark.filterwarnings("error")  # e.g. an out= tensor of another shape, resized
@pytest.mark.parametrize("rank, bias, w0, hidden, per_chunk", [
    (5, "latent", 0.3, False, 2),
    (1, "fixed", 1.0, True, 1),
    (5, "none", 0.0, True, 3),
    (5, "latent", 1.0, True, 2),
])
def test_projected_units_equal_their_closed_form(rank, bias, w0, hidden, per_chunk,
                                                 monkeypatch):
    # Units 2..6 of 7, on inputs of exactly the projection's rank (so that it is exact),
    # in chunks of per_chunk units: each unit's Bayesian linear regression on its
    # batch (rows drawn with repeats, which count twice), its hidden targets, its
    # prior and its bias.
    n, d, k, h, b, lo, hi = 40, 30, 3, 7, 12, 2, 7
    x = torch.randn(n, rank, dtype=F64) @ torch.randn(rank, d, dtype=F64)
    y = torch.randn(n, k, dtype=F64)
    noise_var = torch.rand(n, k, dtype=F64) + 0.1
    idx = torch.randint(0, n, (h, b))
    cols = torch.arange(h) % k
    layer = _unit_layer(h, d, bias, w0)
    targets = HiddenTargets(torch.tensor([1.0, -1.0]).repeat(4)[:h], True, True, 0.5) \
        if hidden else None
    calls = []

    def spy(zb, t, noise, prior_loc, prior_scale, **kwargs):
        calls.append((zb.shape, kwargs))
        return blr.bayesian_linear_regression(zb, t, noise, prior_loc, prior_scale, **kwargs)

    monkeypatch.setattr(_regressions, "bayesian_linear_regression", spy)
    assert projects(layer, x, idx, lo, hi, rank)
    width = rank + (bias == "latent")
    means, variances = solve_units(
        layer, x, y, noise_var, idx, lo, hi, cols=cols, hidden=targets, solver="primal",
        jitter=1e-3, max_chunk_elements=per_chunk * 4 * b * (rank + 1), input_rank=rank)
    assert means.shape == variances.shape == (hi - lo, d + (bias == "latent"))
    # as many units per solve as max_chunk_elements allows (4 b (rank + 1) each), once each
    sizes = [min(per_chunk, hi - start) for start in range(lo, hi, per_chunk)]
    assert [shape for shape, _ in calls] == [(c, b, width) for c in sizes]
    assert all(kw["jitter"] == 1e-3 for _, kw in calls)  # the option's, not the default
    for j in range(lo, hi):
        rows = idx[j]
        post = _unit_posterior(layer, j, x[rows], y[rows, cols[j]], noise_var[rows, cols[j]],
                               targets)
        assert_close(means[j - lo], post.mean, atol=1e-9, rtol=1e-7)
        assert_close(variances[j - lo], post.precision_diag.reciprocal(), atol=0, rtol=1e-12)


@pytest.mark.parametrize("pattern", ["one-hot", "dense", "per-unit", "equal", "one unit",
                                     "binary", "mixed"])
@pytest.mark.parametrize("max_chunk_elements", [1, 2**22])
def test_weighted_grams_equal_each_units_product(pattern, max_chunk_elements):
    # X^T diag(w_u) X for every column of the weights, whichever way it is computed: a
    # one-hot likelihood's (one unit per row above the others: the shared product plus
    # each unit's rows), random (each unit's own product), a constant per unit, the same
    # for every unit (the shared product alone), a single unit, two balanced classes
    # whose weights differ by exactly 1, or one-hot units beside a unit of its own
    n, d, units = 30, 4, 5
    x = torch.randn(n, d, dtype=F64)
    labels = torch.randint(0, units, (n,))
    weights = {
        "one-hot": 0.2 + 1.3 * F.one_hot(labels, units).to(F64),
        "dense": torch.rand(n, units, dtype=F64) + 0.1,
        "per-unit": torch.linspace(0.5, 2.0, units, dtype=F64).expand(n, units),
        "equal": (torch.rand(n, 1, dtype=F64) + 0.1).expand(n, units),
        "one unit": torch.rand(n, 1, dtype=F64) + 0.1,
        "binary": 0.5 + F.one_hot(torch.arange(n) % 2, 2).to(F64),
        "mixed": torch.cat([0.2 + 1.3 * F.one_hot(labels % 4, 4).to(F64),
                            torch.rand(n, 1, dtype=F64) + 0.1], 1),
    }[pattern]
    expected = torch.stack([x.T @ torch.diag(w) @ x for w in weights.T])
    gram = _regressions.weighted_grams(x, weights, max_chunk_elements)
    assert_close(gram, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("bias, hidden", [("latent", False), ("fixed", True), ("none", False)])
@pytest.mark.parametrize("solver, shared", [("primal", True), ("auto", True), ("dual", False)])
def test_units_on_shared_rows_equal_their_closed_form(bias, hidden, solver, shared,
                                                      monkeypatch):
    # Units 1..5 of 6 on the same 25 rows (an output layer's), each onto its column with
    # a one-hot likelihood's noise (two levels, one column per row lower): each unit's
    # Bayesian linear regression, through the shared Gram matrices unless the dual form
    # is asked for.
    n, d, k, h, lo, hi = 25, 4, 3, 6, 1, 6
    x = torch.randn(n, d, dtype=F64)
    y = torch.randn(n, k, dtype=F64)
    noise_var = 4.6 - 3.9 * F.one_hot(torch.randint(0, k, (n,)), k).to(F64)
    idx = torch.randperm(n)[None].expand(h, n)
    cols = torch.arange(h) % k
    layer = _unit_layer(h, d, bias, 0.3)
    targets = HiddenTargets(torch.tensor([1.0, -1.0]).repeat(3), True, True, 0.5) \
        if hidden else None
    products = []
    monkeypatch.setattr(_regressions, "weighted_grams", lambda x, w, m, **kw: products.append(
        w.shape) or blr_grams(x, w, m, **kw))
    means, variances = solve_units(
        layer, x, y, noise_var, idx, lo, hi, cols=cols, hidden=targets, solver=solver,
        jitter=1e-3, max_chunk_elements=2**22, input_rank=None)
    assert products == ([(n, hi - lo)] if shared else [])
    for j in range(lo, hi):
        post = _unit_posterior(layer, j, x, y[:, cols[j]], noise_var[:, cols[j]], targets)
        assert_close(means[j - lo], post.mean, atol=1e-10, rtol=1e-9)
        assert_close(variances[j - lo], post.precision_diag.reciprocal(), atol=0, rtol=1e-12)


blr_grams = _regressions.weighted_grams


def test_units_on_shared_rows_in_the_layers_dtype():
    # a float32 layer with float64 targets, noise and priors: the solve runs in float32
    n, d, k, h = 25, 4, 3, 3
    x = torch.randn(n, d)
    y = torch.randn(n, k, dtype=F64)
    noise_var = 4.6 - 3.9 * F.one_hot(torch.randint(0, k, (n,)), k).to(F64)
    layer = _unit_layer(h, d, "latent", 0.3)
    means, variances = solve_units(
        layer, x, y, noise_var, torch.arange(n)[None].expand(h, n), 0, h, cols=torch.arange(h),
        hidden=None, solver="primal", jitter=1e-3, max_chunk_elements=2**22, input_rank=None)
    assert means.dtype == variances.dtype == torch.float32
    for j in range(h):
        post = _unit_posterior(layer, j, x.to(F64), y[:, j], noise_var[:, j], None)
        assert_close(means[j], post.mean.float(), atol=1e-4, rtol=1e-4)


def test_units_on_shared_rows_get_jitter_on_a_singular_system():
    # two equal integer inputs and a flat prior: X^T L^-1 X + diag(1e-16) is exactly
    # singular in float32, and the Cholesky factorization needs the jitter (the option's):
    # the mean still fits
    n, h = 20, 2
    x = torch.randint(1, 4, (n, 1)).float().expand(n, 2).contiguous()
    y = 3.0 * x[:, :1].expand(n, h)
    layer = Layer("linear", "w", torch.Size([h, 2]), prior_loc=torch.zeros(h, 2),
                  prior_scale=torch.full((h, 2), 1e8))
    means, _ = solve_units(
        layer, x, y, torch.full((n, h), 0.1), torch.arange(n)[None].expand(h, n), 0, h,
        cols=torch.arange(h), hidden=None, solver="primal", jitter=1e-3,
        max_chunk_elements=2**22, input_rank=None)
    assert torch.isfinite(means).all()
    assert_close(means.sum(1), torch.full((h,), 3.0), atol=1e-2, rtol=0)


@pytest.mark.filterwarnings("error")  # e.g. an out= tensor of another shape, resized
@pytest.mark.parametrize("noise", ["one-hot", "per-column", "mixed"])
def test_units_on_shared_rows_solved_in_bounded_chunks(noise, monkeypatch):
    # 7 units on the same 40 rows, with room per chunk for 2 units' weights and targets on
    # the rows and Gram matrices (each with its regularized copy and its factor): 4 solves
    # of at most 2 units, not the whole layer's at once (1,000 classes on 512 inputs: 3 GB),
    # the product of the rows' smallest weight over all 7 units made once and shared by
    # the chunks; each unit its closed form
    n, d, h = 40, 4, 7
    width = d + 1
    x = torch.randn(n, d, dtype=F64)
    y = torch.randn(n, h, dtype=F64)
    one_hot = 4.6 - 3.9 * F.one_hot(torch.randint(0, h, (n,)), h).to(F64)
    noise_var = {
        "one-hot": one_hot,
        "per-column": torch.linspace(0.5, 2.0, h, dtype=F64).expand(n, h),
        "mixed": torch.cat([one_hot[:, :4], torch.rand(n, 3, dtype=F64) + 0.1], 1),
    }[noise]
    layer = _unit_layer(h, d, "latent", 0.3)
    sizes, floors, bases = [], [], []

    def spy_solve(gram, *args):
        sizes.append(gram.shape[0])
        return solve_statistics(gram, *args)

    def spy_grams(x, w, m, shared=None):
        floors.append(None if shared is None else shared.floor)
        return blr_grams(x, w, m, shared)

    class SpyProduct(_regressions.SharedProduct):
        def base(self):
            bases.append(super().base())
            return bases[-1]

    monkeypatch.setattr(_regressions, "solve_statistics", spy_solve)
    monkeypatch.setattr(_regressions, "weighted_grams", spy_grams)
    monkeypatch.setattr(_regressions, "SharedProduct", SpyProduct)
    means, variances = solve_units(
        layer, x, y, noise_var, torch.arange(n)[None].expand(h, n), 0, h, cols=torch.arange(h),
        hidden=None, solver="primal", jitter=1e-3,
        max_chunk_elements=2 * (4 * n + 3 * width**2) + 1, input_rank=None)
    assert sizes == [2, 2, 2, 1]
    assert len(floors) == 4
    for floor in floors:  # every unit's, not a chunk's
        assert torch.equal(floor, noise_var.max(1).values.reciprocal())
    assert bases and all(base is bases[0] for base in bases)  # made once
    for j in range(h):
        xj = torch.cat([x, torch.ones(n, 1, dtype=F64)], 1)
        loc = torch.cat([layer.prior_loc[j], layer.bias_prior_loc[j, None]])
        scale = torch.cat([layer.prior_scale[j], layer.bias_prior_scale[j, None]])
        post = blr.bayesian_linear_regression(xj, y[:, j], noise_var[:, j], loc, scale)
        assert_close(means[j], post.mean, atol=1e-10, rtol=1e-9)
        assert_close(variances[j], post.precision_diag.reciprocal(), atol=0, rtol=1e-12)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("patches_at_once", [True, False])
def test_conv_units_equal_their_closed_form(groups, patches_at_once, monkeypatch):
    # Units 1..5 of a 3x3 convolution (stride 2, padding 1) with a latent bias, on
    # batches of rows drawn with repeats: each unit's Bayesian linear regression on
    # every patch of its rows (its group's channels), each patch with its row's
    # target. The rows' patches are extracted once where they fit in
    # max_chunk_elements, or per chunk of units; the same regressions either way.
    n, c, h, k, b, lo, hi = 10, 4, 6, 3, 5, 1, 6
    x = torch.randn(n, c, 5, 5, dtype=F64)
    y = torch.randn(n, k, dtype=F64)
    noise_var = torch.rand(n, k, dtype=F64) + 0.1
    idx = torch.randint(0, n, (h, b))
    cols = torch.arange(h) % k
    shape = torch.Size([h, c // groups, 3, 3])
    layer = Layer("conv2d", "w", shape, dict(stride=2, padding=1, dilation=1, groups=groups),
                  prior_loc=torch.zeros(shape, dtype=F64),
                  prior_scale=torch.linspace(0.5, 1.2, h, dtype=F64)[:, None, None, None]
                  .expand(shape), bias_name="b",
                  bias_prior_loc=torch.linspace(-0.5, 0.5, h, dtype=F64),
                  bias_prior_scale=torch.full((h,), 1.5, dtype=F64))
    d, positions = layer.fan_in, 9
    # the patches of all rows (n * positions * groups * d elements) fit, or they do not
    # (and a chunk is one unit)
    budget = n * positions * groups * d - (not patches_at_once)
    rows_seen = []

    def spy(layer, x):
        rows_seen.append(len(x))
        return unit_inputs(layer, x)

    monkeypatch.setattr(_regressions, "unit_inputs", spy)
    means, variances = solve_units(layer, x, y, noise_var, idx, lo, hi, cols=cols, hidden=None,
                                   solver="primal", jitter=1e-6, max_chunk_elements=budget)
    # (after the one row that reads the layout) every row once, or each unit's rows
    assert rows_seen == [1, n] if patches_at_once else rows_seen == [1] + [b] * (hi - lo)
    patches = _regressions.extract_patches(x, (3, 3), 2, 1).reshape(n, positions, groups, d)
    for j in range(lo, hi):
        rows = idx[j]
        xj = patches[rows, :, j // (h // groups)].reshape(b * positions, d)
        t = y[rows, cols[j]].repeat_interleave(positions)
        noise = noise_var[rows, cols[j]].repeat_interleave(positions)
        post = blr.bayesian_linear_regression(
            torch.cat([xj, torch.ones(len(xj), 1, dtype=F64)], 1), t, noise,
            torch.cat([layer.prior_loc[j].reshape(-1), layer.bias_prior_loc[j, None]]),
            torch.cat([layer.prior_scale[j].reshape(-1), layer.bias_prior_scale[j, None]]))
        assert_close(means[j - lo], post.mean, atol=1e-9, rtol=1e-7)
        assert_close(variances[j - lo], post.precision_diag.reciprocal(), atol=0, rtol=1e-12)
