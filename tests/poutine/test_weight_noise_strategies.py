"""Weight-noise strategies chosen per site (WeightNoiseMessenger's config) and the
distribution registries they read."""

import re
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

from pyro_vinit.distributions import (
    KTiedNormal,
    RadialNormal,
    factorized_normal,
    is_sign_symmetric,
    low_rank_scale,
    register_factorized_normal,
    register_sign_symmetric,
)
from pyro_vinit.poutine import (
    AutoWeightNoise,
    Flipout,
    FlipoutMessenger,
    LocalReparam,
    LocalReparamMessenger,
    WeightNoise,
    WeightNoiseMessenger,
    local_reparam,
    weight_noise,
)
from tests.common import assert_close

X = torch.randn(1, 5).expand(4, 5)  # four rows of the same input
LOC1, SCALE1 = torch.randn(3, 5), torch.rand(3, 5) + 0.5
LOC2, SCALE2 = torch.randn(2, 5), torch.rand(2, 5) + 0.5


def _model(x, second=None):
    # Two layers on the same input: w1 a factorized Normal, w2 radial (or ``second``).
    w1 = pyro.sample("w1", dist.Normal(LOC1, SCALE1).to_event(2))
    fn = RadialNormal(LOC2, SCALE2, event_dim=2) if second is None else second
    w2 = pyro.sample("w2", fn)
    return F.linear(x, w1), F.linear(x, w2)


def _run(handler, *args):
    with handler:
        trace = poutine.trace(_model).get_trace(X, *args)
    out1, out2 = trace.nodes["_RETURN"]["value"]
    return trace, out1, out2


def _per_example(out):
    # whether rows of the same input got different outputs (not all alike: Flipout's signs,
    # which convolutions take, can repeat between two rows over few channels)
    return not all(torch.equal(out[0], row) for row in out[1:])


def test_auto_config_lrt_on_normal_and_flipout_on_radial_in_one_step():
    # The default config picks per site: local reparameterization for the factorized Normal
    # (whose draw it never needs, so it stays deferred), Flipout for the radial one (which
    # uses its draw). strict=True: no site kept its ordinary sample.
    trace, out1, out2 = _run(WeightNoiseMessenger(strict=True))
    assert trace.nodes["w1"]["value"].is_deferred
    assert not trace.nodes["w2"]["value"].is_deferred
    assert _per_example(out1) and _per_example(out2)


def test_auto_config_moments():
    # Each layer's output has its ordinary distribution (Monte Carlo, 5 standard errors).
    n = 3000
    with WeightNoiseMessenger(strict=True):
        outs = [_model(X[:1]) for _ in range(n)]
    for i, (loc, var) in enumerate([(LOC1, SCALE1**2), (LOC2, SCALE2**2 / LOC2.numel())]):
        samples = torch.stack([o[i][0] for o in outs])
        mean, v = F.linear(X[0], loc), F.linear(X[0] ** 2, var)
        assert_close(samples.mean(0), mean, atol=5 * (v / n).sqrt().max().item(), rtol=0)
        assert (samples.var(0) / v - 1).abs().max() < 5 * (3 / n) ** 0.5


def test_local_reparam_alone_cannot_treat_the_radial_site():
    # The short form applies one strategy everywhere: the radial site is reported.
    with pytest.raises(ValueError, match="'w2': its distribution is RadialNormal, not a "
                       "factorized Normal"):
        _run(LocalReparamMessenger(strict=True))


@pytest.mark.parametrize(
    "config",
    [{"w1": Flipout()}, {"w1": Flipout(), "w2": None},
     lambda msg: Flipout() if msg["name"] == "w1" else None],
    ids=["dict", "dict with None", "callable"],
)
def test_config_leaves_other_sites_alone(config):
    # w1 gets Flipout (drawn, per-example noise); w2, left alone, keeps its ordinary sample
    # (one sample for all rows) and is not reported, even with strict=True.
    trace, out1, out2 = _run(WeightNoiseMessenger(config=config, strict=True))
    assert not trace.nodes["w1"]["value"].is_deferred and _per_example(out1)
    assert not _per_example(out2)


def test_one_strategy_for_every_site():
    trace, out1, out2 = _run(WeightNoiseMessenger(config=Flipout(), strict=True))
    assert not trace.nodes["w1"]["value"].is_deferred
    assert _per_example(out1) and _per_example(out2)


def test_unknown_distribution_is_reported_by_the_auto_config():
    laplace = dist.Laplace(LOC2, SCALE2).to_event(2)
    with pytest.raises(ValueError) as error:
        _run(WeightNoiseMessenger(strict=True), laplace)
    assert (
        "'w2': no weight-noise strategy is known for its distribution (Laplace): it is "
        "neither a factorized Normal (LocalReparam) nor sign-symmetric (Flipout)"
    ) in str(error.value)


class _SymmetricLaplace(dist.Laplace):
    pass


def test_registered_sign_symmetry_opts_a_distribution_in():
    # Knowledge registered beside a distribution, not in the handlers: Flipout applies.
    laplace = _SymmetricLaplace(LOC2, SCALE2).to_event(2)
    assert not is_sign_symmetric(laplace)  # asked (and cached) before it registers
    register_sign_symmetric(_SymmetricLaplace)(lambda d: True)
    assert is_sign_symmetric(laplace) and not is_sign_symmetric(dist.Laplace(LOC2, SCALE2))
    _, _, out2 = _run(WeightNoiseMessenger(strict=True), laplace)
    assert _per_example(out2)


def test_weight_noise_handler_function():
    def step(x):
        return _model(x)

    out1, out2 = weight_noise(step, config={"w2": Flipout()}, strict=True)(X)
    assert not _per_example(out1) and _per_example(out2)
    assert isinstance(weight_noise(config=Flipout()), WeightNoiseMessenger)


def test_weight_noise_strict_is_off_by_default_and_passed_on():
    # The Laplace site has no strategy: reported by a warning, or by an error with strict=True.
    laplace = dist.Laplace(LOC2, SCALE2).to_event(2)

    def step(x):
        return _model(x, laplace)

    with pytest.warns(UserWarning, match="'w2': no weight-noise strategy is known"):
        weight_noise(step)(X)
    with pytest.raises(ValueError, match="'w2': no weight-noise strategy is known"):
        weight_noise(step, strict=True)(X)
    # the handler's own default
    with pytest.warns(UserWarning, match="'w2': no weight-noise strategy is known"):
        with WeightNoiseMessenger():
            step(X)


class _Counting(WeightNoise):
    """A user's strategy wrapping another one (Pyro reparam style), counting its calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def apply(self, call, weight, fn):
        self.calls += 1
        return self.inner.apply(call, weight, fn)


def test_auto_strategy_applied_through_a_wrapper_picks_per_distribution():
    # The handler asks the wrapper (which does not choose) to apply; AutoWeightNoise.apply
    # then picks LRT for w1 and Flipout for w2 itself: the same outputs under the same seed
    # as each strategy wrapped alike (both wrappers draw w1 eagerly, which LRT does not use).
    wrapper = _Counting(AutoWeightNoise())
    pyro.set_rng_seed(1)
    _, out1, out2 = _run(WeightNoiseMessenger(config=wrapper, strict=True))
    assert wrapper.calls == 2
    pyro.set_rng_seed(1)
    _, ref1, ref2 = _run(WeightNoiseMessenger(config={"w1": _Counting(LocalReparam()),
                                                      "w2": _Counting(Flipout())},
                                              strict=True))
    assert torch.equal(out1, ref1) and torch.equal(out2, ref2)
    assert _per_example(out1) and _per_example(out2)


@pytest.mark.parametrize(
    "config, message",
    [
        (3, "WeightNoiseMessenger: config must be a WeightNoise strategy, a dict from site "
            "names to strategies, or a callable from a site's message to a strategy, got 3"),
        ({"w1": "lrt"}, "WeightNoiseMessenger: config['w1'] must be a WeightNoise strategy "
                        "(e.g. LocalReparam(), Flipout()) or None, got 'lrt'"),
    ],
)
def test_bad_config_is_refused(config, message):
    with pytest.raises(TypeError) as error:
        WeightNoiseMessenger(config=config)
    assert str(error.value) == message


def test_callable_config_returning_a_non_strategy_is_refused():
    with pytest.raises(TypeError) as error:
        _run(WeightNoiseMessenger(config=lambda msg: "lrt"))
    assert str(error.value) == ("WeightNoiseMessenger: config returned 'lrt' for site 'w1'; "
                                "it must return a WeightNoise strategy or None")


def test_flipout_names_a_distribution_not_known_to_be_sign_symmetric():
    laplace = dist.Laplace(LOC2, SCALE2).to_event(2)
    with pytest.raises(ValueError) as error:
        _run(WeightNoiseMessenger(config=Flipout(), strict=True), laplace)
    assert str(error.value) == (
        "WeightNoiseMessenger: 1 latent site(s) kept their ordinary sample, shared by the "
        "whole minibatch:\n  'w2': its distribution is Laplace, whose perturbations are not "
        "known to be symmetric under sign flips.\n"
        "(strict=True: pass strict=False to only warn about them.)"
    )


class _RowShared(dist.Normal):
    pass


def test_a_registered_normal_of_another_shape_is_not_the_weights():
    # A registration whose Normal lacks the value's shape (here one row's, which would
    # broadcast over the rows) does not give the weight's elements: LocalReparam leaves
    # the site to its ordinary sample, drawn as usual, and says why.
    register_factorized_normal(_RowShared)(lambda d: dist.Normal(d.loc[0], d.scale[0]))
    fn = _RowShared(LOC2, SCALE2).to_event(2)
    with pytest.warns(UserWarning) as record:
        trace, _, out2 = _run(WeightNoiseMessenger(config=LocalReparam()), fn)
    assert [str(r.message).split("\n")[1] for r in record] == [
        "  'w2': its distribution is _RowShared, not a factorized Normal (FlipoutMessenger "
        "gives per-example noise for sign-symmetric ones such as RadialNormal)."
    ]
    w2 = trace.nodes["w2"]["value"]
    assert not w2.is_deferred and not _per_example(out2)
    assert torch.equal(out2, F.linear(X, w2 * 1.0))


def _shared_bias_model(x):
    w1 = pyro.sample("w1", dist.Normal(LOC1, SCALE1).to_event(2))
    w2 = pyro.sample("w2", dist.Normal(LOC1, SCALE1).to_event(2))
    b = pyro.sample("b", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    return F.linear(x, w1, b), F.linear(x, w2, b)


def test_auto_config_refuses_a_shared_bias_that_got_noise():
    # AutoWeightNoise picks LocalReparam, which gives the bias noise too: a second use of
    # the bias is refused, as with LocalReparam itself.
    for config in (None, LocalReparam()):
        with pytest.raises(ValueError, match=r"^WeightNoiseMessenger: the sample of site 'b' "
                           r"is used a second time \(by linear\) in one run"):
            with WeightNoiseMessenger(config=config):
                _shared_bias_model(X)


@pytest.mark.parametrize("guide_class", [AutoNormal, AutoDiagonalNormal])
def test_config_is_never_asked_about_a_guides_auxiliary_sites(guide_class):
    # Only latent sites are offered to the config: the guide's auxiliary sites
    # (AutoNormal's "w1_unconstrained", AutoDiagonalNormal's "_AutoDiagonalNormal_latent")
    # are not.
    asked = set()

    def config(msg):
        asked.add(msg["name"])
        return AutoWeightNoise()

    guide = guide_class(_model)
    guide(X)
    with WeightNoiseMessenger(config=config, strict=True):
        Trace_ELBO().loss(_model, guide, X)
    assert asked == {"w1", "w2"}


def test_bad_low_rank_is_refused():
    with pytest.raises(TypeError, match="LocalReparam: low_rank must be None or a bool"):
        LocalReparam(low_rank="yes")
    with pytest.raises(TypeError, match="LocalReparam: low_rank must be None or a bool"):
        AutoWeightNoise(low_rank=1.0)
    with pytest.raises(TypeError, match="LocalReparam: conv must be a bool"):
        LocalReparam(conv=1)
    with pytest.raises(TypeError, match="AutoWeightNoise: conv must be a bool"):
        AutoWeightNoise(conv="no")
    with pytest.raises(TypeError, match="LocalReparamMessenger: conv must be a bool"):
        LocalReparamMessenger(conv=None)
    with pytest.raises(TypeError, match="Flipout: conv must be a bool"):
        Flipout(conv=0)
    with pytest.raises(TypeError, match="FlipoutMessenger: conv must be a bool"):
        FlipoutMessenger(conv="no")


IMAGE = torch.randn(1, 2, 5, 5).expand(4, 2, 5, 5)  # four copies of one image
CONV_LOC, CONV_SCALE = torch.randn(3, 2, 3, 3), torch.rand(3, 2, 3, 3) + 0.5


def _conv_model(x):
    # A convolution and a linear layer, both factorized Normal weights.
    w = pyro.sample("conv", dist.Normal(CONV_LOC, CONV_SCALE).to_event(4))
    h = F.conv2d(x, w)
    v = pyro.sample("lin", dist.Normal(LOC1[:, :3], SCALE1[:, :3]).to_event(2))
    return h, F.linear(h.mean((-2, -1)), v)


@pytest.mark.parametrize("handler", [
    lambda: LocalReparamMessenger(conv=False, strict=True),
    lambda: WeightNoiseMessenger(config=LocalReparam(conv=False), strict=True),
    lambda: WeightNoiseMessenger(config=AutoWeightNoise(conv=False), strict=True),
    lambda: FlipoutMessenger(conv=False, strict=True),
    lambda: WeightNoiseMessenger(config=Flipout(conv=False), strict=True),
], ids=["messenger", "strategy", "auto", "flipout messenger", "flipout"])
def test_conv_false_leaves_convolutions_on_the_ordinary_sample(handler):
    # The convolution runs on the drawn weight, one for the batch, and strict=True does
    # not name it; the linear layer after it still gets per-example noise.
    with handler():
        trace = poutine.trace(_conv_model).get_trace(IMAGE)
    h, out = trace.nodes["_RETURN"]["value"]
    w = trace.nodes["conv"]["value"]
    assert_close(h, F.conv2d(IMAGE, torch.as_tensor(w)), rtol=1e-6)
    assert torch.equal(h[0], h[1])
    assert _per_example(out)
    for default in (LocalReparamMessenger, FlipoutMessenger):  # the convolution too
        with default(strict=True):
            h, _ = poutine.trace(_conv_model).get_trace(IMAGE).nodes["_RETURN"]["value"]
        assert _per_example(h)


def test_auto_conv_false_leaves_a_radial_convolution_alone():
    # AutoWeightNoise's conv is both strategies': Flipout's convolution keeps its sample
    def model(x):
        w = pyro.sample("w", RadialNormal(CONV_LOC, CONV_SCALE, event_dim=4))
        return F.conv2d(x, w)

    for conv, per_example in ((False, False), (True, True)):
        with WeightNoiseMessenger(config=AutoWeightNoise(conv=conv), strict=True):
            out = model(IMAGE)
        assert _per_example(out) is per_example


def test_conv_false_allows_a_shared_convolution_weight():
    # Left alone, the drawn weight may be used again (a weight-tied convolution).
    def model(x):
        w = pyro.sample("w", dist.Normal(CONV_LOC[:, :2], CONV_SCALE[:, :2]).to_event(4))
        h = F.conv2d(x, w, padding=1)
        return F.conv2d(h[:, :2], w, padding=1)

    with local_reparam(conv=False, strict=True):
        out = model(IMAGE)
    assert torch.equal(out[0], out[1])
    with pytest.raises(ValueError, match="used a second time"):
        with local_reparam(strict=True):
            model(IMAGE)


@pytest.mark.parametrize("handler", [
    lambda: LocalReparamMessenger(conv=False),
    lambda: FlipoutMessenger(conv=False),
    lambda: WeightNoiseMessenger(config=AutoWeightNoise(conv=False)),
], ids=["local_reparam", "flipout", "auto"])
def test_conv_false_refuses_a_convolution_after_a_noised_use(handler):
    # A linear layer gave the weight per-example noise; a convolution left alone would
    # then run on the ordinary sample: the two uses not jointly exact, refused as for any
    # second use. A convolution first, then the linear layer: both on the ordinary
    # sample (exact), the site named.
    def model(x, conv_first):
        w = pyro.sample("w", dist.Normal(CONV_LOC[:, :1], CONV_SCALE[:, :1]).to_event(4))
        if conv_first:
            c = F.conv2d(x[:, :1], w)
        h = F.linear(x[:, 0, :3, :3].flatten(1), w.reshape(3, 9))
        if not conv_first:
            c = F.conv2d(x[:, :1], w)
        return h, c, w

    with pytest.raises(ValueError, match="'w' is used a second time \\(by conv2d\\)"):
        with handler():
            model(IMAGE, conv_first=False)
    with pytest.warns(UserWarning, match="already used as drawn in this run, by an earlier "
                      "layer call"):
        with handler():
            h, c, w = model(IMAGE, conv_first=True)
    w = torch.as_tensor(w)
    assert_close(h, F.linear(IMAGE[:, 0, :3, :3].flatten(1), w.reshape(3, 9)), rtol=1e-6)
    assert_close(c, F.conv2d(IMAGE[:, :1], w), rtol=1e-6)


@pytest.mark.parametrize("nsp", [1, 2, 3])
@pytest.mark.parametrize("handler", [
    lambda: LocalReparamMessenger(conv=False, strict=True),
    lambda: FlipoutMessenger(conv=False, strict=True),
    lambda: WeightNoiseMessenger(config=AutoWeightNoise(conv=False), strict=True),
    lambda: WeightNoiseMessenger(config={"w": Flipout(conv=False)}, strict=True),
], ids=["local_reparam", "flipout", "auto", "dict"])
def test_conv_false_leaves_transposed_convolutions_alone(handler, nsp):
    # conv=False: a transposed convolution keeps its sample, unreported, like conv2d; its
    # output is the un-handled model's under the same seed (weight and bias).
    op = getattr(F, f"conv_transpose{nsp}d")
    x = torch.randn((4, 2) + (3,) * nsp)

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros((2, 3) + (2,) * nsp), 1.0).to_event(2 + nsp))
        b = pyro.sample("b", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        return op(x, w, b, stride=2)

    pyro.set_rng_seed(0)
    expected = model()
    pyro.set_rng_seed(0)
    with handler():
        out = model()
    assert torch.equal(out, expected)
    # conv=True: reported, naming the op and the way to leave it alone
    with pytest.raises(ValueError) as error:
        with LocalReparamMessenger(strict=True):
            model()
    assert (f"\n  'w': it is used by conv_transpose{nsp}d, which the handler does not treat "
            "(it treats F.linear, F.conv1d/2d/3d and matrix products of an input and a 2-d "
            "weight: matmul, @, mm, addmm, einsum with one contracted index) (conv=False "
            "leaves convolutions, transposed ones too, unreported);\n") in str(error.value)


def test_conv_false_refuses_a_transposed_convolution_after_a_noised_use():
    def model(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, 1, 3), 1.0).to_event(3))
        h = F.linear(x, w.reshape(3, 3))
        return F.conv_transpose1d(h.unsqueeze(-1), w)

    with pytest.raises(ValueError, match="'w' is used a second time \\(by conv_transpose1d\\)"):
        with local_reparam(conv=False):
            model(torch.randn(4, 3))


# ---------------------------------------------------------------- registries


def test_factorized_normal_looks_through_wrappers():
    normal = dist.Normal(LOC1, SCALE1)
    assert factorized_normal(normal) is normal
    assert factorized_normal(normal.to_event(2)) is normal
    assert factorized_normal(normal.mask(False).to_event(1)) is normal
    assert factorized_normal(RadialNormal(LOC1, SCALE1, event_dim=2)) is None
    assert factorized_normal(dist.Laplace(LOC1, SCALE1)) is None


def test_a_radial_normal_of_one_element_is_a_factorized_normal():
    # D = 1: a random sign times a standard Normal radius is a standard Normal, so
    # AutoRadialNormal's sites without event dims (a weight drawn in two plates) are
    # Normal, and the trick applies (it was refused, "not a factorized Normal")
    for event_dim, loc, scale in ((0, LOC1, SCALE1), (2, LOC1[:1, :1], SCALE1[:1, :1])):
        radial = RadialNormal(loc, scale, event_dim=event_dim)
        normal = factorized_normal(radial)
        assert normal is not None and normal.loc is radial.loc and normal.scale is radial.scale
    pyro.set_rng_seed(0)
    draws = RadialNormal(LOC1, SCALE1).sample((20000,))
    assert_close(draws.mean(0), LOC1, atol=6 * SCALE1.max() / 20000 ** 0.5, rtol=0)
    assert_close(draws.std(0), SCALE1, rtol=0.05, atol=0)  # (5 %: about 7 standard errors)

    def model(x):
        with pyro.plate("out", 3, dim=-2), pyro.plate("in", 5, dim=-1):
            w = pyro.sample("w", dist.Normal(0.0, 1.0))
        return F.linear(x, w)

    from pyro_vinit import AutoRadialNormal

    x = torch.randn(1, 5).expand(4, 5)
    guide = AutoRadialNormal(model)
    guide(x)
    with local_reparam(strict=True):
        out = poutine.replay(model, poutine.trace(guide).get_trace(x))(x)
    assert not torch.isclose(out[0], out[1]).any()  # the same row: noise of its own


def test_is_sign_symmetric():
    assert is_sign_symmetric(dist.Normal(LOC1, SCALE1).to_event(2))
    assert is_sign_symmetric(RadialNormal(LOC1, SCALE1, event_dim=2))
    assert not is_sign_symmetric(dist.Gamma(SCALE1, 1.0).to_event(2))


def test_low_rank_scale_of_a_k_tied_matrix():
    u, v = torch.rand(3, 2), torch.rand(5, 2)
    d = KTiedNormal(LOC1, u, v)
    factors = low_rank_scale(d)
    assert factors is not None and factors[0] is u and factors[1] is v
    assert_close(factors[0] @ factors[1].t(), d.scale)
    # a batch of tied matrices, and a plain Normal, have no such one-matrix factors
    batched = KTiedNormal(LOC1.expand(4, 3, 5), u.expand(4, 3, 2), v.expand(4, 5, 2))
    assert low_rank_scale(batched) is None
    assert low_rank_scale(dist.Normal(LOC1, SCALE1)) is None


def test_sites_the_config_leaves_alone_are_not_reported():
    # A weight-like site that never reaches a layer call is named, unless the config leaves
    # it alone.
    def model(x):
        pyro.sample("w3", dist.Normal(LOC1, SCALE1).to_event(2))
        return _model(x)

    with WeightNoiseMessenger(config={"w1": Flipout(), "w2": Flipout()}, strict=True):
        model(X)
    with pytest.raises(ValueError, match="'w3': it never reached a layer call"):
        with WeightNoiseMessenger(strict=True):
            model(X)


def test_auto_weight_noise_keeps_a_point_mass_unreported():
    # an AutoDelta member's weight has no noise to spread: its ordinary sample is exact,
    # and strict=True has nothing to report (it named the site before)
    from pyro.infer.autoguide import AutoDelta, AutoGuideList

    def model(x, y):
        w1 = pyro.sample("w1", dist.Normal(0.0, 1.0).expand([6, 3]).to_event(2))
        w2 = pyro.sample("w2", dist.Normal(0.0, 1.0).expand([2, 6]).to_event(2))
        with pyro.plate("data", len(x)):
            out = F.linear(torch.tanh(F.linear(x, w1)), w2)
            pyro.sample("obs", dist.Normal(out, 1.0).to_event(1), obs=y)

    guide = AutoGuideList(model)
    guide.append(AutoNormal(poutine.block(model, expose=["w1"])))
    guide.append(AutoDelta(poutine.block(model, expose=["w2"])))
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    guide(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with weight_noise(config=AutoWeightNoise(), strict=True):
            loss = Trace_ELBO().differentiable_loss(model, guide, x, y)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("handler", [LocalReparamMessenger, FlipoutMessenger],
                         ids=["local_reparam", "flipout"])
def test_a_point_mass_under_a_named_strategy_is_reported_as_one(handler):
    # an AutoDelta guide under local_reparam() was told that FlipoutMessenger gives
    # per-example noise for sign-symmetric distributions; under flipout(), that Delta is
    # not known to be sign-symmetric
    from pyro.infer.autoguide import AutoDelta

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(F.linear(x, w), 1.0).to_event(1), obs=y)

    def vector(x, y):  # the tutorials' x @ w, a use the handlers do not read as a layer
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(x @ w, 1.0), obs=y[:, 0])

    x, y = torch.randn(5, 3), torch.randn(5, 2)
    for fn in (model, vector):
        guide = AutoDelta(fn)
        guide(x, y)
        with pytest.raises(ValueError) as error:
            with handler(strict=True):
                Trace_ELBO().differentiable_loss(fn, guide, x, y)
        assert ("\n  'w': its distribution is Delta (a point estimate, e.g. an AutoDelta "
                "guide's), which has no noise to give each example: its ordinary sample is "
                "exact (weight_noise()'s automatic choice leaves such sites alone, "
                "unreported).\n") in str(error.value)
        pyro.clear_param_store()


def test_config_names_that_no_site_has_are_reported():
    # A misspelt name would leave its site on the ordinary sample, with no report (the
    # sites the config leaves alone are not named): the name is reported instead, once
    # per handler without strict.
    handler = WeightNoiseMessenger(config={"w1": Flipout(), "w_2": Flipout()})
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run(handler)
        messages = [str(w.message) for w in caught]
        if _ == 0:
            assert messages == [
                "WeightNoiseMessenger: config names ['w_2'], but no sample site of this run "
                "has that name (its latent sites: ['w1', 'w2']); the sites meant keep their "
                "ordinary sample. Use the model's site names."
            ]
        else:
            assert messages == []
    with pytest.raises(ValueError, match=r"config names \['w_2'\], but no sample site"):
        _run(WeightNoiseMessenger(config={"w1": Flipout(), "w_2": Flipout()}, strict=True))
    # None entries and observed sites are not misspellings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(WeightNoiseMessenger(config={"w1": Flipout(), "w2": None, "w_3": None}))


def _biased(x):
    w = pyro.sample("w", dist.Normal(LOC1, SCALE1).to_event(2))
    b = pyro.sample("b", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    return F.linear(x, w, b)


def test_config_names_of_layer_biases_are_reported():
    # a layer takes its weight's strategy: an entry for its bias alone did nothing, without
    # a word (also with strict=True)
    message = ("WeightNoiseMessenger: config names ['b'], the biases of layer calls, whose "
               "strategy is their weights' (['w']): the bias follows it (with its "
               "bias_noise). Name the weights' sites instead.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with WeightNoiseMessenger(config={"b": Flipout()}):
            out = _biased(X)
    assert [str(w.message) for w in caught] == [message]
    assert not _per_example(out)  # the ordinary sample: the entry did nothing
    with pytest.raises(ValueError, match=re.escape(message)):
        with WeightNoiseMessenger(config={"b": Flipout()}, strict=True):
            _biased(X)
    # beside a weight's entry of None (no noise on the weight, meant on the bias) as alone
    with pytest.raises(ValueError, match=re.escape(message)):
        with WeightNoiseMessenger(config={"w": None, "b": Flipout()}, strict=True):
            _biased(X)
    # beside its weight's strategy, the bias follows that one: nothing to report
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with WeightNoiseMessenger(config={"w": Flipout(), "b": Flipout()}, strict=True):
            out = _biased(X)
    assert _per_example(out)


def test_the_reports_of_a_config_are_one_message_line_by_line():
    # a site the named strategy cannot treat and nothing else to report: the report alone;
    # a misspelt name and a bias's name: both, each on its line
    from pyro.infer.autoguide import AutoDelta

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(F.linear(x, w), 1.0).to_event(1), obs=y)

    x, y = torch.randn(5, 3), torch.randn(5, 2)
    guide = AutoDelta(model)
    guide(x, y)
    with pytest.raises(ValueError) as error:
        with WeightNoiseMessenger(config={"w": Flipout()}, strict=True):
            Trace_ELBO().differentiable_loss(model, guide, x, y)
    assert str(error.value).startswith("WeightNoiseMessenger") and "config names" not in str(
        error.value) and not str(error.value).endswith("\n")
    with pytest.raises(ValueError) as error:
        with WeightNoiseMessenger(config={"b": Flipout(), "c": Flipout()}, strict=True):
            _biased(X)
    assert str(error.value) == (
        "WeightNoiseMessenger: config names ['c'], but no sample site of this run has that "
        "name (its latent sites: ['b', 'w']); the sites meant keep their ordinary sample. "
        "Use the model's site names.\n"
        "WeightNoiseMessenger: config names ['b'], the biases of layer calls, whose strategy "
        "is their weights' (['w']): the bias follows it (with its bias_noise). Name the "
        "weights' sites instead.")


def test_config_names_of_a_bias_shared_by_layers_are_reported_for_each_weight_left_out():
    # a bias shared by two layer calls: reported whichever call comes first
    def model(x):
        w1 = pyro.sample("w1", dist.Normal(LOC1, SCALE1).to_event(2))
        w2 = pyro.sample("w2", dist.Normal(LOC1, SCALE1).to_event(2))
        b = pyro.sample("b", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        return F.linear(x, w1, b), F.linear(x, w2, b)

    for named in ("w1", "w2"):
        left = "w2" if named == "w1" else "w1"
        with pytest.raises(ValueError, match=re.escape(
                f"config names ['b'], the biases of layer calls, whose strategy is their "
                f"weights' (['{left}'])")):
            with WeightNoiseMessenger(config={named: Flipout(), "b": Flipout()}, strict=True):
                model(X)
