import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F

from pyro_vinit.poutine import (
    FlipoutMessenger,
    LayerCallMessenger,
    LocalReparamMessenger,
    flipout,
    local_reparam,
)
from pyro_vinit.poutine._site_value import SiteValue, Uses, replay
from tests.common import assert_close

_T = torch.Tensor

_FUNCTIONS = ("linear", "conv1d", "conv2d", "conv3d")
HANDLERS = [LayerCallMessenger, LocalReparamMessenger, FlipoutMessenger]


def _model(x):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
    return F.linear(x, w)


@pytest.mark.parametrize("handler", HANDLERS)
def test_functional_identity_restored(handler):
    before = {name: getattr(F, name) for name in _FUNCTIONS}
    with handler():
        _model(torch.randn(2, 4))
    assert {name: getattr(F, name) for name in _FUNCTIONS} == before
    with pytest.raises(KeyError):
        with handler():
            _model(torch.randn(2, 4))
            raise KeyError("inside")
    assert all(getattr(F, name) is fn for name, fn in before.items())
    assert not torch.overrides._is_torch_function_mode_enabled()
    # and a new handler can be entered afterwards
    with handler():
        _model(torch.randn(2, 4))


@pytest.mark.parametrize("outer", HANDLERS)
@pytest.mark.parametrize("inner", HANDLERS)
def test_nesting_raises(outer, inner):
    with outer():
        with pytest.raises(RuntimeError, match="nesting two layer-call handlers"):
            with inner():
                pass
    with inner():  # the failed entry left nothing behind
        _model(torch.randn(2, 4))


def test_handler_functions():
    assert isinstance(local_reparam(), LocalReparamMessenger)
    assert isinstance(flipout(), FlipoutMessenger)
    wrapped = local_reparam(_model, strict=True)
    assert wrapped(torch.randn(5, 4)).shape == (5, 3)
    with pytest.raises(ValueError, match="^3 is not callable, did you mean to pass it as a key"):
        local_reparam(3)
    # the options reach the messenger
    assert local_reparam(low_rank=True).low_rank is True
    assert local_reparam(low_rank=False).low_rank is False
    with pytest.raises(TypeError, match="low_rank"):
        LocalReparamMessenger(low_rank="yes")
    with pytest.raises(TypeError, match="strict"):
        FlipoutMessenger(strict="yes")


def test_site_values_behave_like_tensors():
    with pytest.warns(UserWarning, match="'w': it never reached a layer call"), \
            LocalReparamMessenger():
        w = pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
        assert isinstance(w, SiteValue) and w.is_deferred
        assert w.shape == (3, 4) and w.dtype == torch.float32 and w.dim() == 2
        assert w.is_deferred  # shape queries do not draw
        total = w.sum()
        assert not w.is_deferred and type(total) is torch.Tensor
    torch.testing.assert_close(total, w.concrete.sum())
    assert torch.equal(w + 1, w.concrete + 1)  # still usable after the context
    # Tensor.dist (a p-norm distance) is not shadowed by the handler's own attributes.
    other = torch.randn(3, 4)
    torch.testing.assert_close(w.dist(other), (w.concrete - other).norm())


class _Recorder(LayerCallMessenger):
    def __init__(self):
        super().__init__()
        self.calls = []

    def _process_layer_call(self, call):
        self.calls.append((call.op, call.source, call.weight_name, call.transposed))
        self.canonical = call()
        return None


def test_sees_calls_with_site_values_only():
    # A layer whose weight and bias are plain tensors costs nothing: it is not seen.
    linear = torch.nn.Linear(4, 3)

    def model(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 3, 3, 3), 1.0).to_event(4))
        b = pyro.sample("b", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        h = F.conv2d(x, w, b, stride=2)
        return linear(h.flatten(1)[:, :4])

    class Conv(_Recorder):
        def _process_layer_call(self, call):
            self.calls.append((call.op, call.weight_name, call.bias_name, dict(call.kwargs)))

    with Conv() as rec:
        model(torch.randn(1, 3, 8, 8))
    assert rec.calls == [
        ("conv2d", "w", "b", {"stride": 2, "padding": 0, "dilation": 1, "groups": 1}),
    ]


# ---------------------------------------------------------------- views of a draw


def _stand_in(shape, name="w"):
    value = torch.randn(shape, dtype=torch.float64)
    return value, SiteValue.wrap(value, dist.Normal(torch.zeros(shape), 1.0), [{"name": name}])


VIEWS = {
    "t": lambda w: w.t(),
    "mT": lambda w: w.mT,
    "reshape": lambda w: w.reshape(4, 3),
    "transpose then flatten": lambda w: w.transpose(0, 1).flatten(),
    "slice": lambda w: w[1:, ::2],
    "index and unsqueeze": lambda w: w[0].unsqueeze(0),
    "cast": lambda w: w.float(),
    "expand to the same shape": lambda w: w.expand(3, 4),
}
NOT_VIEWS = {
    "expand": lambda w: w[:1].expand(3, 4),
    "advanced index": lambda w: w[[0, 0]],
    "detach": lambda w: w.detach(),
    "bit view": lambda w: w.view(torch.int64),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_views_replay_on_parameters(name):
    # A view of a draw knows the ops that made it: applied to the drawn value (or to a
    # distribution's parameters) they give the view.
    op = VIEWS[name]
    value, stand_in = _stand_in((3, 4))
    with LayerCallMessenger():
        view = op(stand_in)
    assert isinstance(view, SiteValue) and view.is_view and view.msgs[-1]["name"] == "w"
    assert torch.equal(replay(view.view_ops, value), view.concrete)
    assert torch.equal(view.concrete, op(value))


@pytest.mark.parametrize("name", sorted(NOT_VIEWS))
def test_repeating_or_detaching_ops_are_not_views(name):
    op = NOT_VIEWS[name]
    value, stand_in = _stand_in((3, 4))
    with LayerCallMessenger():
        out = op(stand_in)
    assert isinstance(out, SiteValue) and not out.is_view
    assert torch.equal(out.concrete, op(value))


def test_view_of_deferred_value_stays_deferred():
    with LocalReparamMessenger():
        w = pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
        view = w.t()[1:]
        assert view.is_deferred and w.is_deferred and view.shape == (3, 3)
        assert torch.equal(view.concrete, w.concrete.t()[1:])
        pyro.sample("obs", dist.Normal(F.linear(torch.ones(1, 4), w), 1.0).to_event(2),
                    obs=torch.zeros(1, 3))


def test_uses_see_overlapping_elements():
    uses = Uses(torch.Size([2, 3]))
    rows = [((_T.__getitem__, (i,), {}),) for i in range(2)]
    assert not uses.add(rows[0]) and not uses.add(rows[1])  # disjoint slices
    assert uses.add(rows[0])  # the same elements again
    uses = Uses(torch.Size([2, 3]))
    assert not uses.add(((_T.t, (), {}),))  # all elements, transposed
    assert uses.add(rows[1])


@pytest.mark.parametrize(
    "product",
    [
        lambda x, w: x @ w,
        lambda x, w: torch.matmul(x, w),
        lambda x, w: torch.einsum("bi,io->bo", x, w),
        lambda x, w: torch.addmm(torch.ones(3, dtype=torch.float64), x, w),
    ],
)
def test_matrix_products_are_layer_calls(product):
    # The product is handed over as the equivalent F.linear call, whose output is the
    # product's; the program's result is the product's own (bit for bit).
    x = torch.randn(5, 4, dtype=torch.float64)

    def model():
        loc = torch.zeros(4, 3, dtype=torch.float64)
        return product(x, pyro.sample("w", dist.Normal(loc, 1.0).to_event(2)))

    with _Recorder() as rec, pyro.poutine.trace() as tr:
        out = model()
    w = tr.trace.nodes["w"]["value"].concrete
    assert len(rec.calls) == 1 and rec.calls[0][0] == "linear"
    assert rec.calls[0][2:] == ("w", True)
    assert torch.equal(out, product(x, w))
    assert_close(rec.canonical, out, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "product, source",
    [
        (lambda x, w, b: x @ w, "matmul"),
        (lambda x, w, b: w.__rmatmul__(x), "matmul"),
        (lambda x, w, b: torch.matmul(x, w), "matmul"),
        (lambda x, w, b: x.mm(w), "mm"),
        (lambda x, w, b: torch.einsum("bi,io->bo", x, w), "einsum"),
        (lambda x, w, b: torch.addmm(b, x, w), "addmm"),
        (lambda x, w, b: b.addmm(x, w), "addmm"),
    ],
)
def test_matrix_product_calls_name_their_source_and_sites(product, source):
    # What a handler learns of a product: the function that was called, the weight's
    # and the bias's sites (a bias only through addmm), and that the weight is (in, out).
    x = torch.randn(5, 4, dtype=torch.float64)
    seen = []

    class Sites(_Recorder):
        def _process_layer_call(self, call):
            seen.append((call.source, call.weight_name, call.bias_name, call.transposed))
            return None

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(4, 3, dtype=torch.float64), 1.0)
                        .to_event(2))
        b = pyro.sample("b", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0)
                        .to_event(1))
        return product(x, w, b)

    with Sites():
        model()
    bias = "b" if source == "addmm" else None
    assert seen == [(source, "w", bias, True)]


def test_autonormal_weight_is_traced_through_its_delta():
    # AutoNormal samples the Normal at "w_unconstrained" and puts Delta(value) at "w":
    # the layer call's weight is that Normal's draw, seen through the guide's Delta and
    # the model's replayed site, in that order.
    from pyro.infer import TraceMeanField_ELBO
    from pyro.infer.autoguide import AutoNormal

    seen = []

    class Sites(_Recorder):
        def _process_layer_call(self, call):
            seen.append(([m["name"] for m in call.weight_msgs], call.weight_name))
            return None

    def model(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
        return F.linear(x, w)

    x = torch.randn(5, 4)
    guide = AutoNormal(model)
    guide(x)
    with Sites():
        TraceMeanField_ELBO().differentiable_loss(model, guide, x)
    assert seen == [(["w_unconstrained", "w", "w"], "w")]
    # a Delta whose value is not a draw of the handler (a plain tensor) is not followed
    seen.clear()

    def delta_model(x):
        w = pyro.sample("w", dist.Delta(torch.ones(3, 4)).to_event(2))
        return F.linear(x, w)

    with Sites():
        delta_model(x)
    assert seen == [(["w"], "w")]
