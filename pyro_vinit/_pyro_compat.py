"""
Every use of Pyro's private helpers and undocumented behaviour, in one place,
so that a Pyro upgrade that moves or changes one touches this file alone.
``tests/test_pyro_compat.py`` checks each against the installed Pyro.

* :func:`deep_setattr`, :func:`helpful_support_errors`: helpers of
  ``pyro.infer.autoguide.utils``, not part of Pyro's documented API.
* :func:`scale_and_mask`, :class:`ScoreParts`: the helpers
  ``pyro.poutine.Trace`` uses to store a site's log density.
* :func:`prefill_log_prob`: stores a site's log density in its message ahead
  of time; relies on ``Trace.compute_log_prob``, ``compute_score_parts`` and
  ``log_prob_sum`` leaving alone the sites that already have them.
* :func:`is_vectorized_particles`: recognizes the plate in which an ELBO with
  ``vectorize_particles=True`` runs the model and guide (by its name).
"""

import torch
from pyro.distributions.score_parts import ScoreParts
from pyro.distributions.util import scale_and_mask
from pyro.infer.autoguide.utils import deep_setattr, helpful_support_errors

__all__ = [
    "ScoreParts",
    "deep_setattr",
    "helpful_support_errors",
    "is_vectorized_particles",
    "prefill_log_prob",
    "scale_and_mask",
]

# The name of the plate of pyro.infer.ELBO._vectorized_num_particles.
_PARTICLE_PLATE = "num_particles_vectorized"


def is_vectorized_particles(frame) -> bool:
    """Whether the ``CondIndepStackFrame`` ``frame`` is the plate of an ELBO's
    vectorized particles."""
    return frame.name == _PARTICLE_PLATE


def prefill_log_prob(
    msg: dict,
    unscaled: torch.Tensor,
    scaled: torch.Tensor,
    total: torch.Tensor,
) -> None:
    """
    Stores the log density of the sample site ``msg`` as
    ``Trace.compute_log_prob`` and ``compute_score_parts`` would (a
    reparameterized site: no score function), so that they keep it instead
    of computing it from ``msg["fn"]`` and ``msg["value"]``.

    :param dict msg: A sample site's message.
    :param torch.Tensor unscaled: ``fn.log_prob(value)``.
    :param torch.Tensor scaled: ``unscaled`` with the site's scale and mask applied.
    :param torch.Tensor total: ``scaled.sum()``.
    """
    msg["unscaled_log_prob"] = unscaled
    msg["log_prob"] = scaled
    msg["log_prob_sum"] = total
    msg["score_parts"] = ScoreParts(log_prob=scaled, score_function=0, entropy_term=scaled)
