"""Flipout as an effect handler."""

from pyro_vinit.poutine.noise import Flipout
from pyro_vinit.poutine.weight_noise_messenger import WeightNoiseMessenger

__all__ = ["FlipoutMessenger"]


class FlipoutMessenger(WeightNoiseMessenger):
    r"""
    Effect handler for Flipout [1]: every layer whose weight is a sample site
    gets per-example pseudo-independent weight noise from its one weight
    sample, for any distribution whose perturbations are symmetric under
    sign flips, the radial posterior [2] included. The short form of
    :class:`~pyro_vinit.poutine.WeightNoiseMessenger` with
    :class:`~pyro_vinit.poutine.Flipout` at every site.

    Usage::

        with FlipoutMessenger():
            svi.step(x, y)

    With the weight sample :math:`W = \bar W + \Delta W`
    (:math:`\bar W` its mean), the output for example :math:`n` is

    .. math::

        b_n = f(x_n, \bar W) + c + \big(f(x_n \odot s_n, \Delta W)\big) \odot r_n,

    with independent random signs :math:`s_n` over the input features (for a
    convolution: input channels) and :math:`r_n` over the outputs (output
    channels), which is :math:`f(x_n, \bar W + \Delta W \odot r_n s_n^\top)`.
    When :math:`\Delta W \odot r s^\top` has the law of :math:`\Delta W` for
    every sign vectors — true for factorized Normals and for
    :class:`~pyro_vinit.distributions.RadialNormal` — each example's output has
    exactly its ordinary distribution, and the examples are uncorrelated.
    It costs two layer evaluations instead of one.

    Layers, interface, requirements, fallbacks and the report on exit are
    those of :class:`~pyro_vinit.poutine.LocalReparamMessenger`: the handler
    must see both the guide and the model; layers are ``F.linear``,
    ``F.conv1d/2d/3d`` and matrix products with one weight operand, whose
    weight may be a view of the sample (transposed, reshaped, sliced); where
    Flipout does not apply (a distribution not known to be sign-symmetric,
    a weight transformed in a way that repeats elements, another op, a
    weight shared by several layer calls after its first use) the ordinary
    sample is used, and on exit one warning, or with ``strict=True`` one
    error, names those sites and the weight-like ones that never reached a
    layer call. The bias is used as sampled.

    :param bool strict: Raise one error instead of one warning, on exit,
        naming the latent sites Flipout did not apply to.

    [1] Wen, Vicol, Ba, Tran, Grosse (2018) "Flipout: Efficient
    Pseudo-Independent Weight Perturbations on Mini-Batches"

    [2] Farquhar, Osborne, Gal (2020) "Radial Bayesian Neural Networks:
    Beyond Discrete Support in Large-Scale Bayesian Deep Learning"
    """

    def __init__(self, strict: bool = False) -> None:
        super().__init__(config=Flipout(), strict=strict)
