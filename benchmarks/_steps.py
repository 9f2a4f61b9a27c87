"""
One training step of each configuration the benchmarks compare, as a
callable: a deterministic ``nn`` step, bayesian-torch's layers, and a Pyro
model and guide trained through ``SVI`` with ``pyro.optim.Adam`` or through
Pyro's PyTorch-native loop (the ELBO as an ``nn.Module`` and one
``torch.optim.Adam``), optionally under an effect handler
(``LocalReparamMessenger``, ``FlipoutMessenger``). Imported by the scripts
in this folder (``from _steps import ...``, the script's own folder being on
the path).

bayesian-torch is a benchmark-only dependency (``pip install --no-deps
bayesian-torch==0.5.0``, which ``make bench`` runs); without it,
:data:`BAYESIAN_TORCH` is None and the scripts skip its rows, printing
:data:`BAYESIAN_TORCH_MISSING`.
"""

import contextlib
from importlib import metadata

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.infer import SVI, TraceMeanField_ELBO

from pyro_vinit.guides import AutoSiteGuide
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

try:
    from bayesian_torch.layers import LinearFlipout, LinearReparameterization

    BAYESIAN_TORCH = metadata.version("bayesian-torch")
except ImportError:  # benchmark-only dependency
    LinearFlipout = LinearReparameterization = None
    BAYESIAN_TORCH = None

BAYESIAN_TORCH_MISSING = (
    "bayesian-torch is not installed: its rows are skipped "
    "(benchmark-only: pip install --no-deps bayesian-torch==0.5.0, as `make bench` does)."
)


class AutoMeanFieldNormal(AutoSiteGuide):
    """AutoNormal's fully factorized Normal, placed at the site itself (so
    TraceMeanField_ELBO uses the closed-form KL)."""

    def _setup_scales(self):
        self._setup_normal_scales(self._event_dims)

    def _unconstrained_posterior(self, name):
        loc, scale = self._get_loc_and_scale(name)
        return dist.Normal(loc, scale).to_event(self._event_dims[name])


def make_model(sizes, num_data, prior_scale=None):
    """A Bayesian ReLU MLP classifier with N(0, 1/D_in) priors (or
    N(0, prior_scale²))."""
    return BayesianClassifier(bayesianize(mlp(sizes), prior_scale=prior_scale),
                              num_data=num_data)


def _under(handler):
    # a fresh context per step: a messenger instance is reusable, but not re-entrant
    return contextlib.nullcontext() if handler is None else handler


def svi_step(model, guide, x, y, handler=None, elbo=TraceMeanField_ELBO, lr=1e-3):
    """``SVI.step`` with ``pyro.optim.Adam`` (what the tutorials write), under
    ``handler`` (a messenger instance, or None); one step is taken here, so
    that the guide's parameters exist before any timing."""
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), elbo())

    def step():
        with _under(handler):
            svi.step(x, y)

    step()
    return step


def native_step(model, guide, x, y, handler=None, elbo=TraceMeanField_ELBO, lr=1e-3):
    """Pyro's PyTorch-native loop: ``loss_fn = elbo()(model, guide)``, one
    ``torch.optim.Adam(loss_fn.parameters())``, ``loss.backward()``."""
    loss_fn = elbo()(model, guide)
    with _under(handler):
        loss_fn(x, y)  # creates the guide's parameters
    opt = torch.optim.Adam(loss_fn.parameters(), lr=lr)

    def step():
        opt.zero_grad()
        with _under(handler):
            loss = loss_fn(x, y)
        loss.backward()
        opt.step()

    step()
    return step


LOOPS = {"SVI": svi_step, "native": native_step}


def deterministic_step(sizes, x, y, lr=1e-3):
    """An Adam step of the deterministic ``mlp(sizes)`` (cross-entropy)."""
    net = mlp(sizes)
    opt = torch.optim.Adam(net.parameters(), lr=lr)

    def step():
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()

    step()
    return step


def bayesian_torch_step(layer_cls, sizes, x, y, num_data, lr=1e-3):
    """An Adam step of a ReLU MLP of bayesian-torch layers (``layer_cls``, e.g.
    ``LinearReparameterization``), negative ELBO with its closed-form KL."""
    layers = torch.nn.ModuleList(layer_cls(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
    opt = torch.optim.Adam(layers.parameters(), lr=lr)

    def step():
        opt.zero_grad()
        h, kl = x, 0.0
        for i, layer in enumerate(layers):
            h, k = layer(h)
            kl = kl + k
            if i < len(layers) - 1:
                h = torch.relu(h)
        loss = F.cross_entropy(h, y, reduction="sum") * (num_data / len(x)) + kl
        loss.backward()
        opt.step()

    step()
    return step
