"""
The library on the device of ``--device`` (default cpu; ``make gpu-check`` runs
these with ``--device cuda``): distributions, guides, handlers, I-BLM, metrics
and fit compute on that device, in float64, what they compute on the CPU (the
deterministic parts to 1e-8 relative; the random ones to a finite loss with every
gradient on the device).
"""

import warnings

import pyro
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import Predictive, Trace_ELBO, TraceMeanField_ELBO
from torch import nn

from pyro_vinit import (
    AutoKTiedNormal,
    AutoMeanFieldNormal,
    AutoRadialNormal,
    fit,
    flipout,
    init_guide_iblm,
    local_reparam,
    vectorized_layers,
)
from pyro_vinit.distributions import KTiedNormal
from pyro_vinit.metrics import brier_score, error_rate, mnll
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

RTOL = 1e-8


def _close(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return torch.allclose(a, b, rtol=RTOL, atol=RTOL * b.abs().max().item())


def _data(device, n=64, d=5, k=3):
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % k
    x = 3 * torch.randn(k, d, generator=g, dtype=torch.float64)[y] + torch.randn(
        n, d, generator=g, dtype=torch.float64)
    return x.to(device), y.to(device)


def _model(device, num_data=64):
    torch.manual_seed(0)
    net = bayesianize(mlp((5, 16, 3))).double()
    return BayesianClassifier(net, num_data=num_data).to(device)


def test_k_tied_normal_on_device(device):
    g = torch.Generator().manual_seed(0)
    loc = torch.randn(4, 6, generator=g, dtype=torch.float64)
    u = torch.rand(4, 2, generator=g, dtype=torch.float64) + 0.1
    v = torch.rand(6, 2, generator=g, dtype=torch.float64) + 0.1
    value = torch.randn(4, 6, generator=g, dtype=torch.float64)
    on_cpu = KTiedNormal(loc, u, v, tied_dims=2).to_event(2)
    on_device = KTiedNormal(loc.to(device), u.to(device), v.to(device), tied_dims=2).to_event(2)
    assert on_device.rsample().device.type == device.type
    assert _close(on_device.log_prob(value.to(device)), on_cpu.log_prob(value))
    prior = pyro.distributions.Normal(torch.zeros(4, 6, dtype=torch.float64), 1.0).to_event(2)
    prior_device = pyro.distributions.Normal(
        torch.zeros(4, 6, dtype=torch.float64, device=device), 1.0).to_event(2)
    assert _close(torch.distributions.kl_divergence(on_device, prior_device),
                  torch.distributions.kl_divergence(on_cpu, prior))


@pytest.mark.parametrize("guide_cls", [AutoKTiedNormal, AutoRadialNormal, AutoMeanFieldNormal])
@pytest.mark.parametrize("handler", [None, local_reparam, flipout])
def test_guides_and_handlers_on_device(guide_cls, handler, device):
    if handler is local_reparam and guide_cls is AutoRadialNormal:
        pytest.skip("local reparameterization needs a factorized Normal at the site; a "
                    "radial guide takes flipout")
    x, y = _data(device)
    model = _model(device)
    guide = guide_cls(model)
    elbo = TraceMeanField_ELBO() if guide_cls is not AutoRadialNormal else Trace_ELBO()
    context = handler() if handler is not None else pyro.poutine.messenger.Messenger()
    with context:
        loss = elbo.differentiable_loss(model, guide, x, y)
    loss.backward()
    params = [p for p in guide.parameters()] + list(model.parameters())
    assert loss.device.type == device.type and torch.isfinite(loss)
    assert params and all(p.device.type == device.type for p in params)
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in guide.parameters())


def test_iblm_on_device(device):
    x, y = _data(device)
    results = []
    for where in (torch.device("cpu"), device):
        pyro.clear_param_store()
        model = _model(where)
        guide = AutoKTiedNormal(model)
        init_guide_iblm(guide, (x.to(where), y.to(where)), batch_size=64)
        results.append({k: v.detach() for k, v in guide.named_parameters()})
    on_cpu, on_device = results
    assert on_cpu.keys() == on_device.keys()
    for name in on_cpu:
        assert on_device[name].device.type == device.type
        # I-BLM's regressions are deterministic: the same initialization on both
        assert _close(on_device[name], on_cpu[name]), name


def test_metrics_on_device(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 24, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (24,), generator=g)
    for metric in (error_rate, mnll, brier_score):
        value = metric(y.to(device), logits=logits.to(device))
        assert value.device.type == device.type
        assert _close(value, metric(y, logits=logits)), metric.__name__


def test_fit_on_device(device):
    x, y = _data(device)
    model = _model(device)
    guide = AutoKTiedNormal(model)
    history = fit(model, guide, (x, y), steps=4, batch_size=32, progress=False)
    assert len(history.loss) == 4 and all(torch.isfinite(torch.tensor(history.loss)))
    assert all(p.device.type == device.type for p in guide.parameters())


def test_batchnorm_model_on_device(device):
    # a deterministic layer beside the Bayesian ones: its parameters and buffers move too
    x, y = _data(device)
    torch.manual_seed(0)
    net = bayesianize(nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(),
                                    nn.Linear(8, 3))).double()
    model = BayesianClassifier(net, num_data=64).to(device)
    guide = AutoMeanFieldNormal(model)
    with local_reparam():
        loss = TraceMeanField_ELBO().differentiable_loss(model, guide, x, y)
    assert torch.isfinite(loss)
    assert net[1].running_mean.device.type == device.type


class _CNN(nn.Module):
    # the tutorial-style CNN: torch functions after a Bayesian conv (pooling, a conv of a
    # plain weight, a group norm, an eval-mode BatchNorm) fold the samples' dim
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.register_buffer("smooth", torch.ones(4, 4, 3, 3) / 36)
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        h = F.max_pool2d(torch.tanh(self.norm(self.conv(x))), 2)
        h = F.group_norm(F.conv2d(h, self.smooth, padding=1), 2)
        return self.fc(F.avg_pool2d(h, 2).flatten(-3))


def test_vectorized_predictive_of_a_cnn_on_device(device):
    # Predictive(parallel=True) on the device: each sample's logits equal the model run
    # on that sample's weights alone, and the same samples give the same logits on the CPU
    torch.manual_seed(0)
    model = BayesianClassifier(bayesianize(_CNN()).double()).eval().to(device)
    x = torch.randn(6, 1, 8, 8, dtype=torch.float64, device=device)
    guide = AutoMeanFieldNormal(model)
    guide(x, torch.arange(6, device=device) % 3)
    predictive = Predictive(model, guide=guide, num_samples=3, parallel=True,
                            return_sites=["_RETURN"])
    with torch.no_grad(), vectorized_layers():
        trace = predictive.get_vectorized_trace(x)
    logits = trace.nodes["_RETURN"]["value"]
    assert logits.shape == (3, 6, 3) and logits.device.type == device.type
    weights = {name: site["value"] for name, site in trace.nodes.items()
               if site["type"] == "sample" and name.startswith("net.")}
    with torch.no_grad():
        for s in range(3):
            one = {name: v[s].reshape(v.shape[2:]) for name, v in weights.items()}
            assert _close(logits[s], poutine.condition(model, one)(x)), s
        given = Predictive(model.cpu(), posterior_samples={k: v.cpu() for k, v in
                                                           weights.items()},
                           parallel=True, return_sites=["_RETURN"])
        with vectorized_layers():
            assert _close(logits, given(x.cpu())["_RETURN"])


def test_fit_with_vectorized_particles_on_device(device):
    x, y = _data(device)
    model = _model(device)
    guide = AutoKTiedNormal(model)
    history = fit(model, guide, (x, y), steps=3, batch_size=32, num_particles=2,
                  progress=False)
    assert len(history.loss) == 3 and all(torch.isfinite(torch.tensor(history.loss)))
    assert all(p.device.type == device.type for p in guide.parameters())


def test_a_weight_indexed_by_a_tensor_on_device(device):
    # the handlers follow a weight's view w[..., idx, :] with idx on the device (the
    # index of the view's elements is computed where idx lives)
    idx = torch.tensor([2, 0], device=device)

    def model(x, y=None):
        w = pyro.sample("w", pyro.distributions.Normal(
            torch.zeros(3, 5, dtype=torch.float64, device=device), 1.0).to_event(2))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", pyro.distributions.Categorical(logits=F.linear(x, w[..., idx, :])),
                        obs=y)
        return w

    x, y = _data(device)
    guide = AutoMeanFieldNormal(model)
    with warnings.catch_warnings(), local_reparam():
        warnings.simplefilter("ignore")  # (a gather of the weight keeps its ordinary sample)
        loss = TraceMeanField_ELBO().differentiable_loss(model, guide, x, y % 2)
    with torch.no_grad(), vectorized_layers():
        trace = Predictive(model, guide=guide, num_samples=3, parallel=True,
                           return_sites=["_RETURN", "obs"]).get_vectorized_trace(x)
    assert torch.isfinite(loss) and loss.device.type == device.type
    logits = trace.nodes["obs"]["fn"].logits
    w = trace.nodes["w"]["value"].squeeze(1)  # (3 samples, 1 plate's, 3, 5)
    assert logits.shape == (3, 64, 2)
    assert _close(logits, torch.log_softmax(x @ w[..., idx, :].mT, -1))
