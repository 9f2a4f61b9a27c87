r"""
Positive low-rank factorization of a positive matrix, the projection of a
per-element standard deviation matrix onto :class:`~pyro_vinit.guides.AutoKTiedNormal`'s
family :math:`S = UV^\top`, :math:`U, V > 0`.
"""

import math
from typing import Optional, Tuple

import torch

__all__ = ["fit_positive_low_rank"]


def _split_weights(m: int, rank: int, like: torch.Tensor) -> torch.Tensor:
    """Distinct positive weights per row summing to 1, shape ``(m, rank)``.

    Deterministic (a low-discrepancy phase per row) so that writing a guide
    draws no random numbers; distinct per row so that the components are not
    proportional, which would give them proportional gradients.
    """
    phase = torch.arange(m, dtype=like.dtype, device=like.device) * ((math.sqrt(5) - 1) / 2)
    offsets = torch.arange(rank, dtype=like.dtype, device=like.device) / rank
    weights = 1.5 + 0.5 * torch.cos(2 * math.pi * (phase[:, None] + offsets))
    return weights / weights.sum(-1, keepdim=True)


def _split(u: torch.Tensor, v: torch.Tensor, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Spreads the first of ``u.shape[-1]`` components over ``rank - (c - 1)``
    components with the same product."""
    extra = rank - u.shape[-1] + 1
    weights = _split_weights(u.shape[0], extra, u)
    u = torch.cat([u[:, :1] * weights, u[:, 1:]], -1)
    v = torch.cat([v[:, :1].expand(-1, extra), v[:, 1:]], -1)
    return u, v


def _rank_one(
    U: torch.Tensor, s: torch.Tensor, Vh: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    # The leading singular vectors of a positive matrix are positive (Perron),
    # and their product is the best rank-1 fit in Frobenius norm.
    root = s[0].sqrt()
    return (root * U[:, 0].abs())[:, None], (root * Vh[0].abs())[:, None]


def _rank_two(
    U: torch.Tensor, s: torch.Tensor, Vh: torch.Tensor
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    r"""Exact positive factors of a positive rank-2 matrix :math:`S = AB^\top`.

    The rows of :math:`S` span a 2-d cone inside the positive orthant; two
    positive rows slightly outside its extreme rays form a basis in which
    every row has positive coordinates. Returns None if the cone is degenerate.
    """
    sign = torch.where(U[:, 0].sum() < 0, -1.0, 1.0).to(U)
    a = U[:, :2] * s[:2] * torch.stack([sign, torch.ones_like(sign)])
    b = Vh[:2].T * torch.stack([sign, torch.ones_like(sign)])
    angle = torch.atan2(a[:, 1], a[:, 0])
    p, q = a[angle.argmin()], a[angle.argmax()]
    row_p, row_q = b @ p, b @ q
    if not (bool((row_p > 0).all()) and bool((row_q > 0).all())):
        return None
    ratio = torch.minimum((row_p / row_q).min(), (row_q / row_p).min())
    eps = 0.25 * float(ratio.clamp(max=1.0))
    basis = torch.stack([p - eps * q, q - eps * p])  # rows, 2 x 2
    if not bool(torch.isfinite(basis).all()) or abs(float(torch.linalg.det(basis))) < 1e-300:
        return None
    u = torch.linalg.solve(basis.T, a.T).T  # a = u @ basis
    v = b @ basis.T
    if not (bool((u > 0).all()) and bool((v > 0).all())):
        return None
    return u, v


def _full_rank(matrix: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Exact positive factors with :math:`\min(m, n)` components.

    For :math:`m \le n`, :math:`U = I + \epsilon \mathbf 1 \mathbf 1^\top` is
    positive and :math:`V^\top = U^{-1} S = S - c\,\mathbf 1 \mathbf 1^\top S`
    with :math:`c = \epsilon / (1 + m\epsilon)`, positive for :math:`c` below
    every :math:`S_{ij} / \sum_i S_{ij}`; :math:`m > n` is the transpose.
    """
    if matrix.shape[0] > matrix.shape[1]:
        v, u = _full_rank(matrix.T)
        return u, v
    m = matrix.shape[0]
    c = 0.5 * float((matrix / matrix.sum(0, keepdim=True)).min())
    eps = c / (1 - m * c)  # c < 1 / m: the smallest entry is below its column's mean
    u = torch.eye(m, dtype=matrix.dtype, device=matrix.device) + eps
    v = (matrix - c * matrix.sum(0, keepdim=True)).T
    # Balance the factors' magnitudes (the product is unchanged).
    balance = (v.max() / u.max()).sqrt()
    return u * balance, v / balance


def _hals(
    matrix: torch.Tensor, u: torch.Tensor, v: torch.Tensor, floor: float, num_iters: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Hierarchical alternating least squares (Cichocki and Phan, 2009): each
    column update is an exact, clamped least-squares step, so the error does
    not increase."""
    k = u.shape[-1]
    norm = matrix.norm()

    def error(u: torch.Tensor, v: torch.Tensor) -> float:
        return float((matrix - u @ v.T).norm() / norm)

    best = (error(u, v), u, v)
    for i in range(num_iters):
        vtv, sv = v.T @ v, matrix @ v
        for a in range(k):
            u[:, a] = (u[:, a] + (sv[:, a] - u @ vtv[:, a]) / vtv[a, a]).clamp_min(floor)
        utu, su = u.T @ u, matrix.T @ u
        for a in range(k):
            v[:, a] = (v[:, a] + (su[:, a] - v @ utu[:, a]) / utu[a, a]).clamp_min(floor)
        if (i + 1) % 10 == 0:
            current = error(u, v)
            if current < best[0]:
                previous, best = best[0], (current, u.clone(), v.clone())
                if current > (1 - 1e-3) * previous:
                    break
            else:
                break
    return best[1], best[2]


def _svd(matrix: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The thin SVD :math:`U\,\mathrm{diag}(s)\,V^\top` of a float64 matrix from
    the eigendecomposition of its smaller Gram matrix (several times faster
    than ``torch.linalg.svd``; its singular values below :math:`10^{-8} s_0`
    and their vectors are inexact, which the fits never use)."""
    if matrix.shape[0] > matrix.shape[1]:
        V, s, Uh = _svd(matrix.T)
        return Uh.T, s, V.T
    values, U = torch.linalg.eigh(matrix @ matrix.T)
    U = U.flip(-1)
    s = values.flip(-1).clamp_min(0).sqrt()
    Vh = (U.T @ matrix) / s.clamp_min(torch.finfo(s.dtype).tiny)[:, None]
    return U, s, Vh


def _fit_matrix(
    matrix: torch.Tensor, rank: int, num_iters: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    m, n = matrix.shape
    floor = 1e-8 * float(matrix.max().sqrt())
    U, s, Vh = _svd(matrix)
    tol = 10 * max(m, n) * torch.finfo(torch.float32).eps
    numerical_rank = int((s > tol * s[0]).sum())
    u1, v1 = _rank_one(U, s, Vh)
    if rank == 1 or numerical_rank <= 1:
        return _split(u1, v1, rank) if rank > 1 else (u1, v1)
    if numerical_rank == 2:
        exact = _rank_two(U, s, Vh)
        if exact is not None:
            return _split(*exact, rank) if rank > 2 else exact
    if rank >= min(m, n):
        u, v = _full_rank(matrix)
        return _split(u, v, rank) if rank > u.shape[-1] else (u, v)
    # Rank 3 or more: the nonnegative rank may exceed the rank, so no exact
    # construction exists in general; refine the rank-1 fit split into
    # components and keep whichever is closer.
    u, v = _split(u1.clamp_min(floor), v1.clamp_min(floor), rank)
    u, v = _hals(matrix, u.clone(), v.clone(), floor, num_iters)
    return u, v


def fit_positive_low_rank(
    matrix: torch.Tensor, rank: int, num_iters: int = 200
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""
    Positive factors :math:`U \in \mathbb R_+^{m\times k}`, :math:`V \in
    \mathbb R_+^{n\times k}` with :math:`UV^\top \approx S` in Frobenius norm,
    for a positive matrix :math:`S` (batched over leading dims).

    * :math:`k = 1`, or :math:`S` of rank 1: the leading singular pair, the
      best rank-1 fit (Perron: it is positive), split into :math:`k`
      components with the same product.
    * :math:`S` of rank 2 and :math:`k \ge 2`: exact, from two positive rows
      just outside the extreme rays of the cone the rows of :math:`S` span
      (every positive matrix of rank 2 has nonnegative rank 2).
    * :math:`k \ge \min(m, n)`: exact, :math:`U = I + \epsilon\mathbf 1\mathbf 1^\top`
      (for :math:`m \le n`, else the transpose) and :math:`V^\top = U^{-1}S`.
    * Otherwise the rank-1 fit split into :math:`k` components and refined by
      up to ``num_iters`` hierarchical alternating least-squares sweeps, which
      never increase the error. (Above rank 2 a positive :math:`S` of rank
      :math:`\le k` need not have an exact positive rank-:math:`k` factorization.)

    Computed in float64 and returned in ``matrix``'s dtype; every entry is at
    least a tiny positive floor, so the factors have a finite softplus inverse.

    :param torch.Tensor matrix: Positive, shape ``(..., m, n)``.
    :param int rank: The number :math:`k \ge 1` of components.
    :param int num_iters: Maximum refinement sweeps.
    :rtype: tuple
    """
    *batch, m, n = matrix.shape
    flat = matrix.detach().to(torch.float64).reshape((math.prod(batch), m, n))
    us, vs = [], []
    for s in flat:
        if s.numel() == 0:
            u, v = s.new_ones(m, rank), s.new_ones(n, rank)
        else:
            u, v = _fit_matrix(s, rank, num_iters)
            floor = 1e-8 * float(s.max().sqrt())
            u, v = u.clamp_min(floor), v.clamp_min(floor)
        us.append(u)
        vs.append(v)
    u = torch.stack(us).reshape(tuple(batch) + (m, rank)).to(matrix)
    v = torch.stack(vs).reshape(tuple(batch) + (n, rank)).to(matrix)
    return u, v
