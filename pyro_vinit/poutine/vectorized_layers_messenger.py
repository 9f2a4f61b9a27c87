"""
Layers with a sample dim: :class:`~pyro.infer.Predictive` with
``parallel=True`` on models built from ``nn.Linear`` / ``nn.Conv*d``.
"""

from pyro_vinit.poutine.layer_call_messenger import LayerCallMessenger

__all__ = ["VectorizedLayersMessenger"]


class VectorizedLayersMessenger(LayerCallMessenger):
    r"""
    Effect handler that runs each ``F.linear`` / ``F.conv1d/2d/3d`` call
    (so ``nn.Linear`` and ``nn.Conv*d`` too), and each matrix product read
    as a linear layer (``x @ w``, ``x @ w.mT``, ``torch.matmul``, a
    two-operand ``einsum``), whose weight or bias is a sample site with
    leading batch dims as one batched layer, so that
    :class:`~pyro.infer.Predictive` with ``parallel=True`` and an ELBO with
    ``vectorize_particles=True`` run such models.

    Usage::

        predictive = Predictive(model, guide=guide, num_samples=100, parallel=True)
        with VectorizedLayersMessenger():
            samples = predictive(x)

    The batch dims of the weight :math:`W` (shape ``batch + (out, in)``)
    broadcast with those of the input :math:`x` (its dims left of the
    features), as a plate's dims do, and each element of the batch is the
    layer with its own weight:

    .. math::

        y_{b,o} = \sum_i x_{b,i} W_{b,o,i} + c_{b,o}.

    A linear layer is one ``einsum``, a convolution one grouped convolution
    over the weight's batch; layers whose weights have no batch dims run
    unchanged. The model's other operations see these batch dims on the left
    of its own dims, so a reshape must count dims from the right
    (``nn.Flatten(-3)``, ``x.flatten(-3)``, not ``nn.Flatten()`` or
    ``x.flatten(1)``); a batched layer whose input's feature or channel dim
    does not fit its weight raises a :class:`ValueError` saying so, before
    the layer runs. An ``nn.BatchNorm*d`` after a batched layer runs on its
    input with the sample dims folded into its rows: in eval mode each sample
    is normalized with the running statistics, as a run per sample would;
    in train mode, whose batch statistics the samples would share, it is
    refused. Pooling modules (``nn.MaxPool2d``, ...) run with the leading
    dims folded into one. Samples given to :class:`~pyro.infer.Predictive`
    (``posterior_samples``) run batched as drawn ones do.
    The weight-noise handlers
    (:class:`~pyro_vinit.poutine.WeightNoiseMessenger` and its short forms)
    do the same for every layer call, so they need no extra handler.
    """
