"""
Reading a model for the data-driven initializers: its Bayesian layers, its
likelihood and where each layer's output goes (the first pass of
:func:`prepare`, a run of :func:`~pyro_vinit.initialization._runs.run_model`).
"""

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Set, Tuple, cast

import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoGuide
from pyro.poutine.block_messenger import BlockMessenger
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch.distributions import (
    Bernoulli,
    Categorical,
    Distribution,
    Normal,
    OneHotCategorical,
    StudentT,
)

from pyro_vinit._pyro_compat import (
    handler_chain,
    is_deterministic_site,
    likelihood_sites,
    model_swapped,
    replace_handler,
    wrap_inner,
)
from pyro_vinit._typing import SampleSite, sample_site
from pyro_vinit.distributions import factorized_normal
from pyro_vinit.guides import site_params
from pyro_vinit.initialization._data import Data, DataPool
from pyro_vinit.initialization._observed import (
    check_has_likelihood,
    check_not_conditioned,
    per_example_sites,
)
from pyro_vinit.initialization._runs import (
    _unwrap,
    conditioned_in_rows,
    draws_the_rows,
    in_rows,
    observed_site,
    one_dim_sites,
    prior_median,
    run_model,
    trace_on,
)
from pyro_vinit.poutine.layer_recorder import (
    LayerRecorderMessenger,
    PlateRowsMessenger,
    RecordedLayer,
)

SUPPORTED_LIKELIHOODS = (
    "Normal or StudentT (regression), Categorical or OneHotCategorical (probs or logits), "
    "Bernoulli (probs or logits)"
)
# Rows of the first pass, which reads the model's structure.
_STRUCTURE_ROWS = 256


class NoLayersError(ValueError):
    """The model has no layer whose weight is one of the guide's latent sites."""


@dataclass
class Layer:
    """One Bayesian layer of the model: an ``F.linear`` / ``F.conv*d`` call (or
    a matrix product read as ``F.linear``) whose weight is a latent site.

    Shapes and priors are in the op's layout (``(out, in)`` for linear,
    ``(out, in / groups, *kernel)`` for conv); ``weight_index`` maps that
    layout onto the site's when they differ (see :meth:`to_site`)."""

    op: str
    weight_name: str
    weight_shape: torch.Size
    kwargs: Dict[str, Any] = field(default_factory=dict)
    source: str = ""
    weight_index: Optional[torch.Tensor] = None
    prior_loc: Optional[torch.Tensor] = None
    prior_scale: Optional[torch.Tensor] = None
    bias_name: Optional[str] = None
    bias_index: Optional[torch.Tensor] = None
    bias_prior_loc: Optional[torch.Tensor] = None
    bias_prior_scale: Optional[torch.Tensor] = None
    fixed_bias: Optional[torch.Tensor] = None
    #: "hidden", "output" (its output is the likelihood's mean or logits) or
    #: "scale" (its output sets the likelihood's scale)
    role: str = "hidden"

    @property
    def num_units(self) -> int:
        return self.weight_shape[0]

    @property
    def fan_in(self) -> int:
        """Inputs per unit: ``in_features``, or ``in_channels / groups × kernel size``."""
        return self.weight_shape[1:].numel()

    @property
    def fan_out(self) -> int:
        """``out_features``, or ``out_channels × kernel size`` (PyTorch's convention)."""
        return self.weight_shape[0] * self.weight_shape[2:].numel()

    @property
    def site_names(self) -> Tuple[str, ...]:
        return (self.weight_name,) + ((self.bias_name,) if self.bias_name else ())

    def to_site(self, name: str, tensor: torch.Tensor, site_shape: torch.Size) -> torch.Tensor:
        """``tensor`` in the op's layout of site ``name``, in the site's layout."""
        index = self.weight_index if name == self.weight_name else self.bias_index
        if index is None:
            return tensor.reshape(site_shape)
        out = tensor.new_empty(site_shape.numel())
        out[index.reshape(-1)] = tensor.reshape(-1)
        return out.reshape(site_shape)


@dataclass
class Likelihood:
    """The model's observed site and what sets its noise (regression only)."""

    name: str
    family: str  # "normal", "categorical", "onehot" or "bernoulli"
    #: where the likelihood's scale comes from: None (classification), "fixed",
    #: "site" (a latent site), "param" (a pyro.param), "layer" (a scale head) or
    #: "held" (a latent site the guide does not own, held by the model: estimated,
    #: and written by the guide list into the member that owns it)
    noise: Optional[str] = None
    noise_name: Optional[str] = None
    #: the support of a "held" noise site
    noise_support: Optional[Any] = None


@dataclass
class ModelStructure:
    """What the first pass over the model finds."""

    layers: List[Layer]
    likelihood: Optional[Likelihood]
    latent: List[str]
    #: latent sites no layer (or noise estimate) will initialize
    uncovered: List[str]
    #: of those, the ones outside the likelihood's plates with a Normal prior: its
    #: scale at the guide's medians (see _fits.cap_uncovered)
    uncovered_priors: Dict[str, torch.Tensor]
    #: the subsample size of the model's subsampled data plate, if it has one
    block_size: Optional[int] = None
    #: whether the model calls F.batch_norm
    batch_norm: bool = False
    #: latent sites the guide does not own (hidden from it by ``poutine.block``), held
    #: fixed for the whole call: name -> (value, where the value comes from)
    held: Dict[str, Tuple[torch.Tensor, str]] = field(default_factory=dict)

    @property
    def output_layers(self) -> List[Layer]:
        return [layer for layer in self.layers if layer.role == "output"]


def unwrap_likelihood(site: SampleSite) -> Distribution:
    return _unwrap(site["fn"])


def likelihood_family(site: SampleSite) -> str:
    fn = unwrap_likelihood(site)
    if isinstance(fn, (Normal, StudentT)):
        return "normal"
    if isinstance(fn, OneHotCategorical):
        return "onehot"
    if isinstance(fn, Categorical):
        return "categorical"
    if isinstance(fn, Bernoulli):
        return "bernoulli"
    raise ValueError(
        f"I-BLM supports {SUPPORTED_LIKELIHOODS} likelihoods; the observed site "
        f"{site['name']!r} is {type(site['fn']).__name__}"
        + (f" over {type(fn).__name__}" if fn is not site["fn"] else "")
        + "; use one of these, or a data-free initializer (init_guide(guide, (x, y), "
        "method='xavier'), which fit then keeps)"
    )


def normal_prior(msg: SampleSite, shape: torch.Size) -> Tuple[torch.Tensor, torch.Tensor]:
    """The loc and scale, broadcast to ``shape`` (views), of the Normal prior at a site."""
    fn = _unwrap(msg["fn"])
    if not isinstance(fn, Normal):
        raise ValueError(
            f"I-BLM needs a Normal prior (possibly expanded and .to_event) at the layer "
            f"site {msg['name']!r}, but its prior is {type(msg['fn']).__name__}"
            + (f" over {type(fn).__name__}" if fn is not msg["fn"] else "")
            + "; use a Normal prior there, or start the guide another way: init_guide("
            "guide, (x, y), method='map') (which fit then keeps), or fit(..., init=None)"
        )
    return fn.loc.expand(shape), fn.scale.expand(shape)


def _to_layout(tensor: torch.Tensor, index: Optional[torch.Tensor],
               shape: torch.Size) -> torch.Tensor:
    """A site-layout tensor (possibly an expanded view) in the op's layout."""
    if index is None:
        return tensor.reshape(shape)  # a view (no copy) when the layouts agree
    if tensor.stride() and all(s == 0 for s in tensor.stride()):  # one value, expanded
        return tensor.reshape(-1)[:1].expand(shape.numel()).reshape(shape)
    return tensor.reshape(-1)[index.reshape(-1)].reshape(shape)


def _layer_from_record(record: RecordedLayer, sites: Dict[str, SampleSite], priors: bool) -> Layer:
    call = record.call
    layer = Layer(call.op, record.weight_name, call.weight.shape, dict(call.kwargs),
                  call.source, record.weight_index)
    if priors:
        msg = sites[record.weight_name]
        loc, scale = normal_prior(msg, msg["value"].shape)
        layer.prior_loc = _to_layout(loc, record.weight_index, layer.weight_shape)
        layer.prior_scale = _to_layout(scale, record.weight_index, layer.weight_shape)
    if record.bias_name is not None:
        layer.bias_name, layer.bias_index = record.bias_name, record.bias_index
        if priors:
            msg = sites[record.bias_name]
            loc, scale = normal_prior(msg, msg["value"].shape)
            shape = torch.Size([layer.num_units])
            layer.bias_prior_loc = _to_layout(loc, record.bias_index, shape)
            layer.bias_prior_scale = _to_layout(scale, record.bias_index, shape)
    elif record.fixed_bias is not None:
        layer.fixed_bias = _fixed_bias(record.fixed_bias, layer)
    return layer


def _fixed_bias(bias: torch.Tensor, layer: Layer) -> torch.Tensor:
    """A constant (not latent) bias as one value per unit, ``(num_units,)``: torch
    broadcasts a scalar, ``(1,)`` or ``(1, num_units)`` bias over the rows."""
    units = layer.num_units
    if bias.numel() == 1:
        return bias.reshape(1).expand(units)
    if bias.numel() == units and bias.shape[-1] == units:
        return bias.reshape(units)
    raise ValueError(
        f"the layer of {layer.weight_name!r} adds a constant bias of shape "
        f"{tuple(bias.shape)}; I-BLM subtracts one value per unit from the targets, so "
        f"it needs a scalar bias or one of shape ({units},): give it that shape, or make "
        "it a latent site"
    )


# ---------------------------------------------------------------------- running the model


def guide_values(guide: AutoGuide, args: Sequence[Any],
                 latent: Sequence[str]) -> Dict[str, torch.Tensor]:
    """A draw of every latent site from the guide (in the model's constrained space)."""
    with poutine.block():
        trace = poutine.trace(guide).get_trace(*args)
    return {name: sample_site(trace.nodes[name])["value"] for name in latent}


def guide_medians(guide: AutoGuide, args: Sequence[Any]) -> Dict[str, torch.Tensor]:
    """The guide's median of every latent site (in the model's constrained space)."""
    with poutine.block():
        return dict(guide.median(*args))


def trace_observed_site(trace: poutine.Trace, latent: Sequence[str],
                        model: Callable[..., Any]) -> SampleSite:
    """The single observed sample site of a trace of ``model``."""
    sites: List[SampleSite] = likelihood_sites([
        sample_site(site)
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and site["is_observed"]
        and name not in latent
        and not site_is_subsample(site)
        and not is_deterministic_site(site)
    ], model)
    if len(sites) != 1:
        raise ValueError(
            f"this initializer needs a model with exactly one observed sample site (its "
            f"likelihood); found {[s['name'] for s in sites]}"
        )
    return sites[0]


# ---------------------------------------------------------------------- what the guide owns


class _HoldMessenger(Messenger):
    """Inside a ``poutine.block``: sets every unobserved sample site it hides
    to a value fixed at the first encounter (``given``, else the prior's median)."""

    def __init__(self, hide_fn: Callable[[Any], Any], given: Dict[str, torch.Tensor],
                 held: Dict[str, Tuple[torch.Tensor, str]]) -> None:
        super().__init__()
        self.hide_fn, self.given, self.held = hide_fn, given, held

    def _pyro_sample(self, msg: Any) -> None:
        if msg["is_observed"] or site_is_subsample(msg) or not self.hide_fn(msg):
            return
        name = msg["name"]
        if name not in self.held:
            if name in self.given:
                self.held[name] = (self.given[name].detach(), "the guide list's median")
            else:
                self.held[name] = (prior_median(msg["fn"]).detach(), "its prior's median")
        # the value only: a site marked observed would pass a block that hides by type
        # (e.g. expose_types=["observe"]) as an observation of the model
        msg["value"] = self.held[name][0]


def hold_hidden_sites(
    model: Callable[..., Any], given: Optional[Dict[str, torch.Tensor]] = None,
) -> Tuple[Callable[..., Any], Dict[str, Tuple[torch.Tensor, str]]]:
    """``model`` with every latent site that a ``poutine.block`` around it hides
    (a site the guide does not own) held at its value in ``given`` (a guide
    list's medians) or else its prior's median; and the values held so far,
    filled as the model runs. A hidden site is out of the reach of any handler
    outside, so each model run would otherwise draw it anew from its prior."""
    held: Dict[str, Tuple[torch.Tensor, str]] = {}
    for messenger, _ in handler_chain(model):
        if isinstance(messenger, BlockMessenger):
            hold = _HoldMessenger(messenger.hide_fn, given or {}, held)
            model = wrap_inner(model, messenger, hold)
            # only the held sites stay hidden: a member of a guide list built with
            # poutine.block(model, expose=[its sites]) hides the likelihood and params too
            model = replace_handler(model, messenger,
                                    BlockMessenger(hide_fn=_latent_only(messenger.hide_fn)))
    return model, held


def _latent_only(hide_fn: Callable[[Any], Any]) -> Callable[[Any], bool]:
    """``hide_fn`` on the latent sample sites only."""
    return lambda msg: (msg["type"] == "sample" and not msg["is_observed"]
                        and not site_is_subsample(msg) and bool(hide_fn(msg)))


# ---------------------------------------------------------------------- the first pass


@dataclass
class Prepared:
    """What every data-driven initializer starts from."""

    pool: DataPool
    guide: Any  # a guide that pyro_vinit.guides.site_params supports, set up
    sites: Dict[str, SampleSite]  # the guide's latent sites (prototype-trace nodes), in model order
    structure: ModelStructure
    first: Tuple[Any, ...]  # the first pass's model arguments
    #: the model I-BLM runs: the guide's, with the latent sites it hides from the
    #: guide held fixed (see :func:`hold_hidden_sites`)
    model: Callable[..., Any] = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = self.guide.model

    def site_shape(self, name: str) -> torch.Size:
        return self.sites[name]["value"].shape

    @property
    def layers(self) -> List[Layer]:
        return self.structure.layers

    @property
    def latent(self) -> List[str]:
        return self.structure.latent

    @property
    def likelihood(self) -> Likelihood:
        """The model's likelihood, read whenever the priors are (``normal_priors=True``)."""
        if self.structure.likelihood is None:
            raise RuntimeError("the model's likelihood is read only with normal_priors=True")
        return self.structure.likelihood


def _roles(
    recorder: LayerRecorderMessenger, layers: List[Layer], site: SampleSite,
    held: Collection[str] = (),
) -> Likelihood:
    family = likelihood_family(site)
    flow = recorder.likelihood_flow
    mean_keys = ("loc",) if family == "normal" else ("logits", "probs")
    mean_tokens = frozenset().union(*(flow.get(k, frozenset()) for k in mean_keys))
    # a "layer" token carries the layer's index, a "site" or "param" token its name
    outputs = sorted(cast(int, i) for kind, i in mean_tokens if kind == "layer")
    if not outputs:
        what = "mean" if family == "normal" else "logits or probs"
        raise ValueError(f"no Bayesian layer's output reaches the {what} of the likelihood "
                         f"{site['name']!r}; I-BLM needs the last layer to feed it")
    if len(outputs) > 1:
        names = [layers[i].weight_name for i in outputs]
        raise ValueError(
            f"the outputs of several Bayesian layers ({names}) reach the likelihood's mean "
            f"directly; I-BLM fits one output layer to the targets. Sum them inside one "
            "layer, or initialize with init_guide(guide, (x, y), method='xavier'), which fit "
            "then keeps")
    layers[outputs[0]].role = "output"
    likelihood = Likelihood(site["name"], family)
    if family != "normal":
        return likelihood
    tokens = flow.get("scale", frozenset())
    scale_layers = sorted(cast(int, i) for kind, i in tokens if kind == "layer")
    sources = sorted((kind, cast(str, name)) for kind, name in tokens
                     if kind in ("site", "param"))
    # a site the guide does not own (``held``) is the noise only where it alone sets the
    # scale (and a guide list member owns it: see prepare); beside anything else it is a
    # constant, as it is to the guide
    hidden = [s for s in sources if s[0] == "site" and s[1] in held]
    sources = [s for s in sources if s not in hidden]
    if len(hidden) == 1 and not sources and not scale_layers:
        sources = hidden
    if scale_layers and (len(scale_layers) > 1 or sources or scale_layers == outputs):
        names = [layers[i].weight_name for i in scale_layers]
        raise ValueError(
            f"the likelihood's scale depends on the Bayesian layers {names}"
            + (f" and on {[n for _, n in sources]}" if sources else "")
            + "; I-BLM can set one scale head (a layer whose output only sets the scale) "
            "or one noise site. Initialize this model with init_guide(guide, (x, y), "
            "method='xavier'), which fit then keeps")
    if scale_layers:
        layers[scale_layers[0]].role = "scale"
        likelihood.noise, likelihood.noise_name = "layer", layers[scale_layers[0]].weight_name
    elif len(sources) > 1:
        raise ValueError(
            f"the likelihood's scale depends on several sites or params {[n for _, n in sources]}"
            "; I-BLM can estimate one noise site. Pass noise_scale=... to fix the regression "
            "noise and initialize the noise sites yourself")
    elif sources:
        likelihood.noise, likelihood.noise_name = sources[0]
    else:
        likelihood.noise = "fixed"
    return likelihood


def trace_structure(
    guide: AutoGuide, pool: DataPool, latent: List[str], normal_priors: bool,
    model: Optional[Callable[..., Any]] = None,
    held: Optional[Dict[str, torch.Tensor]] = None,
) -> Tuple[ModelStructure, Tuple[Any, ...]]:
    """The first pass: the model (the guide's, unless given) on up to 256 rows
    with the guide's medians (and the sites it does not own at ``held``)."""
    model = guide.model if model is None else model
    first = next(pool.chunks(_STRUCTURE_ROWS))
    values = guide_medians(guide, first)
    num_rows = pool.rows_of(first)
    recorder = run_model(model, values, first, latent, num_rows=num_rows, track_flow=True,
                         sources=held)
    plates = PlateRowsMessenger(num_rows=num_rows)
    with torch.no_grad(), poutine.block():
        trace = poutine.trace(conditioned_in_rows(model, values, plates)).get_trace(*first)
    sites = {name: sample_site(trace.nodes[name]) for name in latent if name in trace.nodes}
    layers = [_layer_from_record(r, sites, normal_priors) for r in recorder.layers]
    seen: Set[str] = set()
    for layer in layers:
        for name in layer.site_names:
            if name in seen:
                raise ValueError(
                    f"the latent site {name!r} is used by more than one layer call (a "
                    "shared weight); I-BLM needs each Bayesian layer's weight and bias to be "
                    "used once: train this model from the guide's own initial values "
                    "(fit(..., init=None), or SVI without init_guide_iblm)"
                )
            seen.add(name)
    likelihood = None
    if normal_priors:
        if not layers:
            vectors = one_dim_sites({name: site["value"].shape for name, site in sites.items()})
            hint = (f". The latent sites {vectors} have one dimension: a product x @ beta "
                    "with beta of shape (D,) is not read as a layer; give it the shape "
                    "(D, 1) and take (x @ beta).squeeze(-1)") if vectors else ""
            raise NoLayersError(
                "the model has no F.linear / F.conv layer or matrix product whose weight is "
                "a latent sample site, so there is nothing to initialize; make the layers "
                "Bayesian with pyro_vinit.nn.bayesianize or pyro.nn.PyroSample (a weight "
                "computed from latent sites, e.g. tau * w_raw, is none: sample it as "
                "Normal(0, tau), or train from the guide's own initial values, fit(..., "
                "init=None))" + hint
            )
        site = observed_site(recorder)
        check_not_conditioned(model, site["name"])
        likelihood = _roles(recorder, layers, site, held or ())
    covered = seen | ({likelihood.noise_name} if likelihood and likelihood.noise == "site"
                      else set())
    uncovered = [name for name in latent if name not in covered]
    data_plates = {f.name for f in site["cond_indep_stack"]} if likelihood else set()
    priors = {name: normal.scale for name in uncovered if name in sites
              for normal in [factorized_normal(sites[name]["fn"])] if normal is not None
              and not any(f.name in data_plates for f in sites[name]["cond_indep_stack"])}
    sizes = {s for _, s in plates.subsampled_plates.values()}
    if len(sizes) > 1:
        raise ValueError(
            f"the model has subsampled plates with different subsample sizes "
            f"{plates.subsampled_plates}; I-BLM walks the data in blocks of one size"
        )
    block_size = sizes.pop() if sizes else None
    if block_size == num_rows > 1 and draws_the_rows(model, values, pool, num_rows):
        block_size = None  # (every row at hand, scaled to the plate's size: no blocks)
    structure = ModelStructure(layers, likelihood, latent, uncovered, priors, block_size,
                               recorder.num_batch_norms > 0)
    return structure, first


def prepare(
    guide: AutoGuide, data: Optional[Data], max_rows: int, chunk_rows: int,
    normal_priors: bool = True, pool: Optional[DataPool] = None,
    owner: Optional[AutoGuide] = None, likelihood: bool = True,
) -> Prepared:
    """Checks the guide class, reads the data (unless a ``pool`` of it is
    given), sets the guide up if needed (after checking that the model has a
    likelihood on the data that the targets fit, which ``likelihood`` asks of
    a set-up guide too), holds the latent sites hidden from the guide
    fixed (at the medians of ``owner``, the guide list the guide belongs to,
    or else of their priors) and reads the model's structure."""
    site_params.check_supported(guide)  # an unsupported guide fails before any work
    if pool is None:
        pool = DataPool(data, max_rows)
    first = next(pool.chunks(min(chunk_rows, _STRUCTURE_ROWS)))
    given = None if owner is None else guide_medians(owner, first)
    model, held = hold_hidden_sites(guide.model, given)
    # a data plate declared over all the rows draws its subsample among those at hand
    in_chunk = in_rows(model, PlateRowsMessenger(num_rows=pool.rows_of(first)))
    if likelihood or guide.prototype_trace is None:  # (else: the data only finds layers)
        trace = check_has_likelihood(in_chunk, first, member=guide)
    if guide.prototype_trace is None:
        setup, args = in_chunk, first
        rows = pool.rows_of(first)
        local = per_example_sites(
            trace, rows, model, partial(trace_on, model, pool, rows - 1) if rows > 1 else None,
        ) if pool.num_rows > rows else []
        if local:  # (its guide takes one value per row it is set up on: all of them)
            if not pool.whole:
                raise ValueError(
                    f"the latent site {local[0][0]!r} lies in plate {local[0][1]!r} over the "
                    "data rows (a per-example latent), so its guide must be set up on all "
                    "of them, which this data does not give at once (a loader, more rows "
                    "than max_pool_size, or a shard): set the guide up first, e.g. "
                    "guide(x, y), then initialize it")
            setup = in_rows(model, PlateRowsMessenger(num_rows=pool.num_rows))
            args = pool.args
        with torch.no_grad(), poutine.block(), model_swapped(guide, setup):
            guide(*args)
    sites = site_params.latent_sites(guide)
    structure, first = trace_structure(guide, pool, list(sites), normal_priors, model,
                                       {name: value for name, (value, _) in held.items()})
    structure.held = held
    found = structure.likelihood
    if found is not None and found.noise == "site" and found.noise_name in held:
        # a noise site another member of the guide list owns, or none (hidden by a block:
        # drawn from its prior at each step, a fixed scale to the fit)
        found.noise = "fixed"
        for member in cast(Any, owner) or ():  # (the guide list's members)
            owned = cast(AutoGuide, member).prototype_trace
            site = None if owned is None else owned.nodes.get(found.noise_name)
            if site is not None and site["type"] == "sample" and not site["is_observed"]:
                found.noise, found.noise_support = "held", site["fn"].support
    for layer in structure.layers:
        for name in layer.site_names:
            site_shape = sites[name]["value"].shape
            expected = layer.weight_shape if name == layer.weight_name else (layer.num_units,)
            if site_shape.numel() != torch.Size(expected).numel():
                raise ValueError(
                    f"site {name!r} has shape {tuple(site_shape)} in the guide but "
                    f"{tuple(expected)} in the layer call"
                )
    return Prepared(pool, guide, sites, structure, first, model)
