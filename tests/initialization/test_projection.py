import math
from operator import attrgetter

import pytest
import torch
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

from pyro_vinit import AutoKTiedNormal, AutoRadialNormal
from pyro_vinit.data import load_digits
from pyro_vinit.initialization.projection import GuideWriter, fit_positive_low_rank
from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp
from tests.common import assert_close


def test_rank_one_matrix_is_fitted_exactly():
    u, v = torch.rand(7, 1) + 0.1, torch.rand(5, 1) + 0.1
    for rank in (1, 2, 3):
        fu, fv = fit_positive_low_rank(u @ v.T, rank)
        assert fu.shape == (7, rank) and fv.shape == (5, rank)
        assert (fu > 0).all() and (fv > 0).all()
        assert_close(fu @ fv.T, u @ v.T, atol=1e-5, rtol=1e-4)


def test_rank_two_beats_rank_one():
    torch.manual_seed(0)
    s = torch.rand(30, 2) @ torch.rand(2, 40) + 0.01
    err = [(s - u @ v.T).norm() for u, v in (fit_positive_low_rank(s, k) for k in (1, 2))]
    best_rank1 = torch.linalg.svdvals(s)[1:].norm()
    assert_close(err[0], best_rank1, rtol=1e-3, atol=1e-5)  # the leading singular pair
    assert err[1] < 0.2 * err[0]


def _guide(cls):
    x, y, _, _ = load_digits()
    guide = cls(BayesianClassifier(bayesianize(mlp((64, 6, 3)))))
    guide(x[:2], y[:2])
    return guide


@pytest.mark.parametrize("cls", [AutoNormal, AutoDiagonalNormal, AutoKTiedNormal,
                                 AutoRadialNormal])
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
    if cls is AutoDiagonalNormal:
        scale = guide.scale[: 6 * 64].reshape(6, 64)
    else:
        scale = attrgetter("net.0.weight")(guide.scales) if cls is AutoNormal else (
            guide.get_loc_and_scale("net.0.weight")[1]
        )
    if cls is AutoRadialNormal:
        # The stored parameter is the marginal sd; the radial scale is sqrt(D) times it.
        assert_close(attrgetter("net.0.weight")(guide.scales), std, atol=1e-5, rtol=1e-4)
        scale = scale / math.sqrt(6 * 64)
    assert_close(scale, std, atol=1e-5, rtol=1e-4)


def test_radial_staged_sample_has_the_projected_marginal_std():
    # I-BLM propagates SiteValues.sample() to the next layer: it must draw from the
    # written radial posterior, whose pooled standardized second moment is r^2 per
    # draw (standard error of the pooled sd ~ 1 / sqrt(2 * 2000) = 1.6 %: 6 %).
    torch.manual_seed(0)
    writer = GuideWriter(_guide(AutoRadialNormal))
    loc = torch.randn(6, 64)
    std = torch.rand(6, 64) + 0.1
    values = writer.project("net.0.weight", loc, std.pow(2))
    z = torch.stack([(values.sample() - loc) / std for _ in range(2000)])
    assert abs(z.pow(2).mean().sqrt().item() - 1) < 0.06


def test_invalid_values_are_rejected():
    guide = _guide(AutoNormal)
    writer = GuideWriter(guide)
    with pytest.raises(ValueError, match="finite and positive"):
        writer.project("net.0.weight", torch.zeros(6, 64), torch.zeros(6, 64))
    with pytest.raises(ValueError, match="shape"):
        writer.project("net.0.weight", torch.zeros(6, 63), torch.ones(6, 63))
