"""
One-call conversion of ordinary ``torch.nn`` networks into Bayesian Pyro
models.
"""

import math
from typing import Iterable, Optional, Tuple, Type, Union

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample
from torch import nn

__all__ = ["BayesianClassifier", "BayesianRegressor", "bayesianize", "mlp"]

_LAYER_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _fan_in(module: nn.Module) -> int:
    # in_features for Linear; in_channels / groups * prod(kernel_size) for Conv
    return module.weight[0].numel()


def _normal_prior(shape: torch.Size, scale: float, like: torch.Tensor) -> dist.Independent:
    loc = torch.zeros((), dtype=like.dtype, device=like.device)
    return dist.Normal(loc, torch.full_like(loc, scale)).expand(shape).to_event(len(shape))


def bayesianize(
    module: nn.Module,
    *,
    prior_scale: Optional[float] = None,
    exclude: Iterable[Union[str, Type[nn.Module]]] = (),
) -> PyroModule:
    r"""
    Turns every ``nn.Linear`` and ``nn.Conv1d/2d/3d`` of ``module`` (at any
    depth, including inside ``nn.Sequential``) into a Bayesian layer in place:
    its ``weight`` and ``bias`` become sample sites with a Normal prior.

    Usage::

        net = bayesianize(nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10)))
        model = BayesianClassifier(net)
        guide = AutoKTiedNormal(model)

    The default prior is the one of [1],

    .. math::

        w \sim \mathcal{N}(0, 1 / D_\text{in}),

    with :math:`D_\text{in}` the layer's fan-in (``in_features``, or
    ``in_channels / groups × kernel size``), for weights and biases alike.

    :param torch.nn.Module module: The network; converted in place and returned.
    :param float prior_scale: If given, a fixed prior N(0, prior_scale²) for
        every weight and bias instead.
    :param exclude: Layers to leave deterministic, by qualified name (as in
        ``module.named_modules()``, e.g. ``"0"`` or ``"features.conv1"``) or by
        type (e.g. ``nn.Conv2d``).
    :return: The converted module, now a :class:`~pyro.nn.PyroModule`.

    [1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
    Bayes for Deep Models"
    """
    if prior_scale is not None and not (isinstance(prior_scale, (int, float)) and prior_scale > 0):
        raise ValueError(f"bayesianize: prior_scale must be a positive number, got {prior_scale!r}")
    exclude = tuple(exclude)
    names = {name for name, _ in module.named_modules()}
    unknown = [e for e in exclude if isinstance(e, str) and e not in names]
    if unknown:
        raise ValueError(
            f"bayesianize: exclude names {unknown} are not submodules of the network; "
            f"its layer names are {sorted(n for n in names if n)}"
        )
    excluded_types = tuple(e for e in exclude if isinstance(e, type))

    found = False
    for name, sub in list(module.named_modules()):
        if not isinstance(sub, _LAYER_TYPES) or name in exclude or isinstance(sub, excluded_types):
            continue
        found = True
        scale = prior_scale if prior_scale is not None else 1.0 / math.sqrt(_fan_in(sub))
        weight, bias = sub.weight, sub.bias
        pyro.nn.module.to_pyro_module_(sub, recurse=False)
        sub.weight = PyroSample(_normal_prior(weight.shape, scale, weight))
        if bias is not None:
            sub.bias = PyroSample(_normal_prior(bias.shape, scale, bias))
    if not found:
        raise ValueError(
            "bayesianize: the network has no nn.Linear or nn.Conv layer left to convert "
            "(check `exclude`)"
        )
    pyro.nn.module.to_pyro_module_(module)
    return module


def _data_plate(x: torch.Tensor, num_data: Optional[int]) -> pyro.plate:
    # An explicit subsample makes the plate scale the likelihood by num_data / batch.
    n = x.shape[0]
    return pyro.plate("data", num_data or n, subsample=torch.arange(n, device=x.device))


class BayesianClassifier(PyroModule):
    """
    A Pyro model ``model(x, y=None)`` with a Categorical likelihood on the
    logits of a Bayesian network (see :func:`bayesianize`).

    :param torch.nn.Module net: A network mapping ``x`` to logits ``(batch, classes)``.
    :param int num_data: Size of the full data set when the model is called on
        minibatches; the likelihood is scaled by ``num_data / batch``.
    """

    def __init__(self, net: nn.Module, num_data: Optional[int] = None):
        super().__init__()
        self.net = net
        self.num_data = num_data

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = self.net(x)
        with _data_plate(x, self.num_data):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


class BayesianRegressor(PyroModule):
    """
    A Pyro model ``model(x, y=None)`` with a Normal likelihood of fixed noise
    scale around a Bayesian network's output.

    :param torch.nn.Module net: A network mapping ``x`` to ``(batch, 1)`` or ``(batch,)``.
    :param float noise_scale: The likelihood's standard deviation.
    :param int num_data: Size of the full data set when the model is called on
        minibatches.
    """

    def __init__(self, net: nn.Module, noise_scale: float = 1.0, num_data: Optional[int] = None):
        super().__init__()
        self.net = net
        self.noise_scale = noise_scale
        self.num_data = num_data

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        mean = self.net(x).squeeze(-1)
        with _data_plate(x, self.num_data):
            pyro.sample("obs", dist.Normal(mean, self.noise_scale), obs=y)
        return mean


def mlp(sizes: Tuple[int, ...], activation: Type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """An ``nn.Sequential`` MLP with layer sizes ``sizes`` and ``activation``
    between layers (not after the last)."""
    layers = []
    for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(d_in, d_out))
        if i < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)
