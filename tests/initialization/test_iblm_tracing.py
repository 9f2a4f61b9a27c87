"""Reading a model for the data-driven initializers: the priors' medians at
which hidden sites are held, and the likelihood site of a model run."""

import re

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn

from pyro_vinit import init_guide
from pyro_vinit.initialization._data import DataPool
from pyro_vinit.initialization._observed import per_example_sites
from pyro_vinit.initialization._runs import draws_the_rows, prior_median, run_model

F64 = torch.float64


def test_prior_median_is_the_icdf_at_one_half_in_the_priors_dtype():
    prior = dist.HalfNormal(torch.tensor([2.0, 0.5], dtype=F64)).expand([3, 2]).to_event(1)
    median = prior_median(prior)
    assert median.dtype == F64 and median.shape == (3, 2)
    # HalfNormal's icdf(0.5) is 2 erfinv(0.5) scale, which float32 rounds at 1e-8
    want = dist.HalfNormal(torch.tensor([2.0, 0.5], dtype=F64)).icdf(torch.tensor(0.5, dtype=F64))
    assert torch.equal(median, want.expand(3, 2))


class _DeviceCheckedNormal(dist.Normal):
    def icdf(self, value):
        assert value.device == self.loc.device, "icdf at a probability on another device"
        return super().icdf(value)


def test_prior_median_is_the_icdf_on_the_priors_device():
    # (its probability 0.5 had been made on the CPU: beside a CUDA prior, icdf failed and
    # the median of 1001 draws stood in)
    loc = torch.zeros(3, device="meta")
    prior = _DeviceCheckedNormal(loc, 1.0, validate_args=False).to_event(1)
    assert prior_median(prior).device.type == "meta"


def test_prior_median_without_an_icdf_is_the_median_of_draws():
    # Gamma has no icdf: the median of 1001 draws, whose standard error is
    # 0.5 / sqrt(1001) / density(median): 0.05 and 0.09 here; 0.4 is over 4 of them
    torch.manual_seed(0)
    median = prior_median(dist.Gamma(torch.tensor([2.0, 5.0]), 1.0).to_event(1))
    assert median.shape == (2,)
    torch.testing.assert_close(median, torch.tensor([1.67835, 4.67091]), atol=0.4, rtol=0)


class _TwoLikelihoods(PyroModule):
    def __init__(self):
        super().__init__()
        self.layer = PyroModule[nn.Linear](3, 2)
        self.layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))

    def forward(self, x, y=None):
        mean = self.layer(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs_a", dist.Normal(mean[:, 0], 1.0), obs=y)
            pyro.sample("obs_b", dist.Normal(mean[:, 1], 1.0), obs=y)


def test_map_refuses_a_model_with_two_observed_sites_by_name():
    x, y = torch.randn(20, 3), torch.randn(20)
    guide = AutoNormal(_TwoLikelihoods())
    message = ("this initializer needs a model with exactly one observed sample site (its "
               "likelihood); found ['obs_a', 'obs_b']")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        init_guide(guide, (x, y), method="map", batch_size=20, map_steps=2)


def _shared_weight_model(x, y=None):
    # one weight in two layer calls, as a forum user ties an encoder's layers
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([4, 4]).to_event(2))
    v = pyro.sample("v", dist.Normal(0.0, 1.0).expand([1, 4]).to_event(2))
    h = torch.relu(torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w)), w))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(torch.nn.functional.linear(h, v).squeeze(-1), 0.1), obs=y)


@pytest.mark.parametrize("call", ["init_guide_iblm", "fit"])
def test_a_shared_weight_is_refused_by_name_before_anything_changes(call):
    from pyro_vinit import fit, init_guide_iblm

    x, y = torch.randn(30, 4), torch.randn(30)
    guide = AutoNormal(_shared_weight_model)
    if call == "init_guide_iblm":  # set up: its parameters come out as they went in
        guide(x, y)  # (fit takes a set-up guide as initialized and skips I-BLM)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    with pytest.raises(ValueError, match=r"the latent site 'w' is used by more than one "
                       r"layer call .*fit\(\.\.\., init=None\)"):
        if call == "fit":  # with the weight noise fit's own check asks for (w left out)
            from pyro_vinit.poutine import AutoWeightNoise, weight_noise

            def leave_w_out():
                return weight_noise(
                    config=lambda msg: None if msg["name"] == "w" else AutoWeightNoise())

            fit(_shared_weight_model, guide, (x, y), steps=2, progress=False,
                weight_noise=leave_w_out)
        else:
            init_guide_iblm(guide, (x, y))
    after = dict(pyro.get_param_store().items())
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("set_up", [False, True])
def test_a_model_that_fails_on_the_data_is_named_with_the_arguments(set_up):
    # float64 data (numpy's default) against a float32 network failed with torch's bare
    # "mat1 and mat2 must have the same dtype" from deep inside the first model run
    from pyro_vinit import AutoKTiedNormal, init_guide_iblm
    from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

    x = torch.randn(200, 4, dtype=torch.float64)
    y = (x[:, 0] > 0).long()
    model = BayesianClassifier(bayesianize(mlp((4, 8, 2))), num_data=200)
    guide = AutoKTiedNormal(model)
    if set_up:
        guide(x.float(), y)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    with pytest.raises(ValueError, match=re.escape(
            "the model fails on the first rows of the data (arguments (200, 4) torch.float64, "
            "(200,) torch.int64): RuntimeError: mat1 and mat2 must have the same dtype, but got "
            "Double and Float. Give the data the network's dtype (x.float() for a float32 "
            "network) or the network the data's (model.double())")):
        init_guide_iblm(guide, (x, y))
    after = dict(pyro.get_param_store().items())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (guide.prototype_trace is not None) == set_up


def test_one_dim_sites_are_the_vectors_of_more_than_one_element():
    # (named in the errors about x @ beta with beta of shape (D,); a (1,) site is a scalar's)
    from pyro_vinit.initialization._runs import one_dim_sites

    shapes = {"a": torch.Size([1]), "b": torch.Size([2]), "c": torch.Size([3]),
              "d": torch.Size([2, 2]), "e": torch.Size([])}
    assert one_dim_sites(shapes) == ["b", "c"]


def test_error_text_drops_pyros_trace_shapes_from_the_librarys_own_error_only():
    # the initializers report a model's error with error_text: a check this library raises
    # in the model (a regressor's (N, 1) targets) without the shapes poutine.trace appends
    # to it; an error torch raises (a width mismatch, in the library's layer) with them
    from pyro_vinit.initialization._observed import error_text
    from pyro_vinit.nn import BayesianRegressor, bayesianize, mlp

    x, y = torch.randn(8, 5), torch.randn(8)
    model = BayesianRegressor(bayesianize(mlp((5, 4, 1))), num_data=8)
    with pytest.raises(ValueError) as error:
        pyro.poutine.trace(model).get_trace(x, y[:, None])
    assert "Trace Shapes" in str(error.value)
    text = error_text(error.value)
    assert text.startswith("ValueError: ") and text.endswith("pass y.squeeze(-1)")
    with pytest.raises(RuntimeError) as error:
        pyro.poutine.trace(model).get_trace(x[:, :4], y)
    assert "Trace Shapes" in error_text(error.value)
    # ... torch's error where the library's handler runs the layer, and the user's own
    # raise statement: with them too
    from pyro_vinit.poutine import local_reparam

    with pytest.raises(RuntimeError) as error, local_reparam():
        pyro.poutine.trace(model).get_trace(x[:, :4], y)
    assert "pyro_vinit" in str(error.traceback[-1].path)
    assert "Trace Shapes" in error_text(error.value)

    def users_model(x):
        pyro.sample("w", dist.Normal(0.0, 1.0))
        raise ValueError("the user's check")

    with pytest.raises(ValueError) as error:
        pyro.poutine.trace(users_model).get_trace(x)
    assert "Trace Shapes" in error_text(error.value)


def test_error_text_puts_the_dtype_advice_after_the_first_line():
    from pyro_vinit.initialization._observed import error_text

    advice = (". Give the data the network's dtype (x.float() for a float32 network) or the "
              "network the data's (model.double())")
    assert error_text(ValueError("boom")) == "ValueError: boom"
    assert error_text(ValueError("boom\ntrace")) == "ValueError: boom\ntrace"
    assert (error_text(RuntimeError("mat1 and mat2 must have the same dtype\n  Trace Shapes:"))
            == "RuntimeError: mat1 and mat2 must have the same dtype" + advice
            + "\n  Trace Shapes:")
    conv = ("Input type (torch.DoubleTensor) and weight type (torch.FloatTensor) should be "
            "the same")
    assert error_text(RuntimeError(conv)) == "RuntimeError: " + conv + advice
    # a dtype named after the first line (e.g. in the trace's shapes) gets no advice
    assert error_text(ValueError("boom\n  dtype x")) == "ValueError: boom\n  dtype x"
    # "should be the same" alone is no dtype mismatch (e.g. sizes)
    assert (error_text(RuntimeError("the sizes should be the same"))
            == "RuntimeError: the sizes should be the same")


def test_per_example_latent_is_set_to_its_prior_median_in_a_run_of_fewer_rows():
    def model(x):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(3.0, 2.0))
            pyro.sample("obs", dist.Normal(z, 1.0), obs=x)

    full = {"z": torch.arange(10.0)}
    with pytest.warns(UserWarning, match="holds 10 values"):
        recorder = run_model(model, full, (torch.zeros(4),), ["z"])
    assert torch.equal(recorder.observed[0]["fn"].loc, torch.full((4,), 3.0))
    recorder = run_model(model, full, (torch.zeros(10),), ["z"])  # (one value per row)
    assert torch.equal(recorder.observed[0]["fn"].loc, full["z"])


@pytest.mark.parametrize("subsample", [False, True])
def test_per_example_sites_are_in_the_plate_of_the_rows(subsample):
    # the plate at an observation's leftmost batch dim (the rows), subsampled or not; not
    # a plate of its features that counts as many (a noise scale per output)
    def model(x, y):
        size = 2 if subsample else None
        with pyro.plate("rows", 4, dim=-2, subsample_size=size):  # (the rows, by another name)
            pyro.sample("r", dist.Normal(0.0, 1.0))
        with pyro.plate("outputs", 4, dim=-1):
            sigma = pyro.sample("sigma", dist.LogNormal(0.0, 1.0))
            with pyro.plate("data", 4, dim=-2, subsample_size=size) as rows:
                z = pyro.sample("z", dist.Normal(0.0, 1.0))
                pyro.sample("obs", dist.Normal(x[rows] + z, sigma), obs=y[rows])

    x = y = torch.zeros(4, 4)
    trace = pyro.poutine.trace(model).get_trace(x, y)
    assert per_example_sites(trace, 4, model) == [("r", "rows"), ("z", "data")]
    assert per_example_sites(trace, 5, model) == []


def test_a_plate_of_as_many_units_as_rows_holds_no_per_example_latent():
    # a weight in a plate of 8 units beside a data plate over 8 rows, both at dim -1: the
    # run on a row fewer tells them apart (the units' plate does not follow the rows)
    def model(x, y):
        with pyro.plate("units", 8):
            w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([8, 3]).to_event(1))
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("obs", dist.Normal((x @ w.T).sum(-1) + z, 1.0), obs=y)

    def trace(rows):
        return pyro.poutine.trace(model).get_trace(torch.zeros(rows, 3), torch.zeros(rows))

    assert per_example_sites(trace(8), 8, model) == [("w", "units"), ("z", "data")]
    assert per_example_sites(trace(8), 8, model, lambda: trace(7)) == [("z", "data")]


_SUBSAMPLES = {  # the subsample size of the data plate, given the rows n of a run's arguments
    "len(x)": lambda n: n,
    "a fixed size": lambda n: 256,
    "min(256, len(x))": lambda n: min(256, n),
    "max(256, len(x))": lambda n: max(256, n),
    "len(x) but at one row fewer": lambda n: 7 if n == 255 else n,
    "len(x) but at one row more": lambda n: 7 if n == 257 else n,
}


@pytest.mark.parametrize("rows", [256, 600], ids=["as_many_rows", "more_rows"])
@pytest.mark.parametrize("name", sorted(_SUBSAMPLES))
def test_draws_the_rows_if_its_subsample_follows_one_row_fewer_and_one_more(name, rows):
    # pyro.plate("data", N, subsample_size=len(x)) draws every row of its arguments; read
    # on 256 rows, a subsample of 256 might be that, or a subsample of its own size: a run
    # on 255 rows and, where the data has them, on 257 tells them apart (a plate of more
    # rows than the run's arguments have takes them wrapped around)
    subsample = _SUBSAMPLES[name]

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([1, 3]).to_event(2))
        with pyro.plate("data", 1000, subsample_size=subsample(len(x))) as ind:
            pyro.sample("obs", dist.Normal((x[ind] @ w.T).squeeze(-1), 1.0),
                        obs=None if y is None else y[ind])

    pool = DataPool((torch.randn(rows, 3), torch.randn(rows)))
    # (with no row more, min(256, len(x)) cannot be told from len(x))
    follows = name == "len(x)" or rows == 256 and name in ("min(256, len(x))",
                                                           "len(x) but at one row more")
    assert draws_the_rows(model, {}, pool, 256) is follows
