"""The fast paths of I-BLM's solves: the slab sort, the noise level's search,
and the projected solve of wide linear layers."""

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn
from torch.testing import assert_close

from pyro_vinit import IBLMGuideInitializer, init_guide_iblm
from pyro_vinit.initialization._collective import argsort_rows
from pyro_vinit.initialization._noise import monotone_inverse
from pyro_vinit.initialization._regressions import principal_directions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argsort_rows_matches_torch(dtype):
    # distinct scores (a permutation per row), so that the order is unique
    scores = torch.stack([torch.randperm(200) for _ in range(5)]).to(dtype)
    order = argsort_rows(scores)
    assert order.dtype == torch.long and order.shape == (5, 200)
    assert torch.equal(order, scores.argsort(-1))


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
    """One latent linear layer with a N(0.3, 0.7^2) weight prior, in float64."""

    def __init__(self, d_in, d_out, noise):
        super().__init__()
        self.layer = PyroModule[nn.Linear](d_in, d_out).to(F64)
        self.layer.weight = PyroSample(
            dist.Normal(torch.tensor(0.3, dtype=F64), 0.7).expand([d_out, d_in]).to_event(2)
        )
        self.layer.bias = PyroSample(
            dist.Normal(torch.tensor(-0.2, dtype=F64), 1.5).expand([d_out]).to_event(1)
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
