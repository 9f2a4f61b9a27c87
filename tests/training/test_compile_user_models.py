"""fit's captured and compiled step on models written as Pyro users write them
(issue 25): a functional model whose step draws more than Normal noise (a
subsampling plate's indices, dropout's mask) compiled to the eager step's
losses and parameters (float64, 1e-10 relative); the warnings of a step that
falls back or is not compiled pointing at the user's line, under fit too; torch's
own deprecation warnings during the compile no error where a user makes them one."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule

import pyro_vinit.training.captured as training_captured
from pyro_vinit import AutoKTiedNormal, CapturedSVI, fit
from pyro_vinit.nn import bayesianize, mlp
from tests.test_captured import Switching, ValueBranch, _close
from tests.training.test_captured_compile import _no_inductor


def _functional(num_data):
    """A functional model (``x @ w``, ``F.linear``) with a learned noise scale, a
    dropout mask, a deterministic site and a plate that scales a minibatch by
    drawing ``subsample_size`` indices."""

    def model(x, y=None):
        w1 = pyro.sample("w1", dist.Normal(0.0, 1.0).expand([x.shape[1], 4]).to_event(2))
        w2 = pyro.sample("w2", dist.Normal(0.0, 1.0).expand([1, 4]).to_event(2))
        sigma = pyro.param("sigma", torch.tensor(1.0), constraint=dist.constraints.positive)
        h = F.dropout(torch.tanh(x @ w1), 0.25, training=True)
        mean = F.linear(h, w2).squeeze(-1)
        with pyro.plate("data", num_data, subsample_size=x.shape[0]):
            pyro.deterministic("mean", mean)
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)

    return model


def _fit(model_fn, x, y, capture):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = model_fn()
    history = fit(model, AutoNormal(model), (x, y), steps=5, batch_size=8, capture=capture,
                  init=None, progress=False)
    return history, {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


@pytest.mark.skipif(_no_inductor() is not None, reason=str(_no_inductor()))
def test_a_functional_model_compiles_to_the_eager_steps():
    torch.set_default_dtype(torch.float64)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(24, 3, generator=g)
        y = x.sum(-1).sin()
        eager, eager_params = _fit(lambda: _functional(24), x, y, False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback, no uncompiled replay
            compiled, params = _fit(lambda: _functional(24), x, y, "compile")
    finally:
        torch.set_default_dtype(torch.float32)
    assert compiled.captured and compiled.compiled
    assert _close(compiled.loss, eager.loss) and len(set(eager.loss)) == 5
    assert params.keys() == eager_params.keys() and "sigma" in params
    for name in params:
        assert _close(params[name], eager_params[name]), name


# ---- where the warnings point --------------------------------------------------------------


@pytest.mark.parametrize("model_cls, reason", [
    (Switching, "sites changed"), (ValueBranch, "could not be traced")])
def test_a_fallback_warning_points_at_the_step_call(model_cls, reason):
    x = torch.randn(10)
    model = model_cls()
    guide = AutoNormal(lambda x: model(x))
    svi = CapturedSVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    with pytest.warns(RuntimeWarning, match=reason) as record:
        for _ in range(3):
            svi.step(x)
    (warning,) = [w for w in record if "CapturedSVI" in str(w.message)]
    assert warning.filename == __file__  # not CapturedSVI.step's line, a frame too deep


class _ItemGuard(PyroModule):
    """A classifier that reads a tensor's value (a guard against overflow)."""

    def __init__(self, num_data):
        super().__init__()
        self.net = bayesianize(mlp((3, 4, 2)))
        self.num_data = num_data

    def forward(self, x, y=None):
        logits = self.net(x)
        if logits.abs().max().item() > 1e6:
            logits = logits.clamp(-1e6, 1e6)
        with pyro.plate("data", self.num_data, subsample=torch.arange(x.shape[0])):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)


def _fit_guarded(capture):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, generator=g), torch.arange(16) % 2
    model = _ItemGuard(16)
    return fit(model, AutoKTiedNormal(model, rank=2), (x, y), steps=4, batch_size=8,
               capture=capture, init=None, progress=False)


def test_fit_points_a_fallback_warning_at_its_caller():
    eager = _fit_guarded(False)
    with pytest.warns(RuntimeWarning, match="could not be traced") as record:
        captured = _fit_guarded(True)
    (warning,) = [w for w in record if "CapturedSVI" in str(w.message)]
    assert warning.filename == __file__  # not fit's line in loop.py
    assert captured.loss == eager.loss


def test_fit_points_a_failed_compile_warning_at_its_caller(monkeypatch):
    def failing(graph, params, tensors):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(training_captured, "inductor_compile", failing)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, generator=g), torch.randn(16, generator=g)
    with pytest.warns(RuntimeWarning, match="compile=True.*not compiled") as record:
        history, _ = _fit(lambda: _functional(16), x, y, "compile")
    (warning,) = [w for w in record if "not compiled" in str(w.message)]
    assert warning.filename == __file__  # not fit's line in loop.py
    assert history.captured and not history.compiled


def test_torchs_own_deprecation_warnings_do_not_fail_the_compile(monkeypatch):
    # inductor's first import warns DeprecationWarning (torch.jit.script_method); a
    # user's test suite run with -W error::DeprecationWarning then lost the compile
    from torch._inductor import compile_fx as inductor_module
    from torch.fx.experimental.proxy_tensor import make_fx

    from pyro_vinit.training._inductor import inductor_compile

    def warning_compile(graph, examples):
        warnings.warn("`torch.jit.script_method` is deprecated", DeprecationWarning, stacklevel=2)
        return graph  # the flat graph, called as inductor's code is

    monkeypatch.setattr(inductor_module, "compile_fx", warning_compile)
    p, t = torch.randn(3), torch.randn(3)
    graph = make_fx(lambda ps, ts: ((ps[0] * ts[0]).sum(), [ps[0] * 2]))([p], [t])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        loss, (grad,) = inductor_compile(graph, [p], [t])([p], [t])
    assert torch.equal(loss, (p * t).sum()) and torch.equal(grad, p * 2)
