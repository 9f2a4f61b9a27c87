"""
I-BLM's checks of the layer that feeds the likelihood: which layer it is in a
guide list's model (:func:`output_layer_site`), and whether the model
transforms its output before the likelihood (:func:`report_transformed_output`),
which the output layer's regressions would not undo.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch

from pyro_vinit._warn import warn_at_caller
from pyro_vinit.initialization._runs import run_model
from pyro_vinit.initialization._tracing import (
    Prepared,
    guide_medians,
    likelihood_family,
    unwrap_likelihood,
)
from pyro_vinit.poutine.layer_recorder import RecordedLayer

__all__ = ["output_layer_site", "report_transformed_output", "transformed_output"]


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


def transformed_output(prep: Prepared) -> Optional[Tuple[str, str]]:
    """``(output layer's weight site, likelihood parameter)`` if, in a run of the
    model whose output layer gives fixed varied values, the likelihood's mean or
    logits (or the probabilities of its logits) are not that output, up to a
    reshape and 5%; else None."""
    output = prep.structure.output_layers[0].weight_name

    def probe(layer: RecordedLayer) -> Optional[torch.Tensor]:
        if layer.weight_name != output:
            return None
        out = layer.call()
        index = torch.arange(out.numel(), dtype=out.dtype, device=out.device)
        return (2 * torch.sin(index)).reshape(out.shape)  # (no random draw)

    # (a model that draws, e.g. dropout or input noise, would take from I-BLM's stream)
    cuda = sorted({a.device.index or 0 for a in prep.first
                   if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        recorder = run_model(prep.model, guide_medians(prep.guide, prep.first), prep.first,
                             prep.latent, num_rows=prep.pool.rows_of(prep.first),
                             on_layer=probe, track_flow=True)
    found = [layer.output for layer in recorder.layers if layer.weight_name == output]
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
    got, expected = got.detach().reshape(-1), expected.reshape(-1).to(got.dtype)
    scale = 1.0 + float(expected.abs().max()) if expected.numel() else 1.0
    if bool(((got - expected).abs() <= 0.05 * scale).all()):
        return None
    return output, param


def report_transformed_output(prep: Prepared, who: str) -> None:
    """Says, in one warning, that the model transforms its output layer's output
    before the likelihood, which the regressions do not undo."""
    found = transformed_output(prep)
    if found is None:
        return
    name, param = found
    warn_at_caller(
        f"{who} fits the output layer {name!r} to the targets as the likelihood's {param}, "
        "but the model transforms that layer's output before the likelihood (e.g. a "
        "de-standardization out * std + mean, an offset, a temperature), which the fit does "
        "not undo: the guide starts off by that transform. Move the transform into the "
        "data (e.g. standardize the targets) or into the layer, or initialize with "
        "init_guide(..., method='xavier')", UserWarning)
