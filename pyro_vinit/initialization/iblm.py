"""I-BLM: layer-by-layer Bayesian-linear-model initialization of autoguides."""

import math
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Type,
    TypeVar,
    Union,
    cast,
)

import pyro
import torch
import torch.nn.functional as F
from pyro.infer.autoguide import AutoGuide
from torch.distributions import Categorical, Normal, StudentT, biject_to, transform_to

from pyro_vinit._typing import SampleSite
from pyro_vinit.guides.site_params import check_supported, set_loc_and_scale
from pyro_vinit.initialization import _distributed
from pyro_vinit.initialization._data import Data, DataPool, is_args_tuple
from pyro_vinit.initialization._distributed import Shards
from pyro_vinit.initialization._rollback import GuideRollback, write_param
from pyro_vinit.initialization._tracing import (
    Layer,
    Likelihood,
    Prepared,
    align_rows,
    capture,
    guide_medians,
    iterate_rows,
    observed_site,
    prepare,
    refresh_norm_statistics,
    report_uncovered,
    run_model,
    unwrap_likelihood,
)
from pyro_vinit.initialization.bayesian_linear_regression import bayesian_linear_regression
from pyro_vinit.poutine.layer_recorder import RecordedLayer

__all__ = [
    "IBLMGuideInitializer",
    "IBLMOptions",
    "dirichlet_transform",
    "extract_patches",
    "init_guide_iblm",
]

_G = TypeVar("_G", bound=AutoGuide)

# Unconstrained range searched for the noise level, and the noise of a scale head's fit.
_LINK_RANGE = 15.0
_SCALE_HEAD_NOISE = 0.1


def dirichlet_transform(y: torch.Tensor, alpha: float = 0.01) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""
    The label transformation of Milios et al. [1] used by I-BLM for
    classification: one-hot labels :math:`y` become regression targets
    :math:`\tilde y` with noise variances :math:`\tilde\sigma^2`,

    .. math::

        \tilde\sigma^2 = \log\Big(\frac{1}{y + \alpha} + 1\Big), \qquad
        \tilde y = \log(y + \alpha) - \tilde\sigma^2 / 2,

    (a log-Normal moment match of the Gamma variables whose normalization is
    Dirichlet(:math:`y + \alpha`)), so that the softmax of the regression
    recovers the class probabilities.

    :param torch.Tensor y: One-hot labels (any shape, values in {0, 1}).
    :param float alpha: The Dirichlet regularization :math:`\alpha > 0`.
    :return: ``(targets, noise_variances)``, each shaped like ``y``.

    [1] Milios, Camoriano, Michiardi, Rosasco, Filippone (2018) "Dirichlet-based
    Gaussian Processes for Large-scale Calibrated Classification"
    """
    var = torch.log1p(1.0 / (y + alpha))
    return torch.log(y + alpha) - var / 2, var


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


def _unit_inputs(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    """The rows a layer's units regress from: ``(N, positions, groups, fan_in)``
    for an input ``x`` of ``N`` data rows (conv patches, or the positions of a
    linear layer applied to more than one leading dim)."""
    if layer.op == "linear":
        return x.reshape(x.shape[0], -1, 1, x.shape[-1])
    kw = layer.kwargs
    patches = extract_patches(x, layer.weight_shape[2:], kw["stride"], kw["padding"],
                              kw["dilation"])
    return patches.reshape(patches.shape[0], patches.shape[1], kw["groups"], -1)


def _local_batches(inputs: torch.Tensor, num_units: int, batch_size: int,
                   pool: Optional["_distributed.ShardedPool"] = None) -> torch.Tensor:
    """
    Row indices ``(num_units, batch_size)``: unit :math:`j` gets ``batch_size``
    consecutive rows of the data sorted along a random direction :math:`u_j`
    of the space of ``inputs`` (one row per data row), from a random start:
    a slab of that space, so that the unit's regression is a local fit. With
    a sharded ``pool``, ``inputs`` are this rank's rows and the indices global.
    """
    flat = inputs.reshape(inputs.shape[0], -1)
    n = flat.shape[0] if pool is None else pool.num_rows
    directions = torch.randn(flat.shape[1], num_units, dtype=flat.dtype, device=flat.device)
    if pool is not None:
        start = torch.randint(0, n - batch_size + 1, (num_units,), device=flat.device)
        return _distributed.local_window(pool, flat @ directions, start, batch_size)
    order = (flat @ directions).argsort(0)  # (n, units)
    start = torch.randint(0, n - batch_size + 1, (num_units,), device=flat.device)
    rows = start + torch.arange(batch_size, device=flat.device)[:, None]  # (batch, units)
    return order.gather(0, rows).T.contiguous()


def _unit_priors(layer: Layer, units: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
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


def _column_var(sigma: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Noise variances shaped like ``y`` from a residual std per column (or one)."""
    return sigma.pow(2).to(y).expand(y.shape[1]).expand_as(y).clone()


@dataclass
class NoiseFit:
    """The estimated observation noise std, and the unconstrained value that
    gives it to the noise site or param ``name`` (None for a scale head or a
    fixed scale)."""

    sigma: torch.Tensor
    name: Optional[str]
    level: Optional[torch.Tensor]


_CHOICES = {
    "hidden_columns": ("cyclic", "random"),
    "hidden_batches": ("local", "random"),
    "propagate": ("mean", "sample"),
    "solver": ("auto", "primal", "dual"),
}


@dataclass(frozen=True)
class IBLMOptions:
    """The options of :class:`IBLMGuideInitializer` (documented there), checked
    in one place when created."""

    batch_size: int = 128
    output_rows: Optional[int] = 4096
    alpha: float = 0.001
    center_targets: Optional[bool] = None
    alternate_hidden_signs: Optional[bool] = None
    hidden_target_scale: Optional[float] = 1.0
    hidden_columns: str = "cyclic"
    hidden_batches: str = "local"
    propagate: str = "mean"
    noise_scale: Optional[float] = None
    estimate_noise: Optional[bool] = None
    strict: bool = False
    solver: str = "auto"
    jitter: float = 1e-6
    max_scale_ratio: Optional[float] = None
    max_pool_size: int = 10_000
    chunk_rows: int = 4096
    max_chunk_elements: int = 2**22

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_pool_size", "chunk_rows", "max_chunk_elements"):
            _check_positive(name, getattr(self, name), int)
        for name in ("alpha", "jitter"):
            _check_positive(name, getattr(self, name))
        if self.output_rows is not None:
            _check_positive("output_rows", self.output_rows, int)
        for name in ("noise_scale", "hidden_target_scale", "max_scale_ratio"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        for name in ("center_targets", "alternate_hidden_signs", "estimate_noise"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(
                    f"IBLMGuideInitializer: {name} must be None, True or False, got "
                    f"{getattr(self, name)!r}"
                )
        if not isinstance(self.strict, bool):
            raise ValueError(f"IBLMGuideInitializer: strict must be a bool, got {self.strict!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"IBLMGuideInitializer: {name} must be one of {choices}, got "
                    f"{getattr(self, name)!r}"
                )
        if self.noise_scale is not None and self.estimate_noise:
            raise ValueError(
                "IBLMGuideInitializer: pass either noise_scale (a fixed regression noise) or "
                "estimate_noise=True, not both"
            )


def _check_positive(
    name: str, value: Any, kind: Union[Type[Any], Tuple[Type[Any], ...]] = (int, float)
) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise ValueError(f"IBLMGuideInitializer: {name} must be positive, got {value!r}")


@dataclass
class Targets:
    """The regression targets of the output layer, one column per output unit."""

    task: str  # "regression" or "classification"
    y: torch.Tensor  # (rows, k)
    noise_var: torch.Tensor  # (rows, k)
    softmax: bool  # whether a shift shared by all columns leaves the likelihood unchanged
    fixed_noise: bool  # whether noise_var is the model's own (a fixed likelihood scale)


@dataclass
class Fit:
    """A layer's fitted per-weight means and variances, in the op's layout
    (``(units, fan_in [+ 1 for a latent bias])``)."""

    layer: Layer
    mean: torch.Tensor
    var: torch.Tensor

    def site_values(
        self, site_shape: Callable[[str], torch.Size]
    ) -> Dict[str, Tuple[torch.Tensor, ...]]:
        layer, d = self.layer, self.layer.fan_in
        out = {
            layer.weight_name: tuple(
                layer.to_site(layer.weight_name, t[:, :d], site_shape(layer.weight_name))
                for t in (self.mean, self.var)
            )
        }
        if layer.bias_name is not None:
            out[layer.bias_name] = tuple(
                layer.to_site(layer.bias_name, t[:, d], site_shape(layer.bias_name))
                for t in (self.mean, self.var)
            )
        return out


class IBLMGuideInitializer:
    r"""
    Iterative Bayesian Linear Modeling (I-BLM) [1]: initializes an autoguide
    of a Bayesian neural network layer by layer, each unit's weights from a
    Bayesian linear regression of the layer's input onto the targets.

    Usage::

        guide = AutoNormal(model)
        IBLMGuideInitializer(batch_size=128)(guide, (x_train, y_train))
        svi = SVI(model, guide, Adam({"lr": 1e-3}), TraceMeanField_ELBO())

    **1. Trace.** The model is run once, ``model(*data)`` on up to 256 rows
    with the guide's medians, under a
    :class:`~pyro_vinit.poutine.layer_recorder.LayerRecorderMessenger`. Its
    *Bayesian layers* are the ``F.linear`` / ``F.conv1d/2d/3d`` calls
    (``nn.Linear``, ``nn.Conv*d``, bayesianized or not) and the matrix
    products of the data with a weight (``x @ w``, ``torch.matmul``,
    ``torch.mm``, ``torch.addmm``, a two-operand ``torch.einsum`` with one
    contracted index, a weight transposed or reshaped before use) whose
    weight is a latent site with a Normal prior :math:`\mathcal N(m_0,
    s_0^2)` (of any batch shape), each with its bias (a latent site, a
    parameter, or a latent vector added to a matrix product). Following the
    data flow into the single observed site (``pyro.deterministic`` sites
    are records, not observations) tells each layer's role: the *output
    layer* feeds the likelihood's mean or logits, a *scale head* its scale,
    every other layer is *hidden*. Anything else between the layers (norm
    layers, residual additions, pooling, reshapes, activations) is whatever
    the model computes. Latent sites that no layer uses (e.g. those of
    ``nn.MultiheadAttention``, whose internal projections are not
    ``F.linear`` calls) are named in one warning, or an error with
    ``strict=True``.

    The likelihood sets the task: ``Normal`` or ``StudentT`` (as a Normal
    with its scale) → regression; ``Categorical``, ``OneHotCategorical``,
    ``Bernoulli`` (logits or probs) → classification, with the
    :func:`dirichlet_transform` of the one-hot labels as heteroscedastic
    regression targets (for ``Bernoulli`` the difference of the two classes',
    i.e. the logit).

    **2. Collect each layer's inputs.** Layer by layer, in execution order,
    the data are propagated through the model with every earlier layer set to
    its fit (its mean by default, a draw from the factorized Normal posterior
    with ``propagate="sample"``) and the layer's input is captured (for a
    convolution, its patches, :func:`extract_patches`, each paired with its
    image's target). While fitting, dropout is off and ``F.batch_norm``
    normalizes with the statistics of the data at hand; a subsampled data
    plate (``pyro.plate(..., subsample_size=B)``) is walked through all the
    data in blocks of ``B``.

    **3. Solve.** Unit :math:`j` of the output layer regresses onto target
    column :math:`j`, a hidden unit onto column :math:`j \bmod d_\text{out}`;
    all units of a layer are solved at once
    (:func:`~pyro_vinit.initialization.bayesian_linear_regression`, primal or
    dual form, the bias one more input column of ones) with the posterior
    precision :math:`A = \mathrm{diag}(s_0^{-2}) + X^\top L^{-1} X`, and the
    KL(q‖p) projection onto a factorized Normal: mean :math:`\mu`,
    variances :math:`1/A_{ii}` (supplement D of [1]).

    *Observation noise* (regression): when the likelihood's scale is a
    latent site (any positive prior), a ``pyro.param``, or a scale head, the
    network is fitted with a provisional noise (``noise_scale``, default a
    tenth of the targets' std), the residual std :math:`\hat\sigma` of its
    mean predictions over the data is computed, the output layer is refitted
    with noise :math:`\hat\sigma^2` (twice), and :math:`\hat\sigma` of the
    final fit is written into the noise site (its median; spread
    :math:`\min(0.1, 1/\sqrt{2n})` in the unconstrained space), the param, or
    the scale head (zero-mean weights and a bias at which the head's link
    gives :math:`\hat\sigma`); the value giving :math:`\hat\sigma` through
    whatever the model does with it is found by bisection. A fixed scale is
    used as it is, unless ``estimate_noise=True``.

    **4. Project** every site onto the guide's family, one site at a time,
    through :func:`~pyro_vinit.guides.site_params.set_loc_and_scale` (the
    guide's own projection: exact for a factorized Normal, a rank-:math:`k`
    fit of the std matrix for AutoKTiedNormal, see that module), and
    set the running statistics of every ``nn.BatchNorm*d`` to their input's
    statistics over the data, so that the model in eval mode computes what
    was fitted.

    **Calibrated defaults.** The literal recipe of [1] fails on hidden
    layers with one-sided or saturating activations (ReLU nets output a
    constant, deep tanh nets lose the signal). By default therefore:

    * ``center_targets`` (classification): a hidden unit's targets are
      centered over its batch, so that it is active on its class and silent
      elsewhere; a softmax output layer's targets are shifted by their overall
      mean (the softmax, hence the fitted probabilities, is unchanged);
    * ``alternate_hidden_signs`` (regression): hidden units sharing a target
      column regress alternately onto :math:`+y` and :math:`-y`, so the
      signal passes a one-sided activation in both directions;
    * ``hidden_target_scale=1``: a hidden unit's targets whose std over its
      batch exceeds 1 are scaled down to std 1 (with their noise), into the
      linear range of tanh or sigmoid, so that the next layer sees graded
      features rather than saturated ±1 (a 4-100-100-100-3 tanh net on iris:
      96% test accuracy right after initialization, 68% without);
    * ``hidden_batches="local"``: a hidden unit's batch is a slab of the data
      along a random direction of the input space, so the units of a layer
      become different, local features; a unit whose slab has a constant
      target or a mostly zero input gets a random batch instead (it would
      otherwise get zero weights);
    * ``output_rows=4096``: the output layer's units all regress on the same
      rows, as many as that (random, if the data have more), rather than on
      one minibatch each (digits, 5×100 ReLU MLP: test error 5.3% instead of
      6.2%; a ResNet-style CNN: 25% instead of 39%);
    * ``propagate="mean"``: earlier layers run at their mean, so the next
      layer is fitted to the features the guide's median network computes.

    ``center_targets=False, alternate_hidden_signs=False,
    hidden_target_scale=None, hidden_batches="random", output_rows=None,
    propagate="sample"`` is the literal recipe of [1].

    **Training after I-BLM.** When the weights far outnumber the training
    points (a 5×100 MLP on 1,257 digits: 47,910 weights), the KL term of the
    ELBO outweighs the data and SVI pulls the guide back towards its prior,
    washing the head start out (test error 3.8% → 18% in 400 steps). The
    recipe that keeps it, measured in ``benchmarks/bench_iblm_recipe.py``:
    initialize with ``max_scale_ratio=0.1`` (stds at most a tenth of the
    prior's, so the predictive starts sharp) and train with the KL term
    weighted by :math:`\lambda = 0.1`
    (:class:`~pyro_vinit.poutine.KLAnnealingMessenger` ``(0.1)``), i.e. a
    tempered posterior, as if each training point were seen ten times::

        init_guide_iblm(guide, (x, y), batch_size=512, max_scale_ratio=0.1)
        svi = SVI(model, guide, Adam({"lr": 1e-3}), TraceMeanField_ELBO())
        with KLAnnealingMessenger(0.1):
            for step in range(num_steps):
                svi.step(x_batch, y_batch)

    With many data points per weight the full ELBO (``λ = 1``) keeps the
    start by itself.

    Nothing is written until every layer is fitted; a call that fails, at any
    point, leaves the guide and the param store exactly as they were (a guide
    that was not set up is set up from the first rows, after checking that
    the model has a likelihood on them, and is returned to its not-set-up
    state on failure). The computation is batched over the units.

    **Across processes.** With ``process_group`` (e.g.
    ``torch.distributed.group.WORLD``), every rank of the group calls the
    initializer with the same options and its own shard of the data (shards
    of any sizes, each with at least one row; the same trailing shapes and
    dtypes), and every rank ends with the same guide, equal, to float
    rounding, to one process's initialization on the concatenated shards in
    rank order (with the random state of rank 0; the other ranks get their
    own back). The rows are numbered in that global order, and every random
    draw (pool subsample, minibatches, slab directions, ``propagate="sample"``)
    is made alike on every rank in that index space, so a shard smaller than
    ``batch_size`` is no special case. Per layer the ranks exchange, in a few
    collective calls whatever the number of units: for ``hidden_batches=
    "local"``, a sparse set of each rank's sorted slab scores, then the
    scores near each unit's window (never all scores); the selected rows of
    every unit's minibatch (one all-gather of the distinct rows: at most
    :math:`\min(N, h B)` rows of the layer's input, with their targets), each
    rank then solving its share of the units, whose fits are all-gathered;
    for the output layer's shared rows, the all-reduced statistics
    :math:`X^\top L^{-1} X` and :math:`X^\top L^{-1} y` of every unit (solved
    in the primal form, whatever ``solver``); the targets' mean and std, the
    residual sums of squares of the noise estimate and, for batch
    normalization, each call's input statistics per chunk of the global pool
    (so ``F.batch_norm`` normalizes as it would in one process) and the
    refreshed running statistics. An error on one rank (bad labels, a
    non-finite input, ranks with different data layouts, options or models)
    is raised, naming the rank, on every rank, before anything is written.
    Not exact: a model with batch normalization *and* a subsampled data
    plate (each rank normalizes its own blocks; warned), slab orders among
    rows with identical scores (duplicated rows), and float32 rounding of the
    slab scores; an iterable ``data`` is read up to ``max_pool_size`` rows on
    each rank before the global subsample.

    :param process_group: A :class:`torch.distributed.ProcessGroup` over
        whose ranks the data is sharded, or None (one process; a group of one
        rank is the same).
    :param int batch_size: Rows in each hidden unit's minibatch (images, for conv
        layers).
    :param int output_rows: Rows the output layer's units share (all rows if
        fewer); None gives each its own minibatch of ``batch_size``.
    :param float alpha: Dirichlet regularization of the classification targets
        (default 0.001). The output layer's logit margin between the true
        class and the others is about :math:`\log(1/\alpha)`: 0.01, the value
        of [2], gives an under-confident predictive (digits, 5×100 MLP: test
        MNLL 0.15 at 3.2% error, mean entropy 0.32 nats) and 0.001 a
        calibrated one (MNLL 0.10 at 3.0%, ECE 0.019 against 0.048).
    :param center_targets: See above; None (default) means on for
        classification, off for regression.
    :param alternate_hidden_signs: See above; None (default) means on for
        regression, off for classification.
    :param float hidden_target_scale: The std hidden targets are scaled down to;
        None leaves them as they are.
    :param str hidden_columns: ``"cyclic"`` (unit :math:`j` → column
        :math:`j \bmod d_\text{out}`) or ``"random"``.
    :param str hidden_batches: ``"local"`` (default) or ``"random"``.
    :param str propagate: ``"mean"`` (default) or ``"sample"``.
    :param float noise_scale: A regression noise std to use (and to write into
        a learnable noise) instead of the estimate.
    :param estimate_noise: Estimate the noise also when the likelihood's scale is
        fixed (it is then used in the regressions only); None (default) means
        only when the scale is learnable.
    :param bool strict: Raise, instead of warning, when latent sites are left
        uninitialized.
    :param str solver: ``"auto"`` (primal if the input dimension is at most
        the batch rows, else the dual), ``"primal"`` or ``"dual"``.
    :param float jitter: Relative jitter of a failed Cholesky factorization.
    :param float max_scale_ratio: Caps every written weight and bias std at
        this fraction of its prior std (see "Training after I-BLM" below);
        None (default) writes the regressions' posterior stds as they are.
    :param int max_pool_size: At most this many data rows are read; minibatches
        are drawn from them.
    :param int chunk_rows: Rows per forward call when propagating the data.
    :param int max_chunk_elements: Bound on the elements of the per-chunk
        design tensors; the units are solved in chunks of this size.

    [1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
    Bayes for Deep Models"

    [2] Milios, Camoriano, Michiardi, Rosasco, Filippone (2018) "Dirichlet-based
    Gaussian Processes for Large-scale Calibrated Classification"
    """

    def __init__(self, process_group: Optional[Any] = None, **options: Any):
        self.options = IBLMOptions(**options)
        if Shards.size_of(process_group) == 0:
            Shards(process_group)  # raises the reason
        self.process_group = process_group

    # ---- the four steps -------------------------------------------------------------------

    def __call__(self, guide: _G, data: Data) -> _G:
        """
        Initializes ``guide`` in place from ``data`` and returns it.

        :param guide: An :class:`~pyro.infer.autoguide.AutoNormal`,
            :class:`~pyro.infer.autoguide.AutoDiagonalNormal`,
            :class:`~pyro_vinit.guides.AutoKTiedNormal` or
            :class:`~pyro_vinit.guides.AutoRadialNormal` (set up from the first
            batch if it is not yet).
        :param data: One tuple of model arguments, ``model(*data)``, or an
            iterable of such tuples (e.g. a DataLoader).
        """
        opts = self.options
        check_supported(guide)
        shards = None
        if Shards.size_of(self.process_group) > 1:
            shards = Shards(self.process_group)
        with GuideRollback(guide) as rollback, ExitStack() as stack:
            # 1. trace: the layers, the likelihood and what feeds it
            if shards is None:
                prep = prepare(guide, data, opts.max_pool_size, opts.chunk_rows)
            else:
                prep = self._prepare_sharded(guide, data, shards, stack)
            report_uncovered(prep.structure, opts.strict, "init_guide_iblm")
            prep.pool.effective_batch_size(opts.batch_size, "init_guide_iblm")
            values = guide_medians(guide, prep.first)
            targets = self._read_targets(prep, values)
            # 2.-3. each layer's inputs under the layers fitted so far, and its regressions
            fits: Dict[str, Fit] = {}
            for layer in prep.layers:
                if layer.role != "scale":  # a scale head is fitted with the noise, below
                    inputs = self._collect_inputs(prep, values, layer)
                    self._stage(prep, values, fits, self._solve(prep, layer, inputs, targets))
            noise = self._fit_noise(prep, values, targets, fits)
            # 4. project onto the guide's family, then bring normalization statistics in line
            rollback.checkpoint()
            self._write(prep, fits, noise)
            refresh_norm_statistics(prep, values, opts.chunk_rows)
        return guide

    def _prepare_sharded(self, guide: AutoGuide, data: Data, shards: Shards,
                         stack: ExitStack) -> Prepared:
        """Step 1 when the data is spread over the ranks of a process group: the
        ranks check that they agree (data layout, options, model structure),
        enter rank 0's random state, and draw the pool in the global row space."""
        opts = self.options
        with shards.agree():
            local = DataPool(data, None if is_args_tuple(data) else opts.max_pool_size)
        reports = shards.gather_objects(
            (local.num_rows, _distributed.data_signature(local), repr(opts)))
        fix = ("call init_guide_iblm with the same options and a shard of the same data on "
               "every rank")
        for rank, (_, layout, options) in enumerate(reports):
            for what, mine, first in (("their data arguments (per argument: trailing shape "
                                       "and dtype of the rows)", layout, reports[0][1]),
                                      ("their options", options, reports[0][2])):
                if mine != first:
                    raise ValueError(
                        f"init_guide_iblm with a process_group: the ranks differ in {what}: "
                        f"rank 0 has {first}, rank {rank} has {mine}; {fix}"
                    )
        pool = _distributed.ShardedPool(shards, local, [r[0] for r in reports])
        stack.enter_context(shards.shared_rng(local.device))
        pool.finish(opts.max_pool_size)
        with shards.agree():
            prep = prepare(guide, None, opts.max_pool_size, opts.chunk_rows, pool=pool)
        shards.check_equal("the model's structure", _distributed.structure_signature(
            prep.structure), "every rank must run the same model and guide")
        if prep.structure.batch_norm:
            if prep.structure.block_size is None:
                pool.sync_norms = True
            else:
                _distributed.warn_not_exact(
                    "the model has batch normalization and a subsampled data plate: each "
                    "rank normalizes its own blocks while fitting")
        return prep

    # ---- step 1: targets -------------------------------------------------------------------

    def _read_targets(self, prep: Prepared, values: Dict[str, torch.Tensor]) -> Targets:
        likelihood = _likelihood(prep)
        fixed = likelihood.noise == "fixed" and not self.options.estimate_noise
        fixed = fixed and self.options.noise_scale is None
        parts: List[Tuple[torch.Tensor, torch.Tensor]] = []
        with _agree(prep):
            for site, rows_of in self._observed(prep, values):
                obs = rows_of(site["value"], "the observed site")
                scale = None
                if fixed:
                    fn = cast(Union[Normal, StudentT], unwrap_likelihood(site))  # "fixed": normal
                    scale = fn.scale.expand(site["value"].shape)
                    scale = rows_of(scale, "the likelihood's scale")
                parts.append(self._site_targets(site, likelihood.family, obs, scale))
        y = torch.cat([p[0] for p in parts])
        noise_var = torch.cat([p[1] for p in parts])
        task = "regression" if likelihood.family == "normal" else "classification"
        if task == "regression" and not fixed:
            std = y.std() if prep.pool.shards is None else _sharded(prep.pool).std(y)
            noise = self.options.noise_scale or 0.1 * std.clamp_min(1e-6).item()
            noise_var.fill_(noise**2)
        softmax = likelihood.family in ("categorical", "onehot")
        output = prep.structure.output_layers[0]
        if output.num_units != y.shape[1]:
            raise ValueError(
                f"the output layer ({output.weight_name!r}) has {output.num_units} outputs but "
                f"the likelihood has {y.shape[1]} target columns; I-BLM needs them to match"
            )
        return Targets(task, y, noise_var, softmax, fixed)

    def _observed(
        self, prep: Prepared, values: Dict[str, torch.Tensor]
    ) -> Iterator[Tuple[SampleSite, Callable[[torch.Tensor, str], torch.Tensor]]]:
        """The observed site of a run of the model over each chunk (or block) of the
        data, with a function picking a tensor's rows of that chunk, in order."""
        for args, rows, keep in iterate_rows(prep.pool, self.options.chunk_rows,
                                             prep.structure.block_size):
            recorder = run_model(prep.guide.model, values, args, prep.latent,
                                 plate_rows=rows)
            if not keep:  # a sharded pool's run for the collectives only
                continue
            n = prep.pool.rows_of(args)
            yield observed_site(recorder), partial(align_rows, n=n, rows=rows, keep=keep)

    def _site_targets(self, site: SampleSite, family: str, obs: torch.Tensor,
                      scale: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(targets (rows, k), noise variances (rows, k)) of an observed site's rows."""
        fn = unwrap_likelihood(site)
        rows = obs.shape[0] if obs.dim() else 0
        if family == "normal":
            y = obs.reshape(rows, -1)
            var = scale.reshape(rows, -1).pow(2) if scale is not None else torch.empty_like(y)
            return y, var
        if family == "categorical":
            logits = cast(Categorical, fn).logits
            k = logits.shape[-1]
            if obs.is_floating_point() and not bool((obs == obs.round()).all()):
                raise ValueError("Categorical labels must be integers")
            labels = obs.reshape(rows, -1)
            if labels.shape[1] != 1 or bool(((labels < 0) | (labels >= k)).any()):
                raise ValueError(
                    f"labels out of range: the Categorical likelihood has {k} classes, so "
                    f"labels must be integers in [0, {k - 1}]; got values in "
                    f"[{labels.min().item()}, {labels.max().item()}]"
                )
            onehot = F.one_hot(labels[:, 0].long(), k).to(logits.dtype)
            return dirichlet_transform(onehot, self.options.alpha)
        y = obs.reshape(rows, -1)
        ok = ((y == 0) | (y == 1)).all()
        if family == "onehot":
            ok = ok & (y.sum(-1) == 1).all()
        if not bool(ok):
            raise ValueError(
                f"labels out of range: {type(fn).__name__} observations must be "
                + ("one-hot rows" if family == "onehot" else "0 or 1")
            )
        mean, var = dirichlet_transform(y, self.options.alpha)
        if family == "bernoulli":  # the logit is the difference of the two classes
            mean_0, var_0 = dirichlet_transform(1 - y, self.options.alpha)
            return mean - mean_0, var + var_0
        return mean, var

    # ---- step 2: each layer's inputs ---------------------------------------------------------

    def _collect_inputs(self, prep: Prepared, values: Dict[str, torch.Tensor],
                        layer: Layer) -> torch.Tensor:
        chunks: List[torch.Tensor] = []
        model = prep.guide.model
        with _agree(prep):
            for args, rows, keep in iterate_rows(prep.pool, self.options.chunk_rows,
                                                 prep.structure.block_size):
                x, _ = capture(model, values, args, prep.latent, layer, plate_rows=rows)
                if keep:  # (0: a sharded pool's run for the collectives only)
                    chunks.append(align_rows(x, f"the input of layer {layer.weight_name!r}",
                                             n=prep.pool.rows_of(args), rows=rows, keep=keep))
            inputs = torch.cat(chunks)
            if not bool(torch.isfinite(inputs).all()):
                raise ValueError(f"the input of layer {layer.weight_name!r} is not finite")
        return inputs

    def _stage(self, prep: Prepared, values: Dict[str, torch.Tensor], fits: Dict[str, Fit],
               fit: Fit) -> None:
        """Records a fit and sets the layer's sites for the passes that follow."""
        fits[fit.layer.weight_name] = fit
        for name, (mean, var) in fit.site_values(prep.site_shape).items():
            sample = self.options.propagate == "sample"
            values[name] = torch.normal(mean, var.sqrt()) if sample else mean

    # ---- step 3: the regressions -------------------------------------------------------------

    def _solve(
        self,
        prep: Prepared,
        layer: Layer,
        inputs: torch.Tensor,
        targets: Targets,
        constant: Optional[torch.Tensor] = None,
    ) -> Fit:
        """All units' Bayesian linear regressions of one layer; a scale head
        regresses onto the ``constant`` per output unit instead."""
        opts, pool = self.options, prep.pool
        shards = pool.shards
        batch_size = min(opts.batch_size, pool.num_rows)  # __call__ warned if smaller
        output = layer.role != "hidden"
        classification = targets.task == "classification"
        center = classification if opts.center_targets is None else opts.center_targets
        alternate = (not classification if opts.alternate_hidden_signs is None
                     else opts.alternate_hidden_signs)
        y, noise_var = targets.y, targets.noise_var
        if constant is not None:
            y = constant.to(y).expand(y.shape[0], -1)
            noise_var = torch.full_like(y, _SCALE_HEAD_NOISE**2)
        elif output and center and targets.softmax:
            y = y - (y.mean() if shards is None else _sharded(pool).mean(y))
        h = layer.num_units
        cols, signs = self._columns(h, y.shape[1], output, inputs.device)
        if output and opts.output_rows is not None:
            # every output unit on the same rows, as many as allowed: the output layer has
            # few units, each with many rows to spare, and no reason to differ
            idx = pool.batch_indices(1, min(pool.num_rows, opts.output_rows))
            batch_size = idx.shape[1]
            if shards is not None:
                return self._solve_shared_rows(_sharded(pool), layer, inputs, y, noise_var,
                                               idx[0], cols)
            idx = idx.expand(h, batch_size)
        elif output or opts.hidden_batches == "random":
            idx = pool.batch_indices(h, batch_size)
        else:
            space = pool.features()
            idx = _local_batches(inputs if space is None else space, h, batch_size,
                                 None if shards is None else _sharded(pool))
            # A slab where the unit's target column is constant (no example of its class)
            # or the layer's input mostly zero (a ReLU layer below silent there) would give
            # the unit zero weights, a dead feature: such a unit gets a random batch instead.
            active = inputs.reshape(inputs.shape[0], -1).ne(0).any(1)
            if shards is None:
                active_at, y_at, y_std = active[idx], y[idx, cols[:, None]], y.std(0)
            else:
                sharded = _sharded(pool)
                active_at = sharded.at(active.to(y), idx)
                y_at = sharded.at(y, idx, cols[:, None])
                y_std = sharded.column_std(y)
            spread = y_at.std(1)
            dead = (active_at.sum(1) < batch_size / 2) | (
                spread <= 1e-3 * y_std[cols].clamp_min(1e-12)
            )
            if bool(dead.any()):
                idx[dead] = pool.batch_indices(int(dead.sum()), batch_size)
        if shards is None:
            means, variances = self._solve_units(layer, inputs, y, noise_var, idx, cols, signs,
                                                 (center, alternate, output), 0, h)
            return Fit(layer, means, variances)
        # the selected rows from their ranks; each rank solves a share of the units
        (inputs, y, noise_var), idx = _distributed.gather_batches(
            _sharded(pool), (inputs, y, noise_var), idx)
        lo, hi = _distributed.unit_share(shards, h)
        with shards.agree():
            means, variances = self._solve_units(layer, inputs, y, noise_var, idx, cols, signs,
                                                 (center, alternate, output), lo, hi)
        means, variances = _distributed.all_gather_units(shards, h, means, variances)
        return Fit(layer, means, variances)

    def _solve_units(self, layer: Layer, inputs: torch.Tensor, y: torch.Tensor,
                     noise_var: torch.Tensor, idx: torch.Tensor, cols: torch.Tensor,
                     signs: torch.Tensor, flags: Tuple[bool, bool, bool],
                     lo: int, hi: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The regressions of units ``lo, ..., hi - 1`` on their batches ``idx``
        (rows of ``inputs``, ``y`` and ``noise_var``): their means and variances."""
        opts = self.options
        center, alternate, output = flags
        h, d = layer.num_units, layer.fan_in
        batch_size = idx.shape[1]
        device, dtype = inputs.device, inputs.dtype
        has_bias = layer.bias_name is not None
        positions, groups = _unit_inputs(layer, inputs[:1]).shape[1:3]
        group_of = torch.arange(h, device=device) // (h // groups)
        rows = batch_size * positions
        width = d + has_bias
        per_unit = 4 * rows * width + min(rows, width) ** 2
        chunk = max(1, opts.max_chunk_elements // per_unit)
        # Filled in place chunk by chunk: many small chunks, concatenated, would leave the
        # allocator's heap fragmented (resident memory that is never given back).
        means = torch.empty(hi - lo, width, dtype=dtype, device=device)
        variances = torch.empty(hi - lo, width, dtype=dtype, device=device)
        for start in range(lo, hi, chunk):
            units = torch.arange(start, min(hi, start + chunk), device=device)
            c = len(units)
            batch = idx[units]  # (c, B)
            x = _unit_inputs(layer, inputs[batch.reshape(-1)])
            x = x.reshape(c, batch_size, positions, groups, d)
            if groups == 1:
                x = x.reshape(c, rows, d)
            else:  # each unit sees its group's input channels
                g = group_of[units].reshape(c, 1, 1, 1, 1).expand(c, batch_size, positions, 1, d)
                x = x.gather(3, g).reshape(c, rows, d)
            t = y[batch, cols[units, None]]  # (c, B)
            noise = noise_var[batch, cols[units, None]]
            if not output:
                t, noise = self._hidden_targets(t, noise, signs[units], center, alternate)
            if positions > 1:  # every patch (or position) is paired with its row's target
                t = t[:, :, None].expand(c, batch_size, positions).reshape(c, rows)
                noise = noise[:, :, None].expand(c, batch_size, positions).reshape(c, rows)
            if layer.fixed_bias is not None:
                t = t - layer.fixed_bias[units, None].to(t)
            if has_bias:
                x = torch.cat([x, torch.ones(c, rows, 1, dtype=dtype, device=device)], -1)
            prior_loc, prior_scale = _unit_priors(layer, units)
            post = bayesian_linear_regression(
                x, t.to(dtype), noise.to(dtype), prior_loc.to(dtype), prior_scale.to(dtype),
                solver=opts.solver, jitter=opts.jitter,
            )
            means[start - lo : start - lo + c] = post.mean
            torch.reciprocal(post.precision_diag, out=variances[start - lo : start - lo + c])
        return means, variances

    def _solve_shared_rows(self, pool: "_distributed.ShardedPool", layer: Layer,
                           inputs: torch.Tensor, y: torch.Tensor, noise_var: torch.Tensor,
                           rows: torch.Tensor, cols: torch.Tensor) -> Fit:
        """Process group: the output layer's (or scale head's) regressions on the
        rows ``rows`` (global positions) that all its units share, from the
        ranks' all-reduced statistics :math:`X^\top L^{-1} X`,
        :math:`X^\top L^{-1} y` (the primal form, whatever the solver)."""
        shards, h = pool.shards, layer.num_units
        dtype, device = inputs.dtype, inputs.device
        with shards.agree():
            local = pool.local_pos[rows[pool.owner[rows] == shards.rank]]
            x = _unit_inputs(layer, inputs[local])
            groups = x.shape[2]
            t, noise = y[local][:, cols], noise_var[local][:, cols]
            if layer.fixed_bias is not None:
                t = t - layer.fixed_bias.to(t)
            gram, rhs = _distributed.shared_rows_statistics(
                x, t.to(dtype), noise.to(dtype),
                torch.arange(h, device=device) // (h // groups), layer.bias_name is not None)
        total = shards.all_reduce(torch.cat([gram.reshape(-1), rhs.reshape(-1)]))
        gram, rhs = total[: gram.numel()].reshape(gram.shape), total[gram.numel() :].reshape(
            rhs.shape)
        with shards.agree():
            prior_loc, prior_scale = _unit_priors(layer, torch.arange(h, device=device))
            mean, precision = _distributed.solve_statistics(
                gram, rhs, prior_loc.to(dtype), prior_scale.to(dtype), self.options.jitter)
        return Fit(layer, mean, precision.reciprocal())

    def _hidden_targets(self, t: torch.Tensor, noise: torch.Tensor, signs: torch.Tensor,
                        center: bool, alternate: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        if center:
            t = t - t.mean(-1, keepdim=True)
        if alternate:
            t = t * signs[:, None].to(t)
        scale = self.options.hidden_target_scale
        if scale is not None:
            # Into the linear range of saturating activations (tanh, sigmoid): targets of
            # a few units would saturate them, and the next layer would see binary features.
            # Shrink only: a unit whose batch has (nearly) one target value stays near zero.
            factor = (scale / t.std(-1, keepdim=True).clamp_min(1e-12)).clamp_max(1.0)
            t, noise = t * factor, noise * factor.pow(2)
        return t, noise

    def _columns(self, h: int, k: int, output: bool,
                 device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Target column of each unit and the sign of its targets."""
        units = torch.arange(h, device=device)
        if output or self.options.hidden_columns == "cyclic":
            cols = units % k
        else:
            cols = torch.randint(k, (h,), device=device)
        # rank of each unit among the units sharing its column: 0, 1, 2, ...
        rank = F.one_hot(cols, k).cumsum(0).gather(1, cols[:, None])[:, 0] - 1
        return cols, 1.0 - 2.0 * (rank % 2)

    # ---- the observation noise ---------------------------------------------------------------

    def _fit_noise(self, prep: Prepared, values: Dict[str, torch.Tensor], targets: Targets,
                   fits: Dict[str, Fit]) -> Optional[NoiseFit]:
        """Regression: the residual std of the fitted network, used in a second fit of
        the output layer and written into the noise site, param or scale head."""
        likelihood = _likelihood(prep)
        if targets.task != "regression" or targets.fixed_noise:
            return None
        output = prep.structure.output_layers[0]
        if self.options.noise_scale is not None:
            sigma = torch.tensor(self.options.noise_scale, dtype=targets.y.dtype,
                                 device=targets.y.device)
        else:
            inputs = self._collect_inputs(prep, values, output)
            for _ in range(2):  # the residuals of a fit with the noise they imply
                sigma = self._residual_std(prep, values, targets)
                refit = replace(targets, noise_var=_column_var(sigma, targets.y))
                self._stage(prep, values, fits, self._solve(prep, output, inputs, refit))
            sigma = self._residual_std(prep, values, targets)
        if likelihood.noise == "layer":
            head = next(layer for layer in prep.layers if layer.role == "scale")
            level = self._shared_link_inverse(prep, values, sigma, head=head)
            inputs = self._collect_inputs(prep, values, head)
            self._stage(prep, values, fits,
                        self._solve(prep, head, inputs, targets, constant=level))
            return NoiseFit(sigma, None, None)
        if likelihood.noise in ("site", "param"):
            level = self._shared_link_inverse(prep, values, sigma)
            return NoiseFit(sigma, likelihood.noise_name, level)
        return NoiseFit(sigma, None, None)

    def _residual_std(self, prep: Prepared, values: Dict[str, torch.Tensor],
                      targets: Targets) -> torch.Tensor:
        """Root mean square residual of the network at ``values``, per target column."""
        squares: Union[float, torch.Tensor] = 0.0
        n: Union[int, torch.Tensor] = 0
        with _agree(prep):
            for site, rows_of in self._observed(prep, values):
                fn = cast(Union[Normal, StudentT], unwrap_likelihood(site))  # regression
                loc = fn.loc.expand(site["value"].shape)
                loc = rows_of(loc, "the likelihood's mean")
                obs = rows_of(site["value"], "the observed site")
                resid = (obs - loc).reshape(obs.shape[0], -1)
                squares = squares + resid.pow(2).sum(0)
                n += resid.shape[0]
        squares = cast(torch.Tensor, squares)  # the pool has rows: some chunk kept them
        if prep.pool.shards is not None:  # over every rank's rows
            total: torch.Tensor = prep.pool.shards.all_reduce(
                torch.cat([squares, squares.new_tensor([n])]))
            squares, n = total[:-1], total[-1]
        return (squares / n).sqrt().clamp_min(1e-6)

    def _shared_link_inverse(self, prep: Prepared, values: Dict[str, torch.Tensor],
                             sigma: torch.Tensor, head: Optional[Layer] = None) -> torch.Tensor:
        """:meth:`_link_inverse`; with a process group, rank 0's (each rank runs
        the model on its own first rows)."""
        with _agree(prep):
            level = self._link_inverse(prep, values, sigma, head=head)
        shards = prep.pool.shards
        return level if shards is None else shards.broadcast(level)

    def _link_inverse(self, prep: Prepared, values: Dict[str, torch.Tensor],
                      sigma: torch.Tensor, head: Optional[Layer] = None) -> torch.Tensor:
        """The unconstrained value of the noise site or param (or the constant
        output of the scale head) at which the likelihood's scale is ``sigma``,
        by bisection (the map is taken to be monotone and element-wise)."""
        likelihood = _likelihood(prep)
        # the noise site's or param's name (or the scale head's): set whenever the noise is fitted
        noise_name = cast(str, likelihood.noise_name)
        args, rows = prep.first, None
        if prep.structure.block_size is not None:
            n = prep.pool.rows_of(args)
            rows = torch.arange(prep.structure.block_size, device=prep.pool.device) % n
        model, latent = prep.guide.model, prep.latent
        if head is not None:
            shape = torch.Size([head.num_units])
            what = f"the scale head {head.weight_name!r}"
        elif likelihood.noise == "site":
            site = prep.guide.prototype_trace.nodes[noise_name]
            shape, support = site["value"].shape, site["fn"].support
            what = f"the noise site {noise_name!r}"
        else:
            store = pyro.get_param_store()
            shape = store[noise_name].shape
            support = store.get_state()["constraints"][noise_name]
            what = f"the noise param {noise_name!r}"
        target = sigma if sigma.numel() == shape.numel() else sigma.pow(2).mean().sqrt()

        def scale_at(u: torch.Tensor) -> torch.Tensor:
            kwargs: Dict[str, Any] = {}
            run_values = values
            if head is not None:
                def on_layer(record: RecordedLayer) -> Optional[torch.Tensor]:
                    if record.weight_name != head.weight_name:
                        return None
                    return u.to(record.call.input).expand(record.call.input.shape[:-1] + shape)

                kwargs["on_layer"] = on_layer
            elif likelihood.noise == "site":
                run_values = {**values, noise_name: biject_to(support)(u)}
            else:
                kwargs["substitute"] = {noise_name: transform_to(support)(u)}
            recorder = run_model(model, run_values, args, latent, plate_rows=rows, **kwargs)
            site = observed_site(recorder)
            fn = cast(Union[Normal, StudentT], unwrap_likelihood(site))  # regression
            scale = fn.scale.expand(site["value"].shape)
            scale = scale.reshape(scale.shape[0], -1) if scale.dim() else scale.reshape(1, 1)
            per_column = scale.mean(0)
            if per_column.numel() == u.numel():
                return per_column.reshape(u.shape)
            return scale.mean().expand(u.shape)

        dtype, device = target.dtype, target.device
        lo = torch.full(shape, -_LINK_RANGE, dtype=dtype, device=device)
        hi = torch.full(shape, _LINK_RANGE, dtype=dtype, device=device)
        goal = target.reshape(shape) if target.numel() > 1 else target.reshape(()).expand(shape)
        increasing = scale_at(hi) > scale_at(lo)
        for _ in range(60):
            mid = (lo + hi) / 2
            right = (scale_at(mid) < goal) == increasing
            lo, hi = torch.where(right, mid, lo), torch.where(right, hi, mid)
        level = (lo + hi) / 2
        reached = scale_at(level)
        if not bool(((reached - goal).abs() <= 1e-3 * goal).all()):
            raise ValueError(
                f"I-BLM estimated the observation noise std as {goal.tolist()}, but {what} "
                f"cannot make the likelihood's scale that (closest: {reached.tolist()}); "
                "widen its prior's support, or pass noise_scale=..."
            )
        return level

    # ---- step 4: writing -----------------------------------------------------------------------

    def _write(self, prep: Prepared, fits: Dict[str, Fit], noise: Optional[NoiseFit]) -> None:
        guide = prep.guide
        # One site at a time through the guide's own projection, so that only one site's
        # values are held twice in memory: a failure half-way is undone by GuideRollback.
        ratio = self.options.max_scale_ratio
        for key in list(fits):
            fit = fits.pop(key)
            if ratio is not None:
                units = torch.arange(fit.layer.num_units, device=fit.var.device)
                _, prior_scale = _unit_priors(fit.layer, units)
                cap = (ratio * prior_scale).to(fit.var).square_()
                fit.var = torch.minimum(fit.var, cap)
            for name, (mean, var) in fit.site_values(prep.site_shape).items():
                set_loc_and_scale(guide, name, mean, var.sqrt_())
        if noise is not None and noise.name is not None:
            level = cast(torch.Tensor, noise.level)  # set with the noise site's or param's name
            if _likelihood(prep).noise == "site":
                # the posterior std of log sigma from n residuals is about 1 / sqrt(2 n)
                spread = min(0.1, (2.0 * prep.pool.num_rows) ** -0.5)
                set_loc_and_scale(guide, noise.name, level, torch.full_like(level, spread))
            else:
                write_param(noise.name, level)


def _likelihood(prep: Prepared) -> Likelihood:
    """The model's likelihood, which I-BLM's :func:`prepare` (with normal priors) always reads."""
    return cast(Likelihood, prep.structure.likelihood)


def _sharded(pool: DataPool) -> "_distributed.ShardedPool":
    """``pool``, which has ``shards``: only a sharded pool has."""
    return cast(_distributed.ShardedPool, pool)


def _agree(prep: Prepared) -> ContextManager[None]:
    """Rank-local work whose failure every rank of a process group must hear of."""
    shards = prep.pool.shards
    return nullcontext() if shards is None else shards.agree()


def init_guide_iblm(guide: _G, data: Data, process_group: Optional[Any] = None,
                    **options: Any) -> _G:
    """
    Initializes ``guide`` in place with I-BLM and returns it; shorthand for
    ``IBLMGuideInitializer(process_group, **options)(guide, data)``.

    Usage::

        guide = AutoNormal(model)
        init_guide_iblm(guide, (x_train, y_train))
        # under torchrun, each rank passes its shard and gets the same result:
        # init_guide_iblm(guide, (x_shard, y_shard), process_group=dist.group.WORLD)

    :param guide: An AutoNormal, AutoDiagonalNormal, AutoKTiedNormal or
        AutoRadialNormal guide of the model.
    :param data: One tuple of model arguments, or an iterable of such tuples.
    :param process_group: The :class:`torch.distributed.ProcessGroup` over
        whose ranks the data is sharded (see :class:`IBLMGuideInitializer`),
        or None.
    :param options: Keyword options of :class:`IBLMGuideInitializer`.
    """
    return IBLMGuideInitializer(process_group=process_group, **options)(guide, data)
