"""
Finding the layer calls whose weights are sample sites, and applying a
weight-noise strategy (:mod:`pyro_vinit.poutine.noise`) chosen per site.
"""

import math
import sys
from types import TracebackType
from typing import Callable, Dict, Optional, Set, Tuple, Type, Union

import torch
from pyro.distributions import Unit, constraints

from pyro_vinit._pyro_compat import (
    is_deterministic_site,
    prefill_log_prob,
    scale_and_mask,
    whole_trace_weights_elbo,
)
from pyro_vinit._typing import SampleSite
from pyro_vinit._warn import warn_at_caller
from pyro_vinit.poutine._layer_ops import MATMUL_OPS, op_name
from pyro_vinit.poutine._site_value import SiteValue, eager
from pyro_vinit.poutine.layer_call_messenger import (
    LayerCall,
    LayerCallMessenger,
    base_distribution,
)
from pyro_vinit.poutine.noise import AutoWeightNoise, WeightNoise
from pyro_vinit.poutine.noise.flipout import noise_rows
from pyro_vinit.poutine.noise.strategy import point_mass_reason

__all__ = ["WeightNoiseMessenger"]

#: What chooses the strategy of a site: one strategy for every site, a dict from site
#: names, or a callable from a sample-site message (None: leave the site alone).
Config = Union[
    WeightNoise,
    Dict[str, Optional[WeightNoise]],
    Callable[[SampleSite], Optional[WeightNoise]],
]

_NEVER_REACHED = (
    "it never reached a layer call the handler sees (F.linear, F.conv1d/2d/3d or a "
    "matrix product with one weight, e.g. nn.Linear, x @ w), or only as the operand of "
    "another operation first (tau * w: sample w from Normal(0, tau) instead); e.g. "
    "nn.MultiheadAttention uses its projection weights inside F.multi_head_attention_forward"
)


_CONV_TRANSPOSE = frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})


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


#: The names of the matrix products that are read as layers where they can be.
_PRODUCTS = frozenset(op_name(func) for func in MATMUL_OPS)
#: The functions that compute a distribution's log density (torch's and Pyro's).
_LOG_DENSITIES = frozenset({"log_prob", "compute_log_prob", "log_abs_det_jacobian"})


def _in_log_density() -> bool:
    """Whether the caller runs inside a log density (asked only of an operation on a
    draw that got per-example noise: the rare case, so the stack walk costs nothing
    per step)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _LOG_DENSITIES:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class WeightNoiseMessenger(LayerCallMessenger):
    """
    Effect handler that gives each example of a minibatch its own weight
    noise, in the shape of :class:`~pyro.poutine.reparam_messenger.ReparamMessenger`:
    every layer call whose weight is a sample site (``F.linear``,
    ``F.conv1d/2d/3d``, so ``nn.Linear`` and ``nn.Conv*d`` too, or a matrix
    product with one weight operand) goes to the site's strategy from
    ``config`` (:class:`~pyro_vinit.poutine.LocalReparam`,
    :class:`~pyro_vinit.poutine.Flipout`, or by default
    :class:`~pyro_vinit.poutine.AutoWeightNoise`: local reparameterization
    for factorized Normals, Flipout for other sign-symmetric families).

    Usage::

        config = {"net.0.weight": LocalReparam(), "net.2.weight": Flipout()}
        with WeightNoiseMessenger(config=config):
            svi.step(x, y)

    A weight a strategy cannot treat is used as its ordinary sample. A draw
    that got per-example noise and is used again in the same run (a shared
    weight) is refused at that use with a ``ValueError`` naming the site:
    a config that leaves the site alone (None) keeps its ordinary sample at
    every use, which is exact. When
    the handler exits, one warning (or with ``strict``, one error) names the
    latent sites of the run that kept their ordinary sample: those it could
    not treat, with the reason, and the weight-like ones (real-valued, two
    dims or more) that never reached a layer call it sees; sites the config
    leaves alone are not named. Without ``strict`` each site is named once
    per handler instance. So is a weight that got per-example noise for rows
    of its layer's input that are not the examples the observed sites' data
    plates count (e.g. tokens flattened into rows): then inexact. A name of a
    dict ``config`` that no sample site of
    the run has (e.g. misspelt), or only a layer's bias (a layer takes its
    weight's strategy), is reported the same way. Requirements and
    fallbacks are those of
    :class:`~pyro_vinit.poutine.LocalReparamMessenger`.

    :param config: A strategy for every site, a dict from site names to
        strategies (sites not in it are left alone), or a callable from a
        sample-site message to a strategy or None, as
        :func:`pyro.poutine.reparam` takes: the site's message is the
        model's at a layer call and the guide's when the guide draws it.
        None: :class:`~pyro_vinit.poutine.AutoWeightNoise`.
    :param bool strict: Raise one error instead of one warning, on exit,
        naming the latent sites no strategy applied to.
    """

    def __init__(self, config: Optional[Config] = None, *, strict: bool = False) -> None:
        if not isinstance(strict, bool):
            raise TypeError(f"{type(self).__name__}: strict must be a bool, got {strict!r}")
        if config is None:
            config = AutoWeightNoise()
        if isinstance(config, dict):
            for name, strategy in config.items():
                if strategy is not None and not isinstance(strategy, WeightNoise):
                    raise TypeError(
                        f"{type(self).__name__}: config[{name!r}] must be a WeightNoise "
                        f"strategy (e.g. LocalReparam(), Flipout()) or None, got {strategy!r}"
                    )
        elif not (isinstance(config, WeightNoise) or callable(config)):
            raise TypeError(
                f"{type(self).__name__}: config must be a WeightNoise strategy, a dict from "
                f"site names to strategies, or a callable from a site's message to a "
                f"strategy, got {config!r}"
            )
        super().__init__()
        self.config = config
        self.strict = strict
        self._warned: Set[str] = set()
        self._warned_unknown: Set[str] = set()
        self._warned_rows: Set[str] = set()

    def _strategy(self, msg: SampleSite) -> Optional[WeightNoise]:
        """The strategy ``config`` gives the site of ``msg``, or None."""
        config = self.config
        if isinstance(config, WeightNoise):
            return config
        if isinstance(config, dict):
            return config.get(msg["name"])
        strategy = config(msg)
        if strategy is not None and not isinstance(strategy, WeightNoise):
            raise TypeError(
                f"{type(self).__name__}: config returned {strategy!r} for site "
                f"{msg['name']!r}; it must return a WeightNoise strategy or None"
            )
        return strategy

    def _start_run(self) -> None:
        super()._start_run()
        self._untreated: Dict[str, str] = {}
        self._reached: Set[str] = set()
        self._sampled: Set[str] = set()
        self._weights: Set[str] = set()  # the sites of the layer calls' weights
        self._bias_of: Dict[str, Set[str]] = {}  # (a bias's site: its layer calls' weights')
        # (a noised weight's site: its layer calls' rows noised and the sizes of the dims
        # that share a row's noise, noise_rows)
        self._rows: Dict[str, Set[Tuple[int, Tuple[int, ...]]]] = {}
        # (the observations' vectorized plates, as (name, size) pairs, by site)
        self._observed: Dict[str, Set[Tuple[Tuple[str, int], ...]]] = {}
        self._objective: Optional[Tuple[Optional[str]]] = None  # (whole_trace_weights_elbo)

    @eager
    def _pyro_post_sample(self, msg: SampleSite) -> None:
        self._sampled.add(msg["name"])
        super()._pyro_post_sample(msg)
        if (msg["is_observed"] and not is_deterministic_site(msg)
                and not isinstance(base_distribution(msg["fn"]), Unit)):  # (pyro.factor)
            self._observed.setdefault(msg["name"], set()).add(tuple(
                (f.name, f.size) for f in msg["cond_indep_stack"] if f.vectorized))

    def _unknown_names(self) -> Optional[str]:
        # The names of a dict config that no sample site of the run has (e.g. misspelt), or
        # only a layer's bias, whose layer takes its weight's strategy: their entries would
        # silently do nothing.
        if not isinstance(self.config, dict) or not self._sampled:
            return None
        named = [name for name, strategy in self.config.items() if strategy is not None]
        unknown = [name for name in named if name not in self._sampled]
        config = self.config
        # (a bias whose every layer call has a weight with a strategy is only redundant)
        biases = [name for name in named if name in self._bias_of and name not in self._weights
                  and any(config.get(w) is None for w in self._bias_of[name])]
        if not self.strict:
            unknown, biases = ([name for name in names if name not in self._warned_unknown]
                               for names in (unknown, biases))
            self._warned_unknown.update(unknown + biases)
        reports = []
        if unknown:
            reports.append(
                f"{type(self).__name__}: config names {unknown}, but no sample site of this "
                f"run has that name (its latent sites: {sorted(self._latent)}); the sites "
                "meant keep their ordinary sample. Use the model's site names.")
        if biases:
            weights = sorted(w for name in biases for w in self._bias_of[name]
                             if config.get(w) is None)
            reports.append(
                f"{type(self).__name__}: config names {biases}, the biases of layer calls, "
                f"whose strategy is their weights' ({weights}): the bias follows it (with "
                "its bias_noise). Name the weights' sites instead.")
        return "\n".join(reports) if reports else None

    @eager
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc_value: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        reports = ([self._report(), self._rows_report(), self._unknown_names()]
                   if exc_type is None else [])
        super().__exit__(exc_type, exc_value, traceback)
        report = "\n".join(r for r in reports if r is not None)
        if report:
            if self.strict:
                raise ValueError(report)
            warn_at_caller(report, UserWarning)

    def _report(self) -> Optional[str]:
        untreated = dict(self._untreated)
        for name, msg in self._latent.items():
            if name not in untreated and name not in self._reached and _is_weight_like(msg):
                untreated[name] = _NEVER_REACHED
        # the sites the config leaves alone are not named
        latent = self._latent
        untreated = {
            k: v for k, v in untreated.items()
            if k not in latent or self._strategy(latent[k]) is not None
        }
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

    def _rows_report(self) -> Optional[str]:
        # Per-example noise is exact where each observation depends on the noised rows of
        # one example. The observed sites' data plates (less those the weight is drawn in:
        # a sample or particle plate) count the examples: more rows than that, or rows of
        # another count whose later dims have that count (e.g. (tokens, batch, features)),
        # mean an observation depends on rows that drew independent noise.
        inexact = {}
        # (a site the guide drew, conditioned on in the model, e.g. by Predictive, is none)
        observed = [plates for name, seen in self._observed.items()
                    if name not in self._draws and name not in self._latent for plates in seen]
        for site, calls in self._rows.items():
            # (a noised weight's site has its distribution: it is in _latent)
            own = {frame.name for frame in self._latent[site]["cond_indep_stack"]}
            examples = {math.prod(size for name, size in plates if name not in own)
                        for plates in observed if any(name not in own for name, _ in plates)}
            for rows, later in calls:
                if examples and (rows > max(examples) or (
                        rows not in examples and any(size in examples for size in later))):
                    inexact[site] = (rows, later, sorted(examples))
                    break
        if not self.strict:
            inexact = {k: v for k, v in inexact.items() if k not in self._warned_rows}
            self._warned_rows.update(inexact)
        if not inexact:
            return None
        sites = ";\n".join(
            f"  {name!r}: noise for {rows} rows" + (f" (their input's dims {(rows,) + later} "
                                                    "left of its features)" if later else "")
            + f", the data plates observe {' or '.join(map(str, examples))} examples"
            for name, (rows, later, examples) in inexact.items())
        return (
            f"{type(self).__name__}: {len(inexact)} latent site(s) got per-example noise "
            "for rows of their layer's input that are not the examples the model "
            f"observes:\n{sites}.\nAn observation that depends on several rows (e.g. "
            "tokens flattened into rows, x.reshape(-1, features), or a (tokens, batch, "
            "features) input) sees their independent noise, so the objective is not "
            "exact. Keep each example's rows on one leading dim, e.g. (batch, tokens, "
            "features), whose later dims share the example's noise; or leave these sites "
            "out of the handler's config: their ordinary sample is exact."
        )

    def _draw(self, msg: SampleSite) -> Optional[SiteValue]:
        strategy = None if msg["infer"].get("is_auxiliary") else self._strategy(msg)
        value = strategy.draw(msg) if strategy is not None else None
        return super()._draw(msg) if value is None else value

    def _post_site_value(self, msg: SampleSite, value: SiteValue) -> None:
        # Defer the site's log density with its value, in the form Trace.compute_log_prob
        # and compute_score_parts would store it (both skip sites that have it).
        if not value.is_deferred or msg["is_observed"]:
            return
        fn, scale, mask = msg["fn"], msg["scale"], msg["mask"]
        shape = fn.batch_shape
        if value.shape != fn.batch_shape + fn.event_shape:
            # torch.broadcast_shapes is unannotated.
            shape = torch.broadcast_shapes(  # type: ignore[no-untyped-call]
                shape, value.shape[: value.dim() - fn.event_dim]
            )
        # On the plain tensor: a log density is never a layer call, and each of its ops on
        # the stand-in would pay a __torch_function__ round trip through the handler.
        unscaled = scaled = SiteValue.defer(
            lambda: fn.log_prob(value.concrete), shape, like=value
        )
        if not (isinstance(scale, (int, float)) and scale == 1.0 and mask is None):
            scaled_shape = torch.broadcast_shapes(  # type: ignore[no-untyped-call]
                shape, *(t.shape for t in (scale, mask) if isinstance(t, torch.Tensor))
            )
            scaled = SiteValue.defer(
                lambda: scale_and_mask(unscaled, scale, mask), scaled_shape, like=value
            )
        total = SiteValue.defer(lambda: scaled.sum(), torch.Size(), like=value)
        prefill_log_prob(msg, unscaled, scaled, total)

    def _process_layer_call(self, call: LayerCall) -> Optional[torch.Tensor]:
        weight, bias = call.weight, call.bias
        for value in (weight, bias):
            if isinstance(value, SiteValue):
                self._reached.update(msg["name"] for msg in value.msgs)
        if isinstance(weight, SiteValue) and isinstance(self.config, dict):
            # (for the report of a dict config's names: _unknown_names)
            self._weights.update(msg["name"] for msg in weight.msgs)
            if isinstance(bias, SiteValue) and weight.msgs:
                for msg in bias.msgs:
                    self._bias_of.setdefault(msg["name"], set()).add(weight.msgs[0]["name"])
        if not isinstance(weight, SiteValue) or not weight.msgs:
            return None
        fn = weight.site_dist
        strategy = self._site_strategy(weight)
        noisy = [weight]
        if (strategy is not None and strategy.noises_bias(call) and isinstance(bias, SiteValue)
                and bias.msgs):
            noisy.append(bias)
        # Every value counts its use, also when another one is reported. A value that is not
        # a view claims the whole draw: which elements it depends on may itself depend on
        # the draw (e.g. an index computed from it).
        reused = [v for v in noisy if v.uses.add(v.view_ops if v.is_view else None)]
        if strategy is None:
            return None  # the config leaves the site alone
        noised = [v for v in reused if v.uses.noised]
        if noised:  # a second use of a draw that got per-example noise, skipped or not
            self._refuse_reuse(noised[0], call.source)
        if strategy.skips(call):
            return None  # the strategy leaves the call alone
        if reused:
            # Every use so far was the ordinary draw: so are this one and the later ones,
            # and the call runs on the ordinary samples of its other sites too.
            for value in noisy:
                if any(value is v for v in reused):
                    self._fallback(
                        value,
                        "this sample was already used as drawn in this run, by an earlier "
                        "layer call or matrix product (a shared or tied weight) or by the "
                        "model's own arithmetic (e.g. w.norm(), w[index]); every use keeps "
                        "the ordinary sample, which is exact. Give each layer its own "
                        "sample site for per-example noise",
                    )
                else:
                    self._fallback(
                        value,
                        f"its layer call also uses the sample of site {reused[0].site!r}, "
                        "which this run already used as drawn, so the call runs on the "
                        "ordinary samples, which is exact. "
                        "Give each layer its own sample sites for per-example noise",
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
        if fn is None and weight.msgs[-1]["is_observed"]:
            return None  # given samples (Predictive's posterior_samples): no law to draw from
        if fn is None:
            self._fallback(
                weight,
                "its value was set by an effect handler outside this one (e.g. a guide trace "
                "replayed from outside it), so the distribution that drew it is unknown; "
                "apply the handler to the whole step (e.g. to svi.step), not to the model",
            )
            return None
        if self._objective is None:  # (once a run: a walk up the stack)
            self._objective = (whole_trace_weights_elbo(),)
        objective = self._objective[0]
        if objective is not None:
            self._fallback(
                weight,
                f"the step's {objective} weighs whole-model samples of the weights against "
                "each other, which per-example noise does not draw (its bound would not be "
                "the one asked for); the ordinary sample keeps it exact. Train with "
                "Trace_ELBO or TraceMeanField_ELBO under the handler",
            )
            return None
        out = strategy.apply(call, weight, fn)
        if isinstance(out, str):
            self._fallback(weight, out)
            return None
        for value in noisy:
            value.uses.noised = True
        site = weight.site
        assert site is not None  # (a value with messages)
        self._rows.setdefault(site, set()).add(noise_rows(call))
        return out

    def _refuse_reuse(self, value: SiteValue, op_name: str) -> None:
        # A second use of a draw that got per-example noise: the uses would not be jointly
        # exact (each example's two uses must see one weight). Nothing persistent has
        # changed yet: the step stops before its loss exists.
        raise ValueError(
            f"{type(self).__name__}: the sample of site {value.site!r} is used a second "
            f"time (by {op_name}) in one run, after an earlier layer call gave it "
            "per-example noise (a shared or tied weight, e.g. a siamese net, or the model's "
            "own arithmetic on it after its layer, e.g. w.norm()): per-example "
            "noise drawn at each use is not jointly exact, and the ordinary sample at this "
            "use alone would bias the objective. Leave the site out of the handler "
            f"(e.g. weight_noise(config=lambda msg: None if msg['name'] == {value.site!r} "
            "else AutoWeightNoise())): every use then keeps the ordinary sample, which is "
            "exact; or give each use its own sample site"
        )

    def _on_plain_op(self, value: SiteValue, op_name: str) -> None:
        # The draw as drawn enters the program's own arithmetic: a layer call that gave it
        # per-example noise before would not be jointly exact with it, and one after must
        # use the same draw (the ordinary sample, exact; reported there). A log density
        # (the ELBO's term of its own, e.g. Pyro's compute_log_prob of a Delta) is no
        # such use.
        if value.uses.noised:
            if not _in_log_density():
                self._refuse_reuse(value, op_name)
            return
        value.uses.add(value.view_ops if value.is_view else None)

    def _on_custom_op(self, value: SiteValue, op_name: str) -> None:
        if value.uses.noised:
            self._refuse_reuse(value, op_name)
        # A later layer call on the same sample must use it as drawn, too.
        value.uses.add(None)
        if op_name in _CONV_TRANSPOSE:
            strategy = self._site_strategy(value)
            if strategy is not None and not strategy.conv:
                # a convolution, which the strategy leaves alone by design, like conv2d
                self._reached.update(msg["name"] for msg in value.msgs)
                return
            hint = " (conv=False leaves convolutions, transposed ones too, unreported)"
        else:
            hint = ""
        point_mass = (point_mass_reason(value.site_dist) if value.site_dist is not None
                      else None)
        if point_mass is not None:  # (no noise to give, whatever the use)
            reason = point_mass
        elif op_name == "matmul" and value.dim() == 1:  # e.g. the tutorials' x @ w
            reason = (
                "it is used by matmul as a vector, which the handler does not read as a "
                "layer: a matrix weight, e.g. of shape (in, 1) in x @ w, its output "
                "squeezed (.squeeze(-1)), gives the same values as a layer it treats")
        elif op_name in _PRODUCTS:  # a product it treats, in a form it does not read
            reason = (
                f"it is used by {op_name} in a form the handler does not read as a layer (it "
                "reads a product of an input and a 2-d weight over one contracted index: not "
                "a weight of one dimension, one with a batch dim such as vectorized "
                "particles' leading one, or a product of three)")
        else:
            reason = (
                f"it is used by {op_name}, which the handler does not treat (it treats "
                "F.linear, F.conv1d/2d/3d and matrix products of an input and a 2-d weight: "
                f"matmul, @, mm, addmm, einsum with one contracted index){hint}")
        self._fallback(value, reason)

    def _site_strategy(self, value: SiteValue) -> Optional[WeightNoise]:
        """The strategy of the site that drew ``value``, chosen for its distribution
        (None: the config leaves it alone)."""
        strategy = self._strategy(value.msgs[-1])
        if strategy is not None and value.site_dist is not None:
            strategy = strategy.select(value.site_dist)
        return strategy

    def _fallback(self, value: SiteValue, reason: str) -> None:
        # Records why the site of value kept its ordinary sample, for the report on exit.
        site = value.site
        assert site is not None  # every caller passes a value with messages
        self._untreated.setdefault(site, reason)
