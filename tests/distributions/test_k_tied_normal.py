import pyro.distributions as dist
import pytest
import torch
from torch.distributions import kl_divergence

from pyro_vinit.distributions import KTiedIndependent, KTiedNormal, k_tied_normal
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


def _tied(batch, matrix_shape, k, dtype=torch.float64):
    m, n = matrix_shape[0], torch.Size(matrix_shape[1:]).numel()
    u, v = _factors(batch, m, n, k)
    loc = torch.randn(batch + matrix_shape)
    return KTiedNormal(loc.to(dtype), u.to(dtype), v.to(dtype), tied_dims=len(matrix_shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("extra_event_dims", [0, 1])
@pytest.mark.parametrize("batch", [(), (3,)])
@pytest.mark.parametrize("matrix_shape,k", [((6, 5), 1), ((6, 5), 3), ((4, 2, 3, 3), 2)])
def test_low_rank_kl_equals_element_wise_kl(
    matrix_shape, k, batch, extra_event_dims, dtype, monkeypatch
):
    d = _tied(batch, matrix_shape, k, dtype)

    def no_fallback(p, q):  # the module calls kl_divergence only to fall back
        raise AssertionError("fell back to the element-wise KL")

    monkeypatch.setattr(k_tied_normal, "kl_divergence", no_fallback)
    ndims = len(matrix_shape) + (extra_event_dims if batch else 0)
    p = d.to_event(ndims)
    assert isinstance(p, KTiedIndependent)
    # A prior of constant scale per matrix, the usual N(mu0, s^2) weight prior.
    prior_scale = torch.rand(batch + (1,) * len(matrix_shape), dtype=dtype) + 0.2
    prior_loc = 0.1 * torch.randn(batch + matrix_shape, dtype=dtype)
    q = dist.Normal(prior_loc, prior_scale.expand(d.batch_shape)).to_event(ndims)
    reference = dist.Normal(d.loc, d.scale).to_event(ndims)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert_close(kl_divergence(p, q), kl_divergence(reference, q), atol=tol, rtol=tol)
    # ... and so are its gradients with respect to all three parameters.
    params = [d.loc, d.scale_u, d.scale_v]
    for t in params:
        t.requires_grad_(True)
    d = KTiedNormal(*params, tied_dims=len(matrix_shape))
    grads = torch.autograd.grad(kl_divergence(d.to_event(ndims), q).sum(), params)
    d = KTiedNormal(*params, tied_dims=len(matrix_shape))
    expected = torch.autograd.grad(
        kl_divergence(dist.Normal(d.loc, d.scale).to_event(ndims), q).sum(), params
    )
    for g, e in zip(grads, expected):
        assert_close(g, e, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "prior",
    [
        # the scale varies within the matrix: no low-rank sum of S^2 / s^2
        lambda shape: dist.Normal(torch.zeros(shape), torch.rand(shape) + 0.5).to_event(2),
        # fewer event dims than tied dims
        lambda shape: dist.Normal(0.0, 1.0).expand(shape).to_event(1),
        # not a Normal
        lambda shape: dist.Laplace(0.0, 1.0).expand(shape).to_event(2),
    ],
    ids=["varying_scale", "event_dims", "laplace"],
)
def test_kl_falls_back_to_element_wise(prior):
    d = _tied((), (6, 5), 2, torch.float32)
    q = prior(d.batch_shape)
    p = d.to_event(q.reinterpreted_batch_ndims)
    reference = dist.Normal(d.loc, d.scale).to_event(q.reinterpreted_batch_ndims)
    try:
        expected = kl_divergence(reference, q)
    except NotImplementedError:
        with pytest.raises(NotImplementedError):
            kl_divergence(p, q)
        return
    assert_close(kl_divergence(p, q), expected, atol=1e-5, rtol=1e-5)


def test_to_event_and_expand_keep_the_k_tied_independent():
    d = _tied((), (4, 5), 2)
    assert d.to_event(0) is d
    p = d.to_event()
    assert isinstance(p, KTiedIndependent) and p.event_shape == (4, 5)
    expanded = p.expand([3])
    assert isinstance(expanded, KTiedIndependent) and expanded.batch_shape == (3,)
    prior = dist.Normal(0.0, 0.5).expand([3, 4, 5]).to_event(2)
    assert_close(
        kl_divergence(expanded, prior),
        kl_divergence(dist.Normal(d.loc, d.scale).to_event(2), prior).expand(3),
    )


def test_validate_args_is_passed_on():
    # conftest enables validation globally; validate_args=False must still turn it off.
    u, v = _factors((), 4, 5, 2)
    loc = torch.zeros(4, 5)
    with pytest.raises(ValueError, match="scale_u"):
        KTiedNormal(loc, -u, v)
    d = KTiedNormal(loc, -u, v, validate_args=False)
    assert d._validate_args is False


class _Shifted(KTiedNormal):
    """A subclass with its own constructor, as Pyro's expand protocol allows."""

    def __init__(self, loc, scale_u, scale_v, shift, validate_args=None):
        self.shift = shift
        super().__init__(loc + shift, scale_u, scale_v, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(_Shifted, _instance)
        new.shift = self.shift
        return super().expand(batch_shape, _instance=new)


def test_expand_of_a_subclass():
    u, v = _factors((), 4, 5, 2)
    d = _Shifted(torch.zeros(4, 5), u, v, shift=3.0).expand([2, 4, 5])
    assert type(d) is _Shifted and d.shift == 3.0
    assert d.scale_u.shape == (2, 4, 2)
    assert_close(d.loc, torch.full((2, 4, 5), 3.0))


def test_expand_batched_factors():
    d = _tied((3,), (4, 5), 2)
    expanded = d.expand([2, 3, 4, 5])
    assert expanded.scale_u.shape == (2, 3, 4, 2) and expanded.scale_v.shape == (2, 3, 5, 2)
    assert_close(expanded.scale, d.scale.expand(2, 3, 4, 5))
    assert_close(expanded.scale_u[1], d.scale_u)


def test_low_rank_kl_for_a_single_row(monkeypatch):
    # A layer with one output unit: the prior scale is constant over the (size-1)
    # row dim without being expanded along it, which still allows the low-rank KL.
    d = _tied((), (1, 5), 2)

    def no_fallback(p, q):
        raise AssertionError("fell back to the element-wise KL")

    monkeypatch.setattr(k_tied_normal, "kl_divergence", no_fallback)
    prior_scale = torch.tensor([[0.7]], dtype=torch.float64).expand(1, 5)
    assert prior_scale.stride() == (1, 0)
    q = dist.Normal(torch.zeros(1, 5, dtype=torch.float64), prior_scale).to_event(2)
    expected = dist.Normal(d.loc, d.scale).to_event(2)
    assert_close(kl_divergence(d.to_event(2), q), kl_divergence(expected, q), atol=1e-10)
