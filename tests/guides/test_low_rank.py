import pytest
import torch

from pyro_vinit.guides._low_rank import _svd, fit_positive_low_rank
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
@pytest.mark.parametrize(
    "m,n,rank", [(5, 8, 5), (8, 5, 5), (6, 6, 6), (4, 7, 6), (7, 4, 6), (3, 3, 4)]
)
def test_full_rank_is_exact(m, n, rank, dtype):
    s = (torch.rand(m, n, dtype=torch.float64) + 0.01).to(dtype)  # full rank
    u, v = fit_positive_low_rank(s, rank)
    assert u.shape == (m, rank) and (u > 0).all() and (v > 0).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert_close(u @ v.T, s, atol=0, rtol=tol)


def _error(s, u, v):
    return float((s - u @ v.T).norm())


@pytest.mark.parametrize("k", [2, 3])
def test_refinement_starts_at_the_rank_one_fit_and_closes_the_gap(k):
    # Eckart-Young: the rank-1 fit's error is |sigma_2..|, the rank-k bound |sigma_{k+1}..|.
    s = _positive(30, 4) @ _positive(40, 4).T
    singular_values = torch.linalg.svdvals(s)
    rank_one, bound = float(singular_values[1:].norm()), float(singular_values[k:].norm())
    # no sweeps: the rank-1 fit split into k components, with its error exactly
    start = fit_positive_low_rank(s, k, num_iters=0)
    assert _error(s, *start) == pytest.approx(rank_one, rel=1e-10)
    # the sweeps close more than 99 % of the gap between the rank-1 fit and the bound
    error = _error(s, *fit_positive_low_rank(s, k))
    assert (error - bound) < 0.01 * (rank_one - bound)
    # they stop once 10 sweeps gain less than 0.1 %: well before 200 here, so more allowed
    # sweeps give the same factors
    first, longer = fit_positive_low_rank(s, k), fit_positive_low_rank(s, k, num_iters=5000)
    assert all(torch.equal(a, b) for a, b in zip(first, longer))


@pytest.mark.parametrize("c", [1e-8, 1e8])
def test_scale_equivariant(c):
    # Posterior standard deviations are small numbers: the fit of c * S is c times the fit
    # of S, whatever c (the floor and the rank tolerance are relative).
    s2 = _positive(7, 2) @ _positive(5, 2).T
    u, v = fit_positive_low_rank(c * s2, 2)
    assert (u > 0).all() and (v > 0).all()
    assert_close(u @ v.T, c * s2, atol=0, rtol=1e-10)  # still exact at rank 2
    s4 = _positive(30, 4) @ _positive(40, 4).T
    u, v = fit_positive_low_rank(c * s4, 3)
    assert_close(u @ v.T, c * (lambda a, b: a @ b.T)(*fit_positive_low_rank(s4, 3)),
                 atol=0, rtol=1e-6)


def test_rank_one_fit_of_rank_two_matrix():
    s = _positive(7, 2) @ _positive(5, 2).T
    u, v = fit_positive_low_rank(s, 1)
    assert u.shape == (7, 1) and v.shape == (5, 1)
    assert _error(s, u, v) == pytest.approx(float(torch.linalg.svdvals(s)[1]), rel=1e-8)


def test_rank_two_either_sign_of_the_singular_vectors():
    # an SVD is unique up to the signs of its singular pairs; both give exact positive factors
    from pyro_vinit.guides._low_rank import _rank_two

    s = _positive(7, 2) @ _positive(5, 2).T
    U, sv, Vh = torch.linalg.svd(s, full_matrices=False)
    for sign in (1.0, -1.0):
        flip = torch.tensor([sign, 1.0, 1.0, 1.0, 1.0], dtype=s.dtype)
        u, v = _rank_two(U * flip, sv, Vh * flip[:, None])
        assert (u > 0).all() and (v > 0).all()
        assert_close(u @ v.T, s, atol=0, rtol=1e-10)


def test_full_rank_with_a_dominant_column_and_balanced_factors():
    # The exact construction's epsilon is bounded by each entry over its *column's* sum; a
    # column dominated by one entry is where a row-based bound would go negative.
    s = torch.tensor([[0.01, 1.0, 1.0, 1.0], [100.0, 1.0, 2.0, 1.0], [1.0, 3.0, 1.0, 1.0]],
                     dtype=torch.float64)
    for matrix in (s, s.T):
        u, v = fit_positive_low_rank(matrix, 3)
        assert (u > 0).all() and (v > 0).all()
        assert_close(u @ v.T, matrix, atol=0, rtol=1e-10)
        # balanced magnitudes: a softplus-parameterized factor is neither tiny nor huge
        assert float(u.max()) == pytest.approx(float(v.max()), rel=1e-10)


def test_float32_is_computed_in_float64():
    s = (_positive(30, 4) @ _positive(40, 4).T).float()
    for rank in (2, 3):
        got = fit_positive_low_rank(s, rank)
        wanted = [t.float() for t in fit_positive_low_rank(s.double(), rank)]
        assert all(torch.equal(a, b) for a, b in zip(got, wanted))


def test_empty_columns():
    u, v = fit_positive_low_rank(torch.ones(4, 0), 2)
    assert u.shape == (4, 2) and v.shape == (0, 2) and (u > 0).all()


@pytest.mark.parametrize("shape", [(6, 9), (9, 6), (5, 5)])
def test_svd_from_the_gram_matrix_matches_torch(shape):
    # the singular values, and the singular vectors up to sign, of a positive matrix
    matrix = torch.rand(shape, dtype=torch.float64) + 0.1
    U, s, Vh = _svd(matrix)
    U0, s0, Vh0 = torch.linalg.svd(matrix, full_matrices=False)
    assert U.shape == U0.shape and Vh.shape == Vh0.shape
    assert_close(s, s0, atol=1e-7 * float(s0[0]), rtol=0)
    signs = (U * U0).sum(0).sign()
    assert_close(U * signs, U0, atol=1e-9, rtol=0)
    assert_close(Vh[:3] * signs[:3, None], Vh0[:3], atol=1e-9, rtol=0)
    assert_close(U @ torch.diag(s) @ Vh, matrix, atol=1e-12, rtol=0)
