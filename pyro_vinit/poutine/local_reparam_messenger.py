"""The local reparameterization trick as an effect handler."""

from typing import Optional

from pyro_vinit.poutine.noise import LocalReparam
from pyro_vinit.poutine.noise.strategy import _check_conv
from pyro_vinit.poutine.weight_noise_messenger import WeightNoiseMessenger

__all__ = ["LocalReparamMessenger"]


class LocalReparamMessenger(WeightNoiseMessenger):
    r"""
    Effect handler for the local reparameterization trick [1]: every layer
    whose weight is a sample site with a factorized Normal distribution
    gets its pre-activations sampled directly, independently per example,
    instead of through one weight sample shared by the minibatch. The short
    form of :class:`~pyro_vinit.poutine.WeightNoiseMessenger` with
    :class:`~pyro_vinit.poutine.LocalReparam` at every site.

    Usage::

        with LocalReparamMessenger():
            svi.step(x, y)

    For a layer :math:`b = f(x, W) + c` (``F.linear`` or ``F.conv1d/2d/3d``,
    so ``nn.Linear`` and ``nn.Conv*d`` too, or a matrix product with one
    weight operand: ``x @ w``, ``torch.matmul``, ``torch.mm``,
    ``torch.addmm(c, x, w)``, a two-operand ``torch.einsum`` with one
    contracted index) with
    :math:`W_{ij} \sim \mathcal N(\mu_{ij}, \sigma_{ij}^2)` and a bias
    :math:`c_i \sim \mathcal N(\nu_i, \tau_i^2)` (or a plain tensor, or
    None), each output element is drawn as

    .. math::

        b = f(x, \mu) + \nu + \sqrt{f(x^2, \sigma^2) + \tau^2}\ \odot \zeta,
        \qquad \zeta \sim \mathcal N(0, I),

    which has exactly the distribution of :math:`f(x, W) + c` for each
    example whose outputs share no weight element (a row of a linear
    layer's input), with the examples independent: the ELBO's expectation
    and so its gradient are unchanged, and the gradient variance scales as
    :math:`1/M` in the minibatch size. Where the outputs of one example do
    share weights, a convolution's positions or the tokens of a linear
    layer's ``(batch, tokens, features)`` input (the example's dim first),
    draws per output would
    lose their correlation and change the ELBO; there the handler takes
    Flipout's sign flips of one weight sample [2], drawn per example and
    shared by its positions (:class:`~pyro_vinit.poutine.Flipout`), which
    keeps each example's distribution exact. Stride, padding, dilation and
    groups are honoured. The weight may be the sample as drawn or a view of it
    (transposed, reshaped, sliced, split or cast, e.g. ``x @ w.t()`` or the slices
    of :class:`~pyro.infer.autoguide.AutoDiagonalNormal`'s flat latent):
    :math:`\mu` and :math:`\sigma` are then viewed the same way.

    For :class:`~pyro_vinit.distributions.KTiedNormal` weights
    (:class:`~pyro_vinit.guides.AutoKTiedNormal`), :math:`\sigma = UV^\top`
    and so :math:`\sigma\circ\sigma = \sum_{a\le b} c_{ab}(u_a\circ u_b)(v_a\circ v_b)^\top`
    (:math:`c_{aa} = 1`, :math:`c_{ab} = 2`) has rank :math:`r = k(k+1)/2`:
    a linear layer's :math:`f(x^2, \sigma^2)` is computed as :math:`r` thin layers, without
    forming :math:`\sigma^2`, when that takes fewer multiplications
    (``low_rank=None``), always (``True``) or never (``False``).

    The handler must see both the guide and the model: wrap a whole SVI
    step, a :class:`~pyro.infer.Predictive` call (its predictions then get
    per-example noise), or a function running both; ``local_reparam(svi.step)``
    does the same. The distribution of a weight is the one that drew its
    value inside the handler: the guide's (for Pyro's
    :class:`~pyro.infer.autoguide.AutoNormal`, the auxiliary
    ``<name>_unconstrained`` Normal behind the ``Delta`` at the site), or the
    prior's when the model runs without a guide. Under ``Predictive``, which
    conditions the model on guide samples, it is the guide's last draw of the
    site inside the handler.

    *Work not done.* The weight sample drawn by the guide is deferred (a
    :class:`~pyro_vinit.poutine._site_value.SiteValue`; drawn where Flipout's
    signs need it) and so are the log
    densities of the weight sites: with
    :class:`~pyro.infer.TraceMeanField_ELBO` and a closed-form KL nothing
    needs them and they are never computed; with
    :class:`~pyro.infer.Trace_ELBO` they are computed from one sample when
    first used.

    *Where it does not apply* the weight's ordinary sample is used: a
    distribution other than a factorized Normal (e.g.
    :class:`~pyro_vinit.guides.AutoRadialNormal`'s; use
    :class:`~pyro_vinit.poutine.FlipoutMessenger` for those), a weight
    transformed before the layer call in a way that repeats or detaches
    elements (e.g. ``expand``), reinterprets their bits (``view(dtype)``) or
    picks them by tensor-valued bounds (``w[i:i + 1]`` with ``i`` a tensor,
    possibly computed from the draw), a weight used by another op (e.g.
    ``F.bilinear``, ``F.embedding``, ``F.conv_transpose2d``, ``torch.bmm``),
    and a value set by a handler outside this one. A use of the kinds above
    claims the whole draw: later layer calls on it use it as drawn. Weight
    elements or a sampled bias that got per-example noise at one layer call
    and are used again in the same run (tied weights, a siamese net) raise a
    ``ValueError`` at that second use: independent noise at each use would
    lose the correlation between the uses; leave such a site out of the
    handler (see :class:`~pyro_vinit.poutine.WeightNoiseMessenger`). A
    bias with another distribution is used as sampled.
    Weights that are plain parameters or conditioned values are used as
    they are. When the handler exits, one warning names the latent sites of
    the run that kept their ordinary sample, with the reasons, together with
    the weight-like sites (real-valued, two dims or more) that never reached
    a layer call it sees (e.g. :class:`~torch.nn.MultiheadAttention`'s
    projections, used inside ``F.multi_head_attention_forward``); each site
    is named once per handler instance. With ``strict=True`` this is one
    error instead, raised on exit (after the run: an SVI step has then been
    taken), which makes ``strict`` a check of a model, e.g. on its first step.

    Weights with leading batch dims (vectorized particles,
    :class:`~pyro.infer.Predictive` with ``parallel=True``) get the same
    treatment, each element of the batch its own per-example noise (see
    :class:`~pyro_vinit.poutine.VectorizedLayersMessenger`). Under
    :func:`torch.compile` the handler runs eagerly (a graph break at each of
    its operations), and the compiled step equals the eager one.

    :param bool strict: Raise one error instead of one warning, on exit,
        naming the latent sites the trick did not apply to.
    :param low_rank: Whether to use the low rank of a k-tied variance
        (None: when it is cheaper).
    :type low_rank: bool or None
    :param bool conv: Whether convolutions get per-example noise too; with
        False their weights (transposed convolutions' too) keep the ordinary
        sample, shared by the minibatch, unreported (see :class:`~pyro_vinit.poutine.LocalReparam`).

    [1] Kingma, Salimans, Welling (2015) "Variational Dropout and the Local
    Reparameterization Trick"

    [2] Wen, Vicol, Ba, Tran, Grosse (2018) "Flipout: Efficient
    Pseudo-Independent Weight Perturbations on Mini-Batches"
    """

    def __init__(
        self, strict: bool = False, low_rank: Optional[bool] = None, conv: bool = True
    ) -> None:
        if not (low_rank is None or isinstance(low_rank, bool)):
            raise TypeError(
                f"LocalReparamMessenger: low_rank must be None or a bool, got {low_rank!r}"
            )
        _check_conv("LocalReparamMessenger", conv)
        super().__init__(config=LocalReparam(low_rank=low_rank, conv=conv), strict=strict)

    @property
    def low_rank(self) -> Optional[bool]:
        """Whether to use the low rank of a k-tied variance (None: when cheaper)."""
        assert isinstance(self.config, LocalReparam)
        return self.config.low_rank

    @property
    def conv(self) -> bool:
        """Whether convolutions get per-example noise too."""
        assert isinstance(self.config, LocalReparam)
        return self.config.conv
