"""The fast paths of I-BLM's solves: the slab sort, the noise level's search,
and the solve of units that share their rows."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from pyro_vinit.initialization._collective import argsort_rows
from pyro_vinit.initialization._noise import monotone_inverse


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
