import pytest
import torch

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
