"""Effect handlers for Bayesian neural networks."""

from pyro_vinit.poutine.layer_call_messenger import LayerCall, LayerCallMessenger

__all__ = ["LayerCall", "LayerCallMessenger"]
