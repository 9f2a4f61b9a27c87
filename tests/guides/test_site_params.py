import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from pyro.nn import PyroModule, PyroParam
from pyro.optim import Adam
from torch.distributions import biject_to, constraints

from pyro_vinit import AutoKTiedNormal, AutoMeanFieldNormal, AutoRadialNormal, init_guide
from pyro_vinit._pyro_compat import deep_setattr
from pyro_vinit.guides import AutoSiteGuide, site_params
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from tests.common import assert_close


class AutoExpNormal(AutoSiteGuide):
    """A third-party AutoSiteGuide: per-site Normal with scale = exp(log_scale)."""

    def _setup_scales(self):
        self.log_scales = PyroModule()
        for name, event_dim in self._event_dims.items():
            loc = getattr_dotted(self.locs, name)
            value = torch.full_like(loc, math.log(self._init_scale))
            deep_setattr(self.log_scales, name, PyroParam(value, constraints.real, event_dim))

    def _get_loc_and_scale(self, name):
        return getattr_dotted(self.locs, name), getattr_dotted(self.log_scales, name).exp()

    def _set_loc_and_scale(self, name, loc, scale):
        self._write_params([(f"locs.{name}", constraints.real, loc),
                            (f"log_scales.{name}", constraints.real, scale.log())])

    def _unconstrained_posterior(self, name):
        loc, scale = self._get_loc_and_scale(name)
        return dist.Normal(loc, scale).to_event(self._event_dims[name])


def getattr_dotted(module, name):
    for part in name.split("."):
        module = getattr(module, part)
    return module


GUIDES = [AutoNormal, AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoKTiedNormal,
          AutoRadialNormal, AutoMeanFieldNormal, AutoExpNormal]


def make_model(dtype):
    def model():
        pyro.sample("w", dist.Normal(torch.zeros(6, 5, dtype=dtype), 1.0).to_event(2))
        pyro.sample("b", dist.Normal(torch.zeros(6, dtype=dtype), 1.0).to_event(1))
        pyro.sample("noise", dist.HalfNormal(torch.tensor(1.0, dtype=dtype)))
        with pyro.plate("plate", 3):
            pyro.sample("local", dist.Normal(torch.zeros(2, 4, dtype=dtype), 1.0).to_event(2))

    return model


def set_up(Guide, dtype=torch.float32):
    model = make_model(dtype)
    guide = Guide(model)
    guide()
    return model, guide


def random_values(shape, dtype, scale_rank=1):
    """A random loc and a positive scale; a matrix scale has rank ``scale_rank``."""
    loc = torch.randn(shape, dtype=dtype)
    if len(shape) < 2:
        return loc, torch.rand(shape, dtype=dtype) * 0.5 + 0.05
    *batch, m = shape[:-1]
    left = torch.rand(tuple(batch) + (shape[-2], scale_rank), dtype=dtype) + 0.1
    right = torch.rand(tuple(batch) + (shape[-1], scale_rank), dtype=dtype) + 0.1
    return loc, 0.3 * left @ right.transpose(-1, -2) / scale_rank


def state(guide):
    return {k: v.detach().clone() for k, v in guide.state_dict().items()}


def assert_same_state(guide, before):
    after = guide.state_dict()
    assert set(after) == set(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("Guide", GUIDES)
def test_round_trip(Guide, dtype):
    _, guide = set_up(Guide, dtype)
    params = dict(guide.named_parameters())
    tol = dict(atol=0, rtol=2e-5 if dtype == torch.float32 else 1e-10)
    written = {}
    for name in site_params.latent_sites(guide):
        shape = site_params.get_loc_and_scale(guide, name)[0].shape
        # Rank-2 std matrices: exact for every family, AutoKTiedNormal(rank=2) included.
        loc, scale = random_values(shape, dtype, scale_rank=2)
        site_params.set_loc_and_scale(guide, name, loc, scale)
        written[name] = loc, scale
    for name, (loc, scale) in written.items():  # later writes left earlier sites alone
        actual_loc, actual_scale = site_params.get_loc_and_scale(guide, name)
        assert actual_loc.dtype == actual_scale.dtype == dtype
        assert_close(actual_loc, loc, **tol)
        assert_close(actual_scale, scale, **tol)
    # In place: the same parameter objects.
    assert all(p is params[n] for n, p in guide.named_parameters())
    # set(get()) changes nothing.
    before = state(guide)
    for name in written:
        site_params.set_loc_and_scale(guide, name, *site_params.get_loc_and_scale(guide, name))
    for key, value in guide.state_dict().items():
        assert_close(value, before[key], **tol)


@pytest.mark.parametrize("Guide", GUIDES)
def test_written_marginals_by_monte_carlo(Guide):
    # The guide's own draws have the written mean and marginal sd, whatever the family
    # (for the radial family, its RadialNormal draws are heavy-tailed per element).
    model, guide = set_up(Guide, torch.float64)
    loc, scale = random_values((6, 5), torch.float64, scale_rank=1)
    site_params.set_loc_and_scale(guide, "w", loc, scale)
    predictive = Predictive(model, guide=guide, num_samples=4000, return_sites=["w"],
                            parallel=True)
    draws = predictive()["w"]
    z = (draws.reshape(4000, 6, 5) - loc) / scale
    # Pooled over 30 elements: the rms has a standard error below 1 / sqrt(2 * 4000) = 1.1 %.
    assert abs(z.pow(2).mean().sqrt().item() - 1) < 0.04
    # Per element: sd within 12 % (s.e. up to 2.2 % for the radial tails), mean within 5 s.e.
    assert_close(z.std(0), torch.ones(6, 5, dtype=torch.float64), atol=0.12, rtol=0)
    assert z.mean(0).abs().max() < 5 / math.sqrt(4000) * 1.5


@pytest.mark.parametrize("Guide", [AutoKTiedNormal])
def test_k_tied_projects_higher_rank(Guide):
    _, guide = set_up(lambda model: Guide(model, rank=2), torch.float64)
    loc, scale = random_values((6, 5), torch.float64, scale_rank=4)
    site_params.set_loc_and_scale(guide, "w", loc, scale)
    actual_loc, actual_scale = site_params.get_loc_and_scale(guide, "w")
    assert_close(actual_loc, loc, atol=0, rtol=1e-12)
    # Within 1 % of the best rank-2 fit (Eckart-Young), which no positive fit beats.
    best = torch.linalg.svdvals(scale)[2:].norm()
    error = (actual_scale - scale).norm()
    assert best * (1 - 1e-9) <= error < 1.01 * best


def test_low_rank_mvn_keeps_correlations():
    # AutoLowRankMultivariateNormal: the marginal sd is set by the diagonal factor,
    # the correlation matrix (a function of cov_factor alone) is unchanged.
    _, guide = set_up(AutoLowRankMultivariateNormal, torch.float64)
    cov_factor = guide.cov_factor.detach().clone()

    def correlation():
        cov = guide.get_posterior().covariance_matrix
        sd = cov.diagonal().sqrt()
        return cov / sd[:, None] / sd

    before = correlation().detach()
    loc, scale = random_values((6, 5), torch.float64)
    site_params.set_loc_and_scale(guide, "w", loc, scale)
    assert torch.equal(guide.cov_factor.detach(), cov_factor)
    assert_close(correlation().detach(), before, atol=1e-12, rtol=0)
    cov = guide.get_posterior().covariance_matrix.detach()
    assert_close(cov.diagonal()[:30].sqrt().reshape(6, 5), scale, atol=0, rtol=1e-12)


@pytest.mark.parametrize("Guide", GUIDES)
def test_invalid_writes_change_nothing(Guide):
    _, guide = set_up(Guide)
    before = state(guide)
    loc, scale = torch.zeros(6, 5), torch.ones(6, 5)
    bad = [
        (ValueError, "shape", dict(loc=torch.zeros(5, 6))),
        (ValueError, "shape", dict(scale=torch.ones(30))),
        (ValueError, "loc has non-finite", dict(loc=torch.full((6, 5), math.nan))),
        (ValueError, "finite and positive", dict(scale=torch.zeros(6, 5))),
        (ValueError, "finite and positive", dict(scale=-torch.ones(6, 5))),
        (ValueError, "finite and positive", dict(scale=torch.full((6, 5), math.inf))),
        (TypeError, "torch.Tensor", dict(scale=1.0)),
    ]
    for error, match, change in bad:
        values = {"loc": loc, "scale": scale, **change}
        with pytest.raises(error, match=match):
            site_params.set_loc_and_scale(guide, "w", values["loc"], values["scale"])
        assert_same_state(guide, before)
    with pytest.raises(KeyError, match="not a latent site"):
        site_params.set_loc_and_scale(guide, "nope", loc, scale)
    with pytest.raises(KeyError, match="not a latent site"):
        site_params.get_loc_and_scale(guide, "nope")
    assert_same_state(guide, before)


@pytest.mark.parametrize("Guide", GUIDES)
def test_not_set_up(Guide):
    guide = Guide(make_model(torch.float32))
    with pytest.raises(RuntimeError, match="not set up yet"):
        site_params.latent_sites(guide)
    with pytest.raises(RuntimeError, match="not set up yet"):
        site_params.get_loc_and_scale(guide, "w")


@pytest.mark.parametrize("Guide", GUIDES)
def test_constrained_site_is_unconstrained(Guide):
    _, guide = set_up(Guide)
    site_params.set_loc_and_scale(guide, "noise", torch.tensor(0.7), torch.tensor(0.2))
    # median of a positive site = exp(unconstrained loc) (HalfNormal: exp transform)
    assert_close(guide.median()["noise"], biject_to(constraints.positive)(torch.tensor(0.7)),
                 rtol=1e-6, atol=0)


@pytest.mark.parametrize("Guide", GUIDES)
def test_latent_sites_in_model_order(Guide):
    _, guide = set_up(Guide)
    sites = site_params.latent_sites(guide)
    assert list(sites) == ["w", "b", "noise", "local"]
    assert sites["local"]["value"].shape == (3, 2, 4)
    assert site_params.get_loc_and_scale(guide, "local")[0].shape == (3, 2, 4)


@pytest.mark.parametrize("Guide", GUIDES)
def test_rollback_on_error(Guide):
    _, guide = set_up(Guide)
    before = state(guide)
    with pytest.raises(ValueError, match="finite and positive"):
        with site_params.rollback_on_error(guide):
            site_params.set_loc_and_scale(guide, "w", *random_values((6, 5), torch.float32))
            site_params.set_loc_and_scale(guide, "b", torch.zeros(6), torch.zeros(6))
    assert_same_state(guide, before)
    # Any error in the block, after successful writes.
    with pytest.raises(KeyboardInterrupt):
        with site_params.rollback_on_error(guide):
            site_params.set_loc_and_scale(guide, "b", torch.ones(6), torch.ones(6))
            raise KeyboardInterrupt
    assert_same_state(guide, before)
    # Without an error, writes stay.
    with site_params.rollback_on_error(guide):
        site_params.set_loc_and_scale(guide, "b", torch.ones(6), torch.ones(6))
    assert_close(site_params.get_loc_and_scale(guide, "b")[0], torch.ones(6))


@pytest.mark.parametrize("Guide", [AutoDelta, AutoMultivariateNormal])
def test_unsupported(Guide):
    _, guide = set_up(Guide)
    for call in (lambda: site_params.check_supported(guide),
                 lambda: site_params.latent_sites(guide),
                 lambda: site_params.get_loc_and_scale(guide, "w"),
                 lambda: site_params.set_loc_and_scale(guide, "w", torch.zeros(6, 5),
                                                       torch.ones(6, 5))):
        with pytest.raises(TypeError, match=f"{Guide.__name__} is not a supported guide.*"
                                            "AutoNormal.*AutoSiteGuide subclass"):
            call()


def test_writes_keep_optimizer_state():
    # Writing between SVI steps keeps Adam's moments (keyed by parameter identity).
    model, guide = set_up(AutoKTiedNormal)
    optim = Adam({"lr": 0.01})
    svi = SVI(model, guide, optim, Trace_ELBO())
    svi.step()
    states = {name: optim.optim_objs[p].state_dict() for name, p in
              pyro.get_param_store().named_parameters()}
    site_params.set_loc_and_scale(guide, "w", *random_values((6, 5), torch.float32))
    svi.step()
    for name, p in pyro.get_param_store().named_parameters():
        assert p in optim.optim_objs and name in states
        assert optim.optim_objs[p].state_dict()["state"][0]["step"] == 2


def test_third_party_guide_trains_and_initializes():
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    model = BayesianClassifier(bayesianize(mlp((4, 7, 3))))
    guide = AutoExpNormal(model)
    svi = SVI(model, guide, Adam({"lr": 0.01}), Trace_ELBO())
    svi.step(x, y)
    init_guide(guide, method="xavier")
    for name, (d_in, d_out) in {"net.0": (4, 7), "net.2": (7, 3)}.items():
        loc, scale = site_params.get_loc_and_scale(guide, f"{name}.weight")
        assert_close(scale, torch.full_like(scale, math.sqrt(2 / (d_in + d_out))), rtol=1e-6)
        assert_close(loc, torch.zeros_like(loc))
        # independently of the adapter: the guide's own parameter
        log_scale = getattr_dotted(guide.log_scales, f"{name}.weight")
        assert_close(log_scale.exp(), scale)
    assert math.isfinite(svi.step(x, y))


def test_write_params_checks_everything_before_writing():
    # The helper subclasses write with: a bad second value leaves the first unwritten.
    _, guide = set_up(AutoRadialNormal)
    before = state(guide)
    writes = [("locs.w", constraints.real, torch.ones(6, 5)),
              ("scales.w", AutoRadialNormal.scale_constraint, -torch.ones(6, 5))]
    with pytest.raises(ValueError, match="nothing was written"):
        guide._write_params(writes)
    assert_same_state(guide, before)


def test_unsupported_message_names_every_supported_family():
    _, guide = set_up(AutoDelta)
    with pytest.raises(TypeError) as error:
        site_params.check_supported(guide)
    # the user-facing families first, then the registered bases, each once
    assert str(error.value) == (
        "AutoDelta is not a supported guide: reading and writing per-site posteriors "
        "supports AutoNormal, AutoDiagonalNormal, AutoKTiedNormal, AutoRadialNormal, "
        "AutoMeanFieldNormal, AutoLowRankMultivariateNormal, AutoSiteGuide and their "
        "subclasses (a third-party AutoSiteGuide subclass is supported if it implements "
        "get_loc_and_scale and set_loc_and_scale); build the guide with one of these, or "
        "register the class with pyro_vinit.guides.site_params.get_loc_and_scale.register and "
        "set_loc_and_scale.register"
    )


def test_not_set_up_message_says_what_to_do():
    guide = AutoNormal(make_model(torch.float32))
    with pytest.raises(RuntimeError, match=r"^AutoNormal is not set up yet: call the guide once "
                                           r"with the model's arguments \(e\.g\. guide\(x, y\), "
                                           r"or one svi\.step\) first\.$"):
        site_params.latent_sites(guide)


def test_scale_that_underflows_in_the_unconstrained_space_is_refused():
    # AutoLowRankMultivariateNormal stores scale / sqrt(1 + |F_i|^2): a positive float32
    # scale at the bottom of the range underflows to 0, whose softplus inverse is -inf.
    _, guide = set_up(AutoLowRankMultivariateNormal)
    with torch.no_grad():
        # an inflation sqrt(1 + 4 rank) > 2: the smallest float32 scale halves to 0
        guide.cov_factor.fill_(2.0)
    before = state(guide)
    with pytest.raises(ValueError, match=r"^cannot write scale: its unconstrained value is not "
                                         r"finite \(a scale too close to 0 or too large for the "
                                         r"dtype\); nothing was written$"):
        site_params.set_loc_and_scale(guide, "w", torch.zeros(6, 5), torch.full((6, 5), 1e-45))
    assert_same_state(guide, before)


def test_flat_layout_mismatch_is_reported():
    # A Pyro release that laid out AutoContinuous's latent differently must fail loudly.
    _, guide = set_up(AutoDiagonalNormal)
    guide.latent_dim += 1  # the sites hold 30 + 6 + 1 + 3 * 8 = 61 elements
    with pytest.raises(RuntimeError, match=r"^AutoDiagonalNormal: the latent sites' "
                                           r"unconstrained sizes add up to 61, not the guide's "
                                           r"latent_dim 62; this Pyro version lays out "
                                           r"AutoContinuous's latent differently: update "
                                           r"pyro_vinit/guides/site_params\.py$"):
        site_params.get_loc_and_scale(guide, "w")
