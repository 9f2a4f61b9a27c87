"""CapturedSVI(compile=True): inductor's compile of the traced step gives the
eager step's losses, gradients and parameters under the same seed (float64,
1e-10 relative); bad values and devices refused before anything changes; a
compile that fails, or a step that writes to a model's buffer, replayed
uncompiled after one warning; fit(capture="compile") passing it through."""

import warnings

import pyro
import pytest
import torch
from pyro.infer import SVI, TraceMeanField_ELBO

import pyro_vinit.training.captured as training_captured
from pyro_vinit import AutoKTiedNormal, CapturedSVI, fit
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from tests.test_captured import PROBLEMS, GradRecorder, _close


def _no_inductor():
    """Why inductor cannot compile here (no C++ compiler), or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as error:
        return f"inductor cannot compile on this host ({type(error).__name__}: {error})"
    return None


def _steps(make_svi, problem="mlp", steps=4, after=3):
    """Losses and recorded gradients of ``steps`` steps from seed 0, the
    parameters after ``after`` steps, and the SVI object."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, make_guide, data, handler = PROBLEMS[problem]("cpu")
    optim = GradRecorder()
    svi = make_svi(model, make_guide(model), optim, TraceMeanField_ELBO())
    losses, params = [], None
    for step in range(steps):
        with handler() if handler is not None else warnings.catch_warnings():
            losses.append(svi.step(*data))
        if step + 1 == after:
            params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    return losses, optim.grads, params, buffers, svi


def _float64(fn, *args, **kwargs):
    torch.set_default_dtype(torch.float64)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_default_dtype(torch.float32)


def _assert_same_run(eager, other):
    losses, grads, params, buffers, _ = eager
    o_losses, o_grads, o_params, o_buffers, _ = other
    assert _close(losses, o_losses), (losses, o_losses)
    assert len(set(losses)) == len(losses)  # a fresh draw (and parameter) every step
    for step, (g, o) in enumerate(zip(grads, o_grads)):
        assert g.keys() == o.keys(), step
        for name in g:
            assert _close(g[name], o[name]), (step, name)
    assert params.keys() == o_params.keys()
    for name in params:
        assert _close(params[name], o_params[name]), name
    assert buffers.keys() == o_buffers.keys()
    for name in buffers:
        assert _close(buffers[name].double(), o_buffers[name].double()), name


@pytest.mark.skipif(_no_inductor() is not None, reason=str(_no_inductor()))
def test_compiled_step_equals_eager_step():
    eager = _float64(_steps, SVI)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback, no uncompiled replay
        compiled = _float64(_steps, lambda *a: CapturedSVI(*a, compile=True))
    svi = compiled[-1]
    assert svi.num_traces == 1 and svi.fallback_reason is None and svi.compile_failure is None
    (capture,) = svi._captures.values()
    assert not isinstance(capture.graph, torch.fx.GraphModule)  # inductor's, not the replay
    _assert_same_run(eager, compiled)


def test_bad_values_are_refused_at_construction():
    model, make_guide, _, _ = PROBLEMS["mlp"]("cpu")
    guide = make_guide(model)
    for value in ("yes", 1, None):
        with pytest.raises(ValueError, match="compile must be True or False"):
            CapturedSVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), TraceMeanField_ELBO(),
                        compile=value)
    with pytest.raises(ValueError, match="CPU only"):
        CapturedSVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), TraceMeanField_ELBO(),
                    compile=True, cuda_graph=True)


def test_data_off_the_cpu_is_refused_before_the_step():
    model, make_guide, (x, y), handler = PROBLEMS["mlp"]("cpu")
    svi = CapturedSVI(model, make_guide(model), pyro.optim.Adam({"lr": 1e-2}),
                      TraceMeanField_ELBO(), compile=True)
    with handler(), pytest.raises(ValueError, match=r"compile=True.*CPU.*\['meta'\]"):
        svi.step(x.to("meta"), y.to("meta"))  # a device other than the CPU, on any host
    assert len(pyro.get_param_store()) == 0 and svi.num_traces == 0


def test_a_failed_compile_warns_once_and_replays_uncompiled(monkeypatch):
    calls = []

    def failing(graph, params, tensors):
        calls.append(graph)
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(training_captured, "inductor_compile", failing)
    captured = _float64(_steps, CapturedSVI)
    match = "not compiled .inductor failed: RuntimeError: no C.. compiler"
    with pytest.warns(RuntimeWarning, match=match) as record:
        compiled = _float64(_steps, lambda *a: CapturedSVI(*a, compile=True))
    assert len([w for w in record if "not compiled" in str(w.message)]) == 1
    svi = compiled[-1]
    assert len(calls) == 1 and "no C++ compiler" in svi.compile_failure
    assert svi.fallback_reason is None and svi.num_traces == 1
    (capture,) = svi._captures.values()
    assert isinstance(capture.graph, torch.fx.GraphModule)  # the plain replay
    _assert_same_run(captured, compiled)
    # a second signature: not compiled again, no second warning
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with PROBLEMS["mlp"]("cpu")[3]():
            _float64(lambda: [svi.step(x.double(), y) for _ in range(2)])
    assert len(calls) == 1 and svi.num_traces == 2


def test_a_step_writing_to_a_buffer_is_replayed_uncompiled(monkeypatch):
    calls = []
    monkeypatch.setattr(training_captured, "inductor_compile",
                        lambda *args: calls.append(args))
    eager = _float64(_steps, SVI, "batchnorm")
    with pytest.warns(RuntimeWarning, match="not compiled.*writes in place.*running statistics"):
        compiled = _float64(_steps, lambda *a: CapturedSVI(*a, compile=True), "batchnorm")
    assert calls == []  # refused before inductor, which would drop the running statistics
    _assert_same_run(eager, compiled)


def test_fit_capture_compile_passes_it_through(monkeypatch):
    compiled = []

    def recording(graph, params, tensors):  # the functional graph, called as it is
        compiled.append(graph)
        return graph

    monkeypatch.setattr(training_captured, "inductor_compile", recording)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 5, generator=g), torch.arange(64) % 3

    def run(capture):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model = BayesianClassifier(bayesianize(mlp((5, 8, 3))), num_data=64)
        guide = AutoKTiedNormal(model, rank=2)
        history = fit(model, guide, (x, y), steps=6, batch_size=32, capture=capture,
                      init=None, progress=False)
        return history

    plain = run(True)
    assert compiled == []
    through = run("compile")
    assert len(compiled) == 1 and through.captured
    assert through.loss == plain.loss and len(set(plain.loss)) == 6
    with pytest.raises(TypeError, match="capture must be"):
        fit(None, None, (x, y), capture="yes")
    pyro.clear_param_store()
    model = BayesianClassifier(bayesianize(mlp((5, 8, 3))), num_data=64)
    guide = AutoKTiedNormal(model, rank=2)
    with pytest.raises(ValueError, match="capture='compile' is measured on the CPU only"):
        fit(model, guide, (x.to("meta"), y.to("meta")), steps=2, capture="compile",
            progress=False)
    assert len(pyro.get_param_store()) == 0 and guide.prototype_trace is None
