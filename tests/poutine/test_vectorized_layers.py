"""Layers with a sample dim (issue 23 item 2): Predictive(parallel=True) and
vectorized particles on models built from nn.Linear / nn.Conv*d."""

import math
import re
import warnings
from functools import partial

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.infer import Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from pyro.nn import PyroModule, PyroSample

from pyro_vinit import (
    AutoKTiedNormal,
    AutoMeanFieldNormal,
    AutoRadialNormal,
    flipout,
    local_reparam,
    vectorized_layers,
)
from pyro_vinit.nn import BayesianClassifier, bayesianize
from pyro_vinit.poutine import LayerCallMessenger
from pyro_vinit.poutine._batched_modules import BatchedModules
from pyro_vinit.poutine._layer_ops import batched_layer
from tests.common import assert_close

GUIDES = [AutoNormal, AutoMeanFieldNormal, AutoKTiedNormal, AutoRadialNormal]


# ------------------------------------------------ the batched op against a loop


def _loop(op, x, w, b, kwargs):
    # F.<op> per sample s of w (S, 1, ...) and b (S, 1, out), x (N, ...) or (S, N, ...)
    outs = []
    for s in range(w.shape[0]):
        xs = x[s] if x.dim() == w.dim() - 1 else x
        outs.append(getattr(F, op)(xs, w[s, 0], None if b is None else b[s, 0], **kwargs))
    return torch.stack(outs)


CASES = {
    "linear": ("linear", (7, 4), (3, 4), {}),
    "linear, batched input": ("linear", (5, 7, 4), (3, 4), {}),
    "conv1d": ("conv1d", (7, 2, 9), (6, 2, 3), dict(stride=2, padding=1, dilation=1, groups=1)),
    "conv2d, groups": ("conv2d", (7, 4, 6, 6), (6, 2, 3, 3),
                       dict(stride=1, padding=1, dilation=2, groups=2)),
    "conv2d, batched input": ("conv2d", (5, 7, 2, 6, 6), (4, 2, 3, 3),
                              dict(stride=1, padding=0, dilation=1, groups=1)),
    "conv3d": ("conv3d", (3, 2, 4, 4, 4), (4, 2, 2, 2, 2),
               dict(stride=1, padding=0, dilation=1, groups=1)),
    "conv2d, default arguments": ("conv2d", (7, 2, 6, 6), (4, 2, 3, 3), {}),
}


@pytest.mark.parametrize("bias", ["batched", "plain", None])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_batched_layer_equals_a_loop_over_samples(case, bias):
    op, x_shape, w_shape, kwargs = CASES[case]
    S = 5
    x = torch.randn(x_shape, dtype=torch.float64)
    w = torch.randn((S, 1) + w_shape, dtype=torch.float64)
    b = {"batched": torch.randn(S, 1, w_shape[0], dtype=torch.float64),
         "plain": torch.randn(w_shape[0], dtype=torch.float64), None: None}[bias]
    out = batched_layer(op, x, w, b, kwargs)
    b_loop = b.expand(S, 1, w_shape[0]) if bias == "plain" else b
    expected = _loop(op, x, w, b_loop, kwargs)
    assert out.shape == expected.shape
    assert_close(out, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("x_shape, b_shape", [((7, 4), (3, 1)), ((5, 7, 4), (3, 1, 1))])
def test_batched_layer_with_a_1d_weight_and_a_batched_bias(x_shape, b_shape):
    # A 1-d weight (x @ w, one output and no output dim) plus a latent bias: only the bias
    # is batched, its batch dims (3, ...) broadcast with the input's.
    x = torch.randn(x_shape, dtype=torch.float64)
    w = torch.randn(4, dtype=torch.float64)
    b = torch.randn(b_shape, dtype=torch.float64)
    out = batched_layer("linear", x, w, b, {})
    expected = torch.stack([x @ w + b[s] for s in range(3)])
    assert out.shape == expected.shape
    assert_close(out, expected, atol=1e-12, rtol=1e-12)
    assert torch.equal(batched_layer("linear", x, w, None, {}), x @ w)


# name -> (op, input shape, weight shape, bias shape or None, kwargs): one batch dim of
# size 3 (and no plate dim) on the weight, the bias or both, and on the input or not.
ONE_BATCH_DIM = {
    "linear, batched weight": ("linear", (3, 4), (3, 2, 4), None, {}),
    "linear, batched weight and bias": ("linear", (3, 4), (3, 2, 4), (3, 2), {}),
    "linear, unbatched input, batched weight": ("linear", (4,), (3, 2, 4), None, {}),
    "linear, unbatched input, batched bias": ("linear", (4,), (2, 4), (3, 2), {}),
    "conv2d, batched weight": ("conv2d", (3, 2, 6, 6), (3, 4, 2, 3, 3), None,
                               dict(stride=1, padding=1, dilation=1, groups=1)),
    "conv2d, unbatched input, batched bias": ("conv2d", (2, 6, 6), (4, 2, 3, 3), (3, 4),
                                              dict(stride=2, padding=1, dilation=1, groups=1)),
}


@pytest.mark.parametrize("case", ONE_BATCH_DIM, ids=list(ONE_BATCH_DIM))
def test_run_layer_batches_a_weight_or_a_bias_with_a_batch_dim(case):
    # run_layer is F.<op> per element s of the batch, which F.<op> alone does not take (a
    # linear weight must be 2-d, a conv's bias 1-d): element s uses x[s], w[s] and b[s]
    # (each where batched).
    from pyro_vinit.poutine._layer_ops import is_batched, run_layer

    op, x_shape, w_shape, b_shape, kwargs = ONE_BATCH_DIM[case]
    nsp = 0 if op == "linear" else 2
    x = torch.randn(x_shape, dtype=torch.float64)
    w = torch.randn(w_shape, dtype=torch.float64)
    b = None if b_shape is None else torch.randn(b_shape, dtype=torch.float64)

    def element(t, s, event_dims):
        return t if t is None or t.dim() == event_dims else t[s]

    assert is_batched(op, w, b)
    out = run_layer(op, x, w, b, kwargs)
    expected = torch.stack([
        getattr(F, op)(element(x, s, nsp + 1), element(w, s, nsp + 2), element(b, s, 1),
                       **kwargs)
        for s in range(3)
    ])
    assert out.shape == expected.shape
    assert_close(out, expected, atol=1e-12, rtol=1e-12)
    # element 0 alone has no batch dims: F.<op> itself
    x0, w0, b0 = element(x, 0, nsp + 1), element(w, 0, nsp + 2), element(b, 0, 1)
    assert not is_batched(op, w0, b0)
    assert torch.equal(run_layer(op, x0, w0, b0, kwargs), getattr(F, op)(x0, w0, b0, **kwargs))


def test_batched_layer_with_more_input_batch_dims_than_the_weight():
    # x (Q, S, N, ...) and w (S, 1, ...): output [q, s] is the layer of x[q, s] with w[s].
    S, Q = 3, 2
    x = torch.randn(Q, S, 7, 2, 6, 6, dtype=torch.float64)
    w = torch.randn(S, 1, 4, 2, 3, 3, dtype=torch.float64)
    out = batched_layer("conv2d", x, w, None, dict(stride=1, padding=1))
    expected = torch.stack([torch.stack([F.conv2d(x[q, s], w[s, 0], padding=1)
                                         for s in range(S)]) for q in range(Q)])
    assert out.shape == expected.shape
    assert_close(out, expected, atol=1e-12, rtol=1e-12)


# ------------------------------------------------ Predictive(parallel=True)


def _mlp():
    torch.manual_seed(0)
    net = bayesianize(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
    return BayesianClassifier(net), torch.randn(10, 6)


def _cnn():
    torch.manual_seed(0)
    net = bayesianize(nn.Sequential(
        nn.Conv2d(1, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(-3),
        nn.Linear(4 * 4 * 4, 3)))
    return BayesianClassifier(net), torch.randn(10, 1, 8, 8)


def _matmul_mlp():
    # A functional model whose layers mix F.linear, x @ w.mT and x @ w (in, out)
    def model(x, y=None):
        w1 = pyro.sample("w1", dist.Normal(0.0, 1.0).expand([8, 6]).to_event(2))
        w2 = pyro.sample("w2", dist.Normal(0.0, 1.0).expand([5, 8]).to_event(2))
        w3 = pyro.sample("w3", dist.Normal(0.0, 1.0).expand([5, 3]).to_event(2))
        h = torch.relu(F.linear(x, w1))
        h = torch.relu(h @ w2.mT)
        logits = h @ w3
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits

    torch.manual_seed(0)
    return model, torch.randn(10, 6)


def _vectorized_trace(model, guide, x, num_samples=4):
    """The trace of Predictive(parallel=True) under vectorized_layers, returning _RETURN."""
    predictive = Predictive(model, guide=guide, num_samples=num_samples, parallel=True,
                            return_sites=["_RETURN"])
    with torch.no_grad(), vectorized_layers():
        return predictive.get_vectorized_trace(x)


def _sequential_outputs(model, trace, x, num_samples):
    # The model run once per sample, conditioned on that sample's weights.
    weights = {name: site["value"] for name, site in trace.nodes.items()
               if site["type"] == "sample" and name != "obs" and site["value"].dim() > 1}
    outs = []
    for s in range(num_samples):
        sample = {name: v[s].reshape(v.shape[2:]) for name, v in weights.items()}
        outs.append(poutine.condition(model, sample)(x))
    return torch.stack(outs)


@pytest.mark.parametrize("guide_class", GUIDES)
@pytest.mark.parametrize("make", [_mlp, _cnn, _matmul_mlp], ids=["mlp", "cnn", "matmul"])
def test_vectorized_predictive_equals_a_loop_over_its_samples(make, guide_class):
    # (matmul: a product x @ w.mT after a batched F.linear broadcast the two sample dims
    # into (S, S, N, out) and failed in Predictive's reshape)
    model, x = make()
    guide = guide_class(model)
    guide(x, torch.randint(0, 3, (10,)))
    num_samples = 4
    predictive = Predictive(model, guide=guide, num_samples=num_samples, parallel=True,
                            return_sites=["_RETURN", "obs"])
    with torch.no_grad(), vectorized_layers():
        trace = predictive.get_vectorized_trace(x)
    logits = trace.nodes["_RETURN"]["value"]
    assert logits.shape == (num_samples, 10, 3)
    with torch.no_grad():
        expected = _sequential_outputs(model, trace, x, num_samples)
    assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    # Predictive's own results, in its shapes
    with torch.no_grad():
        samples = vectorized_layers(predictive)(x)
    assert samples["_RETURN"].shape == (num_samples, 10, 3)
    assert samples["obs"].shape == (num_samples, 10)


def _latent_bias_model():
    # A deterministic weight with a latent bias, and observed data with an event dim.
    torch.manual_seed(0)
    layer = PyroModule[nn.Linear](4, 3)
    layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([3]).to_event(1))

    def model(x, y=None):
        f = layer(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(f, 1.0).to_event(1), obs=y)
        return f

    return model, layer


@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam, flipout])
def test_vectorized_predictive_with_only_the_bias_latent_and_observed_data(handler):
    # F.linear with a plain weight and a bias with a sample dim runs batched (F.linear
    # alone refuses the bias), and the observed data (10, 3), which lack the sample dim,
    # are left as they are: each sample's log-likelihood is the model's own.
    model, layer = _latent_bias_model()
    x, y = torch.randn(10, 4), torch.randn(10, 3)
    guide = AutoNormal(model)
    guide(x, y)
    predictive = Predictive(model, guide=guide, num_samples=4, parallel=True,
                            return_sites=["_RETURN"])
    with torch.no_grad(), handler():
        trace = predictive.get_vectorized_trace(x, y)
    b = trace.nodes["bias"]["value"]
    assert b.shape == (4, 1, 3)
    obs = trace.nodes["obs"]
    assert torch.equal(obs["value"], y)
    expected = F.linear(x, layer.weight.detach()) + b  # (4, 10, 3)
    assert_close(trace.nodes["_RETURN"]["value"], expected, atol=1e-6, rtol=1e-6)
    assert_close(obs["fn"].log_prob(y), dist.Normal(expected, 1.0).to_event(1).log_prob(y))


class _FrozenBatchNorm2d(nn.BatchNorm2d):  # a user's subclass
    pass


class _MaxPoolValues(nn.MaxPool2d):  # the values of a pooling with its indices
    def __init__(self, size):
        super().__init__(size, return_indices=True)

    def __call__(self, x):
        values, indices = super().__call__(x)
        assert indices.shape == values.shape
        return values


@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam])
def test_sequential_predictive_of_a_guide_with_plates(handler):
    # A per-example latent puts the guide's draws in a plate: Predictive(parallel=False)
    # then conditions the model on each weight as (1, out, in), which nn.Linear refuses
    # (plain Pyro fails too); under the handler each sample's weight takes its shape
    torch.manual_seed(0)
    net = bayesianize(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))

    def model(x, y=None):
        logits = net(x)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("obs", dist.Categorical(logits=logits + z[:, None]), obs=y)
        return logits

    x = torch.randn(10, 6)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (10,)))
    predictive = Predictive(model, guide=guide, num_samples=3,
                            return_sites=["_RETURN", "0.weight", "0.bias", "2.weight", "2.bias"])
    with pytest.raises(RuntimeError), torch.no_grad():
        predictive(x)  # (the control)
    with torch.no_grad(), handler():
        out = predictive(x)
    assert out["_RETURN"].shape == (3, 10, 3)
    if handler is local_reparam:
        return  # (its outputs are drawn per example, given the guide's law, not its draw)
    with torch.no_grad():
        for s in range(3):
            sample = {name: out[name][s].squeeze(0) for name in out if name != "_RETURN"}
            assert_close(out["_RETURN"][s], poutine.condition(model, sample)(x),
                         atol=1e-6, rtol=1e-6)


def _bn_cnn(norm, **options):
    torch.manual_seed(0)
    conv = [nn.Conv2d(1, 4, 3, stride=2, padding=1)]
    head = [nn.ReLU(), nn.Flatten(-3), nn.Linear(64, 3)]
    layers = {"1d": [nn.Flatten(-3), nn.Linear(64, 6), nn.BatchNorm1d(6), nn.ReLU(),
                     nn.Linear(6, 3)],
              "1d, length": [nn.Flatten(-2), nn.Conv1d(1, 4, 3, padding=1),
                             nn.BatchNorm1d(4), nn.ReLU(), nn.Flatten(-2),
                             nn.Linear(256, 3)],
              "2d": conv + [nn.BatchNorm2d(4, **options)] + head,
              "2d, a subclass": conv + [_FrozenBatchNorm2d(4)] + head,
              "sync": conv + [nn.SyncBatchNorm(4)] + head,
              # (pooling: with indices, adaptive, 1-d; the BatchNorm after them)
              "pooling": [nn.Conv2d(1, 4, 3, padding=1), nn.MaxPool2d(2), nn.BatchNorm2d(4),
                          nn.AdaptiveAvgPool2d(2), nn.ReLU(), nn.Flatten(-2),
                          nn.AvgPool1d(2), nn.Flatten(-2), nn.Linear(8, 3)],
              "pooling, indices": [nn.Conv2d(1, 4, 3, padding=1), _MaxPoolValues(2),
                                   nn.Flatten(-3), nn.Linear(64, 3)],
              "instance, group": conv + [nn.InstanceNorm2d(4, affine=True), nn.GroupNorm(2, 4)]
              + head}[norm]
    net = bayesianize(nn.Sequential(*layers))
    model = BayesianClassifier(net)
    x = torch.randn(10, 1, 8, 8)
    model(x)  # (train mode: the running statistics move away from 0 and 1)
    return model.eval(), x


@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam])
@pytest.mark.parametrize("norm", ["1d", "1d, length", "2d", "2d, a subclass", "sync",
                                  "pooling", "pooling, indices", "instance, group"])
def test_batch_norm_in_eval_mode_after_batched_layers_equals_a_loop_over_samples(norm,
                                                                                 handler):
    # A BatchNorm after a batched layer got its input with the samples' dim on the left,
    # which it refused ("expected 4D input (got 5D input)"); in eval mode it now
    # normalizes each sample with the running statistics, as a run per sample does
    model, x = _bn_cnn(norm)
    _assert_equals_a_loop_over_samples(model, x, handler)


def _assert_equals_a_loop_over_samples(model, x, handler):
    """A classifier's vectorized Predictive equals a run per sample, and so does one of
    those samples given to Predictive under ``handler``; returns the latter."""
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (len(x),)))
    trace = _vectorized_trace(model, guide, x)
    with torch.no_grad():
        expected = _sequential_outputs(model, trace, x, 4)
    assert_close(trace.nodes["_RETURN"]["value"], expected, atol=1e-5, rtol=1e-5)
    samples = {name: site["value"] for name, site in trace.nodes.items()
               if site["type"] == "sample" and name.startswith("net.")}
    given = Predictive(model, posterior_samples=samples, parallel=True,
                       return_sites=["_RETURN"])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # (given samples have no law: nothing to report)
        with handler():
            logits = given(x)["_RETURN"]
    assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    _assert_no_global_hooks()
    return given


@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam])
@pytest.mark.parametrize("run", ["Predictive", "a step"])
def test_observed_data_come_back_as_plain_tensors(handler, run):
    # the data lack the samples' dim: not a site value, which Predictive had returned
    # (and outside Predictive's samples no observed value is a given sample)
    model, _ = _latent_bias_model()
    x, y = torch.randn(10, 4), torch.randn(10, 3)
    guide = AutoNormal(model)
    guide(x, y)
    if run == "a step":
        with handler():
            trace = poutine.trace(model).get_trace(x, y)
        assert type(trace.nodes["obs"]["value"]) is torch.Tensor
        return
    with torch.no_grad(), handler():
        out = Predictive(model, guide=guide, num_samples=3, parallel=True,
                         return_sites=["bias", "obs"])(x, y)
    assert type(out["obs"]) is torch.Tensor and torch.equal(out["obs"], y.expand(3, 10, 3))


@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam])
@pytest.mark.parametrize("run", ["particles", "samples"])
def test_outputs_in_a_plate_at_dim_minus_two_are_refused(run, handler):
    # mu of shape (N, 1) in a data plate at dim=-2: the batched layers put the samples'
    # dim at -4, a latent sigma's is at -3, and the likelihood paired every particle's mu
    # with every particle's sigma (a vectorized loss of 153 against 67, unreported)
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, 3]).to_event(2))
        sigma = pyro.sample("sigma", dist.LogNormal(0.0, 1.0))
        mu = F.linear(x, w)
        with pyro.plate("data", x.shape[0], dim=-2):
            pyro.sample("obs", dist.Normal(mu, sigma), obs=y)

    x, y = torch.randn(20, 3), torch.randn(20, 1)
    guide = AutoNormal(model)
    guide(x, y)
    match = re.escape(
        "the site 'obs' has batch shape (4, 4, 20, 1), with dims left of the plate of the "
        "vectorized samples or particles (dim -3): a batched layer's output (its weight has "
        "the samples' dim) puts that dim left of the model's plate dims of the layer's "
        "input, and here the output's last dim is a plate's too (e.g. outputs (N, 1) in a "
        "data plate at dim=-2), so its samples' dim is one too far left. Give the outputs "
        "an event dim (pyro.plate('data', N) with dist.Normal(mu, sigma).to_event(1), or "
        "mu.squeeze(-1)), or take the samples or particles one at a time "
        "(Predictive(..., parallel=False); vectorize_particles=False, fit's "
        "num_particles=1)")
    with pytest.raises(ValueError, match=match), handler():
        if run == "particles":
            TraceMeanField_ELBO(num_particles=4, vectorize_particles=True).loss(
                model, guide, x, y)
        else:
            Predictive(model, guide=guide, num_samples=4, parallel=True)(x)
    _assert_no_global_hooks()


@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam])
def test_samples_given_within_the_handler_that_drew_them(handler):
    # one held handler: the guide's samples of one Predictive given to another (their
    # draw already used by the first run's layers) are given values, not a second use
    model, x = _mlp()
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (10,)))
    with torch.no_grad(), handler():
        drawn = Predictive(model, guide=guide, num_samples=3, parallel=True)(x)
        samples = {k: v for k, v in drawn.items() if k != "obs"}
        given = Predictive(model, posterior_samples=samples, parallel=True,
                           return_sites=["_RETURN"])
        logits = given(x)["_RETURN"]
    with torch.no_grad():
        expected = torch.stack([poutine.condition(model, {
            k: v[s].reshape(v.shape[2:]) for k, v in samples.items()})(x) for s in range(3)])
    assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def _assert_no_global_hooks():
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not torch.nn.modules.module._global_forward_hooks
    assert not torch.overrides._get_current_function_mode_stack()


@pytest.mark.parametrize("length, num_samples", [(5, 3), (4, 3), (5, 10), (4, 10)])
def test_batch_norm_of_an_input_without_sample_dims_is_left_alone(length, num_samples):
    # After a batched layer, a BatchNorm1d of plain data (N, C, L), not computed from
    # it, runs as it is (folded, it would be normalized over L), also where it leads
    # with as many rows as there are samples and L equals C (once taken for samples)
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4).eval()
    norm.running_mean.normal_()

    def model(x, series):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 6]).to_event(2))
        out = F.linear(x, w) + norm(series).mean(-1)[..., :3]
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(out, 1.0).to_event(1))
        return out

    x, series = torch.randn(10, 6), torch.randn(10, 4, length)
    guide = AutoNormal(model)
    guide(x, series)
    predictive = Predictive(model, guide=guide, num_samples=num_samples, parallel=True,
                            return_sites=["_RETURN"])
    with torch.no_grad(), vectorized_layers():
        trace = predictive.get_vectorized_trace(x, series)
    w = trace.nodes["w"]["value"]
    with torch.no_grad():
        expected = torch.stack([F.linear(x, w[s].reshape(3, 6)) + norm(series).mean(-1)[..., :3]
                                for s in range(num_samples)])
    assert_close(trace.nodes["_RETURN"]["value"], expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("norm", ["1d", "2d"])
def test_a_held_handler_folds_each_runs_samples(norm):
    # Two Predictive calls of other sample counts under one handler: each run's
    # BatchNorm folds its own samples (the first run's count had stayed, so that the
    # second's input was left as it was: wrong, with no error, where it still fit)
    model, x = _bn_cnn(norm)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (10,)))
    with torch.no_grad(), vectorized_layers():
        for num_samples in (4, 2, 6):
            predictive = Predictive(model, guide=guide, num_samples=num_samples,
                                    parallel=True, return_sites=["_RETURN"])
            trace = predictive.get_vectorized_trace(x)
            expected = _sequential_outputs(model, trace, x, num_samples)
            assert_close(trace.nodes["_RETURN"]["value"], expected, atol=1e-5, rtol=1e-5)


def test_a_held_handler_leaves_the_results_of_a_run_free_to_reduce():
    # a run's outputs lead with the samples; outside its plate, the caller's own reductions
    # over them (the predictive mean) are no model's dims counted from the left
    model, x = _cnn()
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (10,)))
    with torch.no_grad(), vectorized_layers():
        logits = Predictive(model, guide=guide, num_samples=4, parallel=True,
                            return_sites=["_RETURN"])(x)["_RETURN"]
        mean = logits.softmax(-1).mean(0)
        assert mean.shape == (10, 3) and logits.sum(1).shape == (4, 3)


def test_a_held_handler_leaves_batch_norms_alone_between_runs():
    # A handler held around several Predictive calls: after a run, another network's
    # BatchNorm on an input that leads with as many rows as there were samples is its own
    model, x = _bn_cnn("2d")
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (10,)))
    predictive = Predictive(model, guide=guide, num_samples=8, parallel=True)
    other = nn.BatchNorm1d(4).eval()
    other.running_mean.normal_()
    inputs = torch.randn(8, 4, 4)
    handler = vectorized_layers()
    with torch.no_grad():
        expected = other(inputs)
        with handler:
            predictive(x)
            assert torch.equal(other(inputs), expected)
            other.train()
            other(inputs)  # (train mode: not refused)
        _assert_no_global_hooks()
        with handler:  # (entered again)
            assert predictive(x)["obs"].shape == (8, 10)
    _assert_no_global_hooks()


_RUNNING = (torch.randn(4) * 0.1, torch.rand(4) + 0.5)  # (a BatchNorm's statistics)
_FUNCTIONAL = {
    "F.max_pool2d": lambda x: F.max_pool2d(x, 2),
    "F.max_pool2d, indices": lambda x: F.max_pool2d(x, 2, return_indices=True)[0],
    "F.avg_pool2d": lambda x: F.avg_pool2d(x, 2),
    "F.adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x, 4),
    "F.lp_pool2d": lambda x: F.lp_pool2d(x.abs() + 0.1, 2, 2),
    "F.max_pool1d": lambda x: F.max_pool1d(x.flatten(-2), 4).unflatten(-1, (4, 4)),
    "F.dropout2d, eval": lambda x: F.max_pool2d(F.dropout2d(x, 0.5, training=False), 2),
    "a plain conv": lambda x: F.conv2d(x, torch.ones(4, 4, 3, 3) / 36, stride=2, padding=1),
    "a plain conv, keywords": lambda x: F.max_pool2d(
        F.conv2d(input=x, weight=torch.ones(4, 4, 3, 3) / 36, padding=1), 2),
    "F.interpolate": lambda x: F.interpolate(x, scale_factor=0.5, mode="bilinear"),
    "F.interpolate, size": lambda x: F.interpolate(x, size=(4, 4)),
    "nn.Upsample": lambda x: nn.Upsample(size=4)(x),
    "F.batch_norm, eval": lambda x: F.max_pool2d(F.batch_norm(x, *_RUNNING), 2),
    "F.instance_norm": lambda x: F.max_pool2d(F.instance_norm(x), 2),
    "F.group_norm": lambda x: F.max_pool2d(F.group_norm(x, 2, torch.ones(4) * 2), 2),
    "F.local_response_norm": lambda x: F.max_pool2d(F.local_response_norm(x, 2, alpha=1.0), 2),
    "a Bayesian conv": None,  # (a layer call: left to the handler)
    "F.channel_shuffle": lambda x: F.max_pool2d(F.channel_shuffle(x, 2), 2),
    "F.pad, reflect": lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect")[..., 1:-1:2, 1:-1:2],
    "F.pad, replicate, positional": lambda x: F.pad(x, (1, 1, 1, 1), "replicate")[
        ..., 1:-1:2, 1:-1:2],
    "F.unfold, F.fold": lambda x: F.max_pool2d(F.fold(F.unfold(x, 2), (8, 8), 2), 2),
    "F.max_unpool2d": lambda x: F.max_pool2d(F.max_unpool2d(*F.max_pool2d(
        x, 2, return_indices=True), 2), 2),
    "nn.Softmax2d": lambda x: F.max_pool2d(nn.Softmax2d()(x), 2),
    "a module called by keyword": lambda x: nn.MaxPool2d(2)(input=x),
}


class _Functional(nn.Module):  # a CNN whose forward calls torch functions
    def __init__(self, tail):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(64, 3)
        self.tail = tail

    def forward(self, x):
        return self.fc(self.tail(torch.tanh(self.conv(x))).flatten(-3))


@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam])
@pytest.mark.parametrize("call", list(_FUNCTIONAL))
def test_torch_functions_after_batched_layers_equal_a_loop_over_samples(call, handler):
    # F.max_pool2d and the others took the samples' dim for one of theirs: refused inside
    # torch ("non-empty 3D or 4D tensor expected"), or misread (F.group_norm took the
    # rows for channels); they now fold the samples into the rows, as the modules do
    torch.manual_seed(0)
    tail = _FUNCTIONAL[call] or nn.Conv2d(4, 4, 3, stride=2, padding=1)
    model = BayesianClassifier(bayesianize(_Functional(tail)))
    given = _assert_equals_a_loop_over_samples(model, torch.randn(10, 1, 8, 8), handler)
    with pytest.raises(ValueError, match="vectorized_layers"):  # (the control: no handler)
        with torch.no_grad():
            given(torch.randn(10, 1, 8, 8))


class _SideBranch(nn.Module):  # the batched features and a branch of the plain input
    def __init__(self, side):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 3)
        self.side = side

    def forward(self, x):
        before = self.side(x)  # (before and after the batched layer)
        h = torch.tanh(self.conv(x)) + (before + self.side(x)).mean(-3, keepdim=True)
        return self.fc(h.flatten(-3))


@pytest.mark.parametrize("side", [
    lambda x: F.local_response_norm(x, 2, alpha=1.0), nn.GroupNorm(1, 3, affine=False),
    F.instance_norm, lambda x: F.avg_pool2d(F.interpolate(x, scale_factor=2), 2)],
    ids=["F.local_response_norm", "nn.GroupNorm", "F.instance_norm", "F.interpolate"])
def test_a_plain_tensor_as_long_as_the_samples_is_left_alone(side):
    # a plain input with as many rows as there are samples had been folded, by one call
    # of a held handler, and by the calls of the next runs before their batched layers
    torch.manual_seed(0)
    model = BayesianClassifier(bayesianize(_SideBranch(side)))
    x = torch.randn(4, 3, 8, 8)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (4,)))
    predictive = Predictive(model, guide=guide, num_samples=4, parallel=True,
                            return_sites=["_RETURN"])
    with torch.no_grad(), vectorized_layers():
        traces = [predictive.get_vectorized_trace(x) for _ in range(2)]
    for trace in traces:
        with torch.no_grad():
            expected = _sequential_outputs(model, trace, x, 4)
        assert_close(trace.nodes["_RETURN"]["value"], expected, atol=1e-5, rtol=1e-5)


def test_a_conv_of_a_plain_weight_and_a_latent_bias_is_left_to_the_handler():
    torch.manual_seed(0)
    net = bayesianize(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(),
                                    nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(-3),
                                    nn.Linear(4 * 8 * 8, 3)))
    net[2].weight = nn.Parameter(torch.randn(4, 4, 3, 3) / 6)  # (its bias stays latent)
    model = BayesianClassifier(net)
    x = torch.randn(6, 1, 8, 8)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (6,)))
    trace = _vectorized_trace(model, guide, x)
    with torch.no_grad():
        expected = _sequential_outputs(model, trace, x, 4)
    assert_close(trace.nodes["_RETURN"]["value"], expected, atol=1e-5, rtol=1e-5)


class _KeywordConvs(PyroModule):
    # convolutions after a batched layer whose latent weight or bias comes positionally
    # without a bias, or by keyword: each a layer call of the handler's, never folded
    def __init__(self, call):
        super().__init__()
        self.w1 = PyroSample(dist.Normal(0.0, 0.3).expand([4, 1, 3, 3]).to_event(4))
        self.w2 = PyroSample(dist.Normal(0.0, 0.3).expand([4, 4, 3, 3]).to_event(4))
        self.b2 = PyroSample(dist.Normal(0.0, 0.3).expand([4]).to_event(1))
        self.plain = torch.randn(4, 4, 3, 3) / 6
        self.fc = nn.Linear(4 * 8 * 8, 3)
        self.call = call

    def forward(self, x):
        h = torch.tanh(F.conv2d(x, self.w1, padding=1))
        return self.fc(torch.tanh(self.call(self, h)).flatten(-3))


_KEYWORD_CONVS = {
    "F.conv2d(h, w)": lambda m, h: F.conv2d(h, m.w2, padding=1),
    "F.conv2d(input=h, weight=w)": lambda m, h: F.conv2d(input=h, weight=m.w2, padding=1),
    "F.conv2d(h, plain, bias=b)": lambda m, h: F.conv2d(h, m.plain, bias=m.b2, padding=1),
    "a plain nn.Conv2d": lambda m, h: _PLAIN_CONV(h),  # (its bias and stride positional)
}
_PLAIN_CONV = nn.Conv2d(4, 4, 3, padding=1)


@pytest.mark.parametrize("call", list(_KEYWORD_CONVS))
def test_a_conv_by_position_or_keyword_after_batched_layers(call):
    torch.manual_seed(0)
    model = BayesianClassifier(_KeywordConvs(_KEYWORD_CONVS[call]))
    _assert_equals_a_loop_over_samples(model, torch.randn(6, 1, 8, 8), vectorized_layers)


def test_a_compiled_network_under_parallel_predictive():
    # (torch.compile had traced into the folding's torch function mode, and failed)
    torch.manual_seed(0)
    model = BayesianClassifier(bayesianize(_Functional(lambda x: F.max_pool2d(x, 2))))
    x = torch.randn(6, 1, 8, 8)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (6,)))
    model.net.forward = torch.compile(model.net.forward, backend="eager")
    trace = _vectorized_trace(model, guide, x)
    with torch.no_grad():
        expected = _sequential_outputs(model, trace, x, 4)
    assert_close(trace.nodes["_RETURN"]["value"], expected, atol=1e-5, rtol=1e-5)
    _assert_no_global_hooks()


@pytest.mark.parametrize("dropout", [F.dropout2d, F.feature_alpha_dropout])
def test_channel_dropout_of_vectorized_particles_drops_channels(dropout):
    # each (particle, row) gets its own mask over the channels, as one particle's rows do
    batched = BatchedModules()
    x = torch.ones(3, 5, 8, 4, 4)
    batched.watch(x, 1)
    try:
        with pyro.plate("num_particles_vectorized", 3, dim=-2):
            out = dropout(x, 0.5, training=True)[..., 0, 0]
    finally:
        batched.close()
    assert (out.std(-1) > 0).all()  # (a whole (particle, row) dropped had no spread)


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.enc(x).mean(-2))


@pytest.mark.parametrize("from_samples", [False, True])
@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam])
def test_a_use_of_a_batched_weight_that_torch_refuses_names_the_site(handler, from_samples):
    # the attention's output projection (F.multi_head_attention_forward: w.t()) failed
    # inside torch ("t() expects a tensor with <= 2 dimensions")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the attention's in_proj stays deterministic)
        model = BayesianClassifier(bayesianize(_Encoder()))
    x = torch.randn(6, 5, 8)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 2, (6,)))
    match = re.escape(
        "multi_head_attention_forward of the value of sample site "
        "'net.enc.self_attn.out_proj.weight', which leads with the dims of Predictive's "
        "samples (parallel=True) or of vectorized particles, failed (t() expects a tensor "
        "with <= 2 dimensions, but self is 4D): the handlers run F.linear, F.conv*d and "
        "matrix products batched over them, and any other use of a site's value must take "
        "them. Predict with Predictive(..., parallel=False) (or vectorize_particles=False), "
        "or keep the layer deterministic (bayesianize(..., exclude=[...]))")
    # from the guide, or from posterior samples (the model's message alone holds the value)
    predictive = (Predictive(model, posterior_samples=Predictive(
        model, guide=guide, num_samples=3, return_sites=[_OUT_PROJ])(x), parallel=True)
        if from_samples else Predictive(model, guide=guide, num_samples=3, parallel=True))
    with pytest.raises(ValueError, match=match), torch.no_grad(), handler():
        predictive(x)


_OUT_PROJ = "net.enc.self_attn.out_proj.weight"
_LEFT_DIMS = {
    # the tutorial's CNN: its class scores over the rows, or the samples merged into them
    "F.log_softmax(x, dim=1)": (lambda x: F.log_softmax(x.flatten(-3) @ torch.ones(64, 3), 1),
                                re.escape(
        "log_softmax(dim=1) of a tensor of shape (4, 10, 3) computed from a batched layer's "
        "output, which leads with the (4,) samples dims: a dim counted from the left lands "
        "on them. Count dims from the right, as models run with vectorized samples must: "
        "dim=-1\n")),
    "nn.Softmax(dim=1)": (lambda x: nn.Softmax(dim=1)(x.flatten(-3) @ torch.ones(64, 3)),
                          r"^nn\.Softmax\(dim=1\) of a tensor .* dim=-1\n"),
    # (the others (4, 10, 4, 4, 4) features of a conv: the model's (10, 4, 4, 4))
    "x.mean((2, 3))": (lambda x: x.mean((2, 3)) @ torch.ones(4, 3),
                       re.escape("mean(dim=(2, 3)) of a tensor of shape (4, 10, 4, 4, 4) "
                                 "computed from a batched layer's output, which leads with "
                                 "the (4,) samples dims: a dim counted from the left lands on "
                                 "them. Count dims from the right, as models run with "
                                 "vectorized samples must: dim=(-2, -1)\n")),
    "x.sum(1)": (lambda x: x.sum(1).flatten(-2) @ torch.ones(16, 3),
                 r"sum\(dim=1\) of a tensor .* dim=-3\n"),
    "torch.sum(input=x, dim=1)": (lambda x: torch.sum(input=x, dim=1).flatten(-2)
                                  @ torch.ones(16, 3), r"sum\(dim=1\) of a tensor .* dim=-3\n"),
    "torch.cat(tensors=..., dim=1)": (lambda x: torch.cat(tensors=[x, x], dim=1).flatten(-3)
                                      @ torch.ones(128, 3), r"cat\(dim=1\) .* dim=-3\n"),
    "x.amax(dim=1)": (lambda x: x.amax(dim=1).flatten(-2) @ torch.ones(16, 3),
                      r"amax\(dim=1\) .* dim=-3\n"),
    "x.logsumexp(1)": (lambda x: x.logsumexp(1).flatten(-2) @ torch.ones(16, 3),
                       r"logsumexp\(dim=1\) .* dim=-3\n"),
    "torch.cat(dim=1)": (lambda x: torch.cat([x, x], dim=1).flatten(-3) @ torch.ones(128, 3),
                         r"cat\(dim=1\) .* dim=-3\n"),
    "torch.stack(dim=1)": (lambda x: torch.stack([x, x], 1).flatten(-4) @ torch.ones(128, 3),
                           r"stack\(dim=1\) .* dim=-4\n"),
    "x.chunk(2, 1)": (lambda x: x.chunk(2, 1)[0].flatten(-3) @ torch.ones(32, 3),
                      r"chunk\(dim=1\) .* dim=-3\n"),
    "x.transpose(1, 2)": (lambda x: x.transpose(1, 2).flatten(-3) @ torch.ones(64, 3),
                          r"transpose\(dim0=1\) .* dim0=-3\n"),
    "x.unsqueeze(1)": (lambda x: x.unsqueeze(1).flatten(-4) @ torch.ones(64, 3),
                       r"unsqueeze\(dim=1\) .* dim=-4\n"),
    "F.normalize(x)": (lambda x: F.normalize(x).flatten(-3) @ torch.ones(64, 3),
                       r"normalize\(dim=1\) .* dim=-3\n"),
    "nn.Unflatten(1, ...)": (lambda x: nn.Unflatten(1, (2, 32))(x.flatten(-3)).sum(-1)
                             @ torch.ones(2, 3), r"^nn\.Unflatten\(dim=1\) .* dim=-1\n"),
}
_RIGHT_DIMS = {
    "x.mean((-2, -1))": lambda x: x.mean((-2, -1)) @ torch.ones(4, 3),
    "x.sum(-3)": lambda x: x.sum(-3).flatten(-2) @ torch.ones(16, 3),
    "torch.cat(dim=-3)": lambda x: torch.cat([x, x], dim=-3).flatten(-3) @ torch.ones(128, 3),
    "x.transpose(-2, -1)": lambda x: x.transpose(-2, -1).flatten(-3) @ torch.ones(64, 3),
    "F.normalize(x, dim=-3)": lambda x: F.normalize(x, dim=-3).flatten(-3) @ torch.ones(64, 3),
    "x.unsqueeze(-4)": lambda x: x.unsqueeze(-4).flatten(-4) @ torch.ones(64, 3),
}


class _ConvHead(nn.Module):  # a conv whose (samples, 10, 4, 4, 4) features a head takes
    def __init__(self, head):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.head = head

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)))


@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam])
@pytest.mark.parametrize("case", list(_LEFT_DIMS))
def test_dims_counted_from_the_left_after_batched_layers_are_refused(case, handler):
    # F.log_softmax(x, dim=1) had normalized over the rows (error 0.28 against 0.13, with
    # no word said); x.mean((2, 3)), x.sum(1), torch.cat(dim=1) and the others acted on
    # other dims than the model's, silently where the shapes still fit
    head, match = _LEFT_DIMS[case]
    torch.manual_seed(0)
    model = BayesianClassifier(bayesianize(_ConvHead(head)))
    x = torch.randn(10, 1, 8, 8)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (10,)))  # (one run at a time: the model's own dims)
    with pytest.raises(ValueError, match=match), torch.no_grad(), handler():
        Predictive(model, guide=guide, num_samples=4, parallel=True)(x)
    _assert_no_global_hooks()


def _weight_view_model(shape, view):
    # A functional model whose weight reaches F.linear as a (3, 4) or (5, 4) matrix through
    # the model's own view of it
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand(shape).to_event(len(shape)))
        f = F.linear(x, view(w))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=f[..., :3]), obs=y)
        return f[..., :3]

    return model


_MOVES = (r".*, indexes, moves or merges them \(a result of shape .*\): a model run with "
          r"vectorized samples must count a value's dims from the right \(w\[\.\.\., :3, :\] "
          r"for the first three rows")
_FAILS = r".*, failed \({}.*\): a model run with vectorized samples must count"
_DIM = r".*: a dim counted from the left lands on them. Count dims from the right, .*: {}\n"
_WEIGHT_VIEWS_FROM_THE_LEFT = {  # shape, the model's use of w, what the refusal says
    "w[:3]": ([5, 4], lambda w: w[:3], "getitem", _MOVES),
    "w.reshape(-1, 4)": ([5, 4], lambda w: w.reshape(-1, 4), "reshape", _MOVES),
    "w.t()": ([4, 5], lambda w: w.t(), "t", _FAILS.format(r"t\(\) expects")),
    "w.T": ([4, 5], lambda w: w.T, "T", _MOVES),
    "w.view(5, 4)": ([20], lambda w: w.view(5, 4), "view", _FAILS.format("shape")),
    "w[[5, 4, 3, 2, 1, 0]]": ([6, 4], lambda w: w[[5, 4, 3, 2, 1, 0]], "getitem",  # (six
        _MOVES + "|" + _FAILS.format("index 5 is out of bounds")),  # samples; four particles)
    "w.narrow(0, 0, 3)": ([5, 4], lambda w: w.narrow(0, 0, 3), r"narrow\(dim=0\)",
                          _DIM.format("dim=-2")),
    "w.transpose(0, 1)": ([4, 5], lambda w: w.transpose(0, 1), r"transpose\(dim0=0\)",
                          _DIM.format("dim0=-2")),
    "w.flip(0)": ([5, 4], lambda w: w.flip(0), r"flip\(dims=0\)", _DIM.format("dims=-2")),
    "torch.roll(w, 1, 0)": ([5, 4], lambda w: torch.roll(w, 1, 0), r"roll\(dims=0\)",
                            _DIM.format("dims=-2")),
    "w.index_select(0, idx)": ([5, 4], lambda w: w.index_select(0, torch.tensor([2, 1, 0])),
                               r"index_select\(dim=0\)", _DIM.format("dim=-2")),
    "w.chunk(2)": ([6, 4], lambda w: w.chunk(2)[0], r"chunk\(dim=0\)", _DIM.format("dim=-2")),
    "w.unflatten(dim=0, sizes=(5, 4))": ([20], lambda w: w.unflatten(dim=0, sizes=(5, 4)),
                                         r"unflatten\(dim=0\)", _DIM.format("dim=-1")),
    # (torch fails on the samples' dim, fewer than the rows: the refusal reads the keywords)
    "w.narrow(dim=0, start=5, length=3)": ([8, 4], lambda w: w.narrow(dim=0, start=5,
                                                                      length=3),
                                           r"narrow\(dim=0\)", _DIM.format("dim=-2")),
    # the model's lists of tensors (torch.cat's), read by the first draw in them
    "torch.cat([w, w])": ([5, 4], lambda w: torch.cat([w, w]), r"cat\(dim=0\)",
                          _DIM.format("dim=-2")),
    "torch.cat(tensors=[w, w], dim=0)": ([5, 4], lambda w: torch.cat(tensors=[w, w], dim=0),
                                         r"cat\(dim=0\)", _DIM.format("dim=-2")),
    "torch.cat([w * 0, w])": ([5, 4], lambda w: torch.cat([w * 0, w]), r"cat\(dim=0\)",
                              _DIM.format("dim=-2")),
    "torch.stack([w, w]).sum(0)": ([5, 4], lambda w: torch.stack([w, w]).sum(0),
                                   r"stack\(dim=0\)", _DIM.format("dim=-3")),
}
_WEIGHT_VIEWS_FROM_THE_RIGHT = {
    "w[..., :3, :]": ([5, 4], lambda w: w[..., :3, :]),
    "w.narrow(-2, 0, 3)": ([5, 4], lambda w: w.narrow(-2, 0, 3)),
    "w.mT": ([4, 5], lambda w: w.mT),
    "w.transpose(-1, -2)": ([4, 5], lambda w: w.transpose(-1, -2)),
    "w.unflatten(-1, (5, 4))": ([20], lambda w: w.unflatten(-1, (5, 4))),
    "w.flatten(-2).unflatten(-1, (5, 4))": ([5, 4], lambda w: w.flatten(-2).unflatten(
        -1, (5, 4))),
    "w.chunk(2, -2)[1]": ([6, 4], lambda w: w.chunk(2, -2)[1]),  # (a tuple of views)
    "torch.split(w, [1, 3], -2)[1]": ([4, 4], lambda w: torch.split(w, [1, 3], -2)[1]),
}


@pytest.mark.filterwarnings("ignore:The use of `x.T` on tensors")
@pytest.mark.parametrize("run", ["the guide's samples", "given samples", "particles"])
@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam, flipout])
@pytest.mark.parametrize("view", list(_WEIGHT_VIEWS_FROM_THE_LEFT))
def test_a_view_of_a_weight_counted_from_the_left_is_refused_by_name(view, handler, run):
    # w[:3] of a weight drawn with the samples' dim on its left took the first three
    # samples (Pyro's shape mismatch at the likelihood; with three particles, none said),
    # and w.reshape(-1, 4) merged them into the rows (a layer of 30 units); w.t() and
    # w.view(5, 4) failed inside torch; with six samples, w[[5, 4, ...]] reversed them, and
    # so did w.flip(0) with as many samples as rows
    shape, use, op, says = _WEIGHT_VIEWS_FROM_THE_LEFT[view]
    model = _weight_view_model(shape, use)
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    guide = AutoNormal(model)
    guide(x, y)  # (one run at a time: the model's own dims)
    match = (rf"(?s)^{op} of the value of sample site 'w', of shape \(\d+, 1, [\d, ]+\), which "
             rf"leads with the dims of Predictive's samples \(parallel=True\) or of vectorized "
             rf"particles({says})")
    predictive = Predictive(model, guide=guide, num_samples=6, parallel=True)
    before = {k: v.clone() for k, v in pyro.get_param_store().items()}
    with pytest.raises(ValueError, match=match), torch.no_grad(), handler():
        if run == "the guide's samples":
            predictive(x)
        elif run == "given samples":
            samples = {"w": torch.randn(6, 1, *shape)}
            Predictive(model, posterior_samples=samples, parallel=True)(x)
        else:
            Trace_ELBO(num_particles=4, vectorize_particles=True,
                       max_plate_nesting=1).loss(model, guide, x, y)
    assert all(torch.equal(v, before[k]) for k, v in pyro.get_param_store().items())


_OTHER_RANKS = {  # shape, the model's use of w, the refused op, the spelling it advises
    # a view of other dims than the site's: the dim counted within the view's own
    "torch.cat([v, v], 2), v = w.unflatten(-1, (2, 2))": (
        [5, 4], lambda w: torch.cat([w.unflatten(-1, (2, 2))] * 2, 2)[..., 0, :],
        r"cat\(dim=2\)", "dim=-1"),
    "w.unflatten(-1, (2, 2)).flip(2)": (
        [5, 4], lambda w: w.unflatten(-1, (2, 2)).flip(2).flatten(-2), r"flip\(dims=2\)",
        "dims=-1"),
    "w.flatten(-2).narrow(0, 0, 12)": (
        [3, 8], lambda w: w.flatten(-2).narrow(0, 0, 12).unflatten(-1, (3, 4)),
        r"narrow\(dim=0\)", "dim=-1"),
    "w.chunk(2)": ([6, 4], lambda w: w.chunk(2)[0], r"chunk\(dim=0\)", "dim=-2"),
}


@pytest.mark.parametrize("guide_class", [AutoNormal, AutoDiagonalNormal])
@pytest.mark.parametrize("view", list(_OTHER_RANKS))
def test_a_dim_counted_from_the_left_is_advised_within_the_views_own_dims(view, guide_class):
    # the samples' dims are the model site's, whatever dims the view and the guide's draw
    # have: a view that unflattens took the samples for one dim more, and
    # AutoDiagonalNormal's flat latent (one dim) for one fewer (w.chunk(2) advised dim=-1)
    shape, use, op, advice = _OTHER_RANKS[view]
    model = _weight_view_model(shape, use)
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    guide = guide_class(model)
    guide(x, y)
    match = (rf"^{op} of the value of sample site 'w', of shape \(6, 1, [\d, ]+\), .*: a dim "
             rf"counted from the left lands on them. Count dims from the right, as models run "
             rf"with vectorized samples must: {advice}\n")
    with pytest.raises(ValueError, match=match), torch.no_grad(), vectorized_layers():
        Predictive(model, guide=guide, num_samples=6, parallel=True)(x)


@pytest.mark.parametrize("view", list(_WEIGHT_VIEWS_FROM_THE_RIGHT))
def test_a_view_of_a_weight_counted_from_the_right_equals_a_loop_over_samples(view):
    model = _weight_view_model(*_WEIGHT_VIEWS_FROM_THE_RIGHT[view])
    x = torch.randn(10, 4)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (10,)))
    trace = _vectorized_trace(model, guide, x)
    with torch.no_grad():
        expected = _sequential_outputs(model, trace, x, 4)
    assert trace.nodes["_RETURN"]["value"].shape == (4, 10, 3)
    assert_close(trace.nodes["_RETURN"]["value"], expected, atol=1e-5, rtol=1e-5)
    given = Predictive(model, posterior_samples={"w": trace.nodes["w"]["value"]},
                       parallel=True, return_sites=["_RETURN"])
    with torch.no_grad(), vectorized_layers():
        assert_close(given(x)["_RETURN"], expected, atol=1e-5, rtol=1e-5)


def _plate_models(use=lambda a: a):
    # indices into the model's own plate dims, counted from the right (Pyro's spelling)
    group = torch.arange(10) % 4

    def intercepts(x, y=None):  # a hierarchical model: an intercept per group
        with pyro.plate("groups", 4):
            a = pyro.sample("a", dist.Normal(0.0, 1.0))
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 4]).to_event(2))
        f = F.linear(x, w) + use(a)[..., group].unsqueeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=f), obs=y)
        return f

    return {"a[..., group]": intercepts}


@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam, flipout])
@pytest.mark.parametrize("case", list(_plate_models()))
def test_an_index_into_a_plate_dim_counted_from_the_right_runs(case, handler):
    # the model's own plate dims are no sample dims: a[..., group] had been refused
    model = _plate_models()[case]
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    guide = AutoNormal(model)
    guide(x, y)
    with torch.no_grad(), handler():
        samples = Predictive(model, guide=guide, num_samples=5, parallel=True,
                             return_sites=["_RETURN"])(x)
        loss = Trace_ELBO(num_particles=4, vectorize_particles=True,
                          max_plate_nesting=1).loss(model, guide, x, y)
    assert samples["_RETURN"].shape == (5, 10, 3) and math.isfinite(loss)
    pyro.clear_param_store()
    flipped = _plate_models(lambda a: a.flip(0))[case]  # (the groups, counted from the left)
    guide = AutoNormal(flipped)
    guide(x, y)
    with pytest.raises(ValueError, match=r"^flip\(dims=0\) of the value of sample site 'a', "
                       r"of shape \(5, 4\), .* dims=-1\n"), torch.no_grad(), handler():
        Predictive(flipped, guide=guide, num_samples=5, parallel=True)(x)
    if handler is vectorized_layers:  # (the guide's samples themselves: a run per sample)
        trace = _vectorized_trace(model, guide, x, num_samples=5)
        outs = []
        for s in range(5):
            given = {name: trace.nodes[name]["value"][s].reshape(shape)
                     for name, shape in (("a", (4,)), ("w", (3, 4)))}
            with torch.no_grad():
                outs.append(poutine.condition(model, given)(x))
        assert_close(trace.nodes["_RETURN"]["value"], torch.stack(outs), atol=1e-5, rtol=1e-5)


def test_a_view_counted_from_the_left_of_one_sample_runs():
    # (one sample: w.view(5, 4) of its (1, 1, 20) holds the weight, as a run without it)
    model = _weight_view_model([20], lambda w: w.view(5, 4))
    x = torch.randn(10, 4)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (10,)))
    trace = _vectorized_trace(model, guide, x, num_samples=1)
    with torch.no_grad():
        expected = _sequential_outputs(model, trace, x, 1)
    assert_close(trace.nodes["_RETURN"]["value"].reshape(1, 10, 3), expected)


def test_dims_counted_from_the_left_after_two_batched_layers_name_the_samples():
    # (the second batched layer, whose input has the samples' dims already, keeps them)
    torch.manual_seed(0)
    net = bayesianize(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))

    def model(x, y=None):
        logits = F.log_softmax(net(x), dim=1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)

    x = torch.randn(10, 4)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (10,)))
    with pytest.raises(ValueError, match=re.escape(
            "log_softmax(dim=1) of a tensor of shape (4, 10, 3) computed from a batched "
            "layer's output, which leads with the (4,) samples dims: a dim counted from the "
            "left lands on them. Count dims from the right, as models run with vectorized "
            "samples must: dim=-1\n")), torch.no_grad(), vectorized_layers():
        Predictive(model, guide=guide, num_samples=4, parallel=True)(x)


class _FoldedGRU(nn.Module):
    # the fold-and-unfold idiom: the model's own dims of the folded tensor, counted from
    # the left, are right there (the samples are merged into its rows)
    def __init__(self, tail):
        super().__init__()
        self.inp, self.fc = nn.Linear(20, 30), nn.Linear(6, 3)
        self.rnn = nn.GRU(6, 6, batch_first=True)
        self.smooth = nn.Conv1d(6, 6, 3, padding=1)
        self.norm = nn.BatchNorm1d(6).eval()
        self.norm6 = nn.BatchNorm1d(30).eval()
        self.tail = tail

    def forward(self, x):
        h = torch.tanh(self.inp(x)).unflatten(-1, (5, 6))  # (..., batch, time, features)
        o, _ = self.rnn(h.reshape(-1, 5, 6))
        return self.fc(self.tail(self, o, h).reshape(*h.shape[:-2], 6))


_FOLDED = {
    "o.mean(1)": lambda m, o, h: o.mean(1),
    "o.transpose(1, 2) into a Conv1d": lambda m, o, h: m.smooth(o.transpose(1, 2)).amax(-1),
    # (unfolded: the samples in front again, folded by the pooling and the BatchNorm)
    "unfolded, F.max_pool1d": lambda m, o, h: F.max_pool1d(
        o.reshape(*h.shape[:-2], 5, 6).transpose(-1, -2), 5).squeeze(-1),
    "unfolded, BatchNorm1d": lambda m, o, h: m.norm(
        (o.reshape(h.shape) + h).transpose(-1, -2)).mean(-1),
    # (the model's own batch and time merged: the samples stay in front)
    "h.flatten(-3, -2), BatchNorm1d": lambda m, o, h: m.norm(
        h.flatten(-3, -2)).unflatten(-2, h.shape[-3:-1]).mean(-2),
    # (other unfolds: the rows split again, the samples in front)
    "unfolded by unflatten(0, lead)": lambda m, o, h: F.max_pool1d(
        o.unflatten(0, h.shape[:-2]).transpose(-1, -2), 5).squeeze(-1),
    "unfolded by view_as": lambda m, o, h: m.norm(o.view_as(h).transpose(-1, -2)).mean(-1),
    "unfolded to the same rank": lambda m, o, h: m.norm6(
        o.reshape(*h.shape[:-2], 30)).unflatten(-1, (5, 6)).mean(-2),
    "unfolded by unflatten(dim=0, sizes=lead)": lambda m, o, h: F.max_pool1d(
        o.unflatten(dim=0, sizes=h.shape[:-2]).transpose(-1, -2), 5).squeeze(-1),
    "unfolded by reshape(shape=...)": lambda m, o, h: m.norm(
        o.reshape(shape=h.shape).transpose(-1, -2)).mean(-1),
    # (a fold by unflatten of its own: still folded)
    "folded by reshape(-1, 30).unflatten(-1, ...)": lambda m, o, h: m.rnn(
        h.reshape(-1, 30).unflatten(-1, (5, 6)))[0].mean(1),
    "folded by reshape(-1, 30).unflatten(1, ...)": lambda m, o, h: m.rnn(
        h.reshape(-1, 30).unflatten(1, (5, 6)))[0].mean(1),
    "folded by reshape((-1, 5, 6))": lambda m, o, h: m.rnn(h.reshape((-1, 5, 6)))[0].mean(1),
    "folded by reshape(shape=(-1, 5, 6))": lambda m, o, h: m.rnn(
        h.reshape(shape=(-1, 5, 6)))[0].mean(1),
    "folded by view(size=(-1, 5, 6))": lambda m, o, h: m.rnn(
        h.contiguous().view(size=(-1, 5, 6)))[0].mean(1),
    "folded by flatten(start_dim=0, end_dim=-3)": lambda m, o, h: m.rnn(
        h.flatten(start_dim=0, end_dim=-3))[0].mean(1),
}


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("tail", list(_FOLDED))
def test_dims_counted_from_the_left_of_a_folded_tensor_run(tail, rows):
    # with one row, the folded (samples * 1, time, features) had the shape of a tensor
    # that leads with the samples: o.mean(1) was refused, its advice (dim=-1) wrong
    if rows == 1 and tail == "unfolded to the same rank":
        pytest.skip("one row: an unfold to the same rank has the shape of the fold")
    torch.manual_seed(0)
    net = bayesianize(_FoldedGRU(_FOLDED[tail]), exclude=[nn.GRU, nn.Conv1d, nn.BatchNorm1d])
    _assert_equals_a_loop_over_samples(BayesianClassifier(net), torch.randn(rows, 20),
                                       vectorized_layers)


_FOLDED_WRONG = {  # a use of the folded tensor's first dim, where the samples are merged
    "F.softmax(o, dim=0)": (lambda m, o, h: F.softmax(o, dim=0).mean(1),
                            r"^softmax\(dim=0\) of a tensor of shape \(24, 5, 6\) into whose "
                            r"first dim a reshape merged the \(4,\) samples dims .* over that "
                            r"dim it mixes them"),
    "F.softmax(dim=0) of a fold by sizes": (
        lambda m, o, h: F.softmax(m.rnn(h.reshape(math.prod(h.shape[:-2]), 5, 6))[0],
                                  dim=0).mean(1),
        r"^softmax\(dim=0\) of a tensor of shape \(24, 5, 6\) into whose first dim .* "
        r"Unfold first \(x\.reshape\(\*lead, T, H\), lead the dims before the fold\) and "
        r"count the dim from the right\n"),
    "a Bayesian layer on the folded rows": (
        lambda m, o, h: m.fc(o.mean(1)),
        "^" + re.escape(
            "F.linear (sample site 'net.fc.weight') runs batched over the samples or "
            "particles on an input of shape (24, 6) into whose first dim a reshape merged "
            "their dims (a fold, as x.reshape(-1, T, H) around an LSTM, or x.view(-1, "
            "features)): every sample's weight would meet every sample's rows. Unfold first "
            "(x.reshape(*lead, T, H), lead the dims before the fold), flatten from the right "
            "(x.flatten(-3)), or keep the layer deterministic (bayesianize(..., "
            "exclude=[...]))\n")),
}


@pytest.mark.parametrize("case", list(_FOLDED_WRONG))
def test_a_use_of_a_folded_tensors_first_dim_is_refused(case):
    # the samples merged into the folded rows: softmax over them had mixed the samples
    # (error 0.28), and a Bayesian layer had run every sample's weight on every sample's
    # rows (silently, with a -1 in the unfold)
    tail, match = _FOLDED_WRONG[case]
    torch.manual_seed(0)
    net = bayesianize(_FoldedGRU(tail), exclude=[nn.GRU, nn.Conv1d, nn.BatchNorm1d])
    if case.startswith("a Bayesian"):
        net.fc = bayesianize(nn.Linear(6, 6))
    model = BayesianClassifier(net)
    x = torch.randn(6, 20)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (6,)))
    with pytest.raises(ValueError, match=match), torch.no_grad(), vectorized_layers():
        Predictive(model, guide=guide, num_samples=4, parallel=True)(x)


def test_a_dim_counted_from_the_left_of_an_unfolded_tensor_is_refused():
    # (the samples back in front after the fold: the model's dims are checked again)
    torch.manual_seed(0)
    net = bayesianize(_FoldedGRU(lambda m, o, h: o.reshape(h.shape).mean(1)),
                      exclude=[nn.GRU, nn.Conv1d, nn.BatchNorm1d])
    model = BayesianClassifier(net)
    x = torch.randn(6, 20)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (6,)))
    with pytest.raises(ValueError, match=r"^mean\(dim=1\) of a tensor of shape \(4, 6, 5, 6\)"
                       r".* dim=-2\n"), torch.no_grad(), vectorized_layers():
        Predictive(model, guide=guide, num_samples=4, parallel=True)(x)


@pytest.mark.parametrize("run", ["samples", "particles"])
@pytest.mark.parametrize("dim", [1, None])
def test_a_dim_module_inside_a_bayesianized_network_is_refused(run, dim):
    # nn.LogSoftmax(dim=1) inside the network: torch's and Pyro's frames only, so the
    # check of the model's own calls had let it normalize over the rows (error 1.08);
    # with no dim, torch's implicit dim of a 3-dim tensor is its first (error 0.42)
    torch.manual_seed(0)
    model = BayesianClassifier(bayesianize(nn.Sequential(nn.Linear(4, 3),
                                                         nn.LogSoftmax(dim=dim))))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    guide = AutoNormal(model)
    guide(x, y)
    match = (rf"^nn\.LogSoftmax\(dim={dim}\) of a tensor of shape .* Count dims from the "
             r"right, .*: dim=-1\n")
    with pytest.raises(ValueError, match=match), torch.no_grad(), vectorized_layers():
        if run == "samples":
            Predictive(model, guide=guide, num_samples=4, parallel=True)(x)
        else:
            Trace_ELBO(num_particles=4, vectorize_particles=True,
                       max_plate_nesting=1).loss(model, guide, x, y)


def test_a_dim_counted_from_the_left_after_a_broadcast_of_the_particles_plates():
    # the particles' dims (4, 1) (two plate dims): a model tensor (2, 1, 3) broadcast their
    # singleton, so
    # the sum's tensor (4, 2, 6, 3) no longer led with them, and z.logsumexp(0) (the
    # model's 2) ran over the particles: loss 30.2 against 43.7
    torch.manual_seed(0)
    net, offset = bayesianize(nn.Linear(4, 3)), torch.randn(2, 1, 3)

    def model(x, y=None):
        logits = (net(x) + offset).logsumexp(0)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)

    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    guide = AutoNormal(model)
    guide(x, y)
    with pytest.raises(ValueError, match=re.escape(
            "logsumexp(dim=0) of a tensor of shape (4, 2, 6, 3) computed from a batched "
            "layer's output, which leads with the (4,) particles dims")), vectorized_layers():
        Trace_ELBO(num_particles=4, vectorize_particles=True,
                   max_plate_nesting=2).loss(model, guide, x, y)


@pytest.mark.parametrize("case", list(_RIGHT_DIMS))
def test_dims_counted_from_the_right_after_batched_layers_equal_a_loop_over_samples(case):
    torch.manual_seed(0)
    _assert_equals_a_loop_over_samples(BayesianClassifier(bayesianize(_ConvHead(
        _RIGHT_DIMS[case]))), torch.randn(10, 1, 8, 8), vectorized_layers)


def test_a_softmax_over_a_dim_counted_from_the_batched_tensor_runs():
    # (its dim, past the model's own rank, lands on the classes: right, not refused)
    model = BayesianClassifier(bayesianize(_Functional(
        lambda x: F.max_pool2d(F.log_softmax(x, dim=x.dim() - 1), 2))))
    _assert_equals_a_loop_over_samples(model, torch.randn(10, 1, 8, 8), vectorized_layers)


def test_functional_batch_norm_with_batch_statistics_after_batched_layers_is_refused():
    torch.manual_seed(0)
    tail = partial(F.batch_norm, running_mean=None, running_var=None, training=True)
    model = BayesianClassifier(bayesianize(_Functional(tail)))
    x = torch.randn(10, 1, 4, 4)
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (10,)))
    with pytest.raises(ValueError, match=r"F\.batch_norm in train mode normalizes with the "
                                         r"statistics of its batch, which the \(4,\) samples"):
        with torch.no_grad(), vectorized_layers():
            Predictive(model, guide=guide, num_samples=4, parallel=True)(x)
    _assert_no_global_hooks()


@pytest.mark.parametrize("case", ["train", "no running statistics", "particles"])
def test_batch_norm_with_batch_statistics_after_batched_layers_is_refused(case):
    model, x = _bn_cnn("2d", track_running_stats=case != "no running statistics")
    y = torch.randint(0, 3, (10,))
    guide = AutoNormal(model)
    guide(x, y)
    if case == "train":
        model.train()
        match = (r"BatchNorm2d in train mode normalizes with the statistics of its batch, "
                 r"which the \(4,\) samples .*parallel=False\)\), or predict in eval mode "
                 r"\(model\.eval\(\)\); the runs Predictive made before this one, one "
                 r"sample at a time in train mode, have updated its running statistics: "
                 r"restore them")
        run = Predictive(model, guide=guide, num_samples=4, parallel=True)
    elif case == "no running statistics":
        match = (r"BatchNorm2d without running statistics \(track_running_stats=False\) "
                 r"normalizes with the statistics of its batch, .*parallel=False\)\)\n")
        run = Predictive(model, guide=guide, num_samples=4, parallel=True)
    else:
        model.train()
        match = (r"the \(2,\) particles .*vectorize_particles=False; fit's "
                 r"num_particles=1\)\n")  # (no advice of predicting in eval mode)
        elbo = Trace_ELBO(num_particles=2, vectorize_particles=True, max_plate_nesting=1)
        run = partial(elbo.loss, model, guide)
    with pytest.raises(ValueError, match=match):
        with torch.no_grad(), vectorized_layers():
            run(x, y) if case == "particles" else run(x)
    _assert_no_global_hooks()


@pytest.mark.parametrize("make", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_without_the_handler_pyro_fails(make):
    # The control: Pyro's Predictive alone cannot run these models vectorized (torch
    # refused it deep inside); the library's models say which handler runs it
    model, x = make()
    guide = AutoNormal(model)
    guide(x, torch.randint(0, 3, (10,)))
    predictive = Predictive(model, guide=guide, num_samples=3, parallel=True)
    with pytest.raises(ValueError, match=r"BayesianClassifier: the samples of "
                       r"Predictive\(parallel=True\) .*pyro_vinit\.poutine\."
                       r"vectorized_layers\(\)"), torch.no_grad():
        predictive(x)
    with pytest.raises(RuntimeError), torch.no_grad():  # (a model of its own: torch's)
        Predictive(lambda x: model.net(x), num_samples=3, parallel=True)(x)


@pytest.mark.parametrize("handler", [local_reparam, flipout])
def test_weight_noise_predictive_matches_sequential_by_moments(handler):
    # The CNN under a weight-noise handler: per example, the predictive mean (z under
    # 5) and standard deviation (within 25%) of the sequential and the vectorized runs.
    model, x = _cnn()
    guide = AutoNormal(model, init_scale=0.3)
    guide(x, torch.randint(0, 3, (10,)))
    num_samples = 300
    out = {}
    for parallel in (False, True):
        predictive = Predictive(model, guide=guide, num_samples=num_samples,
                                parallel=parallel, return_sites=["_RETURN"])
        with torch.no_grad():
            out[parallel] = handler(predictive)(x)["_RETURN"]
    assert out[True].shape == out[False].shape == (num_samples, 10, 3)
    mean = {p: v.mean(0) for p, v in out.items()}
    std = {p: v.std(0) for p, v in out.items()}
    z = (mean[True] - mean[False]) / ((std[True] ** 2 + std[False] ** 2) / num_samples).sqrt()
    assert z.abs().max() < 5, z
    assert_close(std[True], std[False], rtol=0.25, atol=0)


# ------------------------------------------------ vectorized particles


@pytest.mark.parametrize("make", [_mlp, _cnn, _matmul_mlp], ids=["mlp", "cnn", "matmul"])
def test_vectorized_particles_are_exact(make):
    # (matmul: the products broadcast the particles against each other, and the ELBO
    # summed the likelihoods of every pair, silently)
    # Each particle's likelihood in the vectorized model trace equals the model's own,
    # run on that particle's weights.
    model, x = make()
    y = torch.randint(0, 3, (10,))
    guide = AutoNormal(model)
    guide(x, y)
    num_particles = 3
    elbo = Trace_ELBO(num_particles=num_particles, vectorize_particles=True,
                      max_plate_nesting=1)
    with vectorized_layers():
        loss = elbo.loss(model, guide, x, y)
        model_trace, _ = elbo._get_vectorized_trace(model, guide, (x, y), {})
    assert torch.isfinite(torch.tensor(loss))
    obs = model_trace.nodes["obs"]
    log_lik = obs["fn"].log_prob(obs["value"]).sum(-1)
    assert log_lik.shape == (num_particles,)
    for p in range(num_particles):
        sample = {name: site["value"][p].squeeze(0) for name, site in model_trace.nodes.items()
                  if site["type"] == "sample" and name not in ("obs", "data")}
        run = poutine.trace(poutine.condition(model, sample)).get_trace(x, y)
        expected = run.nodes["obs"]["fn"].log_prob(y).sum()
        assert_close(log_lik[p], expected, atol=1e-4, rtol=1e-5)
    pyro.clear_param_store()


@pytest.mark.parametrize("S", [2, 5])
@pytest.mark.parametrize("op, x_shape, w_shape", [("linear", (7, 4), (3, 4)),
                                                  ("conv1d", (7, 2, 9), (6, 2, 3))])
def test_expanded_weight_runs_once_with_the_full_output_shape(op, x_shape, w_shape, S):
    # A weight expanded over its sample dim (stride 0) gives the plain layer's output,
    # expanded to the full batch: the same values as the loop, in the same shape.
    kwargs = {} if op == "linear" else dict(stride=1, padding=0, dilation=1, groups=1)
    x = torch.randn(x_shape, dtype=torch.float64)
    w = torch.randn((1, 1) + w_shape, dtype=torch.float64).expand((S, 1) + w_shape)
    out = batched_layer(op, x, w, None, kwargs)
    expected = _loop(op, x, w, None, kwargs)
    assert out.shape == expected.shape
    assert_close(out, expected, atol=1e-12, rtol=1e-12)
    assert out.stride(0) == 0  # computed once


@pytest.mark.parametrize("handler", [local_reparam, flipout])
@pytest.mark.parametrize("make", [_mlp, _cnn, _matmul_mlp], ids=["mlp", "cnn", "matmul"])
def test_weight_noise_vectorized_particles_match_sequential_by_moments(make, handler):
    # The ELBO estimate under a weight-noise handler, vectorized and one particle after
    # another: the same expectation (z under 5 over 6 estimates of 50 particles each).
    model, x = make()
    y = torch.randint(0, 3, (10,))
    guide = AutoNormal(model, init_scale=0.3)
    guide(x, y)
    losses = {}
    for vectorize in (False, True):
        elbo = Trace_ELBO(num_particles=50, vectorize_particles=vectorize,
                          max_plate_nesting=1)
        with torch.no_grad():
            losses[vectorize] = torch.tensor(
                [handler(elbo.loss)(model, guide, x, y) for _ in range(6)])
    diff = losses[True].mean() - losses[False].mean()
    se = ((losses[True].var() + losses[False].var()) / 6).sqrt()
    assert abs(diff / se) < 5, (losses, diff, se)


# ------------------------------------------------ reshapes of a batched layer's output


class _FlattenNet(PyroModule):
    # A small CNN as a user writes it, its flatten spelled in the forward.
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.conv = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(FLATTEN[self.spelling](torch.relu(self.conv(x))))


FLATTEN = {
    # counting dims from the right: the model's own dims whatever the batch dims
    "nn.Flatten(-3)": nn.Flatten(-3),
    "x.flatten(-3)": lambda h: h.flatten(-3),
    "x.reshape(x.shape[:-3] + (-1,))": lambda h: h.reshape(h.shape[:-3] + (-1,)),
    "x.view(*x.shape[:-3], -1)": lambda h: h.view(*h.shape[:-3], -1),
    # counting from the left: merges the batch dims into the features
    "nn.Flatten()": nn.Flatten(),
    "x.flatten(1)": lambda h: h.flatten(1),
    "x.reshape(len(x), -1)": lambda h: h.reshape(len(h), -1),
    "x.view(x.size(0), -1)": lambda h: h.view(h.size(0), -1),
}
FROM_THE_RIGHT = list(FLATTEN)[:4]
FROM_THE_LEFT = list(FLATTEN)[4:]


def _flatten_cnn(spelling):
    torch.manual_seed(0)
    return BayesianClassifier(bayesianize(_FlattenNet(spelling))), torch.randn(10, 1, 8, 8)


@pytest.mark.parametrize("guide_class", [AutoNormal, AutoKTiedNormal])
@pytest.mark.parametrize("spelling", FROM_THE_RIGHT)
def test_flatten_from_the_right_equals_a_loop_over_samples(spelling, guide_class):
    # The spellings the refusal below names: the vectorized Predictive equals the model
    # run on each of its samples (atol = rtol = 1e-5, float32).
    model, x = _flatten_cnn(spelling)
    guide = guide_class(model)
    guide(x, torch.randint(0, 3, (10,)))
    trace = _vectorized_trace(model, guide, x)
    logits = trace.nodes["_RETURN"]["value"]
    assert logits.shape == (4, 10, 3)
    with torch.no_grad():
        expected = _sequential_outputs(model, trace, x, 4)
    assert_close(logits, expected, atol=1e-5, rtol=1e-5)


class _Recording(LayerCallMessenger):
    # The base handler, recording the layer calls it is handed.
    def __init__(self):
        super().__init__()
        self.seen = []

    def _process_layer_call(self, call):
        self.seen.append(call.weight_name)
        return None


@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam, flipout, _Recording])
@pytest.mark.parametrize("spelling", FROM_THE_LEFT)
def test_flatten_from_the_left_is_refused_before_the_layer_runs(spelling, handler):
    # A left-counting flatten of a batched conv's output (S, N, C, H, W) gives the linear
    # layer (S, N * C * H * W) features: refused with the spellings to use instead, at
    # the layer call, before the handler acts on it (the run without sample dims works).
    model, x = _flatten_cnn(spelling)
    y = torch.randint(0, 3, (10,))
    assert model(x).shape == (10, 3)
    guide = AutoNormal(model)
    guide(x, y)
    predictive = Predictive(model, guide=guide, num_samples=4, parallel=True)
    message = r"F.linear \(sample site 'net.fc.weight'\) runs batched .* takes 64 input " \
              r"features, but its input of shape \(4, 640\) has 640.*nn.Flatten\(-3\)"
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        with handler() as h:
            predictive(x)
    if handler is _Recording:
        assert h.seen == ["net.conv.weight"]  # the refused call was never handed on
    # vectorized particles, under svi.step: refused before the step changes a parameter
    elbo = Trace_ELBO(num_particles=3, vectorize_particles=True, max_plate_nesting=1)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), elbo)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    with pytest.raises(ValueError, match=message.replace(r"\(4, 640\)", r"\(3, 640\)")):
        with handler():
            svi.step(x, y)
    after = dict(pyro.get_param_store().items())
    assert all(torch.equal(after[k], v) for k, v in before.items())
    # the handler left nothing behind: the same handler runs a right-counting model
    model, x = _flatten_cnn("x.flatten(-3)")
    guide = AutoNormal(model)
    guide(x, y)
    with torch.no_grad(), handler():
        samples = Predictive(model, guide=guide, num_samples=4, parallel=True,
                             return_sites=["_RETURN"])(x)
    assert samples["_RETURN"].shape == (4, 10, 3)
    pyro.clear_param_store()


@pytest.mark.parametrize("handler", [vectorized_layers, local_reparam, flipout])
def test_an_input_of_more_dims_than_the_plates_is_refused_by_name(handler):
    # Regression (a fresh-eyes review): a (batch, tokens, features) input under one plate
    # puts the particle dim of the weight, (3, 1, out, in), against the batch dim, and the
    # einsum of the batched layer failed inside torch ("operands could not be broadcast")
    x, y = torch.randn(6, 5, 4), torch.randn(6)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
        with pyro.plate("data", 6):
            pyro.sample("obs", dist.Normal(F.linear(x, w).mean((-2, -1)), 1.0), obs=y)

    guide = AutoNormal(model)
    guide(x, y)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    for nesting in (1, 2):
        elbo = Trace_ELBO(num_particles=3, vectorize_particles=True, max_plate_nesting=nesting)
        svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), elbo)
        if nesting == 2:  # as the message says: the tokens' dim counted
            with handler():
                assert math.isfinite(svi.step(x, y))
            continue
        with pytest.raises(ValueError, match=(
                r"^F.linear \(sample site 'w'\) runs batched with a weight of batch dims "
                r"\(3, 1\) .* its input's \(6, 5\): the input has more dims left of its "
                r"features than the plates, e.g. \(batch, tokens, features\) under one "
                r"plate. Give the ELBO max_plate_nesting= that many dims")):
            with handler():
                svi.step(x, y)
        after = dict(pyro.get_param_store().items())
        assert all(torch.equal(after[k], v) for k, v in before.items())
