"""
I-BLM's checks of the layer that feeds the likelihood: which layer it is in a
guide list's model (:func:`output_layer_site`), and whether the model
transforms its output before the likelihood (:func:`output_transform`): an
affine map per output (``out * std + mean``, a temperature of Bernoulli
logits), which the output layer's targets undo, or another, which the
regressions would not.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch

from pyro_vinit._warn import warn_at_caller
from pyro_vinit.initialization._collective import Collective
from pyro_vinit.initialization._runs import run_model
from pyro_vinit.initialization._tracing import (
    Prepared,
    guide_medians,
    likelihood_family,
    unwrap_likelihood,
)
from pyro_vinit.poutine.layer_recorder import RecordedLayer

__all__ = ["Affine", "output_layer_site", "output_transform", "transformed_output"]

#: per output unit, the gain and offset of the map from the output layer to the
#: likelihood's mean or logits
Affine = Tuple[torch.Tensor, torch.Tensor]


def output_layer_site(
    model: Callable[..., Any], values: Dict[str, torch.Tensor], args: Sequence[Any],
    num_rows: int,
) -> Tuple[Optional[str], List[str]]:
    """The weight site of the layer whose output feeds the likelihood's mean (or
    logits) in a run of ``model`` with its latent sites at ``values`` (None
    unless exactly one does), and the weight sites of all its layers."""
    recorder = run_model(model, values, args, list(values), num_rows=num_rows,
                         track_flow=True)
    names = [layer.weight_name for layer in recorder.layers]
    if len(recorder.observed) != 1:
        return None, names
    site = recorder.observed[0]
    keys = ("loc",) if likelihood_family(site) == "normal" else ("logits", "probs")
    tokens = frozenset().union(*(recorder.likelihood_flow.get(k, frozenset()) for k in keys))
    outputs = sorted(cast(int, i) for kind, i in tokens if kind == "layer")
    return (names[outputs[0]] if len(outputs) == 1 else None), names


def _probe(prep: Prepared, args: Tuple[Any, ...],
           ) -> Optional[Tuple[str, bool, torch.Tensor, torch.Tensor]]:
    """``(likelihood parameter, whether it is softmax logits or probabilities, the
    fixed varied values the output layer gave, the parameter as they reached it)``
    in a run of the model on ``args``, both flat; None where no single output
    layer feeds a single likelihood."""
    output = prep.structure.output_layers[0]

    def probe(layer: RecordedLayer) -> Optional[torch.Tensor]:
        if layer.weight_name != output.weight_name:
            return None
        out = layer.call()
        index = torch.arange(out.numel(), dtype=out.dtype, device=out.device)
        return (2 * torch.sin(index)).reshape(out.shape)  # (no random draw)

    # (a model that draws, e.g. dropout or input noise, would take from I-BLM's stream)
    cuda = sorted({a.device.index or 0 for a in args
                   if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        recorder = run_model(prep.model, guide_medians(prep.guide, args), args,
                             prep.latent, num_rows=prep.pool.rows_of(args),
                             on_layer=probe, track_flow=True)
    found = [layer.output for layer in recorder.layers
             if layer.weight_name == output.weight_name]
    if len(found) != 1 or found[0] is None or len(recorder.observed) != 1:
        return None
    out, site = found[0].detach(), recorder.observed[0]
    fn = cast(Any, unwrap_likelihood(site))
    family = likelihood_family(site)
    softmax = family in ("categorical", "onehot")
    if family == "normal":
        param, got, expected = "loc", fn.loc, out
    elif "probs" in recorder.likelihood_flow:
        param, got = "probs", fn.probs
        expected = out.softmax(-1) if softmax else out.sigmoid()
    else:
        param, got = "logits", fn.logits
        expected = out.log_softmax(-1) if softmax else out
        got = got.log_softmax(-1) if softmax else got
    if got.numel() != expected.numel() or (softmax and got.shape[-1] != expected.shape[-1]):
        return None
    return param, softmax, expected.reshape(-1).to(got.dtype), got.detach().reshape(-1)


def transformed_output(prep: Prepared) -> Optional[Tuple[str, str, Optional[Affine]]]:
    """``(output layer's weight site, likelihood parameter, affine map or None)`` if,
    in a run of the model on the first rows whose output layer gives fixed
    varied values, the likelihood's mean or logits (or the probabilities of its
    logits) are not that output, up to a reshape and 5%; else None. The map is
    given where a Normal's mean or Bernoulli logits are the output times a gain
    plus an offset per output unit (to 1e-4 of each unit's spread)."""
    output = prep.structure.output_layers[0]
    found = _probe(prep, prep.first)
    if found is None:
        return None
    param, softmax, expected, got = found
    scale = 1.0 + float(expected.abs().max()) if expected.numel() else 1.0
    if bool(((got - expected).abs() <= 0.05 * scale).all()):
        return None
    affine = None
    if param == "loc" or (param == "logits" and not softmax):
        affine = _affine(expected.reshape(-1, output.num_units),
                         got.reshape(-1, output.num_units))
    return output.weight_name, param, affine


def _holds(affine: Affine, out: torch.Tensor, got: torch.Tensor) -> bool:
    # got = gain * out + offset per column, to 1e-4 of the column's spread (and rounding)
    gain, offset = affine
    residual = gain * out.double() + offset - got.double()
    rounding = 4 * torch.finfo(got.dtype).eps * got.abs().amax(0).double()
    return bool((residual.abs() <= 1e-4 * got.double().std(0) + rounding).all())


def _affine(out: torch.Tensor, got: torch.Tensor) -> Optional[Affine]:
    # per column j, got[:, j] = gain[j] * out[:, j] + offset[j], where that holds
    if out.shape[0] < 3:
        return None
    x, y = out.double(), got.double()
    centred = x - x.mean(0)
    gain = (centred * (y - y.mean(0))).sum(0) / centred.pow(2).sum(0)
    offset = y.mean(0) - gain * x.mean(0)
    if not bool((gain.abs() > 1e-6 * (1.0 + float(gain.abs().max()))).all()):
        return None
    return (gain, offset) if _holds((gain, offset), out, got) else None


def output_transform(prep: Prepared, who: str, chunk_rows: int,
                     collective: Collective) -> Optional[Affine]:
    """The affine map per output unit from the output layer to the likelihood's
    mean or logits, where the model applies one on every row (the output
    layer's targets undo it; every process takes the first one's); else None,
    saying in one warning that the model transforms its output layer's output
    in another way, which the regressions do not undo."""
    found = transformed_output(prep)
    if found is None:
        return None
    name, param, affine = found
    holds = affine is not None
    if affine is not None:  # (on every chunk: a map may change along sorted rows)
        units = prep.structure.output_layers[0].num_units
        for args in prep.pool.chunks(chunk_rows):
            probed = _probe(prep, args)
            if probed is None or not _holds(affine, probed[2].reshape(-1, units),
                                            probed[3].reshape(-1, units)):
                holds = False
                break
        failed = torch.tensor(0.0 if holds else 1.0, dtype=torch.float64,
                              device=prep.pool.device)
        holds = float(collective.all_reduce(failed)) == 0.0
    if affine is not None and holds:
        return collective.broadcast(affine[0]), collective.broadcast(affine[1])
    warn_at_caller(
        f"{who} fits the output layer {name!r} to the targets as the likelihood's {param}, "
        "but the model transforms that layer's output before the likelihood (e.g. a "
        "nonlinear map, a temperature of softmax logits, an offset that depends on the "
        "inputs), which the fit does not undo: the guide starts off by that transform. "
        "Move the transform into the data or into the layer, or initialize with "
        "init_guide(..., method='xavier')", UserWarning)
    return None
