import re

import pytest
import torch

import pyro_vinit.initialization.bayesian_linear_regression as blr
from pyro_vinit.initialization.bayesian_linear_regression import bayesian_linear_regression
from tests.common import assert_close


def _closed_form(x, y, noise_var, m0, s0):
    """The textbook posterior with explicit inverses (float64, test only)."""
    lam_inv = torch.diag_embed(s0.pow(-2))
    l_inv = torch.diag_embed(noise_var.reciprocal())
    a = lam_inv + x.transpose(-1, -2) @ l_inv @ x
    cov = torch.linalg.inv(a)
    rhs = x.transpose(-1, -2) @ l_inv @ y.unsqueeze(-1) + (lam_inv @ m0.unsqueeze(-1))
    return (cov @ rhs).squeeze(-1), a.diagonal(dim1=-2, dim2=-1), cov.diagonal(dim1=-2, dim2=-1)


@pytest.mark.parametrize("n,d", [(30, 5), (6, 20), (10, 10)])
@pytest.mark.parametrize("hetero", [False, True])
@pytest.mark.parametrize("solver", ["primal", "dual", "auto"])
def test_matches_closed_form(n, d, hetero, solver):
    batch = (3, 2)
    x = torch.randn(batch + (n, d), dtype=torch.float64)
    y = torch.randn(batch + (n,), dtype=torch.float64)
    noise = torch.rand(batch + (n,), dtype=torch.float64) + 0.1 if hetero else torch.full(
        batch + (n,), 0.3, dtype=torch.float64
    )
    m0 = torch.randn(batch + (d,), dtype=torch.float64)
    s0 = torch.rand(batch + (d,), dtype=torch.float64) + 0.2
    post = bayesian_linear_regression(x, y, noise, m0, s0, solver=solver, covariance_diag=True)
    mean, prec, cov = _closed_form(x, y, noise, m0, s0)
    assert_close(post.mean, mean, atol=1e-10, rtol=1e-9)
    assert_close(post.precision_diag, prec, atol=1e-10, rtol=1e-10)
    assert_close(post.covariance_diag, cov, atol=1e-10, rtol=1e-9)


def test_primal_and_dual_agree_float32():
    x = torch.randn(50, 40, 60)
    y = torch.randn(50, 40)
    primal = bayesian_linear_regression(x, y, 0.5, 0.0, 0.3, solver="primal")
    dual = bayesian_linear_regression(x, y, 0.5, 0.0, 0.3, solver="dual")
    assert_close(primal.mean, dual.mean, atol=1e-4, rtol=1e-3)


def test_scalar_arguments_broadcast():
    x = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randn(8, dtype=torch.float64)
    post = bayesian_linear_regression(x, y, 0.2, 0.1, 2.0)
    mean, prec, _ = _closed_form(
        x, y, torch.full((8,), 0.2, dtype=torch.float64),
        torch.full((3,), 0.1, dtype=torch.float64), torch.full((3,), 2.0, dtype=torch.float64),
    )
    assert_close(post.mean, mean, atol=1e-12, rtol=1e-10)
    assert_close(post.precision_diag, prec)
    assert post.covariance_diag is None


def test_jitter_rescues_singular_system():
    # Zero prior precision would make A singular for collinear inputs; a huge prior
    # scale makes it numerically so. The solve must still return finite values.
    x = torch.ones(4, 10, 3)
    y = torch.randn(4, 10)
    post = bayesian_linear_regression(x, y, 1.0, 0.0, 1e8, solver="primal")
    assert torch.isfinite(post.mean).all()


def test_bad_solver():
    with pytest.raises(ValueError, match="solver"):
        bayesian_linear_regression(torch.randn(3, 2), torch.randn(3), 1.0, solver="qr")


def test_defaults_are_a_standard_normal_prior():
    x = torch.randn(9, 4, dtype=torch.float64)
    y = torch.randn(9, dtype=torch.float64)
    post = bayesian_linear_regression(x, y, 0.5)
    expected = bayesian_linear_regression(x, y, 0.5, 0.0, 1.0)
    mean, prec, _ = _closed_form(
        x, y, torch.full((9,), 0.5, dtype=torch.float64),
        torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64),
    )
    assert_close(post.mean, mean, atol=1e-12, rtol=1e-10)
    assert_close(post.precision_diag, prec)
    assert_close(post.mean, expected.mean, atol=0, rtol=0)


def test_arguments_take_the_dtype_of_x():
    # Integer targets (labels) and float64 prior tensors with float32 inputs.
    x = torch.randn(12, 3)
    labels = torch.randint(0, 3, (12,))
    m0 = torch.full((3,), 0.2, dtype=torch.float64)
    s0 = torch.full((3,), 1.5, dtype=torch.float64)
    for solver in ["primal", "dual"]:
        post = bayesian_linear_regression(x, labels, 0.3, m0, s0, solver=solver,
                                          covariance_diag=True)
        expected = bayesian_linear_regression(x, labels.float(), 0.3, m0.float(), s0.float(),
                                              solver=solver, covariance_diag=True)
        for got, want in zip(post, expected):
            assert got.dtype == torch.float32
            assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize(
    "solver,n,d,factored",
    [("primal", 4, 6, "A"), ("dual", 6, 4, "K"), ("auto", 6, 4, "A"), ("auto", 5, 5, "A"),
     ("auto", 4, 6, "K")],
)
def test_solver_choice(solver, n, d, factored, monkeypatch):
    # "auto" factors the d x d precision A when d <= n, else the n x n Gram matrix K.
    x = torch.randn(n, d, dtype=torch.float64)
    y = torch.randn(n, dtype=torch.float64)
    noise, s0 = 0.4, 1.3
    seen = []
    cholesky = blr._cholesky

    def spy(matrix, jitter):
        seen.append(matrix.clone())
        return cholesky(matrix, jitter)

    monkeypatch.setattr(blr, "_cholesky", spy)
    bayesian_linear_regression(x, y, noise, 0.0, s0, solver=solver)
    if factored == "A":
        expected = torch.eye(d, dtype=torch.float64) / s0**2 + x.T @ x / noise
    else:
        expected = torch.eye(n, dtype=torch.float64) * noise + s0**2 * x @ x.T
    assert len(seen) == 1
    assert_close(seen[0], expected, atol=1e-12, rtol=1e-12)


def test_jitter_only_where_the_factorization_fails():
    # Two batch dims (so no batch size can stand in for the matrix size), one
    # matrix not positive definite: only that one gets jitter, with its own scale.
    # The two bad matrices fail at the second and at the first pivot.
    good = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    bad = torch.tensor([[10.0, 0.0], [0.0, -1e-3]], dtype=torch.float64)
    bad_first = bad.flip(0, 1)
    matrix = torch.stack([torch.stack([good, bad, good]), torch.stack([good, good, bad_first])])
    factor = blr._cholesky(matrix, jitter=1e-6)
    rebuilt = factor @ factor.transpose(-1, -2)
    for i, j in [(0, 0), (0, 2), (1, 0), (1, 1)]:
        assert_close(rebuilt[i, j], good, atol=1e-14, rtol=0)
    # -1e-3 needs four tries: 1e-6, 1e-5, 1e-4 and 1e-3 times the mean |diagonal|.
    added = (1e-6 + 1e-5 + 1e-4 + 1e-3) * (10.0 + 1e-3) / 2 * torch.eye(2, dtype=torch.float64)
    assert_close(rebuilt[0, 1], bad + added, atol=1e-12, rtol=0)
    assert_close(rebuilt[1, 2], bad_first + added, atol=1e-12, rtol=0)
    # ... and alone, where no other matrix of the batch keeps the retries going.
    factor = blr._cholesky(bad_first, jitter=1e-6)
    assert_close(factor @ factor.T, bad_first + added, atol=1e-12, rtol=0)


def test_jitter_for_a_zero_first_pivot():
    # An infinite prior scale and an all-zero input column: A[0, 0] = 0, the
    # factorization fails at the first pivot.
    x = torch.randn(10, 3, dtype=torch.float64)
    x[:, 0] = 0
    y = torch.randn(10, dtype=torch.float64)
    s0 = torch.tensor([float("inf"), 1.0, 1.0], dtype=torch.float64)
    post = bayesian_linear_regression(x, y, 0.5, 0.0, s0, solver="primal")
    assert torch.isfinite(post.mean).all()
    assert post.mean[0] == 0
    # The jitter (1e-6 x the mean diagonal by default) barely moves the other weights.
    exact = bayesian_linear_regression(x[:, 1:], y, 0.5, 0.0, 1.0)
    assert_close(post.mean[1:], exact.mean, atol=0, rtol=1e-4)
    assert_close(post.mean, bayesian_linear_regression(x, y, 0.5, 0.0, s0, solver="primal",
                                                       jitter=1e-6).mean, atol=0, rtol=0)


def test_jitter_gives_up_with_an_actionable_error():
    # An eigenvalue of -99 x the mean diagonal: the eighth try adds only 11.1 x.
    matrix = torch.tensor([[1.0, 100.0], [100.0, 1.0]], dtype=torch.float64)
    message = (
        "bayesian_linear_regression: the system is not positive definite even with "
        "jitter 1.0e+01 x its mean diagonal; check the inputs for NaN/inf or "
        "degenerate prior or noise scales, or compute in float64"
    )
    with pytest.raises(RuntimeError, match=re.escape(message)):
        blr._cholesky(matrix, jitter=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_system_with_inf_or_nan_is_refused_at_once(bad):
    # An inf last on the diagonal factors "successfully" (info 0, an inf in the factor);
    # NaN fails every jitter. Both: an error at once, naming the overflow and float64.
    matrix = torch.eye(3).repeat(2, 1, 1)
    matrix[1, 2, 2] = bad
    message = (
        "bayesian_linear_regression: the system matrix has inf or NaN entries (float32 "
        "overflows above 3.4e+38); the inputs are too large, or a prior or noise scale too "
        "small (its inverse square overflows): compute in float64 or rescale them"
    )
    with pytest.raises(RuntimeError, match=re.escape(message)):
        blr._cholesky(matrix, jitter=1e-6)
    # through the regression: inputs whose squares overflow float32
    x, y = torch.tensor([[1e20, 1.0], [1.0, 2.0], [3.0, 1.0]]), torch.ones(3)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        bayesian_linear_regression(x, y, 1.0)
    assert torch.isfinite(bayesian_linear_regression(x.double(), y.double(), 1.0).mean).all()


def test_a_system_whose_sum_overflows_is_factored():
    # Finite entries whose sum overflows float32 (the quick check of finiteness is not
    # the answer): the factor, as LAPACK's.
    matrix = torch.diag(torch.tensor([3e38, 3e38, 1.0])).repeat(2, 1, 1)
    assert not torch.isfinite(matrix.sum())
    assert torch.equal(blr._cholesky(matrix, jitter=1e-6), torch.linalg.cholesky(matrix))


def test_bad_x():
    with pytest.raises(ValueError, match=re.escape("x must have shape (..., n, d), got (3,)")):
        bayesian_linear_regression(torch.randn(3), torch.randn(3), 1.0)


def test_dual_solve_with_jitter():
    # No noise and more rows than weights: K = X X^T is singular and needs the
    # default jitter; the mean then interpolates the data, as the primal limit does.
    x = torch.randn(8, 3, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    post = bayesian_linear_regression(x, y, 0.0, solver="dual")
    assert post.covariance_diag is None
    assert_close(x @ post.mean, y, atol=1e-4, rtol=0)
    limit = bayesian_linear_regression(x, y, 1e-10, solver="primal")
    assert_close(post.mean, limit.mean, atol=1e-4, rtol=0)
