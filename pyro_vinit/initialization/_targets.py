"""I-BLM's regression targets: the observations, or the Dirichlet transform of the labels."""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union, cast

import torch
import torch.nn.functional as F
from torch.distributions import Categorical, Normal, StudentT

from pyro_vinit._typing import SampleSite
from pyro_vinit.initialization._collective import Collective
from pyro_vinit.initialization._observed import check_targets
from pyro_vinit.initialization._options import IBLMOptions
from pyro_vinit.initialization._passes import observed_sites
from pyro_vinit.initialization._runs import one_dim_sites
from pyro_vinit.initialization._tracing import Prepared, unwrap_likelihood

__all__ = ["dirichlet_transform"]


def dirichlet_transform(y: torch.Tensor, alpha: float = 0.01) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""
    The label transformation of Milios et al. [1] used by I-BLM for
    classification: one-hot labels :math:`y` become regression targets
    :math:`\tilde y` with noise variances :math:`\tilde\sigma^2`,

    .. math::

        \tilde\sigma^2 = \log\Big(\frac{1}{y + \alpha} + 1\Big), \qquad
        \tilde y = \log(y + \alpha) - \tilde\sigma^2 / 2,

    (a log-Normal moment match of the Gamma variables whose normalization is
    Dirichlet(:math:`y + \alpha`)), so that the softmax of the regression
    recovers the class probabilities.

    :param torch.Tensor y: One-hot labels (any shape, values in {0, 1}).
    :param float alpha: The Dirichlet regularization :math:`\alpha > 0`.
    :return: ``(targets, noise_variances)``, each shaped like ``y``.

    [1] Milios, Camoriano, Michiardi, Rosasco, Filippone (2018) "Dirichlet-based
    Gaussian Processes for Large-scale Calibrated Classification"
    """
    var = torch.log1p(1.0 / (y + alpha))
    return torch.log(y + alpha) - var / 2, var


@dataclass
class Targets:
    """The regression targets of the output layer, one column per output unit."""

    task: str  # "regression" or "classification"
    y: torch.Tensor  # (rows, k)
    noise_var: torch.Tensor  # (rows, k)
    softmax: bool  # whether a shift shared by all columns leaves the likelihood unchanged
    fixed_noise: bool  # whether noise_var is the model's own (a fixed likelihood scale)
    #: per column, the gain from the output layer to the likelihood's mean or logits
    gain: Optional[torch.Tensor] = None


def read_targets(prep: Prepared, values: Dict[str, torch.Tensor], options: IBLMOptions,
                 collective: Collective,
                 affine: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Targets:
    """The output layer's regression targets, from the observed site of a pass
    over the data with the latent sites at ``values``; where the model maps the
    output layer's output by ``affine`` (a gain and an offset per column) to
    the likelihood's mean or logits, the targets and noise are mapped back."""
    likelihood = prep.likelihood
    fixed = likelihood.noise == "fixed" and not options.estimate_noise
    fixed = fixed and options.noise_scale is None
    parts: List[Tuple[torch.Tensor, torch.Tensor]] = []
    with collective.agree():
        for site, rows_of in observed_sites(prep, values, options.chunk_rows, collective):
            obs = rows_of(site["value"], "the observed site")
            scale = None
            if fixed:
                fn = cast(Union[Normal, StudentT], unwrap_likelihood(site))  # "fixed": normal
                scale = fn.scale.expand(site["value"].shape)
                scale = rows_of(scale, "the likelihood's scale")
            parts.append(site_targets(site, likelihood.family, obs, scale, options.alpha))
    y = torch.cat([p[0] for p in parts])
    noise_var = torch.cat([p[1] for p in parts])
    gain = None
    if affine is not None and affine[0].numel() == y.shape[1]:
        gain, offset = (a.to(y) for a in affine)
        y, noise_var = (y - offset) / gain, noise_var / gain.pow(2)
    task = "regression" if likelihood.family == "normal" else "classification"
    if task == "regression" and not fixed:
        if options.noise_scale is not None:  # (the likelihood's, over the model's gain)
            noise_var.fill_(options.noise_scale**2)
            if gain is not None:
                noise_var /= gain.pow(2)
        else:
            noise_var.fill_(0.1**2 * collective.std(y).clamp_min(1e-6).item() ** 2)
    softmax = likelihood.family in ("categorical", "onehot")
    output = prep.structure.output_layers[0]
    if output.num_units != y.shape[1]:
        layered = {name for layer in prep.layers for name in layer.site_names}
        vectors = one_dim_sites({name: prep.site_shape(name) for name in prep.latent
                                 if name not in layered})
        matrices = [name for name in prep.latent
                    if name not in layered and len(prep.site_shape(name)) == 2]
        hint = (f" (the latent sites {vectors} have one dimension: a product h @ w with w of "
                "shape (D,) is not read as a layer; give it the shape (D, 1) and take "
                "(h @ w).squeeze(-1))") if vectors else ""
        hint += (f" (the latent matrices {matrices} are in no layer I-BLM reads: a product "
                 "that sums the outputs' dim away, einsum('oi,ni->n', w, h), or puts it "
                 "first, is none; write F.linear(h, w) or h @ w.T and reshape its output)"
                 ) if matrices and not vectors else ""
        raise ValueError(
            f"the output layer ({output.weight_name!r}) has {output.num_units} outputs but "
            f"the likelihood has {y.shape[1]} target columns; I-BLM needs them to match"
            + hint
        )
    return Targets(task, y, noise_var, softmax, fixed, gain)


def site_targets(site: SampleSite, family: str, obs: torch.Tensor,
                 scale: Optional[torch.Tensor], alpha: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(targets (rows, k), noise variances (rows, k)) of an observed site's rows."""
    fn = unwrap_likelihood(site)
    check_targets(site, site["value"])  # dtype and support, as fit checks them
    rows = obs.shape[0] if obs.dim() else 0
    if family == "normal":
        y = obs.reshape(rows, -1)
        var = scale.reshape(rows, -1).pow(2) if scale is not None else torch.empty_like(y)
        return y, var
    if family == "categorical":
        logits = cast(Categorical, fn).logits
        k = logits.shape[-1]
        labels = obs.reshape(rows, -1)
        if labels.shape[1] != 1:
            raise ValueError(f"the Categorical likelihood {site['name']!r} takes one label per "
                             f"row, got {labels.shape[1]}")
        onehot = F.one_hot(labels[:, 0].long(), k).to(logits.dtype)
        return dirichlet_transform(onehot, alpha)
    y = obs.reshape(rows, -1)
    mean, var = dirichlet_transform(y, alpha)
    if family == "bernoulli":  # the logit is the difference of the two classes
        mean_0, var_0 = dirichlet_transform(1 - y, alpha)
        return mean - mean_0, var + var_0
    return mean, var
