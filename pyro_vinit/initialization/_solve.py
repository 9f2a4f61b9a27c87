"""Step 3 of I-BLM: one layer's per-unit regressions, from its inputs and the targets."""

from functools import partial
from typing import Optional

import torch

from pyro_vinit.initialization._collective import Collective
from pyro_vinit.initialization._data import DataPool
from pyro_vinit.initialization._fits import Fit
from pyro_vinit.initialization._minibatches import hidden_batches, unit_columns
from pyro_vinit.initialization._options import IBLMOptions
from pyro_vinit.initialization._regressions import HiddenTargets, solve_units, unit_priors
from pyro_vinit.initialization._standardize import standardize_units
from pyro_vinit.initialization._targets import Targets
from pyro_vinit.initialization._tracing import Layer
from pyro_vinit.initialization.bayesian_linear_regression import _Unsolvable

# The noise of a scale head's regression onto its constant.
_SCALE_HEAD_NOISE = 0.1


def solve_layer(pool: DataPool, layer: Layer, inputs: torch.Tensor, targets: Targets,
                options: IBLMOptions, collective: Collective,
                constant: Optional[torch.Tensor] = None) -> Fit:
    """
    All units' Bayesian linear regressions of one layer: unit :math:`j` of the
    output layer onto target column :math:`j`, a hidden unit onto its column's
    :class:`~pyro_vinit.initialization._regressions.HiddenTargets`, a scale
    head onto the ``constant`` per output unit. A classifier's output units
    count their rows ``1 / options.kl_weight`` times (their noise variances
    times it): the posterior of the objective whose KL term is weighted so.

    :param DataPool pool: The data rows (the pool of this process).
    :param torch.Tensor inputs: The layer's input on every row of ``pool``.
    """
    try:
        return _solve_layer(pool, layer, inputs, targets, options, collective, constant)
    except _Unsolvable as error:
        raise RuntimeError(_unsolvable(layer, inputs, options, error)) from error


def _unsolvable(layer: Layer, inputs: torch.Tensor, options: IBLMOptions,
                error: _Unsolvable) -> str:
    """The message of a layer whose regressions no jitter solves: the layer, the
    magnitudes that may overflow, and the remedies."""
    _, prior_scale = unit_priors(layer, torch.arange(layer.num_units, device=inputs.device))
    return (
        f"init_guide_iblm: the regressions of layer {layer.weight_name!r} failed: "
        f"{error.reason}; the layer's inputs reach |x| = {inputs.abs().max().item():.1e} "
        f"and its prior scales go down to {prior_scale.min().item():.1e}. Run the model "
        "and the data in float64 (model.double(), x.double()) or rescale the layer's "
        "inputs; a prior scale whose inverse square overflows must be larger. A larger "
        f"jitter (now {options.jitter:g}) helps only a system without inf or NaN"
    )


def _solve_layer(pool: DataPool, layer: Layer, inputs: torch.Tensor, targets: Targets,
                 options: IBLMOptions, collective: Collective,
                 constant: Optional[torch.Tensor]) -> Fit:
    batch_size = min(options.batch_size, pool.num_rows)  # step 1 warned if smaller
    output = layer.role != "hidden"
    classification = targets.task == "classification"
    y, noise_var = targets.y, targets.noise_var
    if constant is not None:
        y = constant.to(y).expand(y.shape[0], -1)
        noise_var = torch.full_like(y, _SCALE_HEAD_NOISE**2)
    elif output and options.center(classification) and targets.softmax:
        y = y - collective.mean(y)
    if output and constant is None and classification:
        noise_var = noise_var * options.kl_weight
    h = layer.num_units
    cols, signs = unit_columns(h, y.shape[1], output or options.hidden_columns == "cyclic",
                               inputs.device)
    hidden = None if output else HiddenTargets(signs, options.center(classification),
                                                options.alternate(classification),
                                                options.hidden_target_scale)
    solve = partial(solve_units, layer, cols=cols, hidden=hidden, solver=options.solver,
                    jitter=options.jitter, max_chunk_elements=options.max_chunk_elements,
                    input_rank=options.input_rank)
    if output and options.output_rows is not None:
        # every output unit on the same rows, as many as allowed: the output layer has
        # few units, each with many rows to spare, and no reason to differ
        rows = pool.batch_indices(1, min(pool.num_rows, options.output_rows))[0]
        means, variances = collective.solve_shared_rows(layer, inputs, y, noise_var, rows, cols,
                                                        options.jitter, solve)
        return Fit(layer, means, variances)
    if output or options.hidden_batches == "random":
        idx = pool.batch_indices(h, batch_size)
    else:
        idx = hidden_batches(pool, inputs, y, cols, batch_size, collective)
    means, variances = collective.solve_units(h, inputs, y, noise_var, idx, solve)
    if not output and options.standardize(classification):
        means, variances = standardize_units(layer, inputs, means, variances, collective,
                                             options.chunk_rows)
    return Fit(layer, means, variances)
