"""
I-BLM: layer-by-layer Bayesian-linear-model initialization of autoguides [1].

The pipeline, one module per step: trace the model's structure
(:mod:`._tracing`), collect each layer's inputs (:mod:`._passes`), solve
the per-unit regressions (:mod:`._solve`, with :mod:`._targets`,
:mod:`._minibatches`, :mod:`._regressions` and, for a learnable noise,
:mod:`._noise`), write the fits through the guide's ``set_loc_and_scale``
(:mod:`._fits`). Where the data live (one process, or the ranks of a
process group) is a :class:`~pyro_vinit.initialization._collective.Collective`.

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"
"""

import itertools
from contextlib import ExitStack
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar, cast

import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoGuide, AutoGuideList

from pyro_vinit._pyro_compat import model_swapped
from pyro_vinit._warn import warn_at_caller
from pyro_vinit.guides.site_params import check_supported, is_supported
from pyro_vinit.initialization._batch_norm import write_with_norm_noise
from pyro_vinit.initialization._collective import Collective
from pyro_vinit.initialization._data import Data, DataPool, is_args_tuple
from pyro_vinit.initialization._fits import Fit, NoiseFit, stage, write_fits, write_held_noise
from pyro_vinit.initialization._marks import mark_initialized
from pyro_vinit.initialization._noise import fit_noise
from pyro_vinit.initialization._observed import check_has_likelihood
from pyro_vinit.initialization._options import IBLMOptions
from pyro_vinit.initialization._output import Affine, output_layer_site, output_transform
from pyro_vinit.initialization._passes import layer_inputs, refresh_norm_statistics
from pyro_vinit.initialization._process_group import check_process_group, collective_for
from pyro_vinit.initialization._regressions import extract_patches
from pyro_vinit.initialization._reports import report_held, report_uncovered
from pyro_vinit.initialization._rollback import GuideRollback
from pyro_vinit.initialization._runs import in_rows
from pyro_vinit.initialization._solve import solve_layer
from pyro_vinit.initialization._targets import dirichlet_transform, read_targets
from pyro_vinit.initialization._tracing import (
    NoLayersError,
    Prepared,
    guide_medians,
    hold_hidden_sites,
    prepare,
)
from pyro_vinit.poutine.layer_recorder import PlateRowsMessenger

__all__ = [
    "IBLMGuideInitializer",
    "IBLMOptions",
    "dirichlet_transform",
    "extract_patches",
    "init_guide_iblm",
]

_G = TypeVar("_G", bound=AutoGuide)


def init_guide_iblm(
    guide: _G,
    data: Data,
    process_group: Optional[Any] = None,
    *,
    batch_size: int = 128,
    output_rows: Optional[int] = 4096,
    alpha: float = 0.001,
    center_targets: Optional[bool] = None,
    alternate_hidden_signs: Optional[bool] = None,
    hidden_target_scale: Optional[float] = 1.0,
    hidden_columns: str = "cyclic",
    hidden_batches: str = "local",
    propagate: str = "mean",
    noise_scale: Optional[float] = None,
    estimate_noise: Optional[bool] = None,
    strict: bool = False,
    solver: str = "auto",
    jitter: float = 1e-6,
    max_scale_ratio: Optional[float] = None,
    max_pool_size: int = 10_000,
    chunk_rows: int = 4096,
    max_chunk_elements: int = 2**22,
    input_rank: Optional[int] = 64,
    kl_weight: float = 1.0,
    standardize_hidden: Optional[bool] = None,
) -> _G:
    r"""
    Iterative Bayesian Linear Modeling (I-BLM) [1]: initializes ``guide`` in
    place, layer by layer, each unit's weights from a Bayesian linear
    regression of the layer's input onto the targets, and returns it.

    The model's Bayesian layers (``F.linear`` / ``F.conv*d`` calls and matrix
    products of the data with a latent weight with a Normal prior
    :math:`\mathcal N(m_0, \Lambda)`) are fitted in execution order, each with
    the earlier ones at their fit. With the layer's input :math:`X` on the
    unit's minibatch, its targets :math:`y` (the observations, or for
    classification the :func:`dirichlet_transform` of the labels [2]) and
    noise :math:`L = \mathrm{diag}(\sigma^2)`, unit :math:`j` gets the mean
    and the factorized-Normal variances of its posterior,

    .. math::

        A = \Lambda^{-1} + X^\top L^{-1} X, \qquad
        \mu = A^{-1}(X^\top L^{-1} y + \Lambda^{-1} m_0), \qquad
        s_i^2 = 1 / A_{ii},

    (for classification, a hidden unit that this leaves on one side of zero
    on the data then standardized: ``standardize_hidden``), written through
    :func:`~pyro_vinit.guides.site_params.set_loc_and_scale`
    (with BatchNorm, the hidden layers' variances shrunk until guide draws
    keep every BatchNorm input's statistics). A learnable observation noise
    gets the residual std of the fitted network. Nothing is written unless
    every step succeeds. See :doc:`/methods/iblm` for the steps, the defaults
    and the measurements.

    Usage::

        guide = AutoNormal(model)
        init_guide_iblm(guide, (x_train, y_train), batch_size=64)

    :param guide: An AutoNormal, AutoDiagonalNormal, AutoKTiedNormal or
        AutoRadialNormal guide of the model (set up from the first rows if not
        yet), or an ``AutoGuideList`` (each such member is initialized).
    :param data: One tuple of model arguments, ``model(*data)``, or an iterable
        of such tuples (e.g. a DataLoader).
    :param process_group: A :class:`torch.distributed.ProcessGroup` over whose
        ranks the data is sharded (every rank passes its shard and gets the
        same guide), or None.
    :param int batch_size: Rows in each unit's minibatch (images, for conv layers).
    :param int output_rows: Rows the output layer's units share; None gives each
        its own minibatch.
    :param float alpha: Dirichlet regularization of classification targets.
    :param bool center_targets: Center hidden units' targets over their batch;
        None: for classification only.
    :param bool alternate_hidden_signs: Alternate the sign of the targets of hidden
        units sharing a column; None: for regression only.
    :param float hidden_target_scale: Shrink hidden targets to at most this std;
        None leaves them.
    :param str hidden_columns: ``"cyclic"`` (unit :math:`j` onto column
        :math:`j \bmod k`) or ``"random"``.
    :param str hidden_batches: ``"local"`` (slabs along a random direction) or
        ``"random"``.
    :param str propagate: Earlier layers at their ``"mean"`` or a ``"sample"``.
    :param float noise_scale: A regression noise std to use (and write into a
        learnable noise) instead of the estimate.
    :param bool estimate_noise: Estimate the noise also for a fixed likelihood
        scale (used in the regressions only); None: for a learnable scale only.
    :param bool strict: Raise, instead of warning, when latent sites are left
        uninitialized.
    :param str solver: ``"auto"``, ``"primal"`` or ``"dual"`` (see
        :func:`~pyro_vinit.initialization.bayesian_linear_regression.bayesian_linear_regression`).
    :param float jitter: Relative jitter of a failed Cholesky factorization.
    :param float max_scale_ratio: Cap every written std at this fraction of its
        prior std; None writes the posterior stds.
    :param int max_pool_size: Read at most this many data rows.
    :param int chunk_rows: Rows per model run when propagating the data.
    :param int max_chunk_elements: Bound on the elements of the per-chunk design
        tensors.
    :param int input_rank: A linear layer with more inputs than rows per unit
        and than ``2 * input_rank`` regresses on the top ``input_rank``
        principal directions of its input (the exact precision diagonal); None:
        the exact regressions always.
    :param float kl_weight: The weight :math:`\lambda` of the KL term in the
        objective the guide is then trained with
        (:class:`~pyro_vinit.poutine.KLAnnealingMessenger`): a classifier's
        output layer regresses with its rows counted :math:`1/\lambda` times
        (:math:`L` times :math:`\lambda`), the optimum of that objective; 1
        gives the exact posterior.
    :param bool standardize_hidden: Rescale the fit (means and stds) of each
        hidden unit whose pre-activation on the data has a mean beyond twice
        its std, to mean 0 and std 1 [3]: the regression's direction with the
        data's scale and offset. None: for classification only, whose
        heteroscedastic targets pull a poorly fitted unit's intercept up until
        it is active on every row.
    :return: ``guide``.

    [1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
    Bayes for Deep Models"

    [2] Milios, Camoriano, Michiardi, Rosasco, Filippone (2018) "Dirichlet-based
    Gaussian Processes for Large-scale Calibrated Classification"

    [3] Krähenbühl, Doersch, Donahue, Darrell (2016) "Data-dependent
    Initializations of Convolutional Neural Networks"
    """
    options = IBLMOptions(
        batch_size=batch_size, output_rows=output_rows, alpha=alpha,
        center_targets=center_targets, alternate_hidden_signs=alternate_hidden_signs,
        hidden_target_scale=hidden_target_scale, hidden_columns=hidden_columns,
        hidden_batches=hidden_batches, propagate=propagate, noise_scale=noise_scale,
        estimate_noise=estimate_noise, strict=strict, solver=solver, jitter=jitter,
        max_scale_ratio=max_scale_ratio, max_pool_size=max_pool_size, chunk_rows=chunk_rows,
        max_chunk_elements=max_chunk_elements, input_rank=input_rank, kl_weight=kl_weight,
        standardize_hidden=standardize_hidden,
    )
    _check_data(data, process_group)
    check_process_group(process_group)
    return _initialize(guide, data, options, process_group)


def _initialize(guide: _G, data: Data, options: IBLMOptions,
                process_group: Optional[Any]) -> _G:
    """I-BLM on ``guide``, or on each member it supports of an ``AutoGuideList``."""
    if isinstance(guide, AutoGuideList):
        _initialize_list(guide, data, options, process_group)
    else:
        check_supported(guide)
        with GuideRollback(guide) as rollback:
            _initialize_member(guide, data, options, process_group, rollback.checkpoint)
    mark_initialized(guide)
    return guide


def _initialize_member(guide: AutoGuide, data: Data, options: IBLMOptions,
                       process_group: Optional[Any], checkpoint: Callable[[], None],
                       owner: Optional[AutoGuideList] = None) -> Optional[NoiseFit]:
    """I-BLM's four steps: trace the model's structure, collect each layer's
    inputs, solve its per-unit regressions (then the noise), and, after
    ``checkpoint`` (the rollback's copy), write the fits through the guide's
    ``set_loc_and_scale``. Returns the noise level of a noise site that another
    member of ``owner`` owns, for the list to write."""
    collective = collective_for(process_group)
    with ExitStack() as stack:
        prep, affine = _trace_model(guide, data, options, collective, stack, owner)  # 1.
        values = guide_medians(guide, prep.first)
        targets = read_targets(prep, values, options, collective, affine)
        fits: Dict[str, Fit] = {}
        for layer in prep.layers:
            if layer.role == "scale":  # a scale head is fitted with the noise
                continue
            inputs = layer_inputs(prep, values, layer, options.chunk_rows, collective)  # 2.
            fit = solve_layer(prep.pool, layer, inputs, targets, options, collective)  # 3.
            stage(prep.site_shape, values, fits, fit, options.propagate)
        noise = fit_noise(prep, values, targets, fits, options, collective)
        checkpoint()
        # 4. set_loc_and_scale (with BatchNorm: the hidden layers' noise that eval mode
        # normalizes as train mode does)
        write_with_norm_noise(
            prep, values, fits, lambda f: write_fits(prep, f, noise, options.max_scale_ratio),
            options.chunk_rows, collective)
        refresh_norm_statistics(prep, values, options.chunk_rows, collective)
        held = prep.likelihood is not None and prep.likelihood.noise == "held"
        return noise if held else None


def _initialize_list(guides: AutoGuideList, data: Data, options: IBLMOptions,
                     process_group: Optional[Any]) -> None:
    """I-BLM on each member of ``guides`` that it supports, in order, with the
    sites of the others held at the list's medians; the others are named."""
    members = [cast(AutoGuide, g) for g in guides]
    supported = [g for g in members if is_supported(g)]
    others = [f"{i}: {type(g).__name__}" for i, g in enumerate(members) if g not in supported]
    if not supported:
        raise TypeError(
            f"none of the members of this AutoGuideList ({others}) is a guide that I-BLM "
            "initializes; make the member over the network's weights an AutoNormal, "
            "AutoDiagonalNormal, AutoKTiedNormal or AutoRadialNormal"
        )
    if not is_args_tuple(data) and iter(data) is data and len(supported) > 1:
        raise ValueError(
            "I-BLM reads the data once per member of an AutoGuideList: pass a tuple of model "
            "arguments, e.g. (x, y), or a DataLoader or list of batches, not a one-shot iterator"
        )
    with ExitStack() as stack:
        # (each member's own state restored on failure, every value by the list's copy)
        rollbacks = [stack.enter_context(GuideRollback(g)) for g in [guides, *members]]
        if guides.prototype_trace is None:
            if is_args_tuple(data):
                first = next(DataPool(data).chunks(256))
            else:
                batch = next(iter(data), None)
                if batch is None:
                    raise ValueError("the data is empty: the iterable yielded no batch")
                first = tuple(batch)
                if iter(data) is data:  # a one-shot iterator: its first batch is read again
                    data = itertools.chain([batch], data)
            # a data plate declared over all the rows draws its subsample among those at hand
            plates = PlateRowsMessenger(num_rows=DataPool(first).num_rows)
            in_chunk = in_rows(guides.model, plates)
            check_has_likelihood(in_chunk, first)
            with torch.no_grad(), poutine.block(), ExitStack() as swaps:
                swaps.enter_context(model_swapped(guides, in_chunk))
                for member in members:  # (what a member's model hides held fixed)
                    held = hold_hidden_sites(member.model)[0]
                    swaps.enter_context(model_swapped(member, in_rows(held, plates)))
                guides(*first)  # sets every member up
        rollbacks[0].checkpoint()  # (a later member's failure undoes the earlier writes)
        _check_output_layer_owned(guides, members, supported, data)
        initialized = []
        noises: List[NoiseFit] = []
        for member in supported:
            try:
                noise = _initialize_member(member, data, options, process_group,
                                           _no_checkpoint, guides)
            except NoLayersError:  # e.g. a member over the noise scale: nothing written
                others.append(f"{members.index(member)}: {type(member).__name__} (no layer "
                              "weight among its sites)")
                continue
            initialized.append(member)
            noises += [noise] if noise is not None else []
        if not initialized:
            raise NoLayersError(
                f"no member of this AutoGuideList has the weight of an F.linear / F.conv "
                f"layer or matrix product among its latent sites ({others}), so there is "
                "nothing to initialize; make the layers Bayesian with "
                "pyro_vinit.nn.bayesianize or pyro.nn.PyroSample"
            )
        written = []
        for noise in noises:  # into the member that owns the noise site
            if write_held_noise(members, noise) is None:
                warn_at_caller(
                    f"init_guide_iblm estimated the observation noise, but the member of "
                    f"the AutoGuideList that owns the noise site {noise.name!r} is not "
                    "one it can write (an AutoDelta or a guide it initializes): the site "
                    "keeps its own initial value", UserWarning)
            else:
                written.append(noise.name)
    if others:
        but = (f", but for the noise sites {written}, which it set to its estimate of the "
               "observation noise" if written else "")
        warn_at_caller(
            f"init_guide_iblm initialized the members "
            f"{[type(g).__name__ for g in initialized]} of the AutoGuideList; it leaves the "
            f"others at their own values: {others}{but}", UserWarning)


def _check_output_layer_owned(guides: AutoGuideList, members: List[AutoGuide],
                              supported: List[AutoGuide], data: Data) -> None:
    """Refuses a list whose layer that feeds the likelihood belongs to another
    member than some supported member's layers: fitted alone, that member's
    last layer would be taken for the output layer."""
    if not is_args_tuple(data) and iter(data) is data:
        return  # (a one-shot iterator: its one member is checked by its own run)
    with torch.random.fork_rng(devices=[]):  # (a shuffling loader draws: not from I-BLM's)
        first = (next(DataPool(data).chunks(256)) if is_args_tuple(data)
                 else tuple(next(iter(data))))
        try:
            output, layers = output_layer_site(guides.model, guide_medians(guides, first),
                                               first, DataPool(first).num_rows)
        except ValueError:
            return  # (what the members' own runs refuse, they refuse saying why)
    if output is None:
        return
    owner = {name: i for i, g in enumerate(members) for name, site in
             cast(Any, g.prototype_trace).nodes.items()
             if site["type"] == "sample" and not site["is_observed"]}
    j = owner.get(output)
    for i, member in enumerate(members):
        own = [name for name in layers if owner.get(name) == i]
        if member in supported and own and i != j:
            whose = (f"member {j}: {type(members[j]).__name__}" if j is not None
                     else "no member")
            raise ValueError(
                f"init_guide_iblm: the layer that feeds the likelihood, {output!r}, belongs "
                f"to {whose}, not to member {i}: {type(member).__name__}, which owns the "
                f"layers {own}; I-BLM fits each member's layers as a network that ends in "
                "its own output layer. Give one member all the layer weights (e.g. "
                "poutine.block(model, hide=[<hyperparameters>])), or start the members with "
                f"init_guide(guide[{i}], data, method='xavier') and fit(..., init=None)"
            )


def _no_checkpoint() -> None:
    """A member's within a guide list, whose rollback has its copy already."""


def _check_data(data: Any, process_group: Optional[Any]) -> None:
    """Refuses, saying what to pass, data that is not model arguments."""
    if isinstance(data, torch.Tensor):
        got = ("the targets as the third positional argument (the process_group)"
               if isinstance(process_group, torch.Tensor) else "a bare tensor")
        raise TypeError(
            f"init_guide_iblm takes the model's arguments as one tuple, "
            f"init_guide_iblm(guide, (x, y)), or a DataLoader of such tuples; it was given "
            f"{got}. Write init_guide_iblm(guide, (x, y))"
        )


def _trace_model(guide: AutoGuide, data: Data, options: IBLMOptions, collective: Collective,
                 stack: ExitStack, owner: Optional[AutoGuideList] = None,
                 ) -> Tuple[Prepared, Optional[Affine]]:
    """Step 1: reads the data into the pool (entering into ``stack`` what must
    last the whole call), sets the guide up if needed, and traces the model's
    layers, likelihood and what feeds it (with the affine map from the output
    layer to the likelihood, where there is one)."""
    pool = collective.open_pool(data, options, stack)
    with collective.agree():
        prep = prepare(guide, None, options.max_pool_size, options.chunk_rows, pool=pool,
                       owner=owner)
    collective.check_structure(prep.structure, guide)
    # (the warnings point at the user's call: of init_guide_iblm, of fit, ...)
    report_uncovered(prep.structure, options.strict, "init_guide_iblm")
    report_held(prep.structure, "init_guide_iblm", noise_written=owner is not None)
    affine = output_transform(prep, "init_guide_iblm", options.chunk_rows, collective)
    pool.effective_batch_size(options.batch_size, "init_guide_iblm")
    return prep, affine


class IBLMGuideInitializer:
    """
    :func:`init_guide_iblm` with its options bound: an initializer object
    that can be applied to several guides.

    Usage::

        IBLMGuideInitializer(batch_size=64)(guide, (x_train, y_train))

    The keyword options are those of :func:`init_guide_iblm`, checked here.

    :param process_group: As for :func:`init_guide_iblm`.
    """

    def __init__(
        self,
        process_group: Optional[Any] = None,
        *,
        batch_size: int = 128,
        output_rows: Optional[int] = 4096,
        alpha: float = 0.001,
        center_targets: Optional[bool] = None,
        alternate_hidden_signs: Optional[bool] = None,
        hidden_target_scale: Optional[float] = 1.0,
        hidden_columns: str = "cyclic",
        hidden_batches: str = "local",
        propagate: str = "mean",
        noise_scale: Optional[float] = None,
        estimate_noise: Optional[bool] = None,
        strict: bool = False,
        solver: str = "auto",
        jitter: float = 1e-6,
        max_scale_ratio: Optional[float] = None,
        max_pool_size: int = 10_000,
        chunk_rows: int = 4096,
        max_chunk_elements: int = 2**22,
        input_rank: Optional[int] = 64,
        kl_weight: float = 1.0,
        standardize_hidden: Optional[bool] = None,
    ) -> None:
        self.options = IBLMOptions(
            batch_size=batch_size, output_rows=output_rows, alpha=alpha,
            center_targets=center_targets, alternate_hidden_signs=alternate_hidden_signs,
            hidden_target_scale=hidden_target_scale, hidden_columns=hidden_columns,
            hidden_batches=hidden_batches, propagate=propagate, noise_scale=noise_scale,
            estimate_noise=estimate_noise, strict=strict, solver=solver, jitter=jitter,
            max_scale_ratio=max_scale_ratio, max_pool_size=max_pool_size,
            chunk_rows=chunk_rows, max_chunk_elements=max_chunk_elements,
            input_rank=input_rank, kl_weight=kl_weight,
            standardize_hidden=standardize_hidden,
        )
        check_process_group(process_group)
        self.process_group = process_group

    def __call__(self, guide: _G, data: Data) -> _G:
        """
        Initializes ``guide`` in place from ``data`` and returns it.

        :param guide: As for :func:`init_guide_iblm`.
        :param data: One tuple of model arguments or an iterable of such tuples.
        """
        _check_data(data, None)
        return _initialize(guide, data, self.options, self.process_group)
