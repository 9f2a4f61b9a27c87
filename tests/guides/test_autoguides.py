"""The contract Pyro's tests/infer/test_autoguide.py checks for every autoguide,
run over our guides with Pyro's AutoNormal as the control."""

import io
import math

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import (
    SVI,
    JitTrace_ELBO,
    JitTraceMeanField_ELBO,
    Predictive,
    Trace_ELBO,
    TraceMeanField_ELBO,
)
from pyro.infer.autoguide import (
    AutoDelta,
    AutoGuideList,
    AutoNormal,
    init_to_sample,
    init_to_value,
)
from pyro.nn import PyroModule, PyroSample
from pyro.optim import Adam

from pyro_vinit import AutoKTiedNormal, AutoMeanFieldNormal, AutoRadialNormal
from tests.common import assert_close

GUIDES = [AutoNormal, AutoKTiedNormal, AutoRadialNormal, AutoMeanFieldNormal]
ELBOS = [Trace_ELBO, TraceMeanField_ELBO]


def assorted_model():
    """Real, positive, simplex and matrix sites, inside and outside plates."""
    pyro.sample("scalar", dist.Normal(0.0, 1.0))
    pyro.sample("vector", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    pyro.sample("matrix", dist.Normal(torch.zeros(4, 5), 1.0).to_event(2))
    pyro.sample("kernel", dist.Normal(torch.zeros(2, 3, 2, 2), 1.0).to_event(4))
    pyro.sample("positive", dist.LogNormal(0.0, 1.0))
    pyro.sample("simplex", dist.Dirichlet(torch.ones(4)))
    with pyro.plate("plate", 6):
        pyro.sample("local", dist.Normal(0.0, 1.0))
        pyro.sample("local_matrix", dist.Normal(torch.zeros(2, 3), 1.0).to_event(2))
        pyro.sample("local_positive", dist.Gamma(2.0, 2.0))
    pyro.sample("obs", dist.Normal(0.0, 1.0), obs=torch.tensor(0.5))


@pytest.mark.parametrize("Guide", GUIDES)
def test_shapes_and_sites(Guide):
    guide = Guide(assorted_model)
    guide_trace = poutine.trace(guide).get_trace()
    model_trace = poutine.trace(poutine.replay(assorted_model, guide_trace)).get_trace()
    for name, site in model_trace.iter_stochastic_nodes():
        if name == "plate":
            continue
        assert name in guide_trace.nodes
        assert guide_trace.nodes[name]["value"].shape == site["value"].shape
        assert site["fn"].support.check(site["value"]).all()


@pytest.mark.parametrize("Guide", [AutoKTiedNormal, AutoRadialNormal, AutoMeanFieldNormal])
def test_real_sites_carry_the_posterior(Guide):
    # No Delta and no auxiliary site at real-support sites, so the KL is closed form.
    guide_trace = poutine.trace(Guide(assorted_model)).get_trace()
    for name in ["scalar", "vector", "matrix", "kernel", "local", "local_matrix"]:
        assert not isinstance(guide_trace.nodes[name]["fn"], dist.Delta)
        assert name + "_unconstrained" not in guide_trace.nodes
    for name in ["positive", "simplex", "local_positive"]:
        assert isinstance(guide_trace.nodes[name]["fn"], dist.Delta)
        assert guide_trace.nodes[name + "_unconstrained"]["infer"]["is_auxiliary"]


@pytest.mark.parametrize("Elbo", ELBOS)
@pytest.mark.parametrize("Guide", GUIDES)
def test_svi_steps(Guide, Elbo):
    guide = Guide(assorted_model)
    svi = SVI(assorted_model, guide, Adam({"lr": 0.01}), Elbo())
    losses = [svi.step() for _ in range(3)]
    assert all(math.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("Guide", GUIDES)
def test_median(Guide):
    guide = Guide(assorted_model)
    guide()
    median = guide.median()
    for name, site in poutine.trace(assorted_model).get_trace().iter_stochastic_nodes():
        if name == "plate":
            continue
        loc, _ = guide._get_loc_and_scale(name)
        assert median[name].shape == site["value"].shape
        assert_close(median[name], torch.distributions.biject_to(site["fn"].support)(loc))


@pytest.mark.parametrize("Guide", GUIDES)
def test_quantiles(Guide):
    guide = Guide(assorted_model, init_scale=0.5)
    guide()
    quantiles = guide.quantiles([0.1, 0.5, 0.9])
    median = guide.median()
    for name, value in quantiles.items():
        assert value.shape == (3,) + median[name].shape
        assert_close(value[1], median[name], atol=1e-5, rtol=1e-5)
        if name == "simplex":  # the stick-breaking transform is not element-wise monotone
            continue
        assert (value[0] < value[1]).all() and (value[1] < value[2]).all(), name


@pytest.mark.parametrize("Guide", GUIDES)
def test_quantiles_match_samples(Guide):
    guide = Guide(assorted_model, init_scale=0.5)
    guide()
    q = guide.quantiles([0.1, 0.9])
    samples = Predictive(assorted_model, guide=guide, num_samples=8000, parallel=True)()
    for name in ["vector", "matrix", "positive"]:
        inside = ((samples[name] > q[name][0]) & (samples[name] < q[name][1])).float().mean()
        # 80% of the mass lies between the 10% and 90% quantiles (± 3 s.e. and then some).
        assert abs(inside.item() - 0.8) < 0.02, name


@pytest.mark.parametrize("Guide", GUIDES)
def test_serialization(Guide):
    guide = Guide(assorted_model)
    svi = SVI(assorted_model, guide, Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(3):
        svi.step()
    buffer = io.BytesIO()
    torch.save(guide.state_dict(), buffer)
    buffer.seek(0)

    pyro.clear_param_store()
    restored = Guide(assorted_model)
    restored()  # set up, then overwrite the freshly initialized parameters
    restored.load_state_dict(torch.load(buffer))
    for name, value in guide.median().items():
        assert_close(restored.median()[name], value)
    pyro.set_rng_seed(1)
    expected = guide()
    pyro.set_rng_seed(1)
    actual = restored()
    for name in expected:
        assert_close(actual[name], expected[name])


@pytest.mark.parametrize("Guide", GUIDES)
def test_init_loc_fn(Guide):
    values = {
        "scalar": torch.tensor(0.25),
        "matrix": torch.arange(20.0).reshape(4, 5) / 10,
        "positive": torch.tensor(3.0),
        "simplex": torch.tensor([0.1, 0.2, 0.3, 0.4]),
    }
    guide = Guide(assorted_model, init_loc_fn=init_to_value(values=values))
    guide()
    median = guide.median()
    for name, value in values.items():
        assert_close(median[name], value, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("init_scale", [1e-2, 0.5])
@pytest.mark.parametrize("Guide", GUIDES)
def test_init_scale(Guide, init_scale):
    guide = Guide(assorted_model, init_scale=init_scale)
    guide()
    samples = Predictive(guide, num_samples=4000, parallel=True)()
    for name in ["scalar", "vector", "matrix", "kernel", "local_matrix"]:
        std = samples[name].std(0)
        # The std of 4000 draws has a relative standard error of ~1.1%: 6% is ~5 s.e.
        assert_close(std.mean(), init_scale, rtol=0.06, atol=0), name


def subsample_model(data):
    loc = pyro.sample("loc", dist.Normal(0.0, 10.0))
    weights = pyro.sample("weights", dist.Normal(torch.zeros(3, 2), 1.0).to_event(2))
    with pyro.plate("data", 100, subsample_size=10, dim=-1) as ind:
        local = pyro.sample("local", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        mean = loc + (local @ weights.T).sum(-1)
        pyro.sample("obs", dist.Normal(mean, 1.0), obs=data[ind])


@pytest.mark.parametrize("Guide", GUIDES)
def test_subsample_model(Guide):
    data = torch.randn(100)
    guide = Guide(subsample_model)
    svi = SVI(subsample_model, guide, Adam({"lr": 0.01}), Trace_ELBO())
    for _ in range(3):
        svi.step(data)
    loc, scale = guide._get_loc_and_scale("local")
    assert loc.shape == (100, 2) and scale.shape == (100, 2)
    guide_trace = poutine.trace(guide).get_trace(data)
    assert guide_trace.nodes["local"]["value"].shape == (10, 2)


@pytest.mark.parametrize("Guide", GUIDES)
def test_subsample_guide(Guide):
    data = torch.randn(100)

    def model(data, ind):
        loc = pyro.sample("loc", dist.Normal(0.0, 10.0))
        with pyro.plate("data", 100, subsample=ind):
            local = pyro.sample("local", dist.Normal(torch.zeros(3, 2), 1.0).to_event(2))
            pyro.sample("obs", dist.Normal(loc + local.sum((-1, -2)), 1.0), obs=data[ind])

    def create_plates(data, ind):
        return pyro.plate("data", 100, subsample=ind)

    guide = Guide(model, create_plates=create_plates)
    guide(data, torch.arange(7))  # set up
    initial = guide._get_loc_and_scale("local")[0].detach().clone()
    svi = SVI(model, guide, Adam({"lr": 0.01}), Trace_ELBO())
    seen = set()
    for step in range(3):
        ind = torch.randperm(100)[:7]
        seen.update(ind.tolist())
        svi.step(data, ind)
        loc = guide._get_loc_and_scale("local")[0].detach()
        assert loc.shape == (100, 3, 2)
        # Only the rows of the model's subsample ind are updated (Adam's momentum keeps
        # moving the rows of earlier steps).
        changed = (loc != initial).any(-1).any(-1).nonzero().flatten().tolist()
        assert changed == (sorted(ind.tolist()) if step == 0 else sorted(seen))


@pytest.mark.parametrize("Guide", GUIDES)
def test_predictive(Guide):
    guide = Guide(assorted_model)
    svi = SVI(assorted_model, guide, Adam({"lr": 0.01}), Trace_ELBO())
    svi.step()
    samples = Predictive(assorted_model, guide=guide, num_samples=7, parallel=False)()
    # Predictive keeps a singleton for the model's plate dim, for every guide alike.
    assert samples["matrix"].shape[0] == 7 and samples["matrix"].shape[-2:] == (4, 5)
    assert samples["local"].shape[0] == 7 and samples["local"].shape[-1] == 6
    assert samples["obs"].numel() == 7


@pytest.mark.parametrize("Guide", GUIDES)
def test_guide_list(Guide):
    guide = AutoGuideList(assorted_model)
    guide.append(Guide(poutine.block(assorted_model, hide=["positive", "simplex"])))
    guide.append(AutoDelta(poutine.block(assorted_model, expose=["positive", "simplex"])))
    svi = SVI(assorted_model, guide, Adam({"lr": 0.01}), Trace_ELBO())
    for _ in range(2):
        assert math.isfinite(svi.step())
    median = guide.median()
    assert set(median) == {
        "scalar", "vector", "matrix", "kernel", "positive", "simplex",
        "local", "local_matrix", "local_positive",
    }


class BayesianLinear(PyroModule):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.linear = PyroModule[torch.nn.Linear](d_in, d_out)
        self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([d_out, d_in]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(0.0, 1.0).expand([d_out]).to_event(1))

    def forward(self, x, y=None):
        mean = self.linear(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(mean, 0.1), obs=y)


@pytest.mark.parametrize("Elbo", ELBOS)
@pytest.mark.parametrize("Guide", GUIDES)
def test_pyro_module(Guide, Elbo):
    x = torch.randn(50, 3)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3
    model = BayesianLinear(3, 1)
    guide = Guide(model)
    svi = SVI(model, guide, Adam({"lr": 0.05}), Elbo())
    for _ in range(400):
        svi.step(x, y)
    median = guide.median()
    assert set(median) == {"linear.weight", "linear.bias"}
    assert_close(median["linear.weight"][0], torch.tensor([1.0, -2.0, 0.5]), atol=0.1, rtol=0)
    assert_close(median["linear.bias"][0], 0.3, atol=0.1, rtol=0)


@pytest.mark.parametrize("Guide", GUIDES)
def test_conjugate_posterior(Guide):
    # w ~ N(0, 1) per element, x_i ~ N(w, 1): the exact posterior is mean-field
    # Normal with precision 1 + n. Scalar sites (D = 1) make the radial guide Normal too.
    data = torch.randn(20, 2) + torch.tensor([1.0, -1.0])

    def model(data):
        with pyro.plate("dims", 2):
            w = pyro.sample("w", dist.Normal(0.0, 1.0))
            with pyro.plate("data", 20, dim=-2):
                pyro.sample("obs", dist.Normal(w, 1.0), obs=data)

    guide = Guide(model)
    svi = SVI(model, guide, Adam({"lr": 0.02}), TraceMeanField_ELBO(num_particles=8,
                                                                     vectorize_particles=True))
    for _ in range(1500):
        svi.step(data)
    loc, scale = guide._get_loc_and_scale("w")
    assert_close(loc, data.sum(0) / 21, atol=0.05, rtol=0)
    assert_close(scale, torch.full((2,), 21**-0.5), atol=0.03, rtol=0)


@pytest.mark.parametrize("Guide", [AutoKTiedNormal, AutoRadialNormal, AutoMeanFieldNormal])
@pytest.mark.parametrize("init_scale", [0.0, -0.1, 1, "0.1", True, float("inf"), float("nan")])
def test_bad_init_scale(Guide, init_scale):
    with pytest.raises(ValueError, match="init_scale must be a positive finite float"):
        Guide(assorted_model, init_scale=init_scale)


@pytest.mark.parametrize("shared_subsample", [False, True])
@pytest.mark.parametrize("Guide", GUIDES)
def test_no_latent_sites(Guide, shared_subsample):
    # As AutoNormal: an empty guide, usable with SVI, for a model whose only sample
    # site is observed, under two subsampled plates the guide creates (the second
    # either subsampled on its own or reusing the first's indices).
    def model(table):
        with pyro.plate("rows", len(table), dim=-2), pyro.plate("cols", len(table), dim=-1):
            block = pyro.subsample(table, event_dim=0)
            assert block.shape[0] == block.shape[1]
            pyro.sample("obs", dist.Normal(0.0, 1.0), obs=block)

    def create_plates(table):
        rows = pyro.plate("rows", len(table), subsample_size=3, dim=-2)
        if not shared_subsample:
            return rows, pyro.plate("cols", len(table), subsample_size=3, dim=-1)
        with rows as index:
            pass
        return rows, pyro.plate("cols", len(table), subsample=index, dim=-1)

    table = torch.randn(8, 8)
    guide = Guide(model, create_plates=create_plates)
    assert guide(table) == {}
    svi = SVI(model, guide, Adam({"lr": 0.01}), Trace_ELBO())
    for _ in range(2):
        assert math.isfinite(svi.step(table))
    assert guide.median() == {} and guide.quantiles([0.5]) == {}


@pytest.mark.parametrize("Guide", [AutoKTiedNormal, AutoRadialNormal, AutoMeanFieldNormal])
def test_discrete_latent_site(Guide):
    def model():
        pyro.sample("z", dist.Bernoulli(0.5))

    guide = Guide(model)
    with pytest.raises(ValueError, match="sample site 'z' is discrete") as error:
        guide()
    assert "poutine.block(model, hide=[...])" in str(error.value)
    # Pyro's own error (from the init strategy), kept as the cause
    assert "Continuous inference cannot handle discrete" in str(error.value.__cause__)
    assert guide.prototype_trace is None


@pytest.mark.parametrize("Guide", [AutoKTiedNormal, AutoRadialNormal, AutoMeanFieldNormal])
def test_get_loc_and_scale_errors(Guide):
    guide = Guide(assorted_model)
    with pytest.raises(RuntimeError, match="not set up yet"):
        guide.get_loc_and_scale("matrix")
    guide()
    with pytest.raises(KeyError, match="not a latent site"):
        guide.get_loc_and_scale("nope")
    loc, scale = guide.get_loc_and_scale("matrix")
    assert loc.shape == scale.shape == (4, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("Guide", GUIDES)
def test_dtype(Guide, dtype):
    def model():
        pyro.sample("w", dist.Normal(torch.zeros(3, 4, dtype=dtype), 1.0).to_event(2))
        pyro.sample("s", dist.LogNormal(torch.tensor(0.0, dtype=dtype), 1.0))

    guide = Guide(model)
    trace = poutine.trace(guide).get_trace()
    assert trace.nodes["w"]["value"].dtype == dtype
    assert all(p.dtype == dtype for p in guide.parameters())


@pytest.mark.parametrize("Guide", GUIDES)
def test_determinism(Guide):
    results = []
    for _ in range(2):
        pyro.clear_param_store()
        pyro.set_rng_seed(123)
        guide = Guide(assorted_model)
        svi = SVI(assorted_model, guide, Adam({"lr": 0.01}), Trace_ELBO())
        results.append([svi.step() for _ in range(3)])
    assert results[0] == results[1]


@pytest.mark.parametrize("Elbo", [JitTrace_ELBO, JitTraceMeanField_ELBO])
@pytest.mark.parametrize("Guide", GUIDES)
def test_jit_elbo(Guide, Elbo):
    # AutoKTiedNormal used to fail here with KeyError 'AutoKTiedNormal.scales.<site>'.
    def model():
        pyro.sample("w", dist.Normal(torch.zeros(4, 5), 1.0).to_event(2))
        pyro.sample("b", dist.Normal(torch.zeros(4), 1.0).to_event(1))
        pyro.sample("positive", dist.LogNormal(0.0, 1.0))

    # Locs away from the prior mean, where the closed-form KL's gradient is not 0.
    guide = Guide(model, init_loc_fn=init_to_sample)
    svi = SVI(model, guide, Adam({"lr": 0.01}), Elbo(ignore_jit_warnings=True))
    svi.step()
    before = {k: v.detach().clone() for k, v in guide.named_parameters()}
    assert all(math.isfinite(svi.step()) for _ in range(3))
    after = dict(guide.named_parameters())
    assert set(after) == set(before)
    assert all(not torch.equal(after[k].detach(), v) for k, v in before.items())


def _store_names(guide):
    return {f"{guide._pyro_name}.{name.removesuffix('_unconstrained')}"
            for name, _ in guide.named_parameters()}


@pytest.mark.parametrize("Guide", GUIDES)
def test_param_store_holds_only_live_parameters(Guide):
    guide = Guide(assorted_model)
    svi = SVI(assorted_model, guide, Adam({"lr": 0.01}), Trace_ELBO())
    svi.step()
    assert set(pyro.get_param_store().keys()) == _store_names(guide)


def _adam_state_floats(optim):
    return sum(
        value.numel()
        for torch_optim in optim.optim_objs.values()
        for state in torch_optim.state.values()
        for key, value in state.items()
        if key != "step"
    )


def test_k_tied_optimizer_state_is_half_of_autonormal():
    # 784-400-400-10: a k-tied(2) guide trains about half of AutoNormal's parameters,
    # (mn + k(m + n)) against 2mn per layer; orphaned full-size scales would add ~mn.
    from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

    x, y = torch.randn(4, 784), torch.randint(0, 10, (4,))
    counts = {}
    for name, make in [("normal", AutoNormal), ("ktied", lambda m: AutoKTiedNormal(m, rank=2))]:
        pyro.clear_param_store()
        model = BayesianClassifier(bayesianize(mlp((784, 400, 400, 10))))
        guide = make(model)
        optim = Adam({"lr": 0.01})
        SVI(model, guide, optim, TraceMeanField_ELBO()).step(x, y)
        assert set(pyro.get_param_store().keys()) == _store_names(guide)
        live = {id(p) for p in guide.parameters()}
        assert all(id(p) in live for p in optim.optim_objs)
        counts[name] = _adam_state_floats(optim)
    layers = [(400, 784), (400, 400), (10, 400)]
    # Adam keeps two moments per parameter element.
    assert counts["normal"] == 2 * 2 * sum(m * n + m for m, n in layers)
    assert counts["ktied"] == 2 * sum(m * n + 2 * (m + n) + 2 * m for m, n in layers)
    assert 0.49 < counts["ktied"] / counts["normal"] < 0.52


@pytest.mark.parametrize("Guide", GUIDES)
def test_new_guide_over_loaded_param_store(Guide, tmp_path):
    # save -> clear -> load -> a new guide -> Predictive: the new guide uses the loaded
    # parameters (read from the param store by name), as AutoNormal does.
    guide = Guide(assorted_model)
    svi = SVI(assorted_model, guide, Adam({"lr": 0.1}), Trace_ELBO())
    for _ in range(20):
        svi.step()
    trained = {k: v.detach().clone() for k, v in guide.state_dict().items()}
    median = guide.median()
    pyro.get_param_store().save(tmp_path / "params.pt")
    pyro.clear_param_store()
    pyro.get_param_store().load(tmp_path / "params.pt")

    restored = Guide(assorted_model)
    samples = Predictive(assorted_model, guide=restored, num_samples=3)()
    assert samples["matrix"].shape[0] == 3
    state = restored.state_dict()
    assert set(state) == set(trained)
    for key, value in trained.items():
        assert torch.equal(state[key], value), key
    for name, value in median.items():
        assert_close(restored.median()[name], value)


def constrained_model():
    pyro.sample("positive", dist.LogNormal(0.0, 1.0))
    pyro.sample("positive_vector", dist.LogNormal(torch.zeros(3), 1.0).to_event(1))
    pyro.sample("unit", dist.Beta(2.0, 2.0))
    with pyro.plate("plate", 4):
        pyro.sample("local_positive", dist.Gamma(2.0, 2.0))
        pyro.sample("local_unit", dist.Uniform(torch.zeros(2, 3), 1.0).to_event(2))
    # more batch dims (here plates; vectorized particles add one too) than event dims
    with pyro.plate("rows", 2, dim=-3), pyro.plate("cols", 3, dim=-2), pyro.plate("plate", 4):
        pyro.sample("deep_positive_vector", dist.LogNormal(torch.zeros(5), 1.0).to_event(1))


@pytest.mark.parametrize("Guide", GUIDES)
def test_constrained_site_log_density(Guide):
    # The site's Delta carries log |du/dx| of the inverse transform, summed over the
    # site's event dims and of the site's batch shape: -log x for exp, -log x(1 - x)
    # for the sigmoid.
    guide = Guide(constrained_model, init_loc_fn=init_to_sample)
    trace = poutine.trace(guide).get_trace()
    trace.compute_log_prob()
    expected = {
        "positive": lambda x: -x.log(),
        "positive_vector": lambda x: -x.log().sum(-1),
        "unit": lambda x: -(x * (1 - x)).log(),
        "local_positive": lambda x: -x.log(),
        "local_unit": lambda x: -(x * (1 - x)).log().sum((-1, -2)),
        "deep_positive_vector": lambda x: -x.log().sum(-1),
    }
    for name, log_density in expected.items():
        site = trace.nodes[name]
        value = log_density(site["value"])
        assert site["log_prob"].shape == value.shape == site["fn"].batch_shape, name
        assert_close(site["log_prob"], value, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("Guide", GUIDES)
def test_keyword_arguments(Guide):
    # Keyword-only arguments reach the model and create_plates, at set-up and later.
    def model(*, data, scale):
        loc = pyro.sample("loc", dist.Normal(0.0, scale))
        with pyro.plate("data", len(data), subsample_size=5) as ind:
            pyro.sample("obs", dist.Normal(loc, 1.0), obs=data[ind])

    def create_plates(*, data, scale):
        return pyro.plate("data", len(data), subsample_size=5)

    data = torch.randn(20)
    guide = Guide(model, create_plates=create_plates)
    assert set(guide(data=data, scale=2.0)) == {"loc"}
    svi = SVI(model, guide, Adam({"lr": 0.01}), Trace_ELBO())
    assert math.isfinite(svi.step(data=data, scale=2.0))


@pytest.mark.parametrize("Guide", GUIDES)
def test_spherical_site_is_refused(Guide):
    def model():
        pyro.sample("direction", dist.ProjectedNormal(torch.ones(3)))

    with pytest.raises(ValueError, match="Continuous inference cannot handle spherical "
                                         "sample site 'direction'"):
        Guide(model)()


def zero_size_model():
    pyro.sample("w", dist.Normal(torch.zeros(3, 2), 1.0).to_event(2))
    pyro.sample("no_rows", dist.Normal(torch.zeros(0, 3), 1.0).to_event(2))
    pyro.sample("no_cols", dist.Normal(0.0, 1.0).expand([4, 0]).to_event(2))
    pyro.sample("empty", dist.Normal(torch.zeros(0), 1.0).to_event(1))
    with pyro.plate("plate", 2):
        pyro.sample("local_empty", dist.Normal(torch.zeros(0, 5), 1.0).to_event(2))


@pytest.mark.parametrize("Elbo", ELBOS)
@pytest.mark.parametrize("Guide", GUIDES)
def test_zero_size_sites(Guide, Elbo):
    guide = Guide(zero_size_model)
    svi = SVI(zero_size_model, guide, Adam({"lr": 0.01}), Elbo())
    assert all(math.isfinite(svi.step()) for _ in range(2))
    trace = poutine.trace(zero_size_model).get_trace()
    median, quantiles = guide.median(), guide.quantiles([0.1, 0.9])
    guide_trace = poutine.trace(guide).get_trace()
    for name, site in trace.iter_stochastic_nodes():
        if name == "plate":
            continue
        assert median[name].shape == site["value"].shape
        assert quantiles[name].shape == (2,) + site["value"].shape
        assert guide_trace.nodes[name]["value"].shape == site["value"].shape
    samples = Predictive(zero_size_model, guide=guide, num_samples=3, parallel=True)()
    assert samples["no_cols"].shape[0] == 3 and samples["no_cols"].shape[-2:] == (4, 0)


@pytest.mark.parametrize("Guide", GUIDES)
def test_parameters_fixed_after_first_call(Guide):
    # All parameters exist after guide(*args), so that the guide can be wrapped by
    # DistributedDataParallel before training: no key or tensor changes later.
    guide = Guide(assorted_model)
    guide()
    keys = list(guide.state_dict())
    params = dict(guide.named_parameters())
    for Elbo in ELBOS:
        svi = SVI(assorted_model, guide, Adam({"lr": 0.01}), Elbo())
        for _ in range(2):
            svi.step()
    guide.median()
    guide.quantiles([0.5])
    assert list(guide.state_dict()) == keys
    assert all(p is params[name] for name, p in guide.named_parameters())
