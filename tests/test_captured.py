"""CapturedSVI against SVI's eager step: the same losses and gradients under the
same seed (float64, 1e-10 relative), re-tracing, falling back, fresh draws."""

import functools
import math
import numbers
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from pyro.nn import PyroModule
from pyro.optim import PyroOptim
from torch import nn

from pyro_vinit import AutoKTiedNormal, AutoMeanFieldNormal, CapturedSVI, fit, local_reparam
from pyro_vinit.nn import BayesianClassifier, BayesianRegressor, bayesianize, mlp
from pyro_vinit.poutine import Flipout, KLAnnealingMessenger, LocalReparam, weight_noise
from pyro_vinit.training import captured as captured_module

RTOL = 1e-10


class GradRecorder(PyroOptim):
    """Adam that keeps a copy of the gradients it was called with, by parameter order."""

    def __init__(self, lr=1e-2):
        super().__init__(torch.optim.Adam, {"lr": lr})
        self.grads = []

    def __call__(self, params, *args, **kwargs):
        params = list(params)
        found = {}
        for p in params:
            if p.grad is not None:
                found[self._name(p)] = p.grad.detach().clone()
        self.grads.append(found)
        super().__call__(params, *args, **kwargs)

    @staticmethod
    def _name(p):
        store = pyro.get_param_store()
        return store.param_name(p)


def _mlp(device):
    x = torch.randn(32, 6, device=device)
    y = torch.randint(0, 3, (32,), device=device)
    model = BayesianClassifier(bayesianize(mlp((6, 16, 3))), num_data=320).to(device)
    return model, (lambda m: AutoKTiedNormal(m, rank=2)), (x, y), local_reparam


def _cnn(device):
    x = torch.randn(8, 1, 6, 6, device=device)
    y = torch.randint(0, 3, (8,), device=device)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    model = BayesianClassifier(bayesianize(net), num_data=80).to(device)
    return model, (lambda m: AutoMeanFieldNormal(m)), (x, y), local_reparam


def _batchnorm(device):
    x = torch.randn(16, 5, device=device)
    y = torch.randint(0, 3, (16,), device=device)
    net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model = BayesianClassifier(bayesianize(net), num_data=160).to(device)
    return model, (lambda m: AutoNormal(m)), (x, y), None


def _learned_noise(device):
    x = torch.randn(20, 4, device=device)
    y = x.sum(-1) + 0.1 * torch.randn(20, device=device)
    model = BayesianRegressor(bayesianize(mlp((4, 8, 1))), num_data=200,
                              learn_noise=True).to(device)
    return model, (lambda m: AutoMeanFieldNormal(m)), (x, y), None


def _diagonal(device):
    # AutoDiagonalNormal: each site's value a slice of one latent vector, under LRT
    model, _, data, handler = _mlp(device)
    return model, AutoDiagonalNormal, data, handler


PROBLEMS = {"mlp": _mlp, "cnn": _cnn, "batchnorm": _batchnorm, "learned_noise": _learned_noise,
            "diagonal": _diagonal}


def _run(cls, problem, device, steps=4, elbo=TraceMeanField_ELBO):
    """Losses, gradients and final buffers of ``steps`` steps, from seed 0."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, make_guide, data, handler = PROBLEMS[problem](device)
    guide = make_guide(model)
    optim = GradRecorder()
    svi = cls(model, guide, optim, elbo())
    losses = []
    for _ in range(steps):
        if handler is None:
            losses.append(svi.step(*data))
        else:
            with handler():
                losses.append(svi.step(*data))
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    return losses, optim.grads, buffers, svi


def _close(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-300)
    return (a - b).abs().max().item() <= RTOL * scale


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_captured_step_equals_eager_step(problem, device):
    with torch.device(device):
        torch.set_default_dtype(torch.float64)
        try:
            eager = _run(SVI, problem, device)
            captured = _run(CapturedSVI, problem, device)
        finally:
            torch.set_default_dtype(torch.float32)
    losses, grads, buffers, _ = eager
    c_losses, c_grads, c_buffers, svi = captured
    assert svi.num_traces == 1 and svi.fallback_reason is None
    assert _replays_cuda_graph(svi) == (device.type == "cuda")
    assert _close(losses, c_losses), (losses, c_losses)
    assert len(set(losses)) == len(losses)  # a fresh draw (and parameter) every step
    for step, (g, c) in enumerate(zip(grads, c_grads)):
        assert g.keys() == c.keys(), step
        for name in g:
            assert _close(g[name], c[name]), (step, name)
    assert buffers.keys() == c_buffers.keys()
    for name in buffers:  # BatchNorm's running statistics: updated once per step
        assert _close(buffers[name].double(), c_buffers[name].double()), name


def _replays_cuda_graph(svi):
    (capture,) = svi._captures.values()
    return type(capture.graph).__name__ == "CudaGraphReplay"


def test_replays_draw_afresh_and_follow_the_seed(device):
    pyro.set_rng_seed(0)
    model, make_guide, data, handler = _mlp(device)
    svi = CapturedSVI(model, make_guide(model), PyroOptim(torch.optim.SGD, {"lr": 0.0}),
                      TraceMeanField_ELBO())
    for _ in range(2):
        with handler():
            svi.step(*data)
    assert svi.num_traces == 1
    assert _replays_cuda_graph(svi) == (device.type == "cuda")
    with handler():
        pyro.set_rng_seed(5)
        first = [svi.step(*data) for _ in range(3)]
        pyro.set_rng_seed(5)
        again = svi.step(*data)
    # lr 0: only the draws change the loss
    assert len(set(first)) == 3
    assert again == first[0]


def test_new_signature_retraces():
    torch.set_default_dtype(torch.float64)
    try:
        results = []
        for cls in (SVI, CapturedSVI):
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            model, make_guide, (x, y), handler = _mlp("cpu")
            svi = cls(model, make_guide(model), pyro.optim.Adam({"lr": 1e-2}),
                      TraceMeanField_ELBO())
            losses = []
            with handler():
                for rows in (32, 32, 32, 16, 16, 16, 32):
                    losses.append(svi.step(x[:rows], y[:rows]))
            results.append((losses, svi))
    finally:
        torch.set_default_dtype(torch.float32)
    (eager, _), (captured, svi) = results
    assert svi.num_traces == 2 and svi.fallback_reason is None
    assert _close(eager, captured)


def test_input_of_another_layout_retraces():
    # the same shape, non-contiguous: the graph's view of the first layout would fail
    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(6), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(x.reshape(x.shape[0], -1) @ w, 1.0), obs=y)

    torch.set_default_dtype(torch.float64)
    try:
        x, y = torch.randn(8, 2, 3), torch.randn(8)
        transposed = torch.randn(8, 3, 2).transpose(1, 2)
        assert transposed.shape == x.shape and not transposed.is_contiguous()
        results = []
        for cls in (SVI, CapturedSVI):
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            svi = cls(model, AutoNormal(model), pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
            results.append(([svi.step(xb, y) for xb in (x, x, x, transposed, transposed, x)],
                            svi))
    finally:
        torch.set_default_dtype(torch.float32)
    (eager, _), (captured, svi) = results
    assert svi.num_traces == 2 and svi.fallback_reason is None
    assert _close(eager, captured), (eager, captured)


def test_each_step_reads_its_own_data(device):
    # the same shapes, new values: a replay reads each step's batch (on CUDA, copied
    # into the graph's static inputs)
    torch.set_default_dtype(torch.float64)
    try:
        results = []
        for cls in (SVI, CapturedSVI):
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            model, make_guide, (x, y), handler = _mlp(device)
            batches = [(x[:16], y[:16]), (x[16:], y[16:])]
            svi = cls(model, make_guide(model), pyro.optim.Adam({"lr": 1e-2}),
                      TraceMeanField_ELBO())
            with handler():
                losses = [svi.step(*batches[i % 2]) for i in range(6)]
            results.append((losses, svi))
    finally:
        torch.set_default_dtype(torch.float32)
    (eager, _), (captured, svi) = results
    assert svi.num_traces == 1 and svi.fallback_reason is None
    assert _replays_cuda_graph(svi) == (device.type == "cuda")
    assert _close(eager, captured), (eager, captured)


def test_cpu_draw_in_a_cuda_step_replays_op_by_op(device):
    # a subsampled plate draws its indices on the CPU: a CUDA graph would freeze them
    torch.set_default_dtype(torch.float64)
    try:
        x = torch.randn(40, 3, device=device)
        y = x.sum(-1)

        def model(x, y):
            w = pyro.sample("w", dist.Normal(torch.zeros(3, device=device), 1.0).to_event(1))
            with pyro.plate("data", 40, subsample_size=8) as idx:
                pyro.sample("obs", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])

        results = []
        for cls in (SVI, CapturedSVI):
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            svi = cls(model, AutoNormal(model), pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses = [svi.step(x, y) for _ in range(5)]
            results.append((losses, svi, [str(w.message) for w in caught]))
    finally:
        torch.set_default_dtype(torch.float32)
    (eager, _, _), (captured, svi, caught) = results
    assert svi.num_traces == 1 and svi.fallback_reason is None
    assert _close(eager, captured), (eager, captured)
    assert len(set(captured)) == len(captured)
    op_by_op = [m for m in caught if "operator by operator" in m]
    if device.type == "cuda":
        assert len(op_by_op) == 1 and "randperm" in op_by_op[0]
        assert not _replays_cuda_graph(svi)
    else:
        assert not op_by_op


def test_only_varying_off_device_operators_block_a_cuda_graph():
    # placeholders on "the device" (meta here), other work on the CPU
    from torch.fx.experimental.proxy_tensor import make_fx

    from pyro_vinit.training._cuda_graph import off_device as _off_device

    meta = torch.device("meta")

    def constant_on_cpu(p):
        return p * 2, torch.arange(5) + 1, torch.tensor(())

    def draw_on_cpu(p):
        return p * 2, torch.randperm(5)[:3] + 1

    def scalar_draw_on_cpu(p):
        return p * torch.ones(()), torch.rand(()) * 2

    held = torch.ones(3)  # a model's tensor: it may change in place between steps

    def held_on_cpu(p):
        return p * 2, held * 3

    def copied_to_the_device(p):
        return p[torch.arange(3)]

    p = torch.ones(3, device=meta)
    assert _off_device(make_fx(constant_on_cpu)(p), meta) is None
    assert "randperm" in _off_device(make_fx(draw_on_cpu)(p), meta)
    assert "held" in _off_device(make_fx(held_on_cpu)(p), meta)
    assert "reads a tensor from aten.arange" in _off_device(make_fx(copied_to_the_device)(p),
                                                            meta)
    assert "rand" in _off_device(make_fx(scalar_draw_on_cpu)(p), meta)


def test_replaced_parameter_storage_is_refused(device):
    if device.type != "cuda":
        pytest.skip("a CUDA graph reads its parameters' memory; op by op follows the tensors")
    model, make_guide, data, handler = _mlp(device)
    svi = CapturedSVI(model, make_guide(model), pyro.optim.Adam({"lr": 1e-2}),
                      TraceMeanField_ELBO())
    with handler():
        for _ in range(3):
            svi.step(*data)
    assert _replays_cuda_graph(svi)
    param = next(iter(pyro.get_param_store().values())).unconstrained()
    param.data = param.data.clone()
    with handler(), pytest.raises(RuntimeError, match="storage changed"):
        svi.step(*data)


def test_cuda_graph_required_off_cuda_is_refused_before_the_step():
    if torch.cuda.is_available():
        pytest.skip("tests the refusal where the data is off CUDA")
    model, make_guide, (x, y), handler = _mlp("cpu")
    svi = CapturedSVI(model, make_guide(model), pyro.optim.Adam({"lr": 1e-2}),
                      TraceMeanField_ELBO(), cuda_graph=True)
    with handler(), pytest.raises(ValueError, match="one CUDA device"):
        svi.step(x, y)
    assert len(pyro.get_param_store()) == 0 and svi.num_traces == 0


def test_kl_weight_change_retraces():
    pyro.set_rng_seed(0)
    model, make_guide, data, _ = _mlp("cpu")
    svi = CapturedSVI(model, make_guide(model), PyroOptim(torch.optim.SGD, {"lr": 0.0}),
                      TraceMeanField_ELBO())
    losses = {}
    for scale in (1.0, 1.0, 0.0, 0.0):
        with KLAnnealingMessenger(scale), local_reparam():
            pyro.set_rng_seed(1)
            losses[scale] = svi.step(*data)
    assert svi.num_traces == 2
    # the KL term is weighted: weight 0 leaves the (positive) expected NLL alone
    assert losses[0.0] < losses[1.0]
    eager = SVI(model, svi.guide, PyroOptim(torch.optim.SGD, {"lr": 0.0}), TraceMeanField_ELBO())
    with KLAnnealingMessenger(0.0), local_reparam():
        pyro.set_rng_seed(1)
        assert eager.step(*data) == pytest.approx(losses[0.0], rel=1e-6)


class Switching(PyroModule):
    """A model whose sample sites change from one call to the next."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        if self.calls % 2 == 0:
            w = w + pyro.sample("extra", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(w, 1.0).expand(x.shape).to_event(1), obs=x)


class ValueBranch(PyroModule):
    """A model that branches on a sampled value."""

    def forward(self, x):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        loc = w if w > 0 else -w
        pyro.sample("obs", dist.Normal(loc, 1.0).expand(x.shape).to_event(1), obs=x)


@pytest.mark.parametrize("model_cls, reason", [
    (Switching, "sites changed"), (ValueBranch, "could not be traced")])
def test_falls_back_with_one_warning(model_cls, reason):
    x = torch.randn(10)
    model = model_cls()
    guide = AutoNormal(lambda x: model(x))  # the guide's own sites stay put
    svi = CapturedSVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [svi.step(x) for _ in range(5)]
    mine = [w for w in caught if "CapturedSVI" in str(w.message)]
    assert len(mine) == 1 and reason in str(mine[0].message)
    assert svi.fallback_reason is not None and svi.num_traces == 0
    assert all(isinstance(v, float) for v in losses)


class _FailingCapture(captured_module._Capture):
    """A traced step whose replay fails (as aten's LSTM backward did, traced on a CPU)."""

    def __init__(self, graph, params, uncompiled=None):
        def fails(*args):
            graph(*args)  # (its draws and BatchNorm's updates made, as a late failure's are)
            raise RuntimeError("Expected a proper Tensor but got None")
        super().__init__(fails, params, uncompiled)


def test_a_first_replay_that_fails_falls_back_to_the_eager_step(monkeypatch):
    # fit's default capture of a model with an nn.LSTM failed on its first replay inside
    # torch; the step is now taken eagerly, from the buffers and generators it found
    with torch.device("cpu"):
        torch.set_default_dtype(torch.float64)
        try:
            eager = _run(SVI, "batchnorm", "cpu")
            monkeypatch.setattr(captured_module, "_Capture", _FailingCapture)
            with pytest.warns(RuntimeWarning, match="failed on its first replay "
                                                    r"\(RuntimeError: Expected a proper"):
                captured = _run(CapturedSVI, "batchnorm", "cpu")
        finally:
            torch.set_default_dtype(torch.float32)
    assert captured[0] == eager[0]
    assert all(torch.equal(captured[2][name], eager[2][name]) for name in eager[2])
    assert captured[3].fallback_reason is not None


def test_a_replay_that_fails_after_the_first_raises(monkeypatch):
    model, make_guide, (x, y), handler = _mlp("cpu")
    svi = CapturedSVI(model, make_guide(model), pyro.optim.Adam({"lr": 1e-2}),
                      TraceMeanField_ELBO())
    with handler():
        for _ in range(3):
            svi.step(x, y)
        (capture,) = svi._captures.values()
        monkeypatch.setattr(capture, "graph", _FailingCapture(capture.graph, []).graph)
        with pytest.raises(RuntimeError, match="proper Tensor"):
            svi.step(x, y)


def test_fit_trains_a_model_with_an_lstm():
    # (aten's LSTM backward, traced on a CPU, cannot be replayed: fit falls back)
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(3, 8, batch_first=True)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    x = torch.randn(40, 5, 3)
    y = (x[..., 0].sum(-1) > 0).long()
    model = BayesianClassifier(bayesianize(Net()), num_data=40)
    guide = AutoKTiedNormal(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = fit(model, guide, (x, y), steps=30, capture=True, progress=False)
    assert len(history.loss) == 30 and all(math.isfinite(v) for v in history.loss)


def test_too_many_signatures_fall_back():
    model, make_guide, (x, y), handler = _mlp("cpu")
    svi = CapturedSVI(model, make_guide(model), pyro.optim.Adam({"lr": 1e-2}),
                      TraceMeanField_ELBO(), max_signatures=1)
    with handler(), pytest.warns(RuntimeWarning, match="max_signatures=1"):
        for rows in (32, 32, 16, 16):
            svi.step(x[:rows], y[:rows])
    assert svi.num_traces == 0


def test_validation_runs_on_the_first_step():
    def model(x):
        pyro.sample("obs", dist.Bernoulli(0.5).expand(x.shape).to_event(1), obs=x)

    svi = CapturedSVI(model, lambda x: None, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    with pytest.raises(ValueError, match="support"):
        svi.step(torch.full((3,), 2.0))


def test_a_replayed_step_with_a_non_finite_loss_raises_before_the_update():
    # the replay runs no validation: a NaN batch turned every parameter into NaN, where
    # SVI raises (outside-user trial); with validation off, SVI steps on as well
    model, make_guide, (x, y), handler = PROBLEMS["mlp"](torch.device("cpu"))
    svi = CapturedSVI(model, make_guide(model), pyro.optim.Adam({"lr": 1e-2}),
                      TraceMeanField_ELBO())
    for _ in range(3):
        with handler():
            svi.step(x, y)
    assert svi.num_traces == 1
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^CapturedSVI: the loss of this step is nan, and "
                       r"the parameters were not updated"), handler():
        svi.step(bad, y)
    assert all(torch.equal(v, before[k]) for k, v in pyro.get_param_store().items())
    with pyro.validation_enabled(False), handler():
        assert math.isnan(svi.step(bad, y))


def test_bad_arguments():
    model, make_guide, _, _ = _mlp("cpu")
    guide = make_guide(model)
    with pytest.raises(TypeError, match="must be a Pyro ELBO"):
        CapturedSVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), lambda m, g: 0.0)
    with pytest.raises(ValueError, match="max_signatures"):
        CapturedSVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO(),
                    max_signatures=0)
    with pytest.raises(ValueError, match="cuda_graph must be None, True or False"):
        CapturedSVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO(),
                    cuda_graph="yes")
    for value in (0, 1):  # equal to False and True, but not a bool: refused, not "automatic"
        with pytest.raises(ValueError, match="cuda_graph must be None, True or False"):
            CapturedSVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO(),
                        cuda_graph=value)


def test_dead_buffers_are_reused_only_where_safe():
    from torch.fx.experimental.proxy_tensor import make_fx

    from pyro_vinit.training._trace import reuse_dead_buffers

    def dies(x):
        a = x * 2.0
        return (a + 1.0).sqrt()  # a dies at the add, its result at the sqrt

    def viewed(x):
        a = x * 2.0
        v = a.t()  # a view of a, read after the add: a must not be overwritten
        b = a + 1.0
        return b + v.sum(0, keepdim=True)  # b dies here: this add may be in place

    def used_later(x):
        a = x * 2.0
        b = a + 1.0  # a is read again below: this add must make a new buffer
        return b * a

    def returned(x):
        a = x * 2.0
        return a, a + 1.0  # a is an output

    x = torch.rand(3, 3)
    for fn, expected in ((dies, 2), (viewed, 1), (used_later, 1), (returned, 0)):
        graph = make_fx(fn)(x)
        assert reuse_dead_buffers(graph) == expected, fn.__name__
        for got, want in zip(torch.utils._pytree.tree_leaves(graph(x)),
                             torch.utils._pytree.tree_leaves(fn(x))):
            assert torch.equal(got, want), fn.__name__


def _linear_model(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal(x @ w, 0.1), obs=y)


def _losses_under(handlers, lr=0.01):
    """SVI's and CapturedSVI's losses of a linear model, one step under each handler."""
    x, y = torch.randn(50, 3), torch.randn(50)
    losses = {}
    for cls in (SVI, CapturedSVI):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        svi = cls(_linear_model, AutoNormal(_linear_model), pyro.optim.Adam({"lr": lr}),
                  Trace_ELBO())
        losses[cls] = []
        for make_handler in handlers:
            with make_handler():
                losses[cls].append(svi.step(x, y))
    return losses[SVI], losses[CapturedSVI]


def test_any_handler_setting_change_retraces():
    # an int scale (not only float settings) is a constant of the graph: scale=3 after
    # scale=2 re-traces and gives the eager loss, not the stale graph's
    eager, captured = _losses_under(
        [lambda s=s: pyro.poutine.scale(scale=s) for s in (2, 2, 2, 3)])
    assert captured == pytest.approx(eager, rel=1e-5)


@pytest.mark.parametrize("make_handler", [
    lambda: weight_noise(),  # AutoWeightNoise, holding its strategies
    lambda: weight_noise(config={"net.0.weight": LocalReparam(), "net.2.weight": Flipout()}),
    lambda: local_reparam(conv=False),
    lambda: weight_noise(config=lambda msg: LocalReparam()),  # a function made afresh
    lambda: pyro.poutine.block(hide=["nothing"]),  # its hide_fn, a fresh partial
    lambda: weight_noise(config=_Picker(LocalReparam()).pick),  # a fresh bound method
], ids=["auto", "dict", "conv=False", "lambda", "block", "bound method"])
def test_a_handler_entered_afresh_each_step_keeps_one_graph(make_handler):
    # fit enters its handlers afresh at each step: equal settings are one signature
    model, make_guide, (x, y), _ = _mlp("cpu")
    svi = CapturedSVI(model, make_guide(model), pyro.optim.Adam({"lr": 1e-2}),
                      TraceMeanField_ELBO(), max_signatures=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(4):
            with make_handler():
                svi.step(x, y)
    assert svi.num_traces == 1 and svi.fallback_reason is None


def test_another_setting_or_config_function_retraces():
    model, make_guide, (x, y), _ = _mlp("cpu")
    svi = CapturedSVI(model, make_guide(model), pyro.optim.Adam({"lr": 1e-2}),
                      TraceMeanField_ELBO())

    def lrt(msg):
        return LocalReparam()

    def none(msg):
        return None

    def pick(strategy):
        return lambda msg: strategy  # one code, another captured value

    handlers = [lambda: local_reparam(low_rank=False), lambda: local_reparam(low_rank=True),
                lambda: weight_noise(config=lrt), lambda: weight_noise(config=none),
                lambda: weight_noise(config=pick(None)),
                lambda: weight_noise(config=pick(Flipout()))]
    for make_handler in handlers:
        for _ in range(2):
            with make_handler():
                svi.step(x, y)
    assert svi.num_traces == 6 and svi.fallback_reason is None


def test_a_setting_compared_by_identity_is_never_a_reused_id():
    # A NumPy scale made afresh at each step: by value, not by the id that the next one
    # reuses (then scale=100 replayed the graph traced for scale=1: stale losses)
    for make_scale in (np.float32, _Opaque):
        eager, captured = _losses_under(
            [lambda s=s, m=make_scale: pyro.poutine.scale(scale=m(s)) for s in (1.0, 100.0) * 3],
            lr=0.0)
        assert captured == pytest.approx(eager, rel=1e-5)


class _Opaque:
    """A scale compared by identity only: no value, no __dict__."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __gt__(self, other):
        return self.value > other

    def __mul__(self, other):
        return self.value * other

    __rmul__ = __mul__


class _Picker:
    def __init__(self, strategy):
        self.strategy = strategy

    def pick(self, msg):
        return self.strategy


def test_a_set_of_settings_compared_by_identity_is_one_key():
    # a set's elements sort by their keys' text: an identity's text must be the object's
    from pyro_vinit.training._signature import _setting_key

    class Opaque:
        __slots__ = ()

    objects = {Opaque() for _ in range(20)}
    assert len({_setting_key(objects) for _ in range(20)}) == 1
    assert _setting_key(objects) != _setting_key({Opaque() for _ in range(20)})


def _regression_svi(max_signatures):
    """A linear regression's CapturedSVI and data."""
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(x @ w, 0.1), obs=y)

    svi = CapturedSVI(model, AutoNormal(model), pyro.optim.Adam({"lr": 0.01}),
                      TraceMeanField_ELBO(), max_signatures=max_signatures)
    return svi, torch.randn(50, 3), torch.randn(50)


def test_signatures_that_never_repeat_fall_back_with_a_warning():
    # a tensor scale made afresh at each step is compared by identity: no signature
    # repeats, so no step is ever captured; after 4 x max_signatures, say so and stop
    # recording them (each record holds the step's parameters)
    svi, x, y = _regression_svi(max_signatures=2)
    scales = [torch.tensor(2.0) for _ in range(9)]  # held: no id is reused
    with pytest.warns(RuntimeWarning, match="more than 8 input signatures"):
        for scale in scales:
            with pyro.poutine.scale(scale=scale):
                svi.step(x, y)
    assert svi.num_traces == 0 and not svi._eager_sites
    assert "made afresh at each step" in svi.fallback_reason


def test_a_kl_weight_schedule_that_never_settles_is_named_in_the_fall_back():
    # its KL weight, a constant of the graph, changes at each step: the warning blamed a
    # handler "made afresh at each step", which this one was not
    from pyro_vinit.poutine import KLAnnealingMessenger
    from pyro_vinit.schedules import LinearWarmup

    svi, x, y = _regression_svi(max_signatures=2)
    annealing = KLAnnealingMessenger(LinearWarmup(100))
    with pytest.warns(RuntimeWarning, match=r"more than 8 input signatures .* \(a "
                      r"KLAnnealingMessenger schedule: its KL weight, a constant of the graph, "
                      r"changes at each step; make CapturedSVI after the schedule's warm-up"):
        for _ in range(9):
            with annealing:
                svi.step(x, y)
            annealing.step()
    assert svi.num_traces == 0


class _Factor:
    """A setting object that holds its number privately."""

    def __init__(self, factor):
        self._factor = factor


class _ScaleBy(pyro.poutine.messenger.Messenger):
    def __init__(self, setting):
        super().__init__()
        self.setting = setting

    def _process_message(self, msg):
        msg["scale"] = msg["scale"] * self.setting._factor


def test_a_settings_private_number_is_part_of_the_signature():
    # as a handler's own private float (a KL weight held as _scale), so an object's:
    # factor 100 after factor 1 re-traces, not the stale graph of factor 1
    eager, captured = _losses_under(
        [lambda f=f: _ScaleBy(_Factor(f)) for f in (1.0, 1.0, 100.0, 100.0, 1.0)], lr=0.0)
    assert captured == pytest.approx(eager, rel=1e-5)


class _Knob:
    """A number type that holds settings (registered as a number, with a __dict__)."""

    def __init__(self, value):
        self.value = value


numbers.Number.register(_Knob)


class _Cycle:
    def __init__(self):
        self.me = self


def test_setting_keys_compare_by_type_and_value_down_to_three_levels():
    from pyro_vinit.training._signature import _setting_key as key

    # plain values by value (a string made afresh too), NumPy scalars by type and value
    assert key("".join(["lr", "t"])) == key("lrt")
    assert key(np.float32(2.0)) == key(np.float32(2.0)) != key(np.float16(2.0))
    # containers by their type and elements; a number with settings by its settings
    assert key([1, 2]) != key((1, 2)) and key({1}) != key(frozenset({1}))
    assert key(_Knob(1.0)) == key(_Knob(1.0)) != key(_Knob(2.0))
    assert key(nn.ReLU) != key(nn.Tanh)  # classes by identity
    # objects by their settings, nested up to three levels; deeper ones by identity,
    # which ends a cycle
    assert key([[_Factor(1.0)]]) == key([[_Factor(1.0)]])
    assert key([[[_Factor(1.0)]]]) != key([[[_Factor(1.0)]]])
    cycle = _Cycle()
    assert key(cycle) == key(cycle)
    assert key(_Factor(1.0)) != key(_OtherFactor(1.0))  # the object's type too


class _OtherFactor(_Factor):
    pass


def _closure(bind):
    if bind:
        late = None

    def use():
        return late  # an empty cell unless bound

    return use


def _defaults(a_value, b_value):
    def use(msg, a=a_value, *, b=b_value):
        return a, b

    return use


def _setting(value):
    return value


def test_setting_keys_of_configs_partials_functions_and_methods():
    # what a handler's config holds (a dict, a partial, a function, a bound method)
    # is compared by everything that can change what it returns
    from pyro_vinit.training._signature import _setting_key as key

    assert key({"b": 1, "a": 2}) == key({"a": 2, "b": 1}) != key({"a": 2, "b": 3})
    assert key({"a": 1, "b": 1}) == key({"b": 1, "a": 1})
    assert key({1: "x", "1": "y"}) == key({"1": "y", 1: "x"})  # keys of mixed types
    part = functools.partial(_setting, 1, a=2)
    assert key(part) == key(functools.partial(_setting, 1, a=2))
    assert key(part) != key(functools.partial(_closure, 1, a=2))
    assert key(part) != key(functools.partial(_setting, 2, a=2))
    assert key(part) != key(functools.partial(_setting, 1, a=3))
    assert key(_closure(False)) != key(_closure(True))  # an empty cell is not None
    assert key(_defaults(1, 1)) == key(_defaults(1, 1))
    assert key(_defaults(1, 1)) != key(_defaults(2, 1))
    assert key(_defaults(1, 1)) != key(_defaults(1, 2))
    first, second = _Picker(LocalReparam()), _Picker(Flipout())
    assert key(first.pick) == key(first.pick) != key(second.pick)
    assert key(first.pick) != key(first.__init__)


def _viewed_weight_model(x, y=None):
    # a functional model that views its weight (w.mT, counted from the right), checked
    # for dims counted from the left in each vectorized run, the traced one too
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([4, 3]).to_event(2))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Categorical(logits=torch.nn.functional.linear(x, w.mT)), obs=y)


def test_vectorized_particles_with_a_view_of_a_weight_are_captured():
    torch.set_default_dtype(torch.float64)
    try:
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        runs = []
        for cls in (SVI, CapturedSVI):
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            svi = cls(_viewed_weight_model, AutoNormal(_viewed_weight_model),
                      pyro.optim.Adam({"lr": 1e-2}),
                      Trace_ELBO(num_particles=3, vectorize_particles=True,
                                 max_plate_nesting=1))
            with local_reparam():
                runs.append([svi.step(x, y) for _ in range(3)])
    finally:
        torch.set_default_dtype(torch.float32)
    assert svi.num_traces == 1 and svi.fallback_reason is None
    assert _close(*runs), runs
