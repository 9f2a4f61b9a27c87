import functools
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.poutine.indep_messenger import CondIndepStackFrame

from pyro_vinit._pyro_compat import _PREDICTIVE_PLATE
from pyro_vinit.poutine import (
    FlipoutMessenger,
    LayerCallMessenger,
    LocalReparamMessenger,
    flipout,
    local_reparam,
)
from pyro_vinit.poutine._site_value import SiteValue, Uses
from pyro_vinit.poutine._tensor_ops import PIECES, piece, replay
from pyro_vinit.poutine.layer_call_messenger import _check_sample_dims
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
    for handler in (local_reparam, flipout):
        assert handler(conv=False).conv is False and handler().conv is True
        assert handler(strict=True).strict is True and handler().strict is False
    # weight_noise()'s automatic strategy gives convolutions noise too, by default
    from pyro_vinit.poutine import AutoWeightNoise, weight_noise

    assert AutoWeightNoise().conv is True and weight_noise().config.conv is True
    from pyro_vinit.poutine import Flipout, LocalReparam

    assert Flipout().conv is True and LocalReparam().conv is True
    with pytest.raises(TypeError) as error:
        LocalReparamMessenger(low_rank="yes")
    assert str(error.value) == "LocalReparamMessenger: low_rank must be None or a bool, got 'yes'"
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
    # the pieces of a split
    "chunk": lambda w: w.chunk(3, 1)[1],
    "torch.split": lambda w: torch.split(w, [1, 2])[1],
    "tensor_split": lambda w: w.tensor_split(torch.tensor([1]), dim=1)[1],
    "unbind, transposed": lambda w: w.t().unbind()[2],
    "split_with_sizes": lambda w: w.split_with_sizes([2, 2], dim=-1)[1],
    "torch.unsafe_chunk": lambda w: torch.unsafe_chunk(w, 3)[2],
}
NOT_VIEWS = {
    "expand": lambda w: w[:1].expand(3, 4),
    "advanced index": lambda w: w[[0, 0]],
    "detach": lambda w: w.detach(),
    "bit view": lambda w: w.view(torch.int64),
    "bit view, keyword": lambda w: w.view(dtype=torch.int64),
    "slice, tensor bound": lambda w: w[torch.tensor(1):],
    "slice, tensor step": lambda w: w[:, ::torch.tensor(2)],
    "expand, then chunk": lambda w: w[:1].expand(3, 4).chunk(3)[1],
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


def test_pieces_of_a_deferred_value_stay_deferred_and_split_the_draw_once(monkeypatch):
    # w.unbind() of a fused weight's rows: one split of the draw for all its pieces (a
    # split per piece cost time quadratic in their number)
    calls = []

    def unbind(tensor, *args, **kwargs):  # torch.Tensor.unbind, counting real splits
        calls.append(tensor.device.type)
        return torch.Tensor.unbind(tensor, *args, **kwargs)

    monkeypatch.setitem(PIECES, unbind, functools.partial(piece, unbind))
    with LocalReparamMessenger():
        w = pyro.sample("w", dist.Normal(torch.zeros(6, 4), 1.0).to_event(2))
        rows = w.pieces(unbind, (), {})
        assert len(rows) == 6 and all(r.is_deferred and r.shape == (4,) for r in rows)
        assert w.is_deferred and calls == ["meta"]  # (counted on a stand-in)
        drawn = [r.concrete for r in rows]
        assert calls == ["meta", "cpu"]  # (the draw's split, once, for the six)
        assert torch.equal(torch.stack(drawn), w.concrete)
        assert torch.equal(replay(rows[1].view_ops, w.concrete), w.concrete[1])
        # a split with arguments, drawn with them
        v = pyro.sample("v", dist.Normal(torch.zeros(6, 4), 1.0).to_event(2))
        pieces = v.pieces(torch.Tensor.split, ([1, 3],), {"dim": -1})
        assert [p.shape for p in pieces] == [(6, 1), (6, 3)] and pieces[1].is_deferred
        assert torch.equal(pieces[1].concrete, v.concrete[:, 1:])


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


def _sources_seen(model, *args):
    seen = []

    class Sources(_Recorder):
        def _process_layer_call(self, call):
            seen.append((call.op, call.source, call.weight_name))
            return None

    with Sources():
        model(*args)
    return seen


def test_layer_function_calls_name_their_source():
    def model(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 3, 3), 1.0).to_event(3))
        v = pyro.sample("v", dist.Normal(torch.zeros(4, 2), 1.0).to_event(2))
        h = F.conv1d(x, w, padding=1).mean(-1)
        return F.linear(input=h, weight=v)

    assert _sources_seen(model, torch.randn(5, 3, 6)) == [
        ("conv1d", "conv1d", "w"), ("linear", "linear", "v"),
    ]


def _w(shape, name="w"):
    return pyro.sample(name, dist.Normal(torch.zeros(shape), 1.0).to_event(len(shape)))


# Uses of a weight that are not layer calls the handlers treat: (use, reported op name).
CUSTOM_USES = {
    "batched weight": (lambda x: x.unsqueeze(0) @ _w((2, 4, 3)), "matmul"),
    "weight on the left": (lambda x: _w((3, 5)) @ x, "matmul"),
    "rmatmul, batched": (lambda x: _w((2, 4, 3)).__rmatmul__(x), "matmul"),
    "bmm": (lambda x: torch.bmm(x.expand(2, 5, 4), _w((2, 4, 3))), "bmm"),
    "einsum of three, in a list": (
        lambda x: torch.einsum("bi,ij,jk->bk", [x, _w((4, 3)), torch.ones(3, 2)]), "einsum"),
    "einsum of three": (
        lambda x: torch.einsum("bi,ij,jk->bk", x, _w((4, 3)), torch.ones(3, 2)), "einsum"),
    "bilinear": (lambda x: F.bilinear(x, x, _w((2, 4, 4))), "bilinear"),
}


@pytest.mark.parametrize("use", sorted(CUSTOM_USES))
def test_custom_uses_are_reported_by_their_name(use):
    fn, name = CUSTOM_USES[use]
    x = torch.randn(5, 4)
    with pytest.raises(ValueError) as error:
        with LocalReparamMessenger(strict=True):
            fn(x)
    # a product the handler reads elsewhere is named as one it does not read in this form
    # (the message had listed matmul and einsum as treated, and bmm and mv, which are not)
    products = ("matmul", "mm", "addmm", "einsum")
    reason = (f"it is used by {name} in a form the handler does not read as a layer (it "
              "reads a product of an input and a 2-d weight over one contracted index: not a "
              "weight of one dimension, one with a batch dim such as vectorized particles' "
              "leading one, or a product of three)" if name in products else
              f"it is used by {name}, which the handler does not treat (it treats F.linear, "
              "F.conv1d/2d/3d and matrix products of an input and a 2-d weight: matmul, @, "
              "mm, addmm, einsum with one contracted index)")
    assert f"\n  'w': {reason}.\n" in str(error.value)
    # the program's own result, with the drawn value
    with pyro.poutine.trace() as tr, pytest.warns(UserWarning, match="used by " + name):
        with LocalReparamMessenger():
            out = fn(x)
    w = tr.trace.nodes["w"]["value"] * 1.0
    with pyro.poutine.condition(data={"w": w}):
        assert torch.equal(out, fn(x))


@pytest.mark.parametrize("use", ["x @ w", "torch.matmul", "torch.mv"])
def test_a_weight_of_one_dimension_is_reported_with_the_shape_to_give(use):
    # the tutorials' regression x @ w with w of shape (in,)
    x = torch.randn(5, 4)
    fn = {"x @ w": lambda w: x @ w, "torch.matmul": lambda w: torch.matmul(x, w),
          "torch.mv": lambda w: torch.mv(x, w)}[use]
    with pytest.raises(ValueError) as error:
        with LocalReparamMessenger(strict=True):
            fn(_w((4,)))
    name = "mv" if use == "torch.mv" else "matmul"
    if name == "mv":  # no product the handler reads in any form
        assert "'w': it is used by mv, which the handler does not treat" in str(error.value)
        return
    assert ("\n  'w': it is used by matmul as a vector, which the handler does not read as "
            "a layer: a matrix weight, e.g. of shape (in, 1) in x @ w, its output squeezed "
            "(.squeeze(-1)), gives the same values as a layer it treats.\n") in str(error.value)
    # a latent bias of addmm is no 1-d weight: the general reason
    with pytest.raises(ValueError) as error:
        with LocalReparamMessenger(strict=True):
            torch.addmm(_w((3,)), x, torch.randn(4, 3))
    assert "'w': it is used by addmm in a form the handler does not read" in str(error.value)


@pytest.mark.parametrize("plated", [True, False], ids=["in a plate", "batch dims"])
def test_a_weight_with_batch_dims_of_the_models_own_is_no_layer(plated):
    # one matrix per head, in a plate of the model's own or as the prior's batch dims: the
    # program's batched product (only vectorized samples' leading dims make a layer of it)
    x = torch.randn(5, 3)

    def model():
        if plated:
            with pyro.plate("heads", 2):
                w = pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2))
        else:
            w = pyro.sample("w", dist.Normal(torch.zeros(2, 3, 4), 1.0).to_event(2))
        return x @ w

    with pytest.raises(ValueError, match=r"'w': it is used by matmul in a form the handler "
                       r"does not read as a layer"):
        with LocalReparamMessenger(strict=True):
            model()


def test_weight_in_a_list_of_operands_is_reported():
    # An einsum whose operands come as one list (of other than two) is not a layer: each
    # site value in the list is reported.
    x = torch.randn(5, 4)

    def model():
        return torch.einsum("bi,ij,jk->bk", [x, _w((4, 3)), _w((3, 2), "v")])

    with pytest.raises(ValueError) as error:
        with LocalReparamMessenger(strict=True):
            model()
    assert "2 latent site(s)" in str(error.value)
    assert "'w': it is used by einsum" in str(error.value)
    assert "'v': it is used by einsum" in str(error.value)


@pytest.mark.parametrize("handler", HANDLERS)
def test_discrete_site_values_are_left_alone(handler):
    # Only floating-point values become stand-ins: integer draws index and count as usual.
    table = torch.randn(4, 3)

    def model():
        k = pyro.sample("k", dist.Categorical(logits=torch.zeros(5, 4)).to_event(1))
        return k, table[k]

    with handler():
        k, rows = model()
    assert type(k) is torch.Tensor and k.dtype == torch.int64
    assert type(rows) is torch.Tensor and torch.equal(rows, table[k])


def test_process_layer_call_may_run_the_call_on_site_values():
    # A subclass that computes with the call's own site values inside the hook is not
    # handed its own layer call again.
    seen = []

    class Doubling(LayerCallMessenger):
        def _process_layer_call(self, call):
            seen.append(call.weight_name)
            return 2 * F.linear(call.input, call.weight, call.bias)

    x = torch.randn(5, 4)
    with pyro.poutine.trace() as tr, Doubling():
        out = _model(x)
    assert seen == ["w"]
    assert torch.equal(out, 2 * F.linear(x, tr.trace.nodes["w"]["value"] * 1.0))
    # and a later layer call is seen again
    with Doubling():
        _model(x)
    assert seen == ["w", "w"]


@pytest.mark.parametrize("handler", HANDLERS)
def test_invalid_matrix_products_fail_as_without_the_handler(handler):
    # torch.mm takes matrices only; under a handler it must not become an F.linear that
    # runs on a batch.
    x = torch.randn(2, 5, 4)

    def model():
        return torch.mm(x, pyro.sample("w", dist.Normal(torch.zeros(4, 3), 1.0).to_event(2)))

    with pytest.raises(RuntimeError, match="self must be a matrix"):
        model()
    with pytest.raises(RuntimeError, match="self must be a matrix"), handler():
        model()


PLAIN_WITH_SITE_ARGUMENT = {
    "to": lambda x, w: x.to(w),
    "expand_as": lambda x, w: x[:1].expand_as(w),
    "view_as": lambda x, w: x.view_as(w),
    "reshape_as": lambda x, w: x.reshape_as(w),
    "keyword input": lambda x, w: torch.reshape(input=w, shape=(12,)),
}


@pytest.mark.parametrize("use", sorted(PLAIN_WITH_SITE_ARGUMENT))
@pytest.mark.parametrize("handler", HANDLERS)
def test_view_ops_with_a_site_value_as_argument(handler, use):
    # A plain tensor shaped or cast like a weight (x.to(w), b.expand_as(w)) is not a view
    # of the draw: the op runs as usual.
    fn = PLAIN_WITH_SITE_ARGUMENT[use]
    x = torch.randn(3, 4, dtype=torch.float64)

    def model():
        return fn(x, pyro.sample("w", dist.Normal(torch.zeros(3, 4), 1.0).to_event(2)))

    with pyro.poutine.trace() as tr, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused weight's report
        with handler():
            out = model()
    w = tr.trace.nodes["w"]["value"] * 1.0
    assert torch.equal(out * 1, fn(x, w))


@pytest.mark.parametrize("view", [
    lambda w: w.to(dtype=torch.float64),
    lambda w: w.double().transpose(dim0=0, dim1=1).T,
    lambda w: w.reshape(shape=(12,)).double().reshape(3, 4),
])
def test_views_with_keyword_arguments(view):
    # The ops' keyword arguments are part of the view: LRT then applies to the float64
    # view, with the drawn value's mean.
    x = torch.randn(1000, 4, dtype=torch.float64)
    loc = torch.randn(3, 4)

    def model():
        return F.linear(x, view(pyro.sample("w", dist.Normal(loc, 0.1).to_event(2))))

    with local_reparam(strict=True):
        out = model()
    assert out.dtype == torch.float64 and out.shape == (1000, 3)
    assert_close(out.mean(0), (x @ loc.double().T).mean(0), atol=0.05, rtol=0)


@pytest.mark.parametrize("batch, refused", [((3, 4), False), ((1, 3, 4), False),
                                            ((1, 1, 3, 4), False), ((2, 3, 4), True),
                                            ((1, 2, 3, 4), True)])
def test_check_sample_dims_refuses_a_dim_left_of_the_samples_plate_unless_a_singleton(
        batch, refused):
    # the samples' plate at dim -2 (size 3): the site's batch dims left of it must be 1s
    msg = {"name": "obs", "fn": dist.Normal(torch.zeros(batch), 1.0),
           "cond_indep_stack": (CondIndepStackFrame("data", -1, 4, 0),
                                CondIndepStackFrame(_PREDICTIVE_PLATE, -2, 3, 0))}
    if refused:
        with pytest.raises(ValueError, match=r"the site 'obs' has batch shape .* dims left "
                                             r"of the plate of the vectorized samples"):
            _check_sample_dims(msg)
    else:
        _check_sample_dims(msg)
