"""GroupedAdam against pyro.optim.Adam: the same SVI trajectory (float64, 1e-10
relative), its settings passed on, parameters added mid-run, its state saved and
restored, gradient clipping, bad settings refused."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.optim import PyroOptim

from pyro_vinit import AutoKTiedNormal, GroupedAdam, local_reparam
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

RTOL = 1e-10  # the fused and the per-parameter kernel round differently (seen: 4e-16)


def _problem():
    x = torch.randn(64, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (64,))
    model = BayesianClassifier(bayesianize(mlp((5, 16, 3))), num_data=640).double()
    return model, AutoKTiedNormal(model, rank=2), x, y


def _train(optim, steps=20, seed=0, problem=None):
    """Losses and final parameters of ``steps`` SVI steps from a fresh param store."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    model, guide, x, y = problem() if problem is not None else _problem()
    svi = SVI(model, guide, optim, TraceMeanField_ELBO())
    losses = []
    for _ in range(steps):
        with local_reparam():
            losses.append(svi.step(x, y))
    params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    return losses, params


def assert_close(a, b, rtol=RTOL):
    assert a.keys() == b.keys()
    for name in a:
        scale = a[name].abs().max().clamp(min=1e-30)
        assert ((a[name] - b[name]).abs().max() / scale).item() <= rtol, name


@pytest.mark.parametrize("args", [
    {"lr": 1e-2},
    {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6},
    {"lr": 1e-2, "weight_decay": 0.1},
    {"lr": 1e-2, "amsgrad": True},
], ids=["lr", "betas-eps", "weight_decay", "amsgrad"])
def test_same_trajectory_as_pyro_adam(args):
    ours_losses, ours = _train(GroupedAdam(args))
    pyro_losses, theirs = _train(pyro.optim.Adam(args))
    assert_close(ours, theirs)
    for a, b in zip(ours_losses, pyro_losses):
        assert abs(a - b) <= RTOL * abs(b)
    # control: the settings matter, so passing them on is what the equality shows
    if args != {"lr": 1e-2}:
        _, default = _train(pyro.optim.Adam({"lr": 1e-2}))
        assert max((ours[k] - default[k]).abs().max().item() for k in ours) > 1e-6


def test_steps_with_one_torch_optimizer():
    _train(GroupedAdam({"lr": 1e-2}), steps=2)  # warm up the import paths
    optim = GroupedAdam({"lr": 1e-2})
    calls = []
    original = torch.optim.Adam.step

    def counting(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    torch.optim.Adam.step = counting
    try:
        _train(optim, steps=3)
    finally:
        torch.optim.Adam.step = original
    assert len(calls) == 3  # one torch step per SVI step, not one per parameter
    assert len(pyro.get_param_store()) == 10


def _two_stage():
    """A model whose second parameter joins at the step after the first."""
    state = {"step": 0}
    data = torch.randn(20, dtype=torch.float64)

    def model():
        a = pyro.param("a", torch.tensor(0.5, dtype=torch.float64))
        mean = a
        if state["step"] >= 3:
            mean = mean + pyro.param("b", torch.tensor(-0.2, dtype=torch.float64))
        state["step"] += 1
        with pyro.plate("data", 20):
            pyro.sample("obs", dist.Normal(mean, 1.0), obs=data)

    return model


def test_parameters_added_mid_run():
    results = []
    for optim in (GroupedAdam({"lr": 0.1}), pyro.optim.Adam({"lr": 0.1})):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model = _two_stage()
        svi = SVI(model, lambda: None, optim, Trace_ELBO())
        for _ in range(10):
            svi.step()
        results.append({k: v.detach().clone() for k, v in pyro.get_param_store().items()})
    assert_close(*results)
    assert results[0]["b"].item() != -0.2  # b was trained, from the step it joined


def test_steps_only_the_parameters_of_the_call():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3))
    optim = GroupedAdam({"lr": 0.1})
    (a.sum() + b.sum()).backward()
    optim([a, b])
    after_b = b.detach().clone()
    b.grad = torch.zeros(3)  # as SVI leaves the gradients of the parameters it stepped
    a.grad = torch.ones(3)
    optim([a])
    assert torch.equal(b, after_b)  # not in the call: untouched, despite its zero gradient


def test_get_state_round_trip_resumes_as_uninterrupted():
    _, uninterrupted = _train(GroupedAdam({"lr": 1e-2}), steps=20)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, guide, x, y = _problem()
    optim = GroupedAdam({"lr": 1e-2})
    svi = SVI(model, guide, optim, TraceMeanField_ELBO())
    for _ in range(12):
        with local_reparam():
            svi.step(x, y)
    saved_optim, saved_store = optim.get_state(), pyro.get_param_store().get_state()
    rng = torch.get_rng_state()
    # a fresh optimizer, guide and param store, as a resumed process has
    pyro.clear_param_store()
    pyro.get_param_store().set_state(saved_store)
    fresh = GroupedAdam({"lr": 1e-2})
    fresh.set_state(saved_optim)
    guide = AutoKTiedNormal(model, rank=2)
    with torch.no_grad():
        pyro.poutine.block(guide)(x, y)  # set up (its random init draws), taking the store's
    svi = SVI(model, guide, fresh, TraceMeanField_ELBO())
    torch.set_rng_state(rng)
    for _ in range(8):
        with local_reparam():
            svi.step(x, y)
    resumed = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        assert torch.equal(resumed[name], uninterrupted[name]), name


def test_state_is_pyro_adams_format_both_ways():
    _train(pyro.optim.Adam({"lr": 1e-2}), steps=5)
    # pyro.optim.Adam's state into GroupedAdam, and GroupedAdam's back into it
    for source, target in ((pyro.optim.Adam, GroupedAdam), (GroupedAdam, pyro.optim.Adam)):
        results = []
        for resume in (False, True):
            pyro.clear_param_store()
            pyro.set_rng_seed(1)
            model, guide, x, y = _problem()
            first = source({"lr": 1e-2})
            svi = SVI(model, guide, first, TraceMeanField_ELBO())
            for _ in range(5):
                with local_reparam():
                    svi.step(x, y)
            if resume:
                second = target({"lr": 1e-2})
                second.set_state(first.get_state())
                svi = SVI(model, guide, second, TraceMeanField_ELBO())
            for _ in range(5):
                with local_reparam():
                    svi.step(x, y)
            results.append({k: v.detach().clone() for k, v in pyro.get_param_store().items()})
        assert_close(*results)
        # control: without the moments, the run differs
        pyro.clear_param_store()
        pyro.set_rng_seed(1)
        model, guide, x, y = _problem()
        svi = SVI(model, guide, source({"lr": 1e-2}), TraceMeanField_ELBO())
        for _ in range(5):
            with local_reparam():
                svi.step(x, y)
        svi = SVI(model, guide, target({"lr": 1e-2}), TraceMeanField_ELBO())
        for _ in range(5):
            with local_reparam():
                svi.step(x, y)
        fresh = {k: v.detach() for k, v in pyro.get_param_store().items()}
        assert max((fresh[k] - results[1][k]).abs().max().item() for k in fresh) > 1e-6


def test_get_state_is_a_copy():
    optim = GroupedAdam({"lr": 1e-2})
    _train(optim, steps=3)
    state = optim.get_state()
    name = next(iter(state))
    before = state[name]["state"][0]["exp_avg"].clone()
    _train_more = SVI(*_problem()[:2], optim, TraceMeanField_ELBO())  # noqa: F841
    p = pyro.get_param_store()[name]
    p.grad = torch.ones_like(p)
    optim([p.unconstrained()])
    assert torch.equal(state[name]["state"][0]["exp_avg"], before)


@pytest.mark.parametrize("clip", [{"clip_norm": 0.5}, {"clip_value": 0.01},
                                  {"clip_norm": 1.0, "clip_value": 0.05}])
def test_clipping_as_pyro_adam(clip):
    ours_losses, ours = _train(GroupedAdam({"lr": 1e-2}, clip))
    _, theirs = _train(PyroOptim(torch.optim.Adam, {"lr": 1e-2}, clip))
    assert_close(ours, theirs)
    _, unclipped = _train(GroupedAdam({"lr": 1e-2}))
    assert max((ours[k] - unclipped[k]).abs().max().item() for k in ours) > 1e-6


def test_autonormal_trace_elbo():
    def problem():
        model, _, x, y = _problem()
        return model, AutoNormal(model), x, y

    _, ours = _train(GroupedAdam({"lr": 1e-2}), steps=10, problem=problem)
    _, theirs = _train(pyro.optim.Adam({"lr": 1e-2}), steps=10, problem=problem)
    assert_close(ours, theirs)


@pytest.mark.parametrize("args, clip, error, match", [
    ({"lr": -1.0}, None, ValueError, "Invalid learning rate"),
    ({"lr": 1e-3, "betas": (1.5, 0.9)}, None, ValueError, "beta"),
    ({"lr": 1e-3, "momentum": 0.9}, None, ValueError, "unknown optim_args"),
    (lambda name: {"lr": 1e-3}, None, TypeError, "per-parameter settings use pyro.optim"),
    ({"lr": 1e-3}, {"clip_norm": 0.0}, ValueError, "clip_norm"),
    ({"lr": 1e-3}, {"max_norm": 1.0}, ValueError, "unknown clip_args"),
])
def test_bad_settings_are_refused_at_construction(args, clip, error, match):
    with pytest.raises(error, match=match):
        GroupedAdam(args, clip)


def _constant_gradient_steps(optim, param, steps):
    """How far each of ``steps`` calls moves ``param`` under a constant gradient
    (for which Adam's bias-corrected step is the learning rate times its sign)."""
    grad = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    moved = []
    for _ in range(steps):
        before = param.detach().clone()
        param.grad = grad.clone()
        optim([param])
        param.grad = None
        moved.append(((before - param.detach()) * grad.sign()).tolist())
    return moved


def test_warmup_rises_linearly_and_resumes_where_it_was():
    pyro.clear_param_store()
    param = pyro.param("w", torch.zeros(3, dtype=torch.float64)).unconstrained()
    optim = GroupedAdam({"lr": 0.1}, warmup_steps=4)
    moved = _constant_gradient_steps(optim, param, 6)
    for step, rate in enumerate([0.025, 0.05, 0.075, 0.1, 0.1, 0.1]):
        assert moved[step] == pytest.approx([rate] * 3, rel=1e-6), step
    # without warm-up the first step is the whole learning rate
    assert _constant_gradient_steps(GroupedAdam({"lr": 0.1}), param, 1)[0] == pytest.approx(
        [0.1] * 3, rel=1e-6)
    # a fresh optimizer given the state after two steps takes the third
    pyro.clear_param_store()
    param = pyro.param("w", torch.zeros(3, dtype=torch.float64)).unconstrained()
    first = GroupedAdam({"lr": 0.1}, warmup_steps=4)
    _constant_gradient_steps(first, param, 2)
    resumed = GroupedAdam({"lr": 0.1}, warmup_steps=4)
    resumed.set_state(first.get_state())
    assert _constant_gradient_steps(resumed, param, 1)[0] == pytest.approx([0.075] * 3, rel=1e-6)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "10"])
def test_bad_warmup_refused(bad):
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0"):
        GroupedAdam({"lr": 0.1}, warmup_steps=bad)


def _moves(optim, params):
    """How far one call moves each of ``params`` under a constant gradient of ones
    (Adam's bias-corrected step is then the learning rate)."""
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    optim(params)
    return [(b - p.detach()).item() for b, p in zip(before, params)]


@pytest.mark.parametrize("joins", [3, 7])
def test_warmup_of_a_parameter_that_joins_later_starts_when_it_joins(joins):
    # b first appears at the optimizer's step 3 (during a's warm-up) or 7 (after it): its
    # own warm-up, 0.025 then 0.05, ..., whatever the optimizer's step; a's goes on.
    a, b = (torch.nn.Parameter(torch.zeros(1, dtype=torch.float64)) for _ in range(2))
    optim = GroupedAdam({"lr": 0.1}, warmup_steps=4)
    for step in range(1, joins):
        assert _moves(optim, [a]) == pytest.approx([0.1 * min(1, step / 4)], rel=1e-6)
    for own in range(1, 6):
        step = joins - 1 + own
        assert _moves(optim, [a, b]) == pytest.approx(
            [0.1 * min(1, step / 4), 0.1 * min(1, own / 4)], rel=1e-6), own


def test_warmup_resumes_each_parameter_at_its_own_step():
    # a took three steps and b one: a resumed optimizer goes on with 0.1 and 0.05
    pyro.clear_param_store()
    a = pyro.param("a", torch.zeros(1, dtype=torch.float64)).unconstrained()
    b = pyro.param("b", torch.zeros(1, dtype=torch.float64)).unconstrained()
    first = GroupedAdam({"lr": 0.1}, warmup_steps=4)
    _moves(first, [a])
    _moves(first, [a])
    assert _moves(first, [a, b]) == pytest.approx([0.075, 0.025], rel=1e-6)
    resumed = GroupedAdam({"lr": 0.1}, warmup_steps=4)
    resumed.set_state(first.get_state())
    assert _moves(resumed, [a, b]) == pytest.approx([0.1, 0.05], rel=1e-6)
