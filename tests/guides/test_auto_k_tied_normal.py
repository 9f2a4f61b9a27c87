import warnings

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_value
from pyro.optim import Adam

from pyro_vinit import AutoKTiedNormal
from pyro_vinit.distributions import KTiedNormal
from pyro_vinit.guides import site_params
from tests.common import assert_close


def layer_model(data=None):
    w = pyro.sample("fc.weight", dist.Normal(torch.zeros(30, 20), 1.0).to_event(2))
    pyro.sample("fc.bias", dist.Normal(torch.zeros(30), 1.0).to_event(1))
    pyro.sample("conv.weight", dist.Normal(torch.zeros(8, 3, 3, 3), 1.0).to_event(4))
    with pyro.plate("groups", 4):
        pyro.sample("local.weight", dist.Normal(torch.zeros(5, 6), 1.0).to_event(2))
    if data is not None:
        with pyro.plate("data", data.shape[0]):
            pyro.sample("obs", dist.Normal(w, 0.3).to_event(2), obs=data)


def _train(guide, steps=30, elbo=Trace_ELBO):
    data = torch.randn(10, 30, 20)
    svi = SVI(layer_model, guide, Adam({"lr": 0.05}), elbo())
    for _ in range(steps):
        svi.step(data)
    return guide


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_std_matrix_has_rank_at_most_k(rank):
    guide = AutoKTiedNormal(layer_model, rank=rank)
    guide()
    for name in ["fc.weight", "conv.weight"]:
        _, scale = guide.get_loc_and_scale(name)
        matrix = scale.reshape(scale.shape[0], -1).double()
        assert torch.linalg.matrix_rank(matrix) <= rank
    _, scale = guide.get_loc_and_scale("local.weight")
    assert scale.shape == (4, 5, 6)
    for g in range(4):  # tied per plate element, never across the plate
        assert torch.linalg.matrix_rank(scale[g].double()) <= rank


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_rank_survives_training(rank):
    guide = _train(AutoKTiedNormal(layer_model, rank=rank, init_scale=0.3))
    _, scale = guide.get_loc_and_scale("fc.weight")
    singular_values = torch.linalg.svdvals(scale.double())
    assert (singular_values[rank:] < 1e-5 * singular_values[0]).all()  # float32 round-off
    if rank > 1:
        # Symmetry was broken at init: training uses more than one component.
        assert singular_values[1] > 1e-3 * singular_values[0]


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_parameter_counts(rank):
    guide = AutoKTiedNormal(layer_model, rank=rank)
    guide()
    counts = {name: p.numel() for name, p in guide.named_parameters()}
    assert counts["scale_u.fc.weight_unconstrained"] == 30 * rank
    assert counts["scale_v.fc.weight_unconstrained"] == 20 * rank
    assert counts["scale_u.conv.weight_unconstrained"] == 8 * rank
    assert counts["scale_v.conv.weight_unconstrained"] == 27 * rank
    assert counts["scale_u.local.weight_unconstrained"] == 4 * 5 * rank
    expected = (
        (30 * 20 + rank * (30 + 20))  # fc.weight: mn + k(m + n)
        + 2 * 30  # fc.bias: per-element scale
        + (8 * 27 + rank * (8 + 27))  # conv.weight as 8 x 27
        + 4 * (5 * 6 + rank * (5 + 6))  # one tied matrix per plate element
    )
    assert sum(counts.values()) == expected


def test_init_is_exact_and_components_differ():
    guide = AutoKTiedNormal(layer_model, rank=3, init_scale=0.07)
    guide()
    for name in ["fc.weight", "conv.weight", "local.weight", "fc.bias"]:
        _, scale = guide.get_loc_and_scale(name)
        assert_close(scale, torch.full_like(scale, 0.07))
    u, v = guide.get_scale_factors("fc.weight")
    assert u.shape == (30, 3) and v.shape == (20, 3)
    # No two components of U are the same (so their gradients differ).
    for a in range(3):
        for b in range(a):
            assert (u[:, a] - u[:, b]).abs().max() > 1e-3


def test_equivalent_to_auto_normal_for_constant_std():
    kt = AutoKTiedNormal(layer_model, rank=2, init_scale=0.2)
    an = AutoNormal(layer_model, init_scale=0.2)
    kt_trace = poutine.trace(kt).get_trace()
    an_trace = poutine.trace(an).get_trace()
    with torch.no_grad():
        for name in ["fc.weight", "fc.bias", "conv.weight", "local.weight"]:
            an_loc = getattr(an.locs, name.split(".")[0])
            kt_loc = getattr(kt.locs, name.split(".")[0])
            getattr(kt_loc, name.split(".")[1] + "_unconstrained").copy_(
                getattr(an_loc, name.split(".")[1])
            )
    kt_trace = poutine.trace(kt).get_trace()
    an_trace = poutine.trace(an).get_trace()
    for name in ["fc.weight", "conv.weight", "local.weight"]:
        kt_fn = kt_trace.nodes[name]["fn"]
        an_fn = an_trace.nodes[name + "_unconstrained"]["fn"]
        value = an_trace.nodes[name]["value"]
        assert_close(kt_fn.log_prob(value), an_fn.log_prob(value), atol=1e-4, rtol=1e-6)
        prior = dist.Normal(0.0, 1.0).expand(value.shape).to_event(kt_fn.event_dim)
        assert_close(
            torch.distributions.kl_divergence(kt_fn, prior),
            torch.distributions.kl_divergence(an_fn, prior),
            atol=1e-4,
            rtol=1e-6,
        )


def test_site_distribution_is_k_tied_normal():
    guide = AutoKTiedNormal(layer_model, rank=2)
    trace = poutine.trace(guide).get_trace()
    fn = trace.nodes["conv.weight"]["fn"]
    assert isinstance(fn.base_dist, KTiedNormal) and fn.event_shape == (8, 3, 3, 3)
    assert fn.base_dist.scale_u.shape == (8, 2) and fn.base_dist.scale_v.shape == (27, 2)
    assert isinstance(trace.nodes["fc.bias"]["fn"].base_dist, dist.Normal)


def test_trains_with_mean_field_elbo():
    guide = _train(AutoKTiedNormal(layer_model, rank=2), steps=200, elbo=TraceMeanField_ELBO)
    loc, scale = guide.get_loc_and_scale("fc.weight")
    # The posterior sd of each element with 10 observations of noise 0.3 is ~0.0945.
    assert_close(scale.mean(), 0.3 / (10 + 0.09) ** 0.5, rtol=0.15, atol=0)


@pytest.mark.parametrize("rank", [0, -1, 1.5, True, "2"])
def test_bad_rank(rank):
    with pytest.raises(ValueError, match="rank must be a positive int"):
        AutoKTiedNormal(layer_model, rank=rank)


def test_get_scale_factors_of_untied_site():
    guide = AutoKTiedNormal(layer_model)
    guide()
    with pytest.raises(KeyError, match="not tied"):
        guide.get_scale_factors("fc.bias")


def test_large_rank_allowed():
    guide = _train(AutoKTiedNormal(layer_model, rank=40), steps=5)
    _, scale = guide.get_loc_and_scale("fc.weight")
    assert scale.shape == (30, 20) and torch.isfinite(scale).all()


def _trained_normal():
    # Distinct per-element sds: the std matrix has full rank.
    guide = AutoNormal(layer_model)
    guide()
    with torch.no_grad():
        for name, p in guide.named_parameters():
            if name.startswith("scales."):
                p.copy_(torch.rand_like(p).mul(0.5).add(0.02).expm1().log())
            else:
                p.normal_()
    return guide


@pytest.mark.parametrize("rank", [1, 2, 5])
def test_from_guide(rank):
    normal = _trained_normal()
    guide = AutoKTiedNormal.from_guide(normal, rank=rank)
    assert guide.rank == rank and guide.prototype_trace is normal.prototype_trace
    for name in ["fc.weight", "fc.bias", "conv.weight", "local.weight"]:
        loc, scale = site_params.get_loc_and_scale(guide, name)
        expected_loc, expected_scale = site_params.get_loc_and_scale(normal, name)
        assert_close(loc, expected_loc)
        if name == "fc.bias":  # untied: exact
            assert_close(scale, expected_scale, rtol=1e-6, atol=0)
            continue
        m = expected_scale.shape[-2] if name == "local.weight" else expected_scale.shape[0]
        target = expected_scale.detach().reshape(expected_scale.shape[:-2] + (m, -1)
                                                 if name == "local.weight" else (m, -1))
        fitted = scale.detach().reshape(target.shape)
        error = (fitted - target).double().norm(dim=(-2, -1))
        best = torch.linalg.svdvals(target.double())[..., rank:].norm(dim=-1)  # Eckart-Young
        if rank >= min(target.shape[-2:]):  # full rank: exact
            assert_close(fitted, target, rtol=1e-5, atol=0)
        elif rank == 1:  # the best rank-1 fit (the task asks for within 1.5x)
            assert (error <= 1.5 * best).all() and (error <= best * (1 + 1e-4)).all()
        else:
            assert (error >= best * (1 - 1e-6)).all() and (error < 1.5 * best).all()


def test_from_guide_trains_and_needs_no_model_args():
    normal = _trained_normal()
    pyro.get_param_store().clear()  # the AutoNormal's module keeps its parameters
    guide = AutoKTiedNormal.from_guide(normal, rank=2)
    svi = SVI(layer_model, guide, Adam({"lr": 0.01}), TraceMeanField_ELBO())
    before = {k: v.detach().clone() for k, v in guide.state_dict().items()}
    data = torch.randn(10, 30, 20)
    # The first call registers the from_guide values, not fresh ones.
    trace = poutine.trace(guide).get_trace(data)
    loc = trace.nodes["fc.weight"]["fn"].base_dist.loc
    assert_close(loc, before["locs.fc.weight_unconstrained"])
    assert set(guide.state_dict()) == set(before)
    svi.step(data)
    assert set(pyro.get_param_store().keys()) == {
        f"AutoKTiedNormal.{k.removesuffix('_unconstrained')}" for k in before
    }


def test_from_guide_errors():
    with pytest.raises(RuntimeError, match="not set up yet"):
        AutoKTiedNormal.from_guide(AutoNormal(layer_model))
    existing = AutoKTiedNormal(layer_model)
    existing()  # its parameters are in the param store under the same names
    with pytest.raises(ValueError, match="already holds"):
        AutoKTiedNormal.from_guide(existing, rank=1)


def test_defaults_and_constructor_options_reach_the_guide():
    # the defaults: rank 2 and init_scale 0.1 (the init is exact: U V^T = init_scale)
    guide = AutoKTiedNormal(layer_model)
    guide()
    u, _ = guide.get_scale_factors("fc.weight")
    assert guide.rank == 2 and u.shape == (30, 2)
    _, scale = guide.get_loc_and_scale("fc.weight")
    assert_close(scale, torch.full_like(scale, 0.1), rtol=1e-6, atol=0)
    # init_loc_fn and create_plates are the ones given
    pyro.clear_param_store()
    wanted = torch.randn(30, 20)
    calls = []

    def create_plates(*args, **kwargs):
        calls.append(args)
        return pyro.plate("groups", 4)

    guide = AutoKTiedNormal(layer_model, init_loc_fn=init_to_value(values={"fc.weight": wanted}),
                            create_plates=create_plates)
    guide()
    assert_close(guide.get_loc_and_scale("fc.weight")[0], wanted)
    assert calls
    # from_guide: the default rank 2, the guide's create_plates unless others are given
    calls.clear()
    pyro.clear_param_store()
    new = AutoKTiedNormal.from_guide(guide)
    assert new.rank == 2 and new.get_scale_factors("fc.weight")[0].shape == (30, 2)
    new()
    assert calls
    pyro.clear_param_store()
    others = []
    new = AutoKTiedNormal.from_guide(
        guide, create_plates=lambda *args, **kwargs: others.append(1) or pyro.plate("groups", 4)
    )
    calls.clear()
    new()
    assert others and not calls


def test_float64_model_gets_float64_factors():
    def model():
        pyro.sample("w", dist.Normal(torch.zeros(5, 4, dtype=torch.float64), 1.0).to_event(2))

    guide = AutoKTiedNormal(model)
    guide()
    assert all(f.dtype == torch.float64 for f in guide.get_scale_factors("w"))


def test_one_element_matrix_site_is_tied():
    def model():
        pyro.sample("w", dist.Normal(torch.zeros(1, 1), 1.0).to_event(2))

    guide = AutoKTiedNormal(model, rank=2)
    guide()
    u, v = guide.get_scale_factors("w")
    assert u.shape == (1, 2) and v.shape == (1, 2)


def test_factors_are_subsampled_with_their_plate():
    # The factors' leading dims are plate dims (event_dim 2 of the PyroParam): a subsampled
    # plate draws the subsample's factors.
    def model():
        with pyro.plate("groups", 5, subsample_size=2):
            pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))

    guide = AutoKTiedNormal(model)
    guide()
    u, v = guide.get_scale_factors("w")
    assert u.shape == (5, 3, 2) and v.shape == (5, 4, 2)
    with torch.no_grad():  # a different scale per group, to see which groups are drawn
        guide.scale_u.w_unconstrained.copy_(
            torch.arange(1.0, 6.0)[:, None, None].expand(5, 3, 2).expm1().log()
        )
    guide_trace = poutine.trace(guide).get_trace()
    index = guide_trace.nodes["groups"]["value"]
    fn = guide_trace.nodes["w"]["fn"]
    assert guide_trace.nodes["w"]["value"].shape == (2, 3, 4)
    expected = (torch.arange(1.0, 6.0)[index, None, None] * v[index].sum(-1)[:, None, :]
                * torch.ones(2, 3, 1))
    assert_close(fn.base_dist.stddev, expected, rtol=1e-5, atol=0)


def test_matrix_in_plates_is_named_as_untied():
    # A weight matrix whose dims are plate dims (Pyro's tensor-shapes style) has one
    # element per event, so it gets AutoNormal's scales: said once, at set-up.
    def model():
        with pyro.plate("units", 6, dim=-2), pyro.plate("inputs", 4, dim=-1):
            pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("rows", 3):
            pyro.sample("v", dist.Normal(torch.zeros(5), 1.0).to_event(1))
        pyro.sample("b", dist.Normal(torch.zeros(6), 1.0).to_event(1))
        pyro.sample("m", dist.Normal(torch.zeros(6, 4), 1.0).to_event(2))
        with pyro.plate("data", 100, subsample=torch.arange(3)):  # per-example: no weight
            pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))

    guide = AutoKTiedNormal(model)
    with pytest.warns(UserWarning, match=r"\['w', 'v'\] have two or more dims") as record:
        guide()
    assert len(record) == 1
    assert record[0].filename == __file__  # the user's call, not the guide's set-up
    assert guide.scales.w.shape == (6, 4) and guide.get_scale_factors("m")[0].shape == (6, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guide()  # (once)
        AutoKTiedNormal(layer_model)()  # a plate around a matrix event: tied, no warning


def test_set_loc_and_scale_writes_both_and_refits_small_changes():
    def model():
        pyro.sample("w", dist.Normal(torch.zeros(5, 4, dtype=torch.float64), 1.0).to_event(2))

    guide = AutoKTiedNormal(model, rank=1)
    guide()
    loc = torch.randn(5, 4, dtype=torch.float64)
    rank_one = (torch.rand(5, 1, dtype=torch.float64) + 0.1) @ (torch.rand(1, 4) + 0.1).double()
    guide.set_loc_and_scale("w", loc, rank_one)
    assert_close(guide.get_loc_and_scale("w")[0], loc)  # the loc is written with the factors
    # A change of 5e-6 (relative), or of 5e-9 on tiny scales, is refitted, not ignored.
    for scale in (rank_one * (1 + 5e-6), 1e-6 * rank_one, 1e-6 * rank_one * 1.005):
        guide.set_loc_and_scale("w", loc, scale)
        assert_close(guide.get_loc_and_scale("w")[1], scale, rtol=1e-9, atol=0)


def test_from_guide_error_message():
    existing = AutoKTiedNormal(layer_model)
    existing()
    with pytest.raises(ValueError) as error:
        AutoKTiedNormal.from_guide(existing, rank=1)
    taken = sorted(k for k in pyro.get_param_store().keys() if k.startswith("AutoKTiedNormal."))
    assert str(error.value) == (
        f"AutoKTiedNormal.from_guide: the param store already holds {taken[:3]}..., which a "
        "new guide of this name would pick up at its first call instead of the values "
        "from_guide computes; save them if needed, then remove them "
        "(pyro.clear_param_store(), or del pyro.get_param_store()[name])"
    )
