"""
Which rows each unit of a layer regresses on, and onto which target column:
I-BLM's minibatches (random, or slabs of the data along a random direction).
"""

from typing import Tuple

import torch
import torch.nn.functional as F

from pyro_vinit.initialization._collective import Collective
from pyro_vinit.initialization._data import DataPool


def unit_columns(num_units: int, num_columns: int, cyclic: bool,
                 device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""The target column of each unit (:math:`j \bmod k` if ``cyclic``, else
    random) and the sign of its targets (alternating among the units sharing
    a column)."""
    units = torch.arange(num_units, device=device)
    if cyclic:
        cols = units % num_columns
    else:
        cols = torch.randint(num_columns, (num_units,), device=device)
    # rank of each unit among the units sharing its column: 0, 1, 2, ...
    rank = F.one_hot(cols, num_columns).cumsum(0).gather(1, cols[:, None])[:, 0] - 1
    return cols, 1.0 - 2.0 * (rank % 2)


def local_batches(inputs: torch.Tensor, num_units: int, batch_size: int, num_rows: int,
                  collective: Collective) -> torch.Tensor:
    r"""
    Row indices ``(num_units, batch_size)``: unit :math:`j` gets ``batch_size``
    consecutive rows of the data sorted along a random direction :math:`u_j`
    of the space of ``inputs`` (one row per data row), from a random start:
    a slab of that space, so that the unit's regression is a local fit.

    :param torch.Tensor inputs: The rows the collective holds of the space.
    :param int num_rows: The rows of the whole pool.
    """
    flat = inputs.reshape(inputs.shape[0], -1)
    directions = torch.randn(flat.shape[1], num_units, dtype=flat.dtype, device=flat.device)
    start = torch.randint(0, num_rows - batch_size + 1, (num_units,), device=flat.device)
    return collective.window(flat @ directions, start, batch_size)


def hidden_batches(pool: DataPool, inputs: torch.Tensor, y: torch.Tensor, cols: torch.Tensor,
                   batch_size: int, collective: Collective) -> torch.Tensor:
    """The slabs (:func:`local_batches`) of a hidden layer's units, in the space
    of the model's input (or the layer's, if the data have no floating-point
    tensor); a unit whose slab would give it zero weights gets a random batch."""
    h = len(cols)
    space = pool.features()
    idx = local_batches(inputs if space is None else space, h, batch_size, pool.num_rows,
                        collective)
    # A slab where the unit's target column is constant (no example of its class)
    # or the layer's input mostly zero (a ReLU layer below silent there) would give
    # the unit zero weights, a dead feature: such a unit gets a random batch instead.
    active = inputs.reshape(inputs.shape[0], -1).abs().amax(1) > 0  # (finite: checked)
    active_at = collective.take(active.to(y), idx)
    y_at = collective.take(y, idx, cols[:, None])
    y_std = collective.column_std(y)
    spread = y_at.std(1)
    dead = (active_at.sum(1) < batch_size / 2) | (
        spread <= 1e-3 * y_std[cols].clamp_min(1e-12)
    )
    if bool(dead.any()):
        idx[dead] = pool.batch_indices(int(dead.sum()), batch_size)
    return idx
