"""Batched Bayesian linear regression with a diagonal Normal prior."""

from typing import NamedTuple, Optional, Union

import torch

from pyro_vinit.initialization._data import all_finite

__all__ = ["BLRPosterior", "bayesian_linear_regression"]

_SOLVERS = ("auto", "primal", "dual")


class BLRPosterior(NamedTuple):
    """
    The Gaussian posterior of :func:`bayesian_linear_regression`, summarized
    per coefficient.

    :ivar torch.Tensor mean: The posterior mean :math:`\\mu`, shape ``(..., d)``.
    :ivar torch.Tensor precision_diag: The diagonal of the posterior precision
        :math:`A_{ii}`; :math:`1/A_{ii}` is the variance of the KL(q‖p)-optimal
        factorized Normal.
    :ivar covariance_diag: The diagonal of the posterior covariance
        :math:`(A^{-1})_{ii}` (the KL(p‖q)-optimal variance), or None unless
        requested.
    """

    mean: torch.Tensor
    precision_diag: torch.Tensor
    covariance_diag: Optional[torch.Tensor] = None


class _Unsolvable(RuntimeError):
    """A system of :func:`bayesian_linear_regression` that no jitter makes
    positive definite: ``reason`` says why, for callers that name the layer
    and their own remedies."""

    def __init__(self, reason: str, remedy: str) -> None:
        super().__init__(f"bayesian_linear_regression: {reason}; {remedy}")
        self.reason = reason


def _cholesky(matrix: torch.Tensor, jitter: float, max_tries: int = 8) -> torch.Tensor:
    """Batched Cholesky factor; adds ``jitter`` × mean diagonal (growing ×10 per
    try) to the matrices of the batch that are not numerically positive definite."""
    factor: torch.Tensor
    info: torch.Tensor
    factor, info = torch.linalg.cholesky_ex(matrix)
    # finite where its sum is (one synchronization, no elementwise pass), else elementwise
    if bool((info == 0).all() & torch.isfinite(matrix.sum())):
        return factor
    if not all_finite(matrix):
        # no jitter helps, and a factorization may even "succeed" with inf in the factor
        dtype = str(matrix.dtype).removeprefix("torch.")
        raise _Unsolvable(
            f"the system matrix has inf or NaN entries ({dtype} overflows above "
            f"{torch.finfo(matrix.dtype).max:.1e})",
            "the inputs are too large, or a prior or noise scale too small (its inverse "
            "square overflows): compute in float64 or rescale them",
        )
    diag = matrix.diagonal(dim1=-2, dim2=-1)
    scale = diag.abs().mean(-1).clamp_min(torch.finfo(matrix.dtype).tiny)
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    added = torch.zeros_like(scale)
    eps = jitter
    for _ in range(max_tries):
        added = torch.where(info > 0, added + eps * scale, added)
        factor, info = torch.linalg.cholesky_ex(matrix + added[..., None, None] * eye)
        if not bool((info > 0).any()):
            return factor
        eps *= 10
    raise _Unsolvable(
        f"the system is not positive definite even with jitter {eps / 10:.1e} x its mean "
        "diagonal",
        "check the inputs for NaN/inf or degenerate prior or noise scales, or compute in "
        "float64",
    )


def _gram(xw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The symmetric :math:`X_w^\top X` ``(..., d, d)`` of weighted rows ``xw``
    and rows ``x`` (broadcast over ``xw``'s batch), its upper right block
    computed once (three quarters of the product's cost)."""
    d = x.shape[-1]
    h = (d + 1) // 2
    gram = xw.new_empty(xw.shape[:-2] + (d, d))
    gram[..., :h, :] = xw[..., :h].transpose(-1, -2) @ x
    gram[..., h:, h:] = xw[..., h:].transpose(-1, -2) @ x[..., h:]
    gram[..., h:, :h] = gram[..., :h, h:].transpose(-1, -2)
    return gram


def _cholesky_solve(factor: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:math:`A^{-1} b` for the lower Cholesky factor ``factor`` of :math:`A`
    ``(..., d, d)`` and ``b`` ``(..., d)``, by two triangular solves (faster on
    the CPU than ``torch.cholesky_solve``)."""
    z = torch.linalg.solve_triangular(factor, b.unsqueeze(-1), upper=False)
    solution: torch.Tensor = torch.linalg.solve_triangular(factor.transpose(-1, -2), z,
                                                           upper=True)
    return solution.squeeze(-1)


def bayesian_linear_regression(
    x: torch.Tensor,
    y: torch.Tensor,
    noise_var: Union[torch.Tensor, float],
    prior_loc: Union[torch.Tensor, float] = 0.0,
    prior_scale: Union[torch.Tensor, float] = 1.0,
    *,
    solver: str = "auto",
    jitter: float = 1e-6,
    covariance_diag: bool = False,
) -> BLRPosterior:
    r"""
    Batched Bayesian linear regression
    :math:`y = Xw + \varepsilon`, :math:`\varepsilon \sim \mathcal N(0, L)`,
    :math:`L = \mathrm{diag}(\sigma^2)` (homo- or heteroscedastic),
    :math:`w \sim \mathcal N(m_0, \Lambda)`, :math:`\Lambda = \mathrm{diag}(s_0^2)`,
    solved independently for every leading batch index (supplement B and C of
    [1]).

    Usage::

        post = bayesian_linear_regression(x, y, noise_var=0.1, prior_scale=s0)
        loc, var = post.mean, post.precision_diag.reciprocal()

    The posterior is :math:`\mathcal N(\mu, A^{-1})` with

    .. math::

        A = \Lambda^{-1} + X^\top L^{-1} X, \qquad
        \mu = A^{-1}\big(X^\top L^{-1} y + \Lambda^{-1} m_0\big).

    The *primal* solve factors the :math:`d\times d` matrix :math:`A`
    (cost :math:`nd^2 + d^3/3`); the *dual* (Woodbury) solve factors the
    :math:`n\times n` matrix :math:`K = L + X\Lambda X^\top` and uses

    .. math::

        \mu = m_0 + \Lambda X^\top K^{-1}(y - X m_0)

    (cost :math:`n^2 d + n^3/3`). ``"auto"`` picks the primal form when
    :math:`d \le n`. No inverse is formed: :math:`A_{ii} = s_{0,i}^{-2} +
    \sum_n x_{ni}^2/\sigma_n^2` is read off directly, and the optional
    covariance diagonal comes from one triangular solve. A Cholesky factorization
    that fails gets a growing jitter, for the failing batch elements only.

    :param torch.Tensor x: Inputs, shape ``(..., n, d)``.
    :param torch.Tensor y: Targets, shape ``(..., n)``.
    :param noise_var: Noise variances :math:`\sigma^2`, broadcastable to ``(..., n)``.
    :param prior_loc: Prior means :math:`m_0`, broadcastable to ``(..., d)``.
    :param prior_scale: Prior standard deviations :math:`s_0`, broadcastable to
        ``(..., d)``.
    :param str solver: ``"auto"``, ``"primal"`` or ``"dual"``.
    :param float jitter: Relative jitter added on a failed Cholesky factorization.
    :param bool covariance_diag: Also return :math:`(A^{-1})_{ii}`.
    :rtype: BLRPosterior

    [1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
    Bayes for Deep Models"
    """
    if solver not in _SOLVERS:
        raise ValueError(f"solver must be one of {_SOLVERS}, got {solver!r}")
    if x.dim() < 2:
        raise ValueError(f"x must have shape (..., n, d), got {tuple(x.shape)}")
    n, d = x.shape[-2:]
    batch = x.shape[:-2]
    dtype, device = x.dtype, x.device
    y = torch.as_tensor(y, dtype=dtype, device=device).expand(batch + (n,))
    noise_var = torch.as_tensor(noise_var, dtype=dtype, device=device).expand(batch + (n,))
    prior_loc = torch.as_tensor(prior_loc, dtype=dtype, device=device).expand(batch + (d,))
    prior_var = torch.as_tensor(prior_scale, dtype=dtype, device=device).pow(2)
    prior_var = prior_var.expand(batch + (d,))

    noise_prec = noise_var.reciprocal()
    if solver == "primal" or (solver == "auto" and d <= n):
        xw = x * noise_prec.unsqueeze(-1)
        a = _gram(xw, x)
        a.diagonal(dim1=-2, dim2=-1).add_(prior_var.reciprocal())
        precision_diag = a.diagonal(dim1=-2, dim2=-1).clone()
        b = (xw.transpose(-1, -2) @ y.unsqueeze(-1)).squeeze(-1) + prior_loc / prior_var
        factor = _cholesky(a, jitter)
        mean = _cholesky_solve(factor, b)
        cov = None
        if covariance_diag:
            eye = torch.eye(d, dtype=dtype, device=device).expand(batch + (d, d))
            cov = torch.linalg.solve_triangular(factor, eye, upper=False).pow(2).sum(-2)
    else:
        precision_diag = prior_var.reciprocal() + torch.einsum("...nd,...n->...d", x * x,
                                                               noise_prec)
        xl = x * prior_var.unsqueeze(-2)
        k = xl @ x.transpose(-1, -2)
        k.diagonal(dim1=-2, dim2=-1).add_(noise_var)
        resid = y - (x @ prior_loc.unsqueeze(-1)).squeeze(-1)
        factor = _cholesky(k, jitter)
        coef = _cholesky_solve(factor, resid)
        mean = prior_loc + (xl.transpose(-1, -2) @ coef.unsqueeze(-1)).squeeze(-1)
        cov = None
        if covariance_diag:
            v = torch.linalg.solve_triangular(factor, xl, upper=False)
            cov = prior_var - v.pow(2).sum(-2)
    return BLRPosterior(mean, precision_diag, cov)
