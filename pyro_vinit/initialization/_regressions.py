"""
The per-unit Bayesian linear regressions of one layer: each unit's rows of
the layer's input (patches, for a convolution), its targets, its prior, and
the batched solves.
"""

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union, cast

import torch
import torch.nn.functional as F

from pyro_vinit.initialization._tracing import Layer
from pyro_vinit.initialization.bayesian_linear_regression import (
    _cholesky,
    _cholesky_solve,
    _gram,
    bayesian_linear_regression,
)

__all__ = ["extract_patches"]


def _ntuple(value: Union[int, Sequence[int]], n: int) -> Tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (cast(int, value),) * n


def extract_patches(
    x: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Union[int, Sequence[int]] = 1,
    padding: Union[int, str, Sequence[int]] = 0,
    dilation: Union[int, Sequence[int]] = 1,
) -> torch.Tensor:
    """
    The patches a ``conv1d/2d/3d`` multiplies with its kernel, as rows.

    :param torch.Tensor x: Input of shape ``(N, C, *spatial)``.
    :param kernel_size: The kernel's spatial size.
    :param stride: As for :func:`torch.nn.functional.conv2d`.
    :param padding: An int, a tuple, ``"valid"`` or ``"same"``, as for the conv op.
    :param dilation: As for the conv op.
    :return: Shape ``(N, P, C * prod(kernel_size))``, with ``P`` output
        positions in row-major order and each row ordered like
        ``weight[j].reshape(-1)`` (channel, then kernel positions), so that
        ``patches @ weight.reshape(out, -1).T`` is the convolution (groups = 1).
    """
    nd = len(kernel_size)
    stride, dilation = _ntuple(stride, nd), _ntuple(dilation, nd)
    if isinstance(padding, str):
        if padding == "valid":
            pads = [(0, 0)] * nd
        elif padding == "same":
            totals = [d * (k - 1) for d, k in zip(dilation, kernel_size)]
            pads = [(t // 2, t - t // 2) for t in totals]
        else:
            raise ValueError(f"padding must be 'valid', 'same' or ints, got {padding!r}")
    else:
        pads = [(p, p) for p in _ntuple(padding, nd)]
    flat_pads = [p for pair in reversed(pads) for p in pair]
    if any(flat_pads):
        x = F.pad(x, flat_pads)
    for i in range(nd):
        span = dilation[i] * (kernel_size[i] - 1) + 1
        x = x.unfold(2 + i, span, stride[i])
    x = x[(...,) + tuple(slice(None, None, d) for d in dilation)]
    # (N, C, P_1..P_nd, k_1..k_nd) -> (N, P_1..P_nd, C, k_1..k_nd)
    x = x.permute([0] + list(range(2, 2 + nd)) + [1] + list(range(2 + nd, 2 + 2 * nd)))
    positions = math.prod(x.shape[1 : 1 + nd])
    return x.reshape(x.shape[0], positions, -1)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for an index tensor ``idx`` of rows, by ``index_select`` (several
    times faster than advanced indexing on the CPU)."""
    return x.index_select(0, idx.reshape(-1)).reshape(idx.shape + x.shape[1:])


def unit_inputs(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    """The rows a layer's units regress from: ``(N, positions, groups, fan_in)``
    for an input ``x`` of ``N`` data rows (conv patches, or the positions of a
    linear layer applied to more than one leading dim)."""
    if layer.op == "linear":
        return x.reshape(x.shape[0], -1, 1, x.shape[-1])
    kw = layer.kwargs
    patches = extract_patches(x, layer.weight_shape[2:], kw["stride"], kw["padding"],
                              kw["dilation"])
    return patches.reshape(patches.shape[0], patches.shape[1], kw["groups"], -1)


@torch.no_grad()
def unit_statistics(layer: Layer, inputs: torch.Tensor, weight: torch.Tensor, chunk_rows: int,
                    squares: bool = True
                    ) -> Tuple[Optional[torch.Tensor], Tuple[torch.Tensor, torch.Tensor], int]:
    """Over every row (and position) of the layer's input ``inputs``: the sums of
    squares of the inputs ``(groups, fan_in)`` (None for no rows, or unless
    ``squares``), the sums of each unit's output :math:`x^\top w_j` and of its
    square (float64), and the number of rows. Without ``squares``, a
    convolution's outputs come from its op (``F.<op>``), not from its patches."""
    h = layer.num_units
    sumsq: Optional[torch.Tensor] = None
    first = torch.zeros(h, dtype=torch.float64, device=weight.device)
    second = torch.zeros_like(first)
    count = 0
    for start in range(0, inputs.shape[0], chunk_rows):
        rows = inputs[start:start + chunk_rows]
        if not squares and layer.op != "linear":
            op = getattr(F, layer.op)
            z = op(rows.to(weight), weight.reshape(layer.weight_shape), None, **layer.kwargs)
            z = z.transpose(0, 1).reshape(h, -1).double()  # (units, rows x positions)
            first += z.sum(1)
            second += z.square().sum(1)
            count += z.shape[1]
            continue
        x = unit_inputs(layer, rows)  # (n, positions, groups, d)
        n, positions, groups, d = x.shape
        x = x.reshape(n * positions, groups, d).to(weight)
        if squares:
            part = x.square().sum(0)
            sumsq = part if sumsq is None else sumsq + part
        per_group = max(h // groups, 1)
        for g in range(groups):
            z = (x[:, g] @ weight[g * per_group:(g + 1) * per_group].T).double()
            first[g * per_group:(g + 1) * per_group] += z.sum(0)
            second[g * per_group:(g + 1) * per_group] += z.square().sum(0)
        count += n * positions
    return sumsq, (first, second), count


def unit_priors(layer: Layer, units: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The prior loc and scale ``(c, fan_in [+ 1])`` of some units, read from the
    (possibly expanded) prior tensors without materializing the whole layer's."""
    # I-BLM reads the layers with their priors (prepare's normal_priors=True), a
    # latent bias's too
    c = len(units)
    loc = cast(torch.Tensor, layer.prior_loc)[units].reshape(c, -1)
    scale = cast(torch.Tensor, layer.prior_scale)[units].reshape(c, -1)
    if layer.bias_name is not None:
        loc = torch.cat([loc, cast(torch.Tensor, layer.bias_prior_loc)[units, None]], 1)
        scale = torch.cat([scale, cast(torch.Tensor, layer.bias_prior_scale)[units, None]], 1)
    return loc, scale


@dataclass
class HiddenTargets:
    """How a hidden unit's targets are made from its target column: centered
    over its batch, with alternating signs (``signs[unit]``), and shrunk to
    std ``scale``."""

    signs: torch.Tensor
    center: bool
    alternate: bool
    scale: Optional[float]

    def __call__(self, t: torch.Tensor, noise: torch.Tensor,
                 units: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.center:
            t = t - t.mean(-1, keepdim=True)
        if self.alternate:
            t = t * self.signs[units][:, None].to(t)
        if self.scale is not None:
            # Into the linear range of saturating activations (tanh, sigmoid): targets of
            # a few units would saturate them, and the next layer would see binary features.
            # Shrink only: a unit whose batch has (nearly) one target value stays near zero.
            factor = (self.scale / t.std(-1, keepdim=True).clamp_min(1e-12)).clamp_max(1.0)
            t, noise = t * factor, noise * factor.pow(2)
        return t, noise


def solve_units(layer: Layer, inputs: torch.Tensor, y: torch.Tensor, noise_var: torch.Tensor,
                idx: torch.Tensor, lo: int, hi: int, *, cols: torch.Tensor,
                hidden: Optional[HiddenTargets], solver: str, jitter: float,
                max_chunk_elements: int,
                input_rank: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The regressions of units ``lo, ..., hi - 1`` on their batches ``idx``
    (rows of ``inputs``, ``y`` and ``noise_var``; unit :math:`j` regresses onto
    column ``cols[j]``, made into ``hidden`` targets for a hidden layer): their
    means and variances ``(hi - lo, fan_in [+ 1])``; on the ``input_rank``
    principal directions of the input where :func:`projects` says so."""
    if input_rank is not None and projects(layer, inputs, idx, lo, hi, input_rank):
        return solve_projected(layer, inputs, y, noise_var, idx, lo, hi, cols=cols,
                               hidden=hidden, jitter=jitter,
                               max_chunk_elements=max_chunk_elements, rank=input_rank)
    h, d = layer.num_units, layer.fan_in
    batch_size = idx.shape[1]
    device, dtype = inputs.device, inputs.dtype
    has_bias = layer.bias_name is not None
    positions, groups = unit_inputs(layer, inputs[:1]).shape[1:3]
    group_of = torch.arange(h, device=device) // (h // groups)
    rows = batch_size * positions
    width = d + has_bias
    per_unit = 4 * rows * width + min(rows, width) ** 2
    chunk = max(1, max_chunk_elements // per_unit)
    # Filled in place chunk by chunk: many small chunks, concatenated, would leave the
    # allocator's heap fragmented (resident memory that is never given back).
    means = torch.empty(hi - lo, width, dtype=dtype, device=device)
    variances = torch.empty(hi - lo, width, dtype=dtype, device=device)
    # a linear layer's rows, with the bias column, gathered in one copy per chunk
    rows_with_bias = None
    if layer.op == "linear" and positions == 1 and groups == 1:
        rows_with_bias = inputs.reshape(inputs.shape[0], d)
        if has_bias:
            rows_with_bias = torch.cat([rows_with_bias, rows_with_bias.new_ones(len(inputs), 1)],
                                       1)
    if (rows_with_bias is not None and hi - lo > 1
            and (solver == "primal" or (solver == "auto" and width <= batch_size))
            and bool((idx[lo:hi] == idx[lo]).all())):
        # every unit on the same rows (an output layer's): one gather, and Gram matrices
        # that share the rows' common weight
        return _solve_shared_rows(layer, rows_with_bias[idx[lo]], y, noise_var, idx[lo],
                                  torch.arange(lo, hi, device=device), cols=cols, hidden=hidden,
                                  jitter=jitter, max_chunk_elements=max_chunk_elements)
    # a convolution's patches of every row at once, where they fit in a chunk's memory,
    # gathered by each chunk of units (instead of each unit's rows' patches anew)
    patches = None
    if rows_with_bias is None and len(inputs) * positions * groups * d <= max_chunk_elements:
        patches = unit_inputs(layer, inputs)  # (N, positions, groups, d)
    for start in range(lo, hi, chunk):
        units = torch.arange(start, min(hi, start + chunk), device=device)
        c = len(units)
        batch = idx[units]  # (c, B)
        if rows_with_bias is not None:
            x = gather_rows(rows_with_bias, batch)  # (c, B, width)
        else:
            if patches is not None:
                x = gather_rows(patches, batch)
            else:
                x = unit_inputs(layer, inputs.index_select(0, batch.reshape(-1)))
            x = x.reshape(c, batch_size, positions, groups, d)
            if groups == 1:
                x = x.reshape(c, rows, d)
            else:  # each unit sees its group's input channels
                g = group_of[units].reshape(c, 1, 1, 1, 1).expand(c, batch_size, positions, 1, d)
                x = x.gather(3, g).reshape(c, rows, d)
        t = y[batch, cols[units, None]]  # (c, B)
        noise = noise_var[batch, cols[units, None]]
        if hidden is not None:
            t, noise = hidden(t, noise, units)
        if positions > 1:  # every patch (or position) is paired with its row's target
            t = t[:, :, None].expand(c, batch_size, positions).reshape(c, rows)
            noise = noise[:, :, None].expand(c, batch_size, positions).reshape(c, rows)
        if layer.fixed_bias is not None:
            t = t - layer.fixed_bias[units, None].to(t)
        if has_bias and rows_with_bias is None:
            x = torch.cat([x, torch.ones(c, rows, 1, dtype=dtype, device=device)], -1)
        prior_loc, prior_scale = unit_priors(layer, units)
        post = bayesian_linear_regression(
            x, t.to(dtype), noise.to(dtype), prior_loc.to(dtype), prior_scale.to(dtype),
            solver=solver, jitter=jitter,
        )
        means[start - lo : start - lo + c] = post.mean
        torch.reciprocal(post.precision_diag, out=variances[start - lo : start - lo + c])
    return means, variances


def _solve_shared_rows(layer: Layer, x: torch.Tensor, y: torch.Tensor, noise_var: torch.Tensor,
                       rows: torch.Tensor, units: torch.Tensor, *, cols: torch.Tensor,
                       hidden: Optional[HiddenTargets], jitter: float,
                       max_chunk_elements: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`solve_units` (the primal form) of ``units`` that all regress on the
    same ``rows`` of ``y`` and ``noise_var``, whose layer inputs (a linear layer's)
    are ``x`` ``(B, fan_in [+ 1])``."""
    dtype = x.dtype
    width = x.shape[1]

    def weights_and_targets(some: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        at = (rows[None], cols[some, None])
        t, noise = y[at], noise_var[at]  # (c, B)
        if hidden is not None:
            t, noise = hidden(t, noise, some)
        if layer.fixed_bias is not None:
            t = t - layer.fixed_bias[some, None].to(t)
        return noise.to(dtype).reciprocal(), t.to(dtype)

    # in chunks of units, each with its weights and targets on the rows, and its Gram
    # matrix, the regularized copy and the factor
    chunk = max(1, max_chunk_elements // (4 * len(rows) + 3 * width * width))
    chunks = [units[start : start + chunk] for start in range(0, len(units), chunk)]
    shared = None
    if len(chunks) > 1:  # the rows' smallest weight over all the units, first
        shared = SharedProduct(x, torch.stack(
            [weights_and_targets(some)[0].amin(0) for some in chunks]).amin(0))
    means = x.new_empty(len(units), width)
    variances = x.new_empty(len(units), width)
    start = 0
    for some in chunks:
        weights, t = weights_and_targets(some)
        gram = weighted_grams(x, weights.T, max_chunk_elements, shared=shared)
        prior_loc, prior_scale = unit_priors(layer, some)
        mean, precision = solve_statistics(gram, (weights * t) @ x, prior_loc.to(dtype),
                                           prior_scale.to(dtype), jitter)
        means[start : start + len(some)] = mean
        torch.reciprocal(precision, out=variances[start : start + len(some)])
        start += len(some)
    return means, variances


class SharedProduct:
    r"""The rows' smallest weight :math:`m` ``(n,)`` over the units of a layer
    and, made when first asked for, :math:`X^\top \mathrm{diag}(m) X` of its
    rows ``x``, shared by :func:`weighted_grams` of chunks of its units."""

    def __init__(self, x: torch.Tensor, floor: torch.Tensor) -> None:
        self.x, self.floor = x, floor
        self._base: Optional[torch.Tensor] = None

    def base(self) -> torch.Tensor:
        if self._base is None:
            self._base = _gram(self.x * self.floor[:, None], self.x)
        return self._base


def weighted_grams(x: torch.Tensor, weights: torch.Tensor, max_chunk_elements: int = 2**22,
                   shared: Optional[SharedProduct] = None) -> torch.Tensor:
    r"""
    :math:`X^\top \mathrm{diag}(w_u) X` ``(units, d, d)`` for the rows ``x``
    ``(n, d)`` and each column :math:`w_u` of ``weights`` ``(n, units)``: from
    the Gram matrix of the rows' smallest weight :math:`m`, plus each unit's
    rows whose weight exceeds it, where those are at most half the rows (a
    one-hot likelihood's noise, where one unit per row differs from the
    others: two products of the rows instead of one per unit). ``shared``: the
    smallest weight and its product over more units than these (a chunk of
    them), used by every unit that gains from it.
    """
    n, units = weights.shape
    d = x.shape[1]
    floor = weights.min(1).values if shared is None else shared.floor
    excess = weights - floor[:, None]
    above = excess.ne(0)
    sparse = above.sum(0) <= n // 2
    gram = x.new_empty(units, d, d)
    rest = torch.arange(units, device=x.device)
    # (one unit alone gains nothing from a product of its own)
    if shared is not None or int(sparse.sum()) > 1:
        for unit in sparse.nonzero()[:, 0].tolist():
            if shared is None:
                shared = SharedProduct(x, floor)
            rows = above[:, unit].nonzero()[:, 0]
            xs = x[rows]
            gram[unit] = torch.addmm(shared.base(), (xs * excess[rows, unit, None]).T, xs)
        rest = rest[~sparse]
    chunk = max(1, max_chunk_elements // max(1, n * d))
    for start in range(0, len(rest), chunk):
        some = rest[start : start + chunk]
        gram[some] = _gram(x * weights[:, some].T[:, :, None], x)
    return gram


def projects(layer: Layer, inputs: torch.Tensor, idx: torch.Tensor, lo: int, hi: int,
             rank: int) -> bool:
    """Whether units ``lo, ..., hi - 1`` are solved by :func:`solve_projected`:
    a linear layer on one position, with more inputs than twice ``rank`` and
    than rows per unit (an underdetermined regression, solved in the dual form
    otherwise), and the same prior variance for every weight of a unit."""
    d = layer.fan_in
    if layer.op != "linear" or inputs.dim() != 2 or d <= 2 * rank or d < idx.shape[1]:
        return False
    _, scale = unit_priors(layer, torch.arange(lo, hi, device=inputs.device))
    return bool((scale[:, :d] == scale[:, :1]).all())


def principal_directions(x: torch.Tensor, rank: int, iterations: int = 1) -> torch.Tensor:
    """
    An orthonormal basis ``(d, rank)`` of the top ``rank`` right singular
    vectors of ``x`` ``(n, d)``, by randomized subspace iteration [1] from a
    fixed seed (the same basis every call; the global RNG is not drawn from).

    [1] Halko, Martinsson, Tropp (2011) "Finding Structure with Randomness:
    Probabilistic Algorithms for Constructing Approximate Matrix Decompositions"
    """
    width = min(rank + 10, *x.shape)
    generator = torch.Generator(device=x.device).manual_seed(0)
    omega = torch.randn(x.shape[1], width, generator=generator, dtype=x.dtype, device=x.device)
    q = torch.linalg.qr(x @ omega).Q
    for _ in range(iterations):
        q = torch.linalg.qr(x @ torch.linalg.qr(x.T @ q).Q).Q
    vh: torch.Tensor = torch.linalg.svd(q.T @ x, full_matrices=False).Vh
    return vh[:rank].T


def solve_projected(layer: Layer, inputs: torch.Tensor, y: torch.Tensor,
                    noise_var: torch.Tensor, idx: torch.Tensor, lo: int, hi: int, *,
                    cols: torch.Tensor, hidden: Optional[HiddenTargets], jitter: float,
                    max_chunk_elements: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""
    :func:`solve_units` of a linear layer with the inputs projected onto their
    top ``rank`` principal directions :math:`V` (:func:`principal_directions`
    of the rows that ``idx`` selects): unit :math:`j` regresses its targets on
    :math:`XV` with the prior :math:`\mathcal N(0, \lambda_j I)` of
    :math:`V^\top (w - m_0)` (exact for a prior :math:`\mathcal
    N(m_0, \lambda_j I)` of the weights), and gets the mean
    :math:`m_0 + V\beta`. The precision diagonal is the exact one,
    :math:`\lambda_j^{-1} + \sum_i x_{id}^2 / \sigma_i^2`.
    """
    d = layer.fan_in
    has_bias = layer.bias_name is not None
    dtype = inputs.dtype
    x = inputs.reshape(inputs.shape[0], d)
    # from the rows that the layer's units use (the same in every process of a group)
    used = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    used[idx.reshape(-1)] = True
    basis = principal_directions(x if bool(used.all()) else x[used], rank)  # (d, r)
    rank = basis.shape[1]  # fewer when the rows are fewer: their span is then exact
    z = x @ basis  # (n, r)
    squares = x * x
    batch_size = idx.shape[1]
    chunk = max(1, max_chunk_elements // (4 * batch_size * (rank + 1)))
    means = torch.empty(hi - lo, d + has_bias, dtype=dtype, device=x.device)
    variances = torch.empty_like(means)
    for start in range(lo, hi, chunk):
        units = torch.arange(start, min(hi, start + chunk), device=x.device)
        c = len(units)
        batch = idx[units]  # (c, B)
        t = y[batch, cols[units, None]]
        noise = noise_var[batch, cols[units, None]]
        if hidden is not None:
            t, noise = hidden(t, noise, units)
        if layer.fixed_bias is not None:
            t = t - layer.fixed_bias[units, None].to(t)
        t, noise = t.to(dtype), noise.to(dtype)
        prior_loc, prior_scale = (p.to(dtype) for p in unit_priors(layer, units))
        w0 = prior_loc[:, :d]
        if bool(w0.ne(0).any()):  # regress the residual of the prior mean
            t = t - (x @ w0.T).gather(0, batch.T).T
        zb = gather_rows(z, batch)  # (c, B, r)
        scale = prior_scale[:, :1].expand(c, rank)
        if has_bias:
            t = t - prior_loc[:, d:]
            zb = torch.cat([zb, zb.new_ones(c, batch_size, 1)], -1)
            scale = torch.cat([scale, prior_scale[:, d:]], 1)
        post = bayesian_linear_regression(zb, t, noise, torch.zeros_like(scale), scale,
                                          solver="primal", jitter=jitter)
        mean = prior_loc.clone()
        mean[:, :d] += post.mean[:, :rank] @ basis.T
        # the exact precision diagonal: the rows' noise precisions, weighted squares
        weights = x.new_zeros(x.shape[0], c)
        weights.scatter_add_(0, batch.T, noise.reciprocal().T)  # (a row twice counts twice)
        precision = prior_scale.pow(-2)
        precision[:, :d] += weights.T @ squares
        if has_bias:
            mean[:, d] += post.mean[:, rank]
            precision[:, d] += weights.sum(0)
        means[start - lo : start - lo + c] = mean
        torch.reciprocal(precision, out=variances[start - lo : start - lo + c])
    return means, variances


def shared_rows_statistics(x: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
                           group_of: torch.Tensor,
                           has_bias: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """
    ``(X^T L^{-1} X, X^T L^{-1} t)`` per unit, for the rows ``x`` ``(rows,
    positions, groups, d)`` that every unit shares, targets and noise
    variances ``(rows, units)`` (each repeated over the positions).
    """
    rows, positions, groups, d = x.shape
    units = t.shape[1]
    w = noise.reciprocal().repeat_interleave(positions, 0)  # (rows * positions, units)
    wt = (t * noise.reciprocal()).repeat_interleave(positions, 0)
    width = d + has_bias
    gram = x.new_zeros(units, width, width)
    rhs = x.new_zeros(units, width)
    for g in range(groups):
        members = torch.nonzero(group_of == g)[:, 0]
        xg = x[:, :, g].reshape(rows * positions, d)
        if has_bias:
            xg = torch.cat([xg, xg.new_ones(len(xg), 1)], 1)
        gram[members] = weighted_grams(xg, w[:, members])
        rhs[members] = (xg.T @ wt[:, members]).T
    return gram, rhs


def solve_statistics(gram: torch.Tensor, rhs: torch.Tensor, prior_loc: torch.Tensor,
                     prior_scale: torch.Tensor,
                     jitter: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The posterior mean and precision diagonal of Bayesian linear
    regressions given their statistics (the primal form of
    :func:`~pyro_vinit.initialization.bayesian_linear_regression`)."""
    prior_var = prior_scale.pow(2)
    a = gram.clone()
    a.diagonal(dim1=-2, dim2=-1).add_(prior_var.reciprocal())
    b = rhs + prior_loc / prior_var
    factor = _cholesky(a, jitter)
    mean = _cholesky_solve(factor, b)
    return mean, a.diagonal(dim1=-2, dim2=-1).clone()
