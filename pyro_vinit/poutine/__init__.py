"""Effect handlers for Bayesian neural networks."""

from pyro_vinit.poutine.flipout_messenger import FlipoutMessenger
from pyro_vinit.poutine.handled_elbo import HandledELBO
from pyro_vinit.poutine.handlers import flipout, local_reparam, vectorized_layers, weight_noise
from pyro_vinit.poutine.kl_annealing_messenger import KLAnnealingMessenger, kl_annealing
from pyro_vinit.poutine.layer_call_messenger import LayerCall, LayerCallMessenger
from pyro_vinit.poutine.local_reparam_messenger import LocalReparamMessenger
from pyro_vinit.poutine.noise import AutoWeightNoise, Flipout, LocalReparam, WeightNoise
from pyro_vinit.poutine.vectorized_layers_messenger import VectorizedLayersMessenger
from pyro_vinit.poutine.weight_noise_messenger import WeightNoiseMessenger

__all__ = [
    "AutoWeightNoise",
    "Flipout",
    "FlipoutMessenger",
    "HandledELBO",
    "KLAnnealingMessenger",
    "LayerCall",
    "LayerCallMessenger",
    "LocalReparam",
    "LocalReparamMessenger",
    "VectorizedLayersMessenger",
    "WeightNoise",
    "WeightNoiseMessenger",
    "flipout",
    "kl_annealing",
    "local_reparam",
    "vectorized_layers",
    "weight_noise",
]
