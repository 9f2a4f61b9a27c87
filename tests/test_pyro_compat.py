"""Fails loudly if Pyro changes what pyro_vinit._pyro_compat and the flat-latent
layout of pyro_vinit.guides.site_params rely on."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import (
    RenyiELBO,
    ReweightedWakeSleep,
    Trace_ELBO,
    TraceGraph_ELBO,
    TraceMeanField_ELBO,
    TraceTailAdaptive_ELBO,
)
from pyro.infer.autoguide import (
    AutoDiagonalNormal,
    AutoGuide,
    AutoLowRankMultivariateNormal,
    AutoNormal,
)
from pyro.nn import PyroModule, PyroParam
from pyro.poutine.messenger import Messenger

from pyro_vinit._pyro_compat import (
    active_sample_plate,
    deep_setattr,
    discrete_site_error,
    helpful_support_errors,
    is_vectorized_particles,
    prefill_log_prob,
    scale_and_mask,
    unconstrained_param,
    whole_trace_weights_elbo,
    without_trace_shapes,
)
from pyro_vinit.guides import site_params


def model():
    pyro.sample("a", dist.Normal(torch.zeros(2, 3), 1.0).to_event(2))
    pyro.sample("simplex", dist.Dirichlet(torch.ones(4)))  # 3 unconstrained elements
    pyro.sample("b", dist.LogNormal(torch.zeros(5), 1.0).to_event(1))


def test_unconstrained_param_is_the_trained_parameter():
    guide = AutoNormal(model)
    guide()
    param = unconstrained_param(guide.scales, "a")
    assert param is dict(guide.named_parameters())["scales.a_unconstrained"]
    # ... and the tensor the param store (hence SVI's optimizer) holds.
    assert param is pyro.get_param_store().get_param("AutoNormal.scales.a").unconstrained()
    assert torch.allclose(torch.nn.functional.softplus(param), guide.scales.a)


def test_flat_latent_layout():
    # site_params slices AutoContinuous's flat latent in trace order; Pyro's own
    # median() unpacks it: the two must agree site by site.
    for Guide in (AutoDiagonalNormal, AutoLowRankMultivariateNormal):
        guide = Guide(model)
        guide()
        with torch.no_grad():
            guide.loc.copy_(torch.arange(guide.latent_dim, dtype=guide.loc.dtype) / 10)
        median = guide.median()
        for name, site in site_params.latent_sites(guide).items():
            loc, _ = site_params.get_loc_and_scale(guide, name)
            expected = torch.distributions.biject_to(site["fn"].support)(loc)
            assert torch.allclose(median[name], expected), name


# ------------------------------------------------- what the poutine handlers rely on


class _Prefill(Messenger):
    # Stores the log density of the guide's site (a Normal) ahead of time, as
    # LocalReparamMessenger does for a deferred weight; like it, it runs outside the
    # ELBO, so its post-processing comes before the ELBO's trace records the site.
    def __init__(self, constant):
        super().__init__()
        self.constant = constant

    def _pyro_post_sample(self, msg):
        if isinstance(msg["fn"].base_dist, dist.Normal):
            value = torch.full(msg["fn"].batch_shape, self.constant)
            scaled = scale_and_mask(value, msg["scale"], msg["mask"])
            prefill_log_prob(msg, value, scaled, scaled.sum())


@pytest.mark.parametrize("elbo", [Trace_ELBO, TraceMeanField_ELBO, TraceGraph_ELBO])
def test_prefilled_log_prob_is_kept(elbo):
    # The guide's draw is z up to 1e-6; a Normal guide and a StudentT prior have no
    # closed-form KL, so every ELBO reads the guide's log density from the site.
    z = torch.tensor([0.5, -0.5])
    prior = dist.StudentT(3.0, torch.zeros(2), 1.0).to_event(1)

    def model():
        pyro.sample("z", prior)

    def guide():
        pyro.sample("z", dist.Normal(z, 1e-6).to_event(1))

    expected = -(prior.log_prob(z) + 7.0)
    with _Prefill(-7.0):
        losses = [elbo().loss_and_grads(model, guide)]
        if hasattr(elbo, "differentiable_loss"):
            losses.append(elbo().differentiable_loss(model, guide))
    for loss in losses:
        assert torch.allclose(torch.as_tensor(loss), expected, atol=1e-4), (
            f"{elbo.__name__} recomputed a guide site's log density although its message "
            "already had one: pyro_vinit._pyro_compat.prefill_log_prob no longer works "
            "with this Pyro (LocalReparamMessenger relies on it)"
        )


def test_trace_keeps_prefilled_entries():
    def guide():
        pyro.sample("z", dist.Normal(torch.zeros(3), 1.0).to_event(1))

    trace = pyro.poutine.trace(guide).get_trace()
    site = trace.nodes["z"]
    sentinel = torch.full((), -3.0)
    prefill_log_prob(site, sentinel, sentinel, sentinel)
    trace.compute_log_prob()
    trace.compute_score_parts()
    assert site["log_prob"] is sentinel and site["unscaled_log_prob"] is sentinel
    assert site["score_parts"].log_prob is sentinel
    assert trace.log_prob_sum() == sentinel


def test_vectorized_particle_plate_is_recognized():
    frames = []

    class Record(Messenger):
        def _pyro_post_sample(self, msg):
            frames.extend(msg["cond_indep_stack"])

    def model():
        with Record():
            pyro.sample("z", dist.Normal(0.0, 1.0))

    def guide():
        pyro.sample("z", dist.Normal(0.0, 1.0))

    Trace_ELBO(num_particles=3, vectorize_particles=True).differentiable_loss(model, guide)
    assert any(is_vectorized_particles(frame) for frame in frames), (
        "an ELBO with vectorize_particles=True no longer runs the model in a plate "
        "named 'num_particles_vectorized': update pyro_vinit._pyro_compat"
    )
    frames.clear()
    Trace_ELBO(num_particles=3).differentiable_loss(model, guide)
    assert frames == [] or not any(is_vectorized_particles(frame) for frame in frames)


@pytest.mark.parametrize("objective, expected", [
    (lambda m, g: RenyiELBO(alpha=0.5, num_particles=2).loss(m, g), "RenyiELBO"),
    (lambda m, g: RenyiELBO(num_particles=2).loss_and_grads(m, g), "RenyiELBO"),
    (lambda m, g: TraceTailAdaptive_ELBO(num_particles=2, vectorize_particles=True)
     .loss_and_grads(m, g), "TraceTailAdaptive_ELBO"),
    (lambda m, g: ReweightedWakeSleep(num_particles=2).loss(m, g), "ReweightedWakeSleep"),
    (lambda m, g: Trace_ELBO(num_particles=2).loss(m, g), None),
    (lambda m, g: TraceMeanField_ELBO(num_particles=2, vectorize_particles=True)
     .loss(m, g), None),
], ids=["renyi loss", "renyi loss_and_grads", "tail adaptive", "rws", "trace", "mean field"])
def test_whole_trace_weights_elbo_is_recognized_while_it_runs_the_model(objective, expected):
    seen = []

    def model():
        seen.append(whole_trace_weights_elbo())
        pyro.sample("z", dist.Normal(0.0, 1.0))

    def guide():
        loc = pyro.param("loc", torch.tensor(0.0))
        pyro.sample("z", dist.Normal(loc, 1.0))

    objective(model, guide)
    assert seen and all(name == expected for name in seen), (
        f"{seen}: the objective no longer runs the model from a method of its own "
        "instance: update pyro_vinit._pyro_compat.whole_trace_weights_elbo")
    assert whole_trace_weights_elbo() is None


def test_scale_and_mask():
    x = torch.tensor([1.0, 2.0, 3.0])
    mask = torch.tensor([True, False, True])
    assert torch.equal(scale_and_mask(x, 2.0, mask), torch.tensor([2.0, 0.0, 6.0]))
    assert scale_and_mask(x, 1.0, None) is x


def test_deep_setattr_and_helpful_support_errors():
    module = PyroModule()
    deep_setattr(module, "a.b", PyroParam(torch.ones(2)))
    assert torch.equal(module.a.b, torch.ones(2))

    site = {"name": "w", "fn": dist.Categorical(logits=torch.zeros(3))}
    with pytest.raises(ValueError, match="discrete sample site 'w'") as error:
        with helpful_support_errors(site):
            raise NotImplementedError("no transform")
    assert discrete_site_error(error.value) == "w"
    assert discrete_site_error(ValueError("discrete site 'w'")) is None
    assert discrete_site_error(TypeError(str(error.value))) is None


def test_discrete_site_error_from_an_autoguides_init():
    # AutoGuide set-up with init_to_feasible on an unobserved discrete site: Pyro's error,
    # which the guides of pyro_vinit turn into their own message.
    def classifier():
        pyro.sample("obs", dist.Categorical(logits=torch.zeros(3)))

    with pytest.raises(ValueError) as error:
        AutoNormal(classifier)()
    assert discrete_site_error(error.value) == "obs"


@pytest.mark.parametrize("error_type", [ValueError, RuntimeError])
def test_without_trace_shapes_is_the_models_own_error(error_type):
    # poutine.trace raises a model's ValueError / RuntimeError again with the trace's
    # shapes appended, from the model's; nested traces append them once each
    def failing():
        pyro.sample("a", dist.Normal(0.0, 1.0))
        raise error_type("the model's message")

    for model in (failing, pyro.poutine.trace(failing)):
        with pytest.raises(error_type) as error:
            pyro.poutine.trace(model).get_trace()
        assert "Trace Shapes" in str(error.value)
        assert str(without_trace_shapes(error.value)) == "the model's message"
    other = ValueError("not from a trace")
    assert without_trace_shapes(other) is other


def test_active_sample_plate_is_read_while_pyro_runs_the_model():
    seen = []

    def model():
        seen.append(active_sample_plate())
        pyro.sample("a", dist.Normal(0.0, 1.0))

    guide = AutoNormal(model)
    guide()
    from pyro.infer import Predictive

    Predictive(model, guide=guide, num_samples=3, parallel=True)()
    Trace_ELBO(num_particles=2, vectorize_particles=True, max_plate_nesting=0).loss(
        model, guide)
    model()
    assert seen[-3:] == ["samples", "particles", None]


def test_setup_prototype_runs_autoguides_own_set_up():
    from pyro_vinit._pyro_compat import setup_prototype

    guide = AutoNormal(model)
    setup_prototype(guide)
    assert set(guide.prototype_trace.stochastic_nodes) == {"a", "simplex", "b"}
    assert not hasattr(guide, "locs")  # AutoNormal's own set-up did not run


def test_guides_call_pyros_private_set_up_only_through_compat():
    import pathlib

    import pyro_vinit

    root = pathlib.Path(pyro_vinit.__file__).parent
    offenders = [
        str(path.relative_to(root)) for path in root.rglob("*.py")
        if path.name != "_pyro_compat.py" and "AutoGuide._setup_prototype" in path.read_text()
    ]
    assert offenders == []


def test_autonormal_delta_follows_the_auxiliary_value():
    # LayerCallMessenger follows the Delta that AutoNormal puts at a real-support site
    # to the Normal of its auxiliary <name>_unconstrained site, through Delta.v.
    guide = AutoNormal(model)
    trace = pyro.poutine.trace(guide).get_trace()
    aux, site = trace.nodes["a_unconstrained"], trace.nodes["a"]
    assert aux["infer"].get("is_auxiliary")
    delta = site["fn"]
    while isinstance(delta, dist.Independent):
        delta = delta.base_dist
    assert isinstance(delta, dist.Delta) and delta.v is aux["value"]


def test_autocontinuous_latent_is_auxiliary():
    # The handlers' reports leave out guide-internal sites by their is_auxiliary flag.
    guide = AutoDiagonalNormal(model)
    trace = pyro.poutine.trace(guide).get_trace()
    internal = [name for name in trace.stochastic_nodes if name not in ("a", "simplex", "b")]
    assert internal and all(trace.nodes[n]["infer"].get("is_auxiliary") for n in internal)


# -------------------------------------- AutoNormal internals the guides build on


def test_autonormal_internals_used_by_the_guides():
    # pyro_vinit.guides subclass AutoNormal and read its protected set-up state.
    guide = AutoNormal(model, init_scale=0.25)
    assert guide._init_scale == 0.25
    assert guide.prototype_trace is None
    guide()
    assert guide.prototype_trace is not None
    plates = guide._create_plates()
    assert isinstance(plates, dict)
    assert hasattr(AutoGuide, "_setup_prototype")


def test_share_prototype_sets_up_a_guide_without_running_the_model():
    from pyro.infer.autoguide import AutoDelta

    from pyro_vinit._pyro_compat import share_prototype

    def plated():
        with pyro.plate("p", 4, subsample_size=2):
            pyro.sample("x", dist.Normal(0.0, 1.0))

    source = AutoNormal(plated)
    source()
    target = AutoDelta(plated)
    share_prototype(source, target)
    assert target.prototype_trace is source.prototype_trace
    # The plates AutoGuide builds from the frames match the source's.
    assert {n: p.subsample_size for n, p in target._create_plates().items()} == {"p": 2}


def test_pyro_sample_priors():
    from pyro.nn import PyroModule, PyroSample

    from pyro_vinit._pyro_compat import pyro_sample_priors

    module = PyroModule[torch.nn.Linear](2, 3)
    prior = dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2)
    module.weight = PyroSample(prior)
    assert pyro_sample_priors(module) == {"weight": prior}
    assert pyro_sample_priors(torch.nn.Linear(2, 3)) == {}


def test_active_messengers_lists_the_handlers_outermost_first():
    from pyro_vinit._pyro_compat import active_messengers

    assert active_messengers() == []
    with pyro.poutine.scale(scale=2.0) as outer, pyro.poutine.mask(mask=True) as inner:
        assert active_messengers() == [outer, inner]


def test_traceable_elbos_keep_the_loss_a_tensor():
    # Pyro's ELBOs read the loss with torch_item and warn_if_nan; under traceable_elbos
    # the loss stays a tensor (what make_fx needs), with the same value, and both are
    # restored on exit
    from pyro.infer import trace_elbo, trace_mean_field_elbo

    from pyro_vinit._pyro_compat import traceable_elbos

    saved = trace_elbo.torch_item, trace_mean_field_elbo.warn_if_nan

    def model():
        pyro.sample("a", dist.Normal(0.0, 1.0))

    guide = AutoNormal(model)
    guide()  # its parameters, drawn once
    for elbo in (Trace_ELBO(), TraceMeanField_ELBO()):
        pyro.set_rng_seed(0)
        expected = elbo.differentiable_loss(model, guide)
        with traceable_elbos():
            assert trace_elbo.torch_item(torch.tensor(3.0)).shape == ()
            pyro.set_rng_seed(0)
            loss = elbo.differentiable_loss(model, guide)
        assert torch.is_tensor(loss) and loss.item() == expected.item()
    assert (trace_elbo.torch_item, trace_mean_field_elbo.warn_if_nan) == saved


def test_handler_chain_wrap_inner_and_model_swapped():
    from pyro.poutine.block_messenger import BlockMessenger
    from pyro.poutine.condition_messenger import ConditionMessenger

    from pyro_vinit._pyro_compat import handler_chain, model_swapped, wrap_inner

    data = {"b": torch.zeros(5)}
    wrapped = pyro.condition(pyro.poutine.block(model, hide=["a"]), data=data)
    chain = handler_chain(wrapped)
    assert [type(m) for m, _ in chain] == [ConditionMessenger, BlockMessenger]
    assert chain[0][0].data is data and chain[1][1] is model
    # a handler put inside the block sees the site the block hides from the outside
    seen = []

    class Spy(Messenger):
        def _pyro_sample(self, msg):
            seen.append(msg["name"])

    rewrapped = wrap_inner(wrapped, chain[1][0], Spy())
    trace = pyro.poutine.trace(rewrapped).get_trace()
    assert "a" in seen and "a" not in trace.nodes and trace.nodes["b"]["is_observed"]
    guide = AutoNormal(model)
    original = guide.model
    with model_swapped(guide, rewrapped):
        assert guide.model is rewrapped
    assert guide.model is original


def test_replace_handler():
    from pyro.poutine.block_messenger import BlockMessenger

    from pyro_vinit._pyro_compat import handler_chain, replace_handler

    data = {"b": torch.zeros(5)}
    block = BlockMessenger(hide=["a"])
    wrapped = pyro.condition(block(model), data=data)
    assert "a" not in pyro.poutine.trace(wrapped).get_trace().nodes
    # the block swapped for one that hides nothing, under the same condition handler
    replaced = replace_handler(wrapped, block, BlockMessenger(hide=[]))
    trace = pyro.poutine.trace(replaced).get_trace()
    assert "a" in trace.nodes and trace.nodes["b"]["is_observed"]
    assert handler_chain(replaced)[0][0] is handler_chain(wrapped)[0][0]
    assert handler_chain(replaced)[1][1] is model


def test_deterministic_sites_are_recognized():
    from pyro_vinit._pyro_compat import is_deterministic_site

    def model():
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
        pyro.deterministic("y", 2 * x)
        pyro.sample("z", dist.Normal(x, 1.0), obs=torch.tensor(0.5))

    trace = pyro.poutine.trace(model).get_trace()
    assert [n for n, s in trace.nodes.items() if s["type"] == "sample"
            and is_deterministic_site(s)] == ["y"], (
        "pyro.deterministic no longer marks its site with infer['_deterministic']: "
        "update pyro_vinit._pyro_compat.is_deterministic_site")


def test_subsampled_plates_are_read():
    from pyro_vinit._pyro_compat import subsampled_plate

    def model():
        with pyro.plate("sub", 10, subsample_size=3):
            pass
        with pyro.plate("whole", 10, subsample_size=10):
            pass
        with pyro.plate("more", 4, subsample_size=6, subsample=torch.arange(6) % 4):
            pass
        with pyro.plate("plain", 4):
            pyro.sample("x", dist.Normal(0.0, 1.0))

    trace = pyro.poutine.trace(model).get_trace()
    plates = {name: subsampled_plate(site) for name, site in trace.nodes.items()
              if site["type"] == "sample"}
    assert plates == {"sub": (10, 3, torch.device("cpu")), "whole": None,
                      "more": (4, 6, torch.device("cpu")), "plain": None, "x": None}, (
        "Pyro's plate subsample site changed (pyro.poutine.subsample_messenger._Subsample's "
        "size, subsample_size, device): update pyro_vinit._pyro_compat.subsampled_plate")


def test_conditioned_sites_and_likelihood_sites():
    from pyro_vinit._pyro_compat import conditioned_sites, likelihood_sites

    def model():
        pyro.sample("a", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(0.0, 1.0), obs=torch.tensor(0.5))

    data = {"a": torch.tensor(1.0)}
    inner = pyro.condition(model, data=data)
    wrapped = pyro.poutine.block(pyro.condition(inner, data={"b": torch.tensor(0.0)}))
    assert conditioned_sites(model) == frozenset()
    assert conditioned_sites(inner) == {"a"} and conditioned_sites(wrapped) == {"a", "b"}
    tr = pyro.poutine.trace(pyro.condition(model, data=data)).get_trace()
    assert {"a", "obs"} <= conditioned_sites(pyro.condition(model, data=tr))  # a Trace's nodes
    a, obs = {"name": "a"}, {"name": "obs"}
    assert likelihood_sites([a, obs], inner) == [obs]  # a fixed hyperparameter left out
    assert likelihood_sites([a], inner) == [a]  # the only observed site: the likelihood
    assert likelihood_sites([a, obs], model) == [a, obs]
