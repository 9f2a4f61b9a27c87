"""Shared base of the handlers that give each example its own weight noise."""

import warnings
from types import TracebackType
from typing import Dict, List, Optional, Set, Tuple, Type

import torch
from pyro.distributions import constraints
from torch.distributions import Distribution

from pyro_vinit._pyro_compat import is_vectorized_particles
from pyro_vinit._typing import SampleSite
from pyro_vinit.poutine._site_value import SiteValue, eager
from pyro_vinit.poutine._tensor_ops import replay
from pyro_vinit.poutine.layer_call_messenger import LayerCall, LayerCallMessenger

__all__: List[str] = []

_NEVER_REACHED = (
    "it never reached a layer call the handler sees (F.linear, F.conv1d/2d/3d or a "
    "matrix product with one weight, e.g. nn.Linear, x @ w); e.g. nn.MultiheadAttention "
    "uses its projection weights inside F.multi_head_attention_forward"
)


def rademacher(shape: Tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Independent random signs, +1 or -1 with probability 1/2 each."""
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(0.5).mul_(2).sub_(1)


def spatial_dims(call: LayerCall) -> int:
    """The number of spatial dims of the call's op (0 for linear)."""
    return 0 if call.op == "linear" else int(call.op[-2])


def view_of(value: SiteValue, param: torch.Tensor) -> torch.Tensor:
    """The parameter ``param`` of the distribution that drew ``value`` (of the
    drawn value's shape or broadcastable to it), viewed as ``value`` is."""
    return replay(value.view_ops, param.expand(value.uses.shape))


def _is_weight_like(msg: SampleSite) -> bool:
    # A real-valued site with at least two dims of its own (not plate dims).
    fn, value = msg["fn"], msg["value"]
    support = fn.support
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    if support is not constraints.real:
        return False
    plated = any(frame.vectorized for frame in msg["cond_indep_stack"])
    return (len(fn.event_shape) if plated else value.dim()) >= 2


class _WeightNoiseMessenger(LayerCallMessenger):
    """
    Base of :class:`~pyro_vinit.poutine.LocalReparamMessenger` and
    :class:`~pyro_vinit.poutine.FlipoutMessenger`: site values are
    intercepted as :class:`~pyro_vinit.poutine._site_value.SiteValue`, and a
    weight the handler cannot treat is used as its ordinary sample. When the
    handler exits, one warning (or with ``strict``, one error) names the
    latent sites of the run that kept their ordinary sample: those it could
    not treat, with the reason, and the weight-like ones (real-valued, two
    dims or more) that never reached a layer call it sees. Without
    ``strict`` each site is named once per handler instance.
    """

    #: Whether the handler gives a sampled bias per-example noise too (then a
    #: bias used by two layer calls is a shared sample like a weight).
    bias_noise = False

    def __init__(self, strict: bool = False) -> None:
        if not isinstance(strict, bool):
            raise TypeError(f"{type(self).__name__}: strict must be a bool, got {strict!r}")
        super().__init__()
        self.strict = strict
        self._warned: Set[str] = set()

    def _start_run(self) -> None:
        super()._start_run()
        self._untreated: Dict[str, str] = {}
        self._reached: Set[str] = set()

    @eager
    def _pyro_sample(self, msg: SampleSite) -> None:
        if any(is_vectorized_particles(frame) for frame in msg["cond_indep_stack"]):
            # Every weight would get a particle dim, which F.linear / F.conv*d do not take
            # and the handlers do not treat: refuse before the model runs.
            raise ValueError(
                f"{type(self).__name__} does not support vectorized particles "
                "(an ELBO with vectorize_particles=True): they give every latent site, such "
                f"as {msg['name']!r}, a particle dim, which nn.Linear / nn.Conv*d (F.linear, "
                "F.conv*d) do not accept and the handler does not treat. Use "
                "vectorize_particles=False: num_particles then still averages that many "
                "particles, one after another."
            )
        super()._pyro_sample(msg)

    @eager
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc_value: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        report = self._report() if exc_type is None else None
        super().__exit__(exc_type, exc_value, traceback)
        if report is not None:
            if self.strict:
                raise ValueError(report)
            warnings.warn(report, stacklevel=2)

    def _report(self) -> Optional[str]:
        untreated = dict(self._untreated)
        for name, msg in self._latent.items():
            if name not in untreated and name not in self._reached and _is_weight_like(msg):
                untreated[name] = _NEVER_REACHED
        if not self.strict:
            untreated = {k: v for k, v in untreated.items() if k not in self._warned}
            self._warned.update(untreated)
        if not untreated:
            return None
        sites = ";\n".join(f"  {name!r}: {reason}" for name, reason in untreated.items())
        if self.strict:
            end = "(strict=True: pass strict=False to only warn about them.)"
        else:
            end = "Each site is named once per handler. Pass strict=True to make this an error."
        return (
            f"{type(self).__name__}: {len(untreated)} latent site(s) kept their ordinary "
            f"sample, shared by the whole minibatch:\n{sites}.\n{end}"
        )

    def _weight_distribution(
        self, call: LayerCall
    ) -> Optional[Tuple[SiteValue, Distribution]]:
        """The call's weight and the distribution that drew it (whose
        :func:`view_of` gives the weight's parameters), or None if the call is
        to run unchanged (a plain weight, or a fallback recorded for the report)."""
        weight = call.weight
        for value in (weight, call.bias):
            if isinstance(value, SiteValue):
                self._reached.update(msg["name"] for msg in value.msgs)
        if not isinstance(weight, SiteValue) or not weight.msgs:
            return None
        noisy = [weight]
        if self.bias_noise and isinstance(call.bias, SiteValue) and call.bias.msgs:
            noisy.append(call.bias)
        # Every value counts its use, also when another one is reported. A value that is not
        # a view claims the whole draw: which elements it depends on may itself depend on
        # the draw (e.g. an index computed from it).
        reused = [v for v in noisy if v.uses.add(v.view_ops if v.is_view else None)]
        if reused:
            # Per-example noise drawn independently at each use would lose the correlation
            # between the uses of one sample (tied weights, a layer called twice).
            self._fallback(
                reused[0],
                "this sample was already used by an earlier layer call or matrix product "
                "in this run (a shared or tied weight); the uses are then not jointly "
                "exact. Give each layer its own sample site, or run such models without "
                "the handler",
            )
            return None
        if not weight.is_view:
            self._fallback(
                weight,
                f"its value is transformed (by {weight.derived}) before the layer call "
                "into one whose elements are not distinct drawn elements; pass the sample "
                "to the layer as drawn, or transposed, reshaped or sliced",
            )
            return None
        if weight.site_dist is None:
            self._fallback(
                weight,
                "its value was set by an effect handler outside this one (e.g. a guide trace "
                "replayed from outside it), so the distribution that drew it is unknown; "
                "apply the handler to the whole step (e.g. to svi.step), not to the model",
            )
            return None
        return weight, weight.site_dist

    def _on_custom_op(self, value: SiteValue, op_name: str) -> None:
        # A later layer call on the same sample must use it as drawn, too.
        value.uses.add(None)
        self._fallback(
            value,
            f"it is used by {op_name}, which the handler does not treat (it treats F.linear, "
            "F.conv1d/2d/3d and matrix products with one weight operand: matmul, @, mm, "
            "bmm, mv, addmm, einsum with one contracted index)",
        )

    def _fallback(self, value: SiteValue, reason: str) -> None:
        site = value.site
        assert site is not None  # every caller passes a value with messages
        self._untreated.setdefault(site, reason)
