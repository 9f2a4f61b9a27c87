import pytest
import torch

from pyro_vinit.guides._low_rank import fit_positive_low_rank
from tests.common import assert_close


def _positive(*shape, dtype=torch.float64):
    return (torch.rand(*shape, dtype=dtype) + 0.1) * 0.3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("true_rank,rank", [(1, 1), (1, 2), (1, 3), (2, 2), (2, 3)])
@pytest.mark.parametrize("m,n", [(7, 5), (40, 30), (1, 6), (6, 1)])
def test_rank_at_most_two_is_exact(m, n, true_rank, rank, dtype):
    # Every positive matrix of rank <= 2 has exact positive factors of rank 2.
    s = (_positive(m, true_rank) @ _positive(n, true_rank).T).to(dtype)
    u, v = fit_positive_low_rank(s, rank)
    assert u.shape == (m, rank) and v.shape == (n, rank) and u.dtype == dtype
    assert (u > 0).all() and (v > 0).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert_close(u @ v.T, s, atol=0, rtol=tol)


def test_rank_one_is_the_best_rank_one_fit():
    s = torch.rand(30, 40, dtype=torch.float64) + 0.01
    u, v = fit_positive_low_rank(s, 1)
    best = torch.linalg.svdvals(s)[1:].norm()  # Eckart-Young
    assert_close((s - u @ v.T).norm(), best, rtol=1e-8, atol=0)


def test_higher_rank_comes_close_to_the_truncated_svd():
    # The rank-k truncated SVD's error (Eckart-Young) bounds any rank-k fit from
    # below; on a positive rank-4 matrix the positive fits come within 1 % of it.
    s = _positive(30, 4) @ _positive(40, 4).T
    singular_values = torch.linalg.svdvals(s)
    for k in (2, 3):
        u, v = fit_positive_low_rank(s, k)
        best = singular_values[k:].norm()
        error = (s - u @ v.T).norm()
        assert best * (1 - 1e-9) <= error < 1.01 * best


def test_batched_and_empty():
    s = _positive(3, 6, 2) @ _positive(3, 5, 2).transpose(-1, -2)
    u, v = fit_positive_low_rank(s, 2)
    assert u.shape == (3, 6, 2) and v.shape == (3, 5, 2)
    assert_close(u @ v.transpose(-1, -2), s, atol=0, rtol=1e-10)
    u, v = fit_positive_low_rank(torch.ones(0, 4), 2)
    assert u.shape == (0, 2) and v.shape == (4, 2) and (v > 0).all()


def test_deterministic_and_no_rng_use():
    s = _positive(20, 3) @ _positive(10, 3).T
    state = torch.get_rng_state()
    first = fit_positive_low_rank(s, 2)
    assert torch.equal(torch.get_rng_state(), state)
    second = fit_positive_low_rank(s, 2)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_components_are_not_proportional():
    # Proportional components get proportional gradients and never separate.
    s = _positive(8, 1) @ _positive(6, 1).T
    u, _ = fit_positive_low_rank(s, 3)
    ratios = u / u[:, :1]
    assert (ratios.std(0)[1:] > 1e-3).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m,n,rank", [(5, 8, 5), (8, 5, 5), (6, 6, 6), (4, 7, 6), (3, 3, 4)])
def test_full_rank_is_exact(m, n, rank, dtype):
    s = (torch.rand(m, n, dtype=torch.float64) + 0.01).to(dtype)  # full rank
    u, v = fit_positive_low_rank(s, rank)
    assert u.shape == (m, rank) and (u > 0).all() and (v > 0).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert_close(u @ v.T, s, atol=0, rtol=tol)
