"""
Finding a model's Bayesian layers and likelihood, and propagating data to a
layer, with :class:`~pyro_vinit.poutine.LayerCallMessenger`.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pyro.poutine as poutine
import torch
from torch.distributions import Distribution, Independent, Normal

from pyro_vinit.initialization._data import Data, DataPool
from pyro_vinit.initialization.projection import GuideWriter
from pyro_vinit.poutine import LayerCall, LayerCallMessenger


@dataclass
class Layer:
    """One ``F.linear`` / ``F.conv*d`` call whose weight is a latent sample site."""

    op: str
    weight_name: str
    weight_shape: torch.Size
    prior_loc: Optional[torch.Tensor] = None  # weight_shape
    prior_scale: Optional[torch.Tensor] = None  # weight_shape
    kwargs: Dict[str, Any] = field(default_factory=dict)
    bias_name: Optional[str] = None  # a latent bias site
    bias_prior_loc: Optional[torch.Tensor] = None  # (out,)
    bias_prior_scale: Optional[torch.Tensor] = None
    fixed_bias: Optional[torch.Tensor] = None  # a bias that is not a latent site

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


def _unwrap(fn: Distribution) -> Distribution:
    while isinstance(fn, Independent) or type(fn).__name__ in (
        "ExpandedDistribution",
        "MaskedDistribution",
    ):
        fn = fn.base_dist
    return fn


def normal_prior(msg: dict, shape: torch.Size) -> Tuple[torch.Tensor, torch.Tensor]:
    """The loc and scale, broadcast to ``shape``, of the Normal prior at a site."""
    fn = _unwrap(msg["fn"])
    if not isinstance(fn, Normal):
        raise ValueError(
            f"I-BLM needs a Normal prior (possibly expanded and .to_event) at the layer "
            f"site {msg['name']!r}, but its prior is {type(msg['fn']).__name__} over "
            f"{type(fn).__name__}; use a Normal prior there, or another initializer "
            "(init_guide(..., method='heuristic'))"
        )
    return fn.loc.expand(shape), fn.scale.expand(shape)


class _LayerRecorder(LayerCallMessenger):
    def __init__(self, latent: Sequence[str], normal_priors: bool):
        super().__init__()
        self.latent = set(latent)
        self.normal_priors = normal_priors
        self.layers: List[Layer] = []

    def _process_layer_call(self, call: LayerCall) -> Optional[torch.Tensor]:
        name = call.weight_name
        if name is None or name not in self.latent:
            return None
        shape = call.weight.shape
        layer = Layer(call.op, name, shape, kwargs=dict(call.kwargs))
        if self.normal_priors:
            layer.prior_loc, layer.prior_scale = normal_prior(call.weight_msgs[-1], shape)
        if call.bias is not None:
            if call.bias_name is not None and call.bias_name in self.latent:
                layer.bias_name = call.bias_name
                if self.normal_priors:
                    layer.bias_prior_loc, layer.bias_prior_scale = normal_prior(
                        call.bias_msgs[-1], call.bias.shape
                    )
            else:
                layer.fixed_bias = call.bias.detach()
        self.layers.append(layer)
        return None


class _Captured(Exception):
    pass


class _InputCapture(LayerCallMessenger):
    """Records the input (and optionally the output) of the call that uses the
    weight site ``weight_name``, then stops the model."""

    def __init__(self, weight_name: str, output: bool = False):
        super().__init__()
        self.weight_name = weight_name
        self.output = output
        self.input: Optional[torch.Tensor] = None
        self.result: Optional[torch.Tensor] = None

    def _process_layer_call(self, call: LayerCall) -> Optional[torch.Tensor]:
        if call.weight_name == self.weight_name:
            self.input = call.input
            if self.output:
                self.result = call()
            raise _Captured
        return None


def trace_layers(
    model: Callable,
    values: Dict[str, torch.Tensor],
    args: Sequence[Any],
    latent: Sequence[str],
    normal_priors: bool = True,
) -> Tuple[List[Layer], poutine.Trace]:
    """Runs ``model(*args)`` with the latent sites set to ``values``; returns the
    Bayesian layers in execution order (with their Normal priors, if
    ``normal_priors``, else no priors) and the trace."""
    recorder = _LayerRecorder(latent, normal_priors)
    with recorder:
        trace = poutine.trace(poutine.condition(model, data=values)).get_trace(*args)
    seen = set()
    for layer in recorder.layers:
        for name in layer.site_names:
            if name in seen:
                raise ValueError(
                    f"the latent site {name!r} is used by more than one layer call; I-BLM "
                    "needs each Bayesian layer's weight and bias to be used once"
                )
            seen.add(name)
    return recorder.layers, trace


def capture(
    model: Callable,
    values: Dict[str, torch.Tensor],
    args: Sequence[Any],
    layer: Layer,
    output: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The input (and output) of ``layer`` when ``model(*args)`` runs with the latent
    sites set to ``values``; the model stops there."""
    catcher = _InputCapture(layer.weight_name, output)
    try:
        with catcher:
            poutine.condition(model, data=values)(*args)
    except _Captured:
        pass
    if catcher.input is None:
        raise RuntimeError(
            f"the model did not call the layer with weight {layer.weight_name!r} on these "
            "arguments; I-BLM needs the same layers to run on every batch"
        )
    return catcher.input, catcher.result


def observed_site(trace: poutine.Trace, latent: Sequence[str]) -> dict:
    """The single observed sample site of a model trace."""
    sites = [
        site
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and site["is_observed"] and name not in latent
    ]
    if len(sites) != 1:
        raise ValueError(
            f"I-BLM needs a model with exactly one observed sample site (its likelihood); "
            f"found {[s['name'] for s in sites]}. Call the model with its targets, "
            "e.g. data=(x, y)"
        )
    return sites[0]


def unwrap_likelihood(site: dict) -> Distribution:
    return _unwrap(site["fn"])


def guide_values(guide, args: Sequence[Any], latent: Sequence[str]) -> Dict[str, torch.Tensor]:
    """A draw of every latent site from the guide (in the model's constrained space)."""
    trace = poutine.trace(guide).get_trace(*args)
    return {name: trace.nodes[name]["value"] for name in latent}


@dataclass
class Prepared:
    """What every data-driven initializer starts from."""

    pool: DataPool
    writer: GuideWriter
    layers: List[Layer]
    trace: poutine.Trace  # of the model on the first chunk, with gradients
    first: Tuple[Any, ...]  # the first chunk's model arguments

    @property
    def latent(self) -> List[str]:
        return self.writer.latent_names


def prepare(
    guide, data: Data, max_rows: int, chunk_rows: int, normal_priors: bool = True
) -> Prepared:
    """Checks the guide class, reads the data, sets the guide up if needed and
    finds the model's Bayesian layers."""
    GuideWriter.family_of(guide)  # an unsupported guide fails before any work
    pool = DataPool(data, max_rows)
    first = next(pool.chunks(chunk_rows))
    if guide.prototype_trace is None:
        with torch.no_grad():
            guide(*first)
    writer = GuideWriter(guide)
    latent = writer.latent_names
    layers, trace = trace_layers(
        guide.model, guide_values(guide, first, latent), first, latent, normal_priors
    )
    if not layers:
        raise ValueError(
            "the model has no F.linear / F.conv layer whose weight is a latent sample "
            "site, so there is nothing to initialize; make the layers Bayesian with "
            "pyro_vinit.nn.bayesianize"
        )
    for layer in layers:
        for name in layer.site_names:
            expected = layer.weight_shape if name == layer.weight_name else (layer.num_units,)
            if tuple(writer.shape(name)) != tuple(expected):
                raise ValueError(
                    f"site {name!r} has shape {tuple(writer.shape(name))} in the guide but "
                    f"{tuple(expected)} in the layer call"
                )
    return Prepared(pool, writer, layers, trace, first)
