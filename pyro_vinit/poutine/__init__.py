"""Effect handlers for Bayesian neural networks."""

from pyro_vinit.poutine.kl_annealing_messenger import KLAnnealingMessenger, kl_annealing
from pyro_vinit.poutine.layer_call_messenger import LayerCall, LayerCallMessenger

__all__ = ["KLAnnealingMessenger", "LayerCall", "LayerCallMessenger", "kl_annealing"]
