"""fit's captured step (``capture=``): the same losses, parameters, checkpoints,
validation and BatchNorm statistics as the eager step under the same seed, one
trace per call (an epoch's partial batch steps eagerly), and ``capture=None``
choosing by the run's length and device."""

import warnings

import pyro
import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_vinit.training.captured as training_captured
import pyro_vinit.training.loop as training_loop
from pyro_vinit import AutoKTiedNormal, fit
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp


def blobs(n=150, d=5, k=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    centers = 3 * torch.randn(k, d, generator=g)
    y = torch.arange(n) % k
    x = centers[y] + torch.randn(n, d, generator=g)
    return x.to(dtype), y


def classifier(n=150, batchnorm=False, dtype=torch.float64):
    net = (nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
           if batchnorm else mlp((5, 16, 3)))
    return BayesianClassifier(bayesianize(net), num_data=n).to(dtype)


def snapshot():
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


@pytest.fixture
def traces(monkeypatch):
    """Counts the steps CapturedSVI traces."""
    count = []
    original = training_captured.CapturedSVI._trace

    def counting(self, *args, **kwargs):
        count.append(args[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(training_captured.CapturedSVI, "_trace", counting)
    return count


def _fit(capture, batchnorm=False, dtype=torch.float64, guide_class=None, **options):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = blobs(dtype=dtype)
    model = classifier(batchnorm=batchnorm, dtype=dtype)
    guide = AutoKTiedNormal(model, rank=2) if guide_class is None else guide_class(model)
    history = fit(model, guide, (x, y), batch_size=64,
                  progress=False, capture=capture, **options)
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    return history, snapshot(), buffers


@pytest.mark.parametrize("batchnorm, guide_class", [(False, None), (True, None),
                                                    (False, AutoNormal)],
                         ids=["mlp", "batchnorm", "AutoNormal"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_captured_fit_equals_eager_fit(batchnorm, guide_class, dtype, traces):
    # 150 rows in batches of 64: every third batch is a partial one of 22 rows. Pyro's
    # AutoNormal under local_reparam() asks for zeros_like of a weight (its log-Jacobian).
    options = dict(steps=14, validation=blobs(seed=1, dtype=dtype), eval_every=5, num_samples=3,
                   guide_class=guide_class)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: every full batch is replayed
        eager, eager_params, eager_buffers = _fit(False, batchnorm, dtype, **options)
        assert not traces
        captured, captured_params, captured_buffers = _fit(True, batchnorm, dtype, **options)
    assert not eager.captured and captured.captured
    assert len(traces) == 1  # the full batches' shape; the partial batches step eagerly
    # bit-identical here (the test of CapturedSVI itself allows 1e-10 relative)
    assert captured.loss == eager.loss
    assert captured.validation == eager.validation
    for name in eager_params:
        assert torch.equal(captured_params[name], eager_params[name]), name
    for name in eager_buffers:  # BatchNorm's statistics, after fit's update_batch_norm
        assert torch.equal(captured_buffers[name], eager_buffers[name]), name


def test_captured_fit_differs_under_another_seed():
    # control for the equality above: the losses depend on the draws
    a, _, _ = _fit(True, steps=4)
    pyro.set_rng_seed(1)
    x, y = blobs()
    pyro.clear_param_store()
    model = classifier()
    b = fit(model, AutoKTiedNormal(model, rank=2), (x, y), steps=4, batch_size=64,
            progress=False, capture=True)
    assert a.loss != b.loss


def test_captured_checkpoint_resumes_bit_identically(tmp_path):
    straight, straight_params, _ = _fit(True, steps=12)
    _fit(True, steps=5, checkpoint=tmp_path / "c.pt")
    resumed, resumed_params, _ = _fit(True, steps=12, checkpoint=tmp_path / "c.pt")
    assert resumed.loss == straight.loss
    for name in straight_params:
        assert torch.equal(resumed_params[name], straight_params[name]), name


@pytest.mark.parametrize("threshold, steps, expected", [
    (10, 12, True), (10, 10, True), (10, 9, False), (None, 12, False)])
def test_capture_none_chooses_by_the_run_length(monkeypatch, threshold, steps, expected):
    monkeypatch.setitem(training_loop._CAPTURE_MIN_STEPS, "cpu", threshold)
    history, _, _ = _fit(None, steps=steps)
    assert history.captured is expected


@pytest.mark.parametrize("threshold, capture", [(10, False), (None, True)])
def test_capture_forced_overrides_the_rule(monkeypatch, threshold, capture):
    monkeypatch.setitem(training_loop._CAPTURE_MIN_STEPS, "cpu", threshold)
    history, _, _ = _fit(capture, steps=12)
    assert history.captured is capture


def test_capture_none_counts_the_steps_left_after_a_checkpoint(monkeypatch, tmp_path):
    monkeypatch.setitem(training_loop._CAPTURE_MIN_STEPS, "cpu", 10)
    first, _, _ = _fit(None, steps=12, checkpoint=tmp_path / "c.pt")
    assert first.captured
    resumed, _, _ = _fit(None, steps=16, checkpoint=tmp_path / "c.pt")  # 4 steps left
    assert not resumed.captured and resumed.steps == 16


def test_capture_none_rule_is_the_documented_one(monkeypatch):
    # the measured rule of docs/methods/training.rst: from 200 steps on a CPU, 100 on CUDA
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert training_loop._use_capture(None, 200, cpu)
    assert not training_loop._use_capture(None, 199, cpu)
    assert training_loop._use_capture(True, 1, cpu)
    assert not training_loop._use_capture(False, 10**6, cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert training_loop._use_capture(None, 100, cuda)
    assert not training_loop._use_capture(None, 99, cuda)
    assert not training_loop._use_capture(False, 10**6, cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not training_loop._use_capture(None, 10**6, cuda)  # no CUDA: not the CUDA rule
    assert not training_loop._use_capture(None, 10**6, torch.device("meta"))  # no rule


def test_bad_capture_is_refused_before_anything_changes():
    x, y = blobs()
    model = classifier()
    guide = AutoKTiedNormal(model, rank=2)
    with pytest.raises(TypeError, match="capture must be True, False or None"):
        fit(model, guide, (x, y), steps=2, progress=False, capture="yes")
    assert len(pyro.get_param_store()) == 0 and guide.prototype_trace is None


def test_a_step_that_cannot_be_captured_warns_and_trains_eagerly():
    x, y = blobs()

    class Branching(BayesianClassifier):
        def forward(self, x, y=None):
            if float(x.sum()) > 1e9:  # a branch on a tensor's value
                x = x * 2
            return super().forward(x, y)

    model = Branching(bayesianize(mlp((5, 16, 3))), num_data=150).double()
    with pytest.warns(RuntimeWarning, match="CapturedSVI: the step could not be traced"):
        history = fit(model, AutoKTiedNormal(model, rank=2), (x, y), steps=4, batch_size=64,
                      progress=False, capture=True)
    assert history.steps == 4
    assert not history.captured  # every step ran eagerly: not reported as captured


@pytest.mark.device
def test_capture_on_the_device(device):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = (t.to(device) for t in blobs(dtype=torch.float32))
    results = []
    # on CUDA also inductor's compile in a CUDA graph (compiled on the CPU elsewhere)
    captures = (False, True, "compile") if device.type == "cuda" else (False, True)
    for capture in captures:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model = classifier(dtype=torch.float32).to(device)
        history = fit(model, AutoKTiedNormal(model, rank=2), (x, y), steps=8, batch_size=64,
                      progress=False, capture=capture)
        assert history.compiled == (capture == "compile")
        results.append(history.loss)
    assert results[0] == pytest.approx(results[1], rel=1e-5)
    for other in results[2:]:  # the first step eager; then inductor's own draws and rounding
        assert other[0] == pytest.approx(results[0][0], rel=1e-5)
        assert len(other) == 8 and all(torch.isfinite(torch.tensor(other)))
