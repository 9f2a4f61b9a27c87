"""Smoke runs of the reproduction scripts (``--quick``) and checks of their helpers."""

import json
import os
import subprocess
import sys

import pyro
import pytest
import torch
from torch.distributions import Normal, kl_divergence

import pyro_vinit
from benchmarks.reproduce import common, iblm, ktied, ood, radial
from pyro_vinit.guides import site_params
from pyro_vinit.nn import BayesianClassifier
from tests.common import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {
    "ktied": ("runs", "truncation", "step_ms", "paper_shape_counts"),
    "radial": ("robustness", "continual", "robustness_summary"),
    "lrt": ("rows", "paper"),
    "ood": ("runs", "sizes"),
    "iblm": ("results", "kinds", "paper", "steps"),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_quick(name, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.reproduce.{name}", "--quick", "--out-dir",
         str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / f"{name}.json") as f:
        results = json.load(f)
    assert set(SCRIPTS[name]) <= set(results), sorted(results)
    assert results["config"]["quick"] is True
    with open(tmp_path / f"{name}_tables.inc") as f:
        tables = f.read()
    assert "====" in tables and "--quick" in tables
    pytest.importorskip("matplotlib")
    assert any(p.endswith(".png") for p in os.listdir(tmp_path)), os.listdir(tmp_path)


@pytest.fixture
def local_params():
    with pyro.settings.context(module_local_params=True):
        yield


def _model_and_guide(sizes=(6, 5, 3)):
    model = common.make_model(sizes, num_data=10)
    guide = common.MeanFieldNormal(model, init_scale=0.05)
    x, y = torch.randn(4, sizes[0]), torch.tensor([0, 1, 2, 1])
    guide(x, y)
    return model, guide, x, y


def test_mean_field_kl_is_closed_form(local_params):
    # the KL the scripts train and report is the exact sum of the per-weight Normal KLs,
    # not a Monte Carlo estimate (which would vary between calls)
    model, guide, x, _ = _model_and_guide()
    expected = 0.0
    for name in site_params.latent_sites(guide):
        loc, scale = guide.get_loc_and_scale(name)
        layer = model.net[int(name.split(".")[1])]
        expected += kl_divergence(Normal(loc, scale), Normal(0.0, layer.prior_scale)).sum()
    first, second = common.kl_divergence(model, guide, x), common.kl_divergence(model, guide, x)
    assert first == second
    assert_close(torch.tensor(first), expected.detach(), rtol=1e-5)


def test_mean_field_set_and_get(local_params):
    _, guide, _, _ = _model_and_guide()
    loc = torch.randn(5, 6)
    scale = torch.tensor([1e-6, 1e-3, 0.5, 3.0, 30.0]).unsqueeze(-1).expand(5, 6)
    guide.set_loc_and_scale("net.0.weight", loc, scale)
    got_loc, got_scale = site_params.get_loc_and_scale(guide, "net.0.weight")
    assert_close(got_loc, loc)
    assert_close(got_scale, scale, rtol=1e-4)


def test_mean_field_samples_at_the_site(local_params):
    # a Normal at the site itself (not AutoNormal's Delta): what closed-form KL and LRT need
    _, guide, x, y = _model_and_guide()
    trace = pyro.poutine.trace(guide).get_trace(x, y)
    fn = trace.nodes["net.0.weight"]["fn"]
    assert isinstance(fn.base_dist, Normal) and fn.event_dim == 2
    assert_close(fn.base_dist.scale, torch.full((5, 6), 0.05))
    assert "net.0.weight_unconstrained" not in trace.nodes


def test_mean_field_means_start_at_a_prior_draw(local_params):
    # not at 0 (AutoSiteGuide's init_to_feasible), where the hidden units are all alike
    _, guide, _, _ = _model_and_guide()
    loc = guide.get_loc_and_scale("net.0.weight")[0]
    assert bool((loc != 0).all()) and len(set(loc[:, 0].tolist())) == loc.shape[0]
    assert 0.2 < loc.std().item() * 6**0.5 < 2.5  # the prior's N(0, 1/6), loosely


def test_radial_sigma_as_the_paper(local_params):
    # [1]'s sigma is the RadialNormal's own scale: per-element marginal sd sigma / sqrt(D)
    model = common.make_model((6, 5, 3), num_data=10)
    guide = common.make_guide("radial", model, init_scale=0.05)
    guide(torch.randn(4, 6), torch.tensor([0, 1, 2, 1]))
    radial.set_radial_sigma(guide, 0.3)
    assert_close(guide.get_radial_scale("net.0.weight"), torch.full((5, 6), 0.3), rtol=1e-5)
    assert_close(guide.get_loc_and_scale("net.0.bias")[1], torch.full((5,), 0.3 / 5**0.5),
                 rtol=1e-5)


def test_snr_recorder():
    # E[g²] / Var[g] over the window's steps, per parameter
    param = torch.nn.Parameter(torch.zeros(2))
    recorder = ktied.SNRRecorder([param], checkpoints=[4], window=3)
    grads = [torch.tensor([1.0, 0.0]), torch.tensor([3.0, 1.0]), torch.tensor([2.0, 2.0]),
             torch.tensor([4.0, 3.0]), torch.tensor([6.0, 5.0])]
    for step, g in enumerate(grads):
        param.grad = g
        recorder(step)
    window = torch.stack(grads[2:5])
    expected = window.pow(2).mean(0) / window.var(0, correction=0)
    summary = recorder.summary()[4]
    assert_close(torch.tensor(summary["mean"]), expected.mean())
    assert summary["num_parameters"] == 2


def test_paper_parameter_counts(local_params):
    # mean-field: 2 per weight and bias; k-tied: mn + k(m + n) per weight matrix, 2 per bias
    args = ktied.parse_args(["--quick"])
    args.paper_sizes = [7, 5, 4, 3]
    counts = ktied.paper_counts(args)
    layers = list(zip(args.paper_sizes[1:], args.paper_sizes[:-1]))
    assert counts["mean-field"] == sum(2 * (m * n + m) for m, n in layers)
    for k in (1, 2, 3):
        assert counts[f"k-tied k={k}"] == sum(m * n + k * (m + n) + 2 * m for m, n in layers)


def test_ood_sets():
    x = torch.rand(40, 784)
    y = torch.arange(40) % 10
    data = (x, y, x.clone(), y.clone())
    (x_tr, y_tr), (x_in, y_in), sets = ood.make_sets(data, torch.arange(5), seed=0)
    assert set(y_tr.tolist()) == set(range(5)) and set(y_in.tolist()) == set(range(5))
    assert len(sets["digits 5-9"]) == 20 and len(sets["uniform noise"]) == len(x_in)
    assert_close(sets["inverted"], 1.0 - x_in)
    image = x_in[0].reshape(28, 28)
    assert_close(sets["rotated 90°"][0].reshape(28, 28), torch.rot90(image, 1, (0, 1)))
    assert not torch.equal(sets["rotated 90°"][0], x_in[0])
    # offline and seeded: the same noise images every time
    assert torch.equal(ood.make_sets(data, torch.arange(5), seed=0)[2]["uniform noise"],
                       sets["uniform noise"])


def test_rst_table():
    text = common.rst_table(["a", "long header"], [["1", "2"], ["333", "4"]])
    lines = text.splitlines()
    assert lines[0] == lines[2] == lines[-1] == "===  ==========="
    assert lines[1] == "a    long header"
    assert lines[3] == "1    2"


def test_continual_priors_reach_the_model(local_params):
    # the body's sites are found (bayesianize turns its parameters into sample sites),
    # and the prior made from a posterior is the distribution the model samples them from
    net, body_sites = radial.bayesian_multi_head([6, 4], num_tasks=2)
    assert body_sites == ["net.body.0.weight", "net.body.0.bias"]
    model = BayesianClassifier(net)
    x, y = torch.randn(3, 6), torch.tensor([0, 1, 1])
    guide = common.MeanFieldNormal(model, init_scale=0.05)
    guide(x, y)
    priors = radial.body_priors(guide, body_sites)
    assert sorted(priors) == sorted(body_sites)
    pyro_vinit.set_priors(model, priors)
    trace = pyro.poutine.trace(model).get_trace(x, y)
    for name in body_sites:
        loc, scale = guide.get_loc_and_scale(name)
        fn = trace.nodes[name]["fn"]
        assert_close(fn.mean, loc.detach())
        assert_close(fn.stddev, scale.detach())
    assert_close(trace.nodes["net.heads.0.weight"]["fn"].stddev, torch.full((2, 4), 0.5))


def test_iblm_checkpoints():
    assert iblm.checkpoints(600) == [0, 10, 20, 50, 100, 200, 500, 600]
    assert iblm.checkpoints(1000) == [0, 10, 20, 50, 100, 200, 500, 1000]
    assert iblm.checkpoints(5) == [0, 5]


def test_iblm_regressor_scales_the_likelihood(local_params):
    # the minibatch log-likelihood is scaled by num_data / batch, as BayesianClassifier's
    net = pyro_vinit.nn.bayesianize(pyro_vinit.nn.mlp((3, 1)))
    model = iblm.Regressor(net, num_data=12)
    x, y = torch.randn(4, 3), torch.randn(4)
    trace = pyro.poutine.trace(model).get_trace(x, y)
    trace.compute_log_prob()
    site = trace.nodes["obs"]
    expected = site["fn"].log_prob(y).sum() * 3.0
    assert_close(site["log_prob_sum"], expected)
