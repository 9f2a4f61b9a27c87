"""ParamAverage (its closed form, swap, write, state) and fit's use of it: fit
returns and evaluates the average that fit_config's documented loop computes."""

import re
import warnings

import pyro
import pytest
import torch

from pyro_vinit import AutoKTiedNormal, ParamAverage, fit, fit_config
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp


def _set(values):
    # the param store's "a" and "b" set to the given values, in place
    store = pyro.get_param_store()
    for name, value in values.items():
        with torch.no_grad():
            store.get_param(name, torch.zeros_like(value)).unconstrained().copy_(value)


def test_average_is_the_mean_then_an_exponential_average():
    decay = 0.75  # the plain mean for the first 1 / (1 - decay) = 4 updates
    average = ParamAverage(decay)
    values = [torch.tensor([float(i), -2.0 * i]) for i in range(1, 8)]
    expected = None
    for n, value in enumerate(values, 1):
        _set({"a": value})
        average.update()
        weight = max(1 - decay, 1 / n)
        expected = value.clone() if expected is None else (1 - weight) * expected + weight * value
    assert average.count == 7
    with average.swapped():
        inside = pyro.param("a").detach().clone()
    assert torch.allclose(inside, expected, rtol=0, atol=1e-6)
    # the first four: the mean of 1..4
    average, mean = ParamAverage(decay), torch.stack(values[:4]).mean(0)
    for value in values[:4]:
        _set({"a": value})
        average.update()
    average.write()
    assert torch.allclose(pyro.param("a").detach(), mean, rtol=0, atol=1e-6)


def test_decay_zero_keeps_the_last_values():
    average = ParamAverage(0.0)
    for value in (torch.tensor([1.0]), torch.tensor([5.0])):
        _set({"a": value})
        average.update()
    average.write()
    assert torch.equal(pyro.param("a").detach(), torch.tensor([5.0]))


def test_swapped_restores_the_parameters_even_after_an_error():
    average = ParamAverage(0.5)
    for value in (torch.tensor([0.0, 0.0]), torch.tensor([4.0, 8.0])):
        _set({"a": value})
        average.update()
    param = pyro.get_param_store().get_param("a").unconstrained()
    with pytest.raises(RuntimeError, match="inside"):
        with average.swapped():
            assert torch.equal(param.detach(), torch.tensor([2.0, 4.0]))
            raise RuntimeError("inside")
    assert torch.equal(param.detach(), torch.tensor([4.0, 8.0]))
    assert pyro.get_param_store().get_param("a").unconstrained() is param


def test_before_any_update_nothing_is_written():
    _set({"a": torch.tensor([3.0])})
    average = ParamAverage()
    average.write()
    with average.swapped():
        assert torch.equal(pyro.param("a").detach(), torch.tensor([3.0]))


def test_a_parameter_set_afresh_restarts_its_average():
    average = ParamAverage(0.5)
    _set({"a": torch.tensor([10.0])})
    average.update()
    pyro.clear_param_store()
    _set({"a": torch.tensor([1.0]), "b": torch.tensor([2.0])})
    average.update()  # "a" is a new tensor: its average starts at 1, not at 10
    average.write()
    assert torch.equal(pyro.param("a").detach(), torch.tensor([1.0]))
    assert torch.equal(pyro.param("b").detach(), torch.tensor([2.0]))


def test_a_constrained_parameter_is_averaged_unconstrained():
    store = pyro.get_param_store()
    pyro.param("s", torch.tensor([1.0]), constraint=torch.distributions.constraints.positive)
    average = ParamAverage(0.0 + 0.5)
    for value in (1.0, 100.0):
        with torch.no_grad():
            store.get_param("s").unconstrained().copy_(torch.tensor([value]).log())
        average.update()
    average.write()  # the mean of the logs: the geometric mean
    assert pyro.param("s").item() == pytest.approx(10.0, rel=1e-5)


def test_state_round_trip_and_unknown_names():
    average = ParamAverage(0.5)
    for value in (torch.tensor([2.0]), torch.tensor([6.0])):
        _set({"a": value})
        average.update()
    state = average.get_state()
    other = ParamAverage(0.9)
    other.set_state(state)
    assert (other.decay, other.count) == (0.5, 2)
    other.write()
    assert torch.equal(pyro.param("a").detach(), torch.tensor([4.0]))
    before = (other.decay, other.count)
    with pytest.raises(ValueError, match=r"^ParamAverage.set_state: \['zz'\] are not "
                                         r"parameters of the param store$"):
        other.set_state({**state, "decay": 0.1, "average": {"zz": torch.zeros(1)}})
    assert (other.decay, other.count) == before
    # the first five of six unknown names; a module's own wording
    many = {f"z{i}": torch.zeros(1) for i in range(6)}
    with pytest.raises(ValueError, match=r"\['z0', 'z1', 'z2', 'z3', 'z4'\] are not "
                                         r"parameters of the module$"):
        ParamAverage(module=torch.nn.Linear(1, 1)).set_state({**state, "average": many})
    # a state of another model: averages of other shapes, refused before anything changes
    module = torch.nn.Linear(2, 1)
    average = ParamAverage(module=module)
    with pytest.raises(ValueError, match=r"^ParamAverage.set_state: averages of other shapes "
                                         r"than the parameters of the module \(weight \(1, 3\) "
                                         r"vs \(1, 2\)\): a state of another model$"):
        average.set_state({"decay": 0.5, "count": 4,
                           "average": {"weight": torch.zeros(1, 3), "bias": torch.zeros(1)}})
    assert (average.decay, average.count, average._average) == (0.99, 0, {})
    # the first five of six, sorted by name
    module = torch.nn.Sequential(*[torch.nn.Linear(1, 1) for _ in range(3)])
    wrong = {name: torch.zeros(2, 2) for name, _ in module.named_parameters()}
    shapes = [f"{name} (2, 2) vs {tuple(p.shape)}" for name, p in module.named_parameters()]
    with pytest.raises(ValueError) as error:
        ParamAverage(module=module).set_state({"decay": 0.5, "count": 1, "average": wrong})
    assert f"({', '.join(sorted(shapes)[:5])}): a state" in str(error.value)


def test_set_state_casts_the_averages_to_the_parameters_dtype():
    _set({"a": torch.tensor([1.0], dtype=torch.float64)})
    average = ParamAverage(0.5)
    average.set_state({"decay": 0.5, "count": 3,
                       "average": {"a": torch.tensor([2.5], dtype=torch.float32)}})
    third = torch.tensor([1 / 3], dtype=torch.float64)
    _set({"a": third})
    average.update()  # the 4th: weight 1/2, in float64
    average.write()
    assert pyro.param("a").dtype == torch.float64
    expected = 0.5 * torch.tensor([2.5], dtype=torch.float64) + 0.5 * third
    # float64 to rounding (a float32 average would be off by about 1e-8)
    assert torch.allclose(pyro.param("a").detach(), expected, rtol=1e-15, atol=0)


def test_a_restored_average_survives_the_store_restored_after_it():
    # saving.rst's resume: set the guide up, restore the average and the store (in
    # either order); the store's new tensors take the restored average on
    average = ParamAverage(0.5)
    for value in (torch.tensor([2.0]), torch.tensor([6.0])):
        _set({"a": value})
        average.update()
    state, store_state = average.get_state(), pyro.get_param_store().get_state()
    store_state = {"params": {k: v.detach().clone() for k, v in store_state["params"].items()},
                   "constraints": dict(store_state["constraints"])}
    pyro.clear_param_store()
    _set({"a": torch.tensor([0.0])})  # set up afresh
    resumed = ParamAverage(0.5)
    resumed.set_state(state)
    pyro.get_param_store().set_state(store_state)  # new tensors, the last step's values
    _set({"a": torch.tensor([10.0])})
    resumed.update()  # 0.5 * 4 + 0.5 * 10
    resumed.write()
    assert torch.equal(pyro.param("a").detach(), torch.tensor([7.0]))


def test_a_tensor_replaced_after_the_restored_one_starts_afresh():
    # set_state's grace holds for the first tensor seen only: a later replacement of
    # the parameter (a store set afresh) restarts its average
    average = ParamAverage(0.5)
    _set({"a": torch.tensor([2.0])})
    average.update()
    resumed = ParamAverage(0.5)
    resumed.set_state(average.get_state())
    resumed.update()  # the restored tensor seen: 0.5 * 2 + 0.5 * 2
    pyro.clear_param_store()
    _set({"a": torch.tensor([9.0])})
    resumed.update()
    resumed.write()
    assert torch.equal(pyro.param("a").detach(), torch.tensor([9.0]))


def test_a_parameter_resized_in_place_starts_afresh():
    average = ParamAverage(0.5)
    _set({"a": torch.tensor([2.0])})
    average.update()
    param = pyro.get_param_store().get_param("a").unconstrained()
    param.data = torch.tensor([1.0, 3.0])  # the same tensor object, another shape
    average.update()
    average.write()
    assert torch.equal(param.detach(), torch.tensor([1.0, 3.0]))


def test_a_parameter_rewrapped_keeps_its_average():
    # a PyroModule turns the store's plain tensor into an nn.Parameter of the same
    # storage (e.g. after a store loaded onto another device): the same parameter
    average = ParamAverage(0.5)
    _set({"a": torch.tensor([2.0])})
    average.update()
    store = pyro.get_param_store()
    wrapped = torch.nn.Parameter(store._params["a"])
    store._params["a"] = wrapped
    with torch.no_grad():
        wrapped.fill_(6.0)
    average.update()
    average.write()
    assert torch.equal(pyro.param("a").detach(), torch.tensor([4.0]))


@pytest.mark.parametrize("decay", [-0.1, 1.0, float("nan"), True, "0.9", None])
def test_bad_decay_is_refused(decay):
    with pytest.raises(ValueError, match=r"^ParamAverage: decay must be a number in \[0, 1\) "
                                         r"\(the decay of the parameters' moving average; 0 "
                                         rf"for none\), got {re.escape(repr(decay))}$"):
        ParamAverage(decay)


@pytest.mark.parametrize("average", [1.0, -1e-3, float("inf"), False])
def test_fit_refuses_a_bad_average_before_anything_changes(average):
    x, y = _data()
    model = _model()
    with pytest.raises(ValueError, match=r"fit: average must be a number in \[0, 1\)"):
        fit(model, AutoKTiedNormal(model, rank=2), (x, y), steps=2, progress=False,
            average=average)
    assert not list(pyro.get_param_store().keys())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before fit_config's learned-noise warning
        with pytest.raises(ValueError, match=r"fit: average must be"):
            fit_config(lambda: None, average=average)


def _data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = 3 * torch.eye(3, 4)[y] + torch.randn(n, 4, generator=g)
    return x.double(), y


def _model(n=96):
    return BayesianClassifier(bayesianize(mlp((4, 8, 3))), num_data=n).double()


def _params():
    # unconstrained: the values the average is taken of
    return {k: v.detach().clone() for k, v in pyro.get_param_store().named_parameters()}


def _fit(steps, average, **options):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    model = _model()
    history = fit(model, AutoKTiedNormal(model, rank=2), (x, y), steps=steps, batch_size=32,
                  progress=False, capture=False, average=average, **options)
    return history, _params()


def test_fit_returns_the_average_of_its_steps():
    # average=0 gives the steps' own parameters (the averager draws nothing, so the
    # trajectory is the same); fit(average=0.7) returns their average
    decay, steps = 0.7, 6
    expected = None
    for n in range(1, steps + 1):
        _, params = _fit(n, 0.0)
        weight = max(1 - decay, 1 / n)
        expected = params if expected is None else {
            k: (1 - weight) * expected[k] + weight * params[k] for k in params}
    history, averaged = _fit(steps, decay)
    assert history.config.average == decay
    for name, value in expected.items():
        assert torch.allclose(averaged[name], value, rtol=1e-12, atol=1e-14), name
    assert any(not torch.equal(averaged[k], params[k]) for k in params)  # not the last step's


def test_fit_validates_the_average():
    # the evaluation at step 2 of a 4-step call is that of a 2-step call, which
    # evaluates the average it returns (same draws: the same seed and order)
    x, y = _data(seed=1)
    long, _ = _fit(4, 0.9, validation=(x, y), eval_every=2)
    short, _ = _fit(2, 0.9, validation=(x, y), eval_every=2)
    assert [v["step"] for v in long.validation] == [0.0, 2.0, 4.0]
    assert long.validation[1] == short.validation[1]
    raw, _ = _fit(2, 0.0, validation=(x, y), eval_every=2)
    assert raw.validation[1] != short.validation[1]  # control: the average is not the last step


def test_a_resumed_call_that_trains_no_further_returns_the_average(tmp_path):
    path = tmp_path / "c.pt"
    _, averaged = _fit(4, 0.9, checkpoint=path)
    with pytest.warns(UserWarning, match="nothing is trained"):
        _, again = _fit(4, 0.9, checkpoint=path)
    for name, value in averaged.items():
        assert torch.equal(again[name], value), name


def test_a_resumed_finished_call_keeps_the_last_evaluation_and_batch_norm(tmp_path):
    # the final evaluation and BatchNorm's statistics for the average are in the
    # checkpoint: a resumed call that trains no further returns what the uninterrupted did
    x, y = _data()
    xv, yv = _data(seed=1)

    def run():
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                  torch.nn.ReLU(), torch.nn.Linear(8, 3))
        model = BayesianClassifier(bayesianize(net), num_data=96).double()
        history = fit(model, AutoKTiedNormal(model, rank=2), (x, y), steps=4, batch_size=32,
                      validation=(xv, yv), eval_every=2, progress=False, capture=False,
                      average=0.9, checkpoint=tmp_path / "c.pt")
        return history, {k: v.clone() for k, v in model.state_dict().items()}

    history, state = run()
    with pytest.warns(UserWarning, match="nothing is trained"):
        again, state_again = run()
    assert [v["step"] for v in again.validation] == [0.0, 2.0, 4.0]
    assert again.validation == history.validation
    assert any("running_mean" in k for k in state)
    for name, value in state.items():
        assert torch.equal(state_again[name], value), name


def test_a_longer_call_resumed_with_validation_trains_on_as_an_uninterrupted_one(tmp_path):
    # the 4-step call's last evaluation (not one of the 6-step call's, every 3) draws
    # from the generator but leaves it as it was before its checkpoint
    x, y = _data(seed=1)
    path = tmp_path / "c.pt"
    straight, params = _fit(6, 0.8, validation=(x, y), eval_every=3)
    _fit(4, 0.8, validation=(x, y), eval_every=3, checkpoint=path)
    resumed, again = _fit(6, 0.8, validation=(x, y), eval_every=3, checkpoint=path)
    assert [v["step"] for v in resumed.validation] == [0.0, 3.0, 4.0, 6.0]
    assert resumed.loss == straight.loss
    assert resumed.validation[-1] == straight.validation[-1]
    for name, value in params.items():
        assert torch.equal(again[name], value), name


def test_fit_averages_module_local_parameters():
    # with module_local_params=True the parameters live in the model's and guide's
    # modules, not in the param store: fit averages those
    def run(steps, average):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        x, y = _data()
        with pyro.settings.context(module_local_params=True):
            model = _model()
            guide = AutoKTiedNormal(model, rank=2)
            fit(model, guide, (x, y), steps=steps, batch_size=32, progress=False,
                capture=False, init=None, average=average)
        assert not list(pyro.get_param_store().keys())
        return {k: v.detach().clone() for k, v in guide.named_parameters()}

    decay, steps = 0.5, 4
    expected = None
    for n in range(1, steps + 1):
        params = run(n, 0.0)
        weight = max(1 - decay, 1 / n)
        expected = params if expected is None else {
            k: (1 - weight) * expected[k] + weight * params[k] for k in params}
    averaged = run(steps, decay)
    for name, value in expected.items():
        assert torch.allclose(averaged[name], value, rtol=1e-12, atol=1e-14), name
    assert any(not torch.equal(averaged[k], params[k]) for k in params)


def test_a_resumed_call_averages_with_its_own_decay(tmp_path):
    # the call's average=, as its lr=, applies to the steps it trains (history.config
    # says so); decay 0 returns the last step's parameters
    path = tmp_path / "c.pt"
    _, raw = _fit(4, 0.0)
    _fit(2, 0.9, checkpoint=path)
    history, resumed = _fit(4, 0.0, checkpoint=path)
    assert history.config.average == 0.0
    for name, value in raw.items():
        assert torch.equal(resumed[name], value), name


def test_fit_refuses_a_checkpoint_of_module_local_parameters(tmp_path):
    # the checkpoint would not hold them: a resumed call would train fresh ones
    x, y = _data()
    with pyro.settings.context(module_local_params=True):
        model = _model()
        guide = AutoKTiedNormal(model, rank=2)
        with pytest.raises(ValueError, match="module_local_params=True"):
            fit(model, guide, (x, y), steps=2, progress=False, init=None,
                checkpoint=tmp_path / "c.pt")
    assert guide.prototype_trace is None and not list(guide.parameters())
    assert not (tmp_path / "c.pt").exists()


def test_a_modules_parameters_are_averaged_instead_of_the_stores():
    layer = torch.nn.Linear(2, 1)
    _set({"a": torch.tensor([7.0])})
    average = ParamAverage(0.5, module=layer)
    first = layer.weight.detach().clone()
    average.update()
    with torch.no_grad():
        layer.weight.add_(2.0)
        pyro.get_param_store().get_param("a").unconstrained().fill_(1.0)
    average.update()
    average.write()
    assert torch.allclose(layer.weight.detach(), first + 1.0)
    assert torch.equal(pyro.param("a").detach(), torch.tensor([1.0]))  # not averaged
    with pytest.raises(TypeError, match="^ParamAverage: module must be a torch.nn.Module, "
                                        "got str$"):
        ParamAverage(module="guide")


def test_nothing_to_average_warns_once():
    average = ParamAverage()
    with pytest.warns(UserWarning, match="module_local_params") as caught:
        average.update()
        average.update()
    assert len(caught) == 1
    assert caught[0].filename == __file__  # the user's line, not torch.no_grad's wrapper
    assert average.count == 2
