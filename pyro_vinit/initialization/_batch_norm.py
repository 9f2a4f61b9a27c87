"""
I-BLM on networks with BatchNorm: the weight noise that keeps eval mode (the
running statistics) computing what train mode (the batch statistics) computes
for every draw of the guide.
"""

from dataclasses import replace
from typing import Callable, Dict, List, Tuple

import torch

from pyro_vinit.initialization._collective import Collective
from pyro_vinit.initialization._fits import Fit
from pyro_vinit.initialization._passes import norm_input_statistics
from pyro_vinit.initialization._tracing import Prepared, guide_values

#: how far a draw may move a BatchNorm input channel's mean and std, in units
#: of its std (the norm of the two, for every channel and draw tried)
NORM_TOLERANCE = 0.05
_DRAWS = 4
_ROUNDS = 4


@torch.no_grad()
def write_with_norm_noise(prep: Prepared, values: Dict[str, torch.Tensor],
                          fits: Dict[str, Fit], write: Callable[[Dict[str, Fit]], None],
                          chunk_rows: int, collective: Collective) -> float:
    r"""
    Writes ``fits`` (through ``write``, which empties them) with the hidden layers' variances
    times the largest factor :math:`c \le 1` tried under which draws of the
    written guide move the mean :math:`m` and std :math:`s` of every
    ``F.batch_norm`` input channel from their values :math:`m_0, s_0` at
    ``values`` (the fitted means) by at most :math:`\kappa` =
    ``NORM_TOLERANCE``, for every channel and draw tried,

    .. math::

        \big((m - m_0)^2 / s_0^2 + (s / s_0 - 1)^2\big)^{1/2} \le \kappa,

    shrinking :math:`c` as if the moves were linear in the noise std; and
    returns :math:`c`. Train mode normalizes each draw with its own batch
    statistics, eval mode with the running ones (refreshed at the means):
    draws that move the statistics make the two disagree, more with depth.
    """
    # (in model order: every rank broadcasts the same sites in the same order)
    hidden = [name for fit in fits.values() if fit.layer.role == "hidden"
              for name in fit.layer.site_names]
    if not prep.structure.batch_norm or not hidden:
        write(fits)
        return 1.0

    def scaled(factor: float) -> Dict[str, Fit]:  # (a copy: write empties it, in place)
        return {key: replace(fit, var=fit.var * (factor if fit.layer.role == "hidden" else 1.0))
                for key, fit in fits.items()}

    write(scaled(1.0))
    at_mean = _statistics(prep, values, chunk_rows, collective)
    factor = 1.0
    for _ in range(_ROUNDS):
        worst = 0.0
        for _ in range(_DRAWS):
            drawn = guide_values(prep.guide, prep.first, prep.latent)
            drawn = {**values, **{name: collective.broadcast(drawn[name]) for name in hidden}}
            for (m0, v0), (m, v) in zip(at_mean, _statistics(prep, drawn, chunk_rows,
                                                               collective)):
                std0 = v0.clamp_min(1e-12).sqrt()
                moved = ((m - m0) / std0).pow(2) + (v.clamp_min(0).sqrt() / std0 - 1).pow(2)
                worst = max(worst, float(moved.max()))
        if worst <= NORM_TOLERANCE**2:
            break
        factor *= NORM_TOLERANCE**2 / worst
        write(scaled(factor))
    fits.clear()
    return factor


def _statistics(prep: Prepared, values: Dict[str, torch.Tensor], chunk_rows: int,
                collective: Collective) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The mean and variance of every BatchNorm input over the data at ``values``."""
    return [(mean, var) for _, _, mean, var in norm_input_statistics(prep, values, chunk_rows,
                                                                      collective)]
