"""
One training step of each configuration the benchmarks compare, as a
callable: a deterministic ``nn`` step, bayesian-torch's layers, and a Pyro
model and guide trained through ``SVI`` with ``pyro.optim.Adam`` or through
Pyro's PyTorch-native loop (the ELBO as an ``nn.Module`` and one
``torch.optim.Adam``), optionally under an effect handler
(``LocalReparamMessenger``, ``FlipoutMessenger``). Imported by the scripts
in this folder (``from benchmarks._steps import ...``; they run as modules,
``python -m benchmarks.bench_targets``).

bayesian-torch is a benchmark-only dependency (``pip install --no-deps
bayesian-torch==0.5.0``, which ``make bench`` runs); without it,
:data:`BAYESIAN_TORCH` is None and the scripts skip its rows, printing
:data:`BAYESIAN_TORCH_MISSING`.
"""

import contextlib
import math
from importlib import metadata

import pyro
import torch
import torch.nn.functional as F
from pyro.infer import SVI, TraceMeanField_ELBO

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
    layers.to(x.device)  # (buffers it makes with legacy constructors stay on the CPU)
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


def pure_ktied_lrt_step(model, guide, x, y, num_data, lr=1e-3):
    """The estimator of ``AutoKTiedNormal`` + ``local_reparam()`` +
    ``TraceMeanField_ELBO`` on ``model`` (an MLP from :func:`make_model`),
    written out in plain PyTorch from copies of ``guide``'s current parameters:
    the same arithmetic (the low-rank variance path, the closed-form k-tied KL,
    the bias KL, the scaled likelihood) without Pyro's per-site machinery.
    Returns ``(step, loss_fn, leaves)``: ``loss_fn()`` gives the loss, which
    under the same seed equals the native loop's (tests/test_benchmarks.py
    checks it and its gradients), and ``leaves`` maps each weight site to its
    tensors ``(weight loc, bias loc, raw U, raw V, raw bias scale)``."""
    from pyro import poutine
    from torch.distributions import transform_to

    from pyro_vinit.poutine.noise.local_reparam import _pairs

    prior = poutine.trace(model).get_trace(x, y)
    positive = transform_to(guide.scale_constraint)
    layers, params, by_site = [], [], {}
    names = [n for n in guide.prototype_trace.nodes if n.endswith(".weight")]
    for name in names:
        bias = name[: -len("weight")] + "bias"
        w_loc, b_loc = (guide.get_loc_and_scale(n)[0].detach().clone() for n in (name, bias))
        u, v = guide.get_scale_factors(name)
        raw = [positive.inv(t.detach()).clone() for t in (u, v, guide.get_loc_and_scale(bias)[1])]
        leaves = [p.requires_grad_() for p in (w_loc, b_loc, *raw)]
        params += leaves
        by_site[name] = leaves
        s_w = prior.nodes[name]["fn"].base_dist.scale.reshape(-1)[0].item()
        s_b = prior.nodes[bias]["fn"].base_dist.scale.reshape(-1)[0].item()
        layers.append((leaves, s_w, s_b))
    k = guide.rank
    a, b, coef = _pairs(k, x.dtype, x.device)
    opt = torch.optim.Adam(params, lr=lr)

    def loss_fn():
        h, kl = x, 0.0
        for i, ((w_loc, b_loc, u_raw, v_raw, bs_raw), s_w, s_b) in enumerate(layers):
            u, v, bs = positive(u_raw), positive(v_raw), positive(bs_raw)
            ut, vt = u.t(), v.t()
            var = F.linear(h * h, vt[a] * vt[b]) @ (ut[a] * ut[b] * coef.unsqueeze(-1))
            mean = F.linear(h, w_loc, b_loc)
            h = torch.addcmul(mean, (var + bs.pow(2)).sqrt(), torch.randn_like(mean))
            if i < len(layers) - 1:
                h = torch.relu(h)
            s = torch.matmul(u, vt.contiguous())
            d = w_loc.flatten()
            kl = kl + (w_loc.numel() * (math.log(s_w) - 0.5) - s.log().sum()
                       + ((ut @ u) * (vt @ v)).sum() / (2 * s_w ** 2)
                       + torch.linalg.vecdot(d, d) / (2 * s_w ** 2))
            kl = kl + (math.log(s_b) - bs.log() + (bs.pow(2) + b_loc.pow(2)) / (2 * s_b ** 2)
                       - 0.5).sum()
        return F.cross_entropy(h, y, reduction="sum") * (num_data / len(x)) + kl

    def step():
        opt.zero_grad()
        loss_fn().backward()
        opt.step()

    return step, loss_fn, by_site
