"""
Starting a guide from a trained network: its weights as the posterior
means, the standard deviations from I-BLM's per-layer Bayesian linear
regressions on the trained layers' inputs (or MOPED's :math:`\\delta |w|`),
a learnable regression noise at the trained network's residual std.
"""

import math
import warnings
from contextlib import ExitStack
from typing import Any, Dict, Mapping, Optional, TypeVar

import torch
from pyro.infer.autoguide import AutoGuide, AutoGuideList

from pyro_vinit.guides.site_params import check_supported
from pyro_vinit.initialization._collective import LocalCollective
from pyro_vinit.initialization._data import Data
from pyro_vinit.initialization._fits import Fit, NoiseFit, write_fits
from pyro_vinit.initialization._marks import mark_initialized
from pyro_vinit.initialization._noise import noise_fit, residual_std
from pyro_vinit.initialization._options import IBLMOptions
from pyro_vinit.initialization._passes import layer_inputs
from pyro_vinit.initialization._regressions import unit_priors, unit_statistics
from pyro_vinit.initialization._rollback import (
    GuideRollback,
    innermost,
    restore_buffers,
    saved_buffers,
)
from pyro_vinit.initialization._tracing import Layer, Prepared, _to_layout, guide_medians, prepare

__all__ = ["TRAINED_PREFIX", "init_guide_pretrained"]

#: The prefix of the buffers holding a layer's trained values: ``trained_weight``
#: and ``trained_bias`` beside the sample sites ``weight`` and ``bias`` (what
#: :func:`~pyro_vinit.nn.bayesianize` registers with ``keep_weights=True``).
TRAINED_PREFIX = "trained_"

_SCALES = ("iblm", "moped")

_G = TypeVar("_G", bound=AutoGuide)


def init_guide_pretrained(
    guide: _G,
    data: Data,
    *,
    weights: Optional[Mapping[str, torch.Tensor]] = None,
    scale: str = "iblm",
    noise_ratio: float = 1.0,
    delta: float = 0.1,
    max_scale_ratio: Optional[float] = None,
    strict: bool = False,
    max_pool_size: int = 10_000,
    chunk_rows: int = 4096,
) -> _G:
    r"""
    Starts ``guide`` in place from a trained network: every Bayesian layer's
    posterior mean is its trained weight, and its standard deviations are
    those of I-BLM's per-unit Bayesian linear regressions [1] with the
    layer's inputs computed by the trained network (``scale="iblm"``), or
    MOPED's :math:`\delta |w|` [2] (``scale="moped"``). Returns ``guide``.

    Usage::

        net = mlp((64, 8, 10))  # trained with torch
        model = BayesianClassifier(bayesianize(net, keep_weights=True), num_data=160)
        guide = AutoNormal(model)
        init_guide_pretrained(guide, (x_train, y_train))

    With the layer's input rows :math:`x_n` (patches, for a convolution) on
    the data, unit :math:`j`'s trained weights :math:`w_j` (and bias) and its
    outputs :math:`z_{nj} = x_n^\top w_j` as targets, the regression with
    prior :math:`\mathcal N(w_j, \Lambda)` (:math:`\Lambda` the model's prior
    variances) and noise :math:`\sigma_j = \rho\, \mathrm{std}_n(z_{nj})` has
    posterior mean :math:`w_j`, and I-BLM writes its factorized variances

    .. math::

        s_{ji}^2 = 1 / A_{ii}, \qquad
        A_{ii} = \Lambda_{ii}^{-1} + \sigma_j^{-2} \textstyle\sum_n x_{ni}^2.

    So the guide's median is the trained network, in eval mode too: the
    model's buffers (e.g. BatchNorm running statistics) keep their trained
    values, though the model runs on the data (in train mode, too);
    :func:`~pyro_vinit.update_batch_norm` recomputes them. A learnable
    regression noise (a noise site or param) starts at the trained
    network's root mean square residual on the data. Nothing is
    written unless every step succeeds. See :doc:`/methods/iblm` for the
    measurements.

    :param guide: An AutoNormal, AutoDiagonalNormal, AutoKTiedNormal or
        AutoRadialNormal guide of the model (set up from the first rows if not
        yet), or a member of an AutoGuideList (start each member).
    :param data: One tuple of model arguments, ``model(*data)``, or an iterable
        of such tuples (e.g. a DataLoader).
    :param dict weights: The trained value of every layer's weight and bias
        site, by site name; None reads them from the model's buffers
        ``trained_weight`` and ``trained_bias`` (``bayesianize(net,
        keep_weights=True)``).
    :param str scale: ``"iblm"`` or ``"moped"``.
    :param float noise_ratio: :math:`\rho`, each unit's regression noise over
        the std of its output (``scale="iblm"``).
    :param float delta: MOPED's :math:`\delta` (``scale="moped"``).
    :param float max_scale_ratio: Cap every written std at this fraction of its
        prior std; None writes them as computed.
    :param bool strict: Raise, instead of warning, when latent sites other than
        the layers' are left at the guide's values.
    :param int max_pool_size: Read at most this many data rows.
    :param int chunk_rows: Rows per model run when propagating the data.
    :return: ``guide``.

    [1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
    Bayes for Deep Models"

    [2] Krishnan, Subedar, Tickoo (2020) "Specifying Weight Priors in Bayesian
    Deep Neural Networks with Empirical Bayes"
    """
    if scale not in _SCALES:
        raise ValueError(f"init_guide_pretrained: scale must be one of {_SCALES}, got {scale!r}")
    for name, value in (("noise_ratio", noise_ratio), ("delta", delta)):
        _check_positive(name, value)
    if max_scale_ratio is not None:
        _check_positive("max_scale_ratio", max_scale_ratio)
    for name, value in (("max_pool_size", max_pool_size), ("chunk_rows", chunk_rows)):
        _check_positive(name, value, integer=True)
    if not isinstance(strict, bool):
        raise TypeError(f"init_guide_pretrained: strict must be a bool, got {strict!r}")
    if weights is not None and not isinstance(weights, Mapping):
        raise TypeError(
            "init_guide_pretrained: weights must be a dict of site name to tensor, got "
            f"{type(weights).__name__}"
        )
    options = IBLMOptions(max_pool_size=max_pool_size, chunk_rows=chunk_rows,
                          max_scale_ratio=max_scale_ratio, strict=strict)
    if isinstance(guide, AutoGuideList):
        raise TypeError(
            "init_guide_pretrained starts an AutoGuideList member by member: call it on "
            f"each member, guide[0] to guide[{len(guide) - 1}], with the same data"
            + (", after setting the list up, guide(x, y)" if guide.prototype_trace is None
               else "")
        )
    check_supported(guide)
    collective = LocalCollective()
    with GuideRollback(guide) as rollback, ExitStack() as stack:
        # The model runs on the data (in train mode, BatchNorm updates its running
        # statistics at each run): its buffers are the trained network's, and stay.
        stack.callback(restore_buffers, saved_buffers(innermost(guide.model)))
        pool = collective.open_pool(data, options, stack)
        prep = prepare(guide, None, options.max_pool_size, options.chunk_rows, pool=pool)
        trained = _trained_values(prep, weights)
        _report_uncovered(prep, options.strict)
        values = guide_medians(guide, prep.first)
        values.update(trained)
        fits: Dict[str, Fit] = {}
        for layer in prep.layers:
            mean = _op_layout(layer, trained)
            if scale == "moped":
                # MOPED's scales; a weight of exactly zero gets a tiny positive one (the
                # variance floored: a floored scale's square underflows to 0)
                var = (delta * mean).square().clamp_min(torch.finfo(mean.dtype).tiny)
            else:
                inputs = layer_inputs(prep, values, layer, options.chunk_rows, collective)
                var = _blr_variances(layer, inputs, mean, noise_ratio, options.chunk_rows)
            fits[layer.weight_name] = Fit(layer, mean, var)
        noise = _trained_noise(prep, values, options.chunk_rows, collective)
        rollback.checkpoint()
        write_fits(prep, fits, noise, options.max_scale_ratio)
    mark_initialized(guide)
    return guide


def _trained_noise(prep: Prepared, values: Dict[str, torch.Tensor], chunk_rows: int,
                   collective: LocalCollective) -> Optional[NoiseFit]:
    """A learnable noise site's or param's value at the trained network's root
    mean square residual on the data (a scale head's is its trained weights)."""
    likelihood = prep.likelihood
    if likelihood is None or likelihood.noise not in ("site", "param"):
        return None
    sigma = residual_std(prep, values, chunk_rows, collective)
    return noise_fit(prep, values, sigma, collective)


def _check_positive(name: str, value: object, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if (isinstance(value, bool) or not isinstance(value, kind)
            or not math.isfinite(value) or not value > 0):
        what = "a positive int" if integer else "a positive finite number"
        raise ValueError(f"init_guide_pretrained: {name} must be {what}, got {value!r}")


def _model_values(model: Any) -> Dict[str, torch.Tensor]:
    """The trained values the model's modules keep, by the site names a root
    :class:`~pyro.nn.PyroModule` gives their sample sites."""
    if not isinstance(model, torch.nn.Module):
        return {}
    out = {}
    for path, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name.startswith(TRAINED_PREFIX):
                site = name[len(TRAINED_PREFIX):]
                out[f"{path}.{site}" if path else site] = buffer
    return out


def _trained_values(prep: Prepared, weights: Optional[Mapping[str, torch.Tensor]]
                    ) -> Dict[str, torch.Tensor]:
    """Every layer site's trained value, checked, in the site's dtype and device."""
    given = weights is not None
    source = dict(weights) if weights is not None else _model_values(
        innermost(prep.guide.model))
    names = [name for layer in prep.layers for name in layer.site_names]
    missing = [name for name in names if name not in source]
    if missing:
        raise ValueError(
            f"init_guide_pretrained: no trained values for the layer sites {missing}. Convert "
            "the trained network with bayesianize(net, keep_weights=True), or pass "
            "weights={site name: tensor}"
            + (f"; the weights given are for {sorted(source)}" if given else "")
        )
    unknown = sorted(set(source) - set(names)) if given else []
    if unknown:
        raise ValueError(
            f"init_guide_pretrained: weights has values for {unknown}, which are not weight or "
            f"bias sites of the model's layers {names}"
        )
    out = {}
    for name in names:
        value, like = source[name], prep.sites[name]["value"]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"init_guide_pretrained: the trained value of {name!r} must be a "
                            f"tensor, got {type(value).__name__}")
        if value.shape != like.shape:
            raise ValueError(
                f"init_guide_pretrained: the trained value of {name!r} has shape "
                f"{tuple(value.shape)}, but the site has shape {tuple(like.shape)}"
            )
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"init_guide_pretrained: the trained value of {name!r} is not "
                             "finite")
        out[name] = value.detach().to(dtype=like.dtype, device=like.device)
    if all(not bool(out[layer.weight_name].any()) for layer in prep.layers):
        raise ValueError(
            "init_guide_pretrained: every layer's trained weights are zero: was the network "
            "trained? Train it before bayesianize(net, keep_weights=True), or start from "
            "scratch with init_guide_iblm"
        )
    return out


def _report_uncovered(prep: Prepared, strict: bool) -> None:
    uncovered, capped = prep.structure.uncovered, list(prep.structure.uncovered_priors)
    if not uncovered:
        return
    message = (
        "init_guide_pretrained starts the weights and biases of the layers it sees (F.linear, "
        "F.conv1d/2d/3d and matrix products with a latent weight) from their trained values, "
        "and a regression's noise site from their residuals; these latent sites keep the "
        f"guide's own initial values: {uncovered}"
        + (f"; those with a Normal prior outside the likelihood's plates ({capped}) get "
           "their stds capped at the started layers' median fraction of their prior's"
           if capped else "")
    )
    if strict:
        raise ValueError(message + "; the guide was left unchanged.")
    warnings.warn(message + ". Pass strict=True to make this an error.", UserWarning,
                  stacklevel=3)


def _op_layout(layer: Layer, trained: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer's trained weights (and latent bias) ``(units, fan_in [+ 1])``."""
    weight = _to_layout(trained[layer.weight_name], layer.weight_index, layer.weight_shape)
    weight = weight.reshape(layer.num_units, layer.fan_in)
    if layer.bias_name is None:
        return weight
    bias = _to_layout(trained[layer.bias_name], layer.bias_index,
                      torch.Size([layer.num_units]))
    return torch.cat([weight, bias[:, None]], 1)


def _blr_variances(layer: Layer, inputs: torch.Tensor, mean: torch.Tensor,
                   noise_ratio: float, chunk_rows: int) -> torch.Tensor:
    """The diagonal of each unit's regression posterior covariance
    ``(units, fan_in [+ 1])`` (see :func:`init_guide_pretrained`)."""
    h, d = layer.num_units, layer.fan_in
    weight = mean[:, :d]
    sumsq, moments, count = unit_statistics(layer, inputs, weight, chunk_rows)
    assert sumsq is not None  # the pool has at least one row
    groups = sumsq.shape[0]
    group_of = torch.arange(h, device=mean.device) // max(h // groups, 1)
    data = sumsq[group_of]  # (h, d): each unit's inputs' sums of squares
    if layer.bias_name is not None:
        data = torch.cat([data, data.new_full((h, 1), float(count))], 1)
    output_mean = moments[0] / max(count, 1)
    output_var = (moments[1] / max(count, 1) - output_mean.square()).clamp_min(0.0)
    noise_var = noise_ratio**2 * output_var.to(mean)
    # A unit whose output is constant on the data is told nothing by it: its prior.
    precision_data = torch.where(noise_var[:, None] > 0, data.to(mean) / noise_var[:, None],
                                 torch.zeros_like(data, dtype=mean.dtype))
    _, prior_scale = unit_priors(layer, torch.arange(h, device=mean.device))
    return (prior_scale.to(mean).pow(-2) + precision_data).reciprocal()
