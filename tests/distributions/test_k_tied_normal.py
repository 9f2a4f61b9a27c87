import pyro.distributions as dist
import pytest
import torch
from torch.distributions import kl_divergence

from pyro_vinit.distributions import KTiedNormal
from tests.common import assert_close


def _factors(batch, m, n, k):
    return torch.rand(batch + (m, k)) + 0.1, torch.rand(batch + (n, k)) + 0.1


@pytest.mark.parametrize("batch", [(), (3,)])
@pytest.mark.parametrize("matrix_shape", [(4, 5), (4, 2, 3, 3)])
def test_scale_is_u_v_transpose(batch, matrix_shape):
    m, n = matrix_shape[0], torch.Size(matrix_shape[1:]).numel()
    u, v = _factors(batch, m, n, 2)
    loc = torch.randn(batch + matrix_shape)
    d = KTiedNormal(loc, u, v, tied_dims=len(matrix_shape))
    expected = (u @ v.transpose(-1, -2)).reshape(loc.shape)
    assert_close(d.scale, expected)
    assert d.rank == 2 and d.batch_shape == loc.shape
    # Exactly a Normal otherwise.
    normal = dist.Normal(loc, expected)
    x = torch.randn(loc.shape)
    assert_close(d.log_prob(x), normal.log_prob(x))
    prior = dist.Normal(0.0, 1.0).expand(loc.shape)
    assert_close(kl_divergence(d, prior), kl_divergence(normal, prior))


def test_scale_matrix_rank_at_most_k():
    u, v = _factors((), 30, 20, 3)
    d = KTiedNormal(torch.zeros(30, 20), u, v)
    assert torch.linalg.matrix_rank(d.scale) <= 3


def test_expand_keeps_factors():
    u, v = _factors((), 4, 5, 2)
    d = KTiedNormal(torch.zeros(4, 5), u, v).expand([7, 4, 5])
    assert isinstance(d, KTiedNormal) and d.batch_shape == (7, 4, 5)
    assert d.scale_u.shape == (7, 4, 2) and d.scale_v.shape == (7, 5, 2)
    assert_close(d.scale[3], (u @ v.T))


def test_to_event_sample_shape():
    u, v = _factors((), 4, 5, 1)
    d = KTiedNormal(torch.zeros(4, 5), u, v).to_event(2)
    assert d.event_shape == (4, 5) and d.rsample((6,)).shape == (6, 4, 5)


def test_bad_shapes():
    u, v = _factors((), 4, 5, 2)
    with pytest.raises(ValueError, match=r"\(4 x 6\) matrix"):
        KTiedNormal(torch.zeros(4, 6), u, v)
    with pytest.raises(ValueError, match="tied_dims"):
        KTiedNormal(torch.zeros(4, 5), u, v, tied_dims=1)
