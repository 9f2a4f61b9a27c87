"""Effect handlers for Bayesian neural networks."""

from pyro_vinit.poutine.flipout_messenger import FlipoutMessenger
from pyro_vinit.poutine.handled_elbo import HandledELBO
from pyro_vinit.poutine.handlers import flipout, local_reparam
from pyro_vinit.poutine.kl_annealing_messenger import KLAnnealingMessenger, kl_annealing
from pyro_vinit.poutine.layer_call_messenger import LayerCall, LayerCallMessenger
from pyro_vinit.poutine.local_reparam_messenger import LocalReparamMessenger

__all__ = [
    "FlipoutMessenger",
    "HandledELBO",
    "KLAnnealingMessenger",
    "LayerCall",
    "LayerCallMessenger",
    "LocalReparamMessenger",
    "flipout",
    "kl_annealing",
    "local_reparam",
]
