"""Flipout as an effect handler."""

from pyro_vinit.poutine.noise import Flipout
from pyro_vinit.poutine.noise.strategy import _check_conv
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

    The estimator and its exactness condition are those of the strategy,
    :class:`~pyro_vinit.poutine.Flipout` (two layer evaluations instead of
    one; exact for factorized Normals and
    :class:`~pyro_vinit.distributions.RadialNormal`). Layers, requirements,
    fallbacks, the refusal of a noised draw used twice, and the report on
    exit are those of :class:`~pyro_vinit.poutine.LocalReparamMessenger`, with
    "not known to be sign-symmetric" (:func:`~pyro_vinit.distributions.is_sign_symmetric`)
    in place of "not a factorized Normal". The bias is used as sampled.

    :param bool strict: Raise one error instead of one warning, on exit,
        naming the latent sites Flipout did not apply to.
    :param bool conv: Whether convolutions get per-example noise too; with
        False their weights (transposed convolutions' too) keep the ordinary
        sample, shared by the minibatch, unreported (see :class:`~pyro_vinit.poutine.Flipout`).

    [1] Wen, Vicol, Ba, Tran, Grosse (2018) "Flipout: Efficient
    Pseudo-Independent Weight Perturbations on Mini-Batches"

    [2] Farquhar, Osborne, Gal (2020) "Radial Bayesian Neural Networks:
    Beyond Discrete Support in Large-Scale Bayesian Deep Learning"
    """

    def __init__(self, strict: bool = False, conv: bool = True) -> None:
        _check_conv("FlipoutMessenger", conv)
        super().__init__(config=Flipout(conv=conv), strict=strict)

    @property
    def conv(self) -> bool:
        """Whether convolutions get per-example noise too."""
        assert isinstance(self.config, Flipout)
        return self.config.conv
