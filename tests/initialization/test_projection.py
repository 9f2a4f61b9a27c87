import pytest
import torch
from pyro.infer.autoguide import AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoNormal

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal
from pyro_vinit.data import load_digits
from pyro_vinit.guides import site_params
from pyro_vinit.initialization.projection import GuideWriter
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from tests.common import assert_close

GUIDES = [AutoNormal, AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoKTiedNormal,
          AutoRadialNormal]


def _guide(cls):
    x, y, _, _ = load_digits()
    guide = cls(BayesianClassifier(bayesianize(mlp((64, 6, 3)))))
    guide(x[:2], y[:2])
    return guide


@pytest.mark.parametrize("cls", GUIDES)
def test_write_in_place(cls):
    guide = _guide(cls)
    writer = GuideWriter(guide)
    params = dict(guide.named_parameters())
    loc = torch.randn(6, 64)
    std = (torch.rand(6, 1) + 0.1) * (torch.rand(1, 64) + 0.1)  # rank 1: every family is exact
    staged = {"net.0.weight": writer.project("net.0.weight", loc, std.pow(2))}
    writer.write(staged)
    assert all(p is params[n] for n, p in guide.named_parameters())
    assert_close(guide.median()["net.0.weight"], loc, atol=1e-6, rtol=1e-6)
    _, scale = site_params.get_loc_and_scale(guide, "net.0.weight")
    assert_close(scale, std, atol=1e-5, rtol=1e-4)


def test_staged_sample_has_the_projected_moments():
    # I-BLM propagates SiteValues.sample() to the next layer: mean loc, sd std
    # (2000 draws: the pooled sd's standard error is ~1 / sqrt(2 * 2000 * 384), 6 % is far out).
    torch.manual_seed(0)
    writer = GuideWriter(_guide(AutoRadialNormal))
    loc = torch.randn(6, 64)
    std = torch.rand(6, 64) + 0.1
    values = writer.project("net.0.weight", loc, std.pow(2))
    z = torch.stack([(values.sample() - loc) / std for _ in range(2000)])
    assert abs(z.pow(2).mean().sqrt().item() - 1) < 0.06
    assert z.mean(0).abs().max() < 0.15  # 5 s.e. of a mean of 2000


def test_invalid_values_are_rejected():
    guide = _guide(AutoNormal)
    writer = GuideWriter(guide)
    with pytest.raises(ValueError, match="finite and positive"):
        writer.project("net.0.weight", torch.zeros(6, 64), torch.zeros(6, 64))
    with pytest.raises(ValueError, match="shape"):
        writer.project("net.0.weight", torch.zeros(6, 63), torch.ones(6, 63))


def test_write_is_all_or_nothing():
    guide = _guide(AutoKTiedNormal)
    writer = GuideWriter(guide)
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    good = writer.project("net.0.weight", torch.randn(6, 64), torch.ones(6, 64))
    bad = writer.project("net.0.bias", torch.zeros(6), torch.ones(6))
    bad.scale = torch.ones(5)  # wrong shape: fails after the first site was written
    with pytest.raises(ValueError, match="shape"):
        writer.write({"net.0.weight": good, "net.0.bias": bad})
    after = guide.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
