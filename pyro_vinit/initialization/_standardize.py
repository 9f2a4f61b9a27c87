"""
An option of step 3 of I-BLM: the hidden units that a regression left on one
side of zero rescaled to standardized pre-activations on the data.
"""

from typing import Tuple

import torch

from pyro_vinit.initialization._collective import Collective
from pyro_vinit.initialization._regressions import unit_statistics
from pyro_vinit.initialization._tracing import Layer

__all__ = ["standardize_units"]

#: A unit is standardized where the mean of its pre-activation is more than this
#: many of its standard deviations away from zero.
OFF_CENTRE = 2.0
#: ... and left as fitted where its standard deviation is under this fraction of
#: its mean (a constant, to rounding).
CONSTANT = 1e-6


def standardize_units(layer: Layer, inputs: torch.Tensor, mean: torch.Tensor,
                      var: torch.Tensor, collective: Collective,
                      chunk_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""
    A hidden layer's fit ``(mean, var)`` (``(units, fan_in + 1)``, the latent
    bias last) with each unit whose regression left it on one side of zero
    standardized [1]. With :math:`\mu_j, \sigma_j` the mean and std of its
    pre-activation :math:`z_j = x^\top w_j + b_j` over the layer's input rows
    ``inputs`` (every patch or position of them, on every process of
    ``collective``), a unit with :math:`|\mu_j| >` :data:`OFF_CENTRE`
    :math:`\sigma_j` gets

    .. math::

        w_j \leftarrow w_j / \sigma_j, \qquad
        b_j \leftarrow (b_j - \mu_j) / \sigma_j, \qquad
        \mathrm{var} \leftarrow \mathrm{var} \min(1, \sigma_j^{-2}),

    i.e. :math:`z_j \leftarrow (z_j - \mu_j) / \sigma_j`: the regression's
    direction, and with it the unit's ranking of the rows, at the data's scale
    and offset. The variances shrink with a unit scaled down and stay where it
    is scaled up: at its threshold, the unit's activations turn with any
    noise in its weights. The other units, a constant one, and every unit of a
    layer without a latent bias (whose threshold cannot move) stay as fitted.

    [1] Krähenbühl, Doersch, Donahue, Darrell (2016) "Data-dependent
    Initializations of Convolutional Neural Networks"
    """
    d = layer.fan_in
    if mean.shape[1] != d + 1:
        return mean, var
    with collective.agree():
        _, (first, second), rows = unit_statistics(layer, inputs, mean[:, :d], chunk_rows,
                                                  squares=False)
        totals = torch.stack([torch.full_like(first, rows), first, second])
    totals = collective.all_reduce(totals)
    count = totals[0].clamp_min(1.0)
    center = totals[1] / count
    spread = (totals[2] / count - center.pow(2)).clamp_min(0.0).sqrt()
    level = center + mean[:, d].to(center)  # mu_j
    keep = (level.abs() <= OFF_CENTRE * spread) | (spread <= CONSTANT * level.abs())
    factor = torch.where(keep, torch.ones_like(spread), spread.clamp_min(1e-300).reciprocal())
    mean, var = mean.clone(), var.clone()
    mean[:, d] = torch.where(keep, mean[:, d].to(factor), -center * factor).to(mean)
    mean[:, :d] *= factor[:, None].to(mean)
    var *= factor.clamp_max(1.0)[:, None].pow(2).to(var)
    return mean, var
