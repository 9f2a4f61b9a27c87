import _thread
import gc
import threading
import weakref

import pyro.distributions as dist
import pytest
import torch

from pyro_vinit.poutine import LayerCallMessenger
from pyro_vinit.poutine._site_value import (
    ACTIVE,
    SiteValue,
    Uses,
    _meta_result,
    _placeholder,
    eager,
    from_the_model,
    unwrap,
)
from pyro_vinit.poutine._tensor_ops import getter, is_transpose, replay

_T = torch.Tensor


def _deferred(value, calls=None, name="w", dtype=None):
    # A deferred stand-in whose thunk returns ``value`` and counts its calls.
    calls = [] if calls is None else calls

    def thunk():
        calls.append(1)
        return value

    normal = dist.Normal(torch.zeros(value.shape), 1.0)
    return SiteValue.defer(thunk, value.shape, like=value, dist=normal, msgs=[{"name": name}],
                           dtype=dtype)


def _wrapped(value, name="w"):
    return SiteValue.wrap(value, dist.Normal(torch.zeros(value.shape), 1.0), [{"name": name}])


# ---------------------------------------------------------------- helpers


def test_getter_is_the_attribute_descriptor_read():
    t = torch.randn(2, 3, dtype=torch.float64)
    assert getter("shape")(t) == (2, 3)
    assert getter("dtype")(t) is torch.float64
    assert torch.equal(getter("T")(t), t.T)


def test_eager_keeps_the_function():
    def fn(x, y=1):
        return x * 10 + y

    assert eager(fn)(2, y=3) == 23


def test_placeholder_is_a_storage_free_zero():
    p = _placeholder(torch.Size([2, 3]), torch.float64, torch.device("cpu"))
    assert p.shape == (2, 3) and p.dtype == torch.float64 and p.device.type == "cpu"
    assert p.stride() == (0, 0)  # one element, expanded
    assert torch.equal(p, torch.zeros(2, 3, dtype=torch.float64))


def test_unwrap_replaces_stand_ins_in_nested_containers():
    a, b = torch.randn(2), torch.randn(3)
    calls = []
    nested = (_wrapped(a), [1, {"k": _deferred(b, calls), "s": "text"}], None)
    out = unwrap(nested)
    assert calls == [1]  # the deferred value was drawn
    assert type(out) is tuple and type(out[1]) is list and type(out[1][1]) is dict
    assert type(out[0]) is torch.Tensor and out[0] is a
    assert out[1][1]["k"] is b and out[1][1]["s"] == "text"
    assert out[1][0] == 1 and out[2] is None


def test_replay_applies_ops_in_order_with_their_arguments():
    t = torch.arange(6.0).reshape(2, 3)
    ops = (
        (_T.transpose, (0, 1), {}),
        (_T.reshape, ((2, 3),), {}),
        (_T.to, (), {"dtype": torch.int64}),
    )
    out = replay(ops, t)
    assert torch.equal(out, t.transpose(0, 1).reshape(2, 3).to(dtype=torch.int64))
    assert replay((), t) is t


# ---------------------------------------------------------------- Uses


def _rows(i):
    return ((_T.__getitem__, (i,), {}),)


def test_uses_whole_draw():
    uses = Uses(torch.Size([2, 3]))
    assert not uses.add(None)  # first use of all elements
    assert uses.add(None)  # and again
    assert uses.add(_rows(0))  # any part of a draw used whole was used


def test_uses_used_after_a_partial_use():
    uses = Uses(torch.Size([2, 3]))
    assert not uses.used()
    uses.add(_rows(1))
    assert uses.used() and not uses.whole  # (a part: the mask's)


def test_uses_part_then_whole():
    uses = Uses(torch.Size([2, 3]))
    assert not uses.add(_rows(1))
    assert torch.equal(uses.mask, torch.tensor([False, False, False, True, True, True]))
    assert uses.add(None)


def test_uses_empty_view_ops_are_the_whole_draw():
    uses = Uses(torch.Size([2, 3]))
    assert not uses.add(())
    assert uses.add(_rows(0))


@pytest.mark.parametrize(
    "first, second, overlap",
    [
        ("rows 0", "rows 1", False),
        ("columns :2", "columns 1:", True),
        ("columns :2", "columns 2:", False),
        ("row 0, cast", "row 0", True),  # a cast keeps the elements
        ("row 0, cast", "row 1, cast", False),
        ("transposed column 0", "row 0", True),  # the same elements, seen transposed
        ("transposed column 0", "row 1", False),
        ("flattened head", "row 0", True),
        ("flattened head", "row 1", False),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_uses_overlapping_elements(first, second, overlap):
    ops = {
        "rows 0": _rows(0),
        "rows 1": _rows(1),
        "row 0": _rows(0),
        "row 1": _rows(1),
        "columns :2": ((_T.__getitem__, ((slice(None), slice(None, 2)),), {}),),
        "columns 1:": ((_T.__getitem__, ((slice(None), slice(1, None)),), {}),),
        "columns 2:": ((_T.__getitem__, ((slice(None), slice(2, None)),), {}),),
        "row 0, cast": (_rows(0)[0], (_T.double, (), {})),
        "row 1, cast": ((_T.to, (torch.float64,), {}), _rows(1)[0]),
        "transposed column 0": ((_T.t, (), {}), (_T.__getitem__, ((slice(None), 0),), {})),
        "flattened head": ((_T.flatten, (), {}), (_T.narrow, (0, 0, 3), {})),
    }
    uses = Uses(torch.Size([2, 3]))
    assert not uses.add(ops[first])
    assert uses.add(ops[second]) is overlap


def test_uses_all_elements_through_views_are_the_whole_draw():
    # a permutation of every element (a transpose, a cast) uses the whole draw
    for ops in [((_T.t, (), {}),), ((_T.float, (), {}),), ((_T.reshape, (6,), {}),)]:
        uses = Uses(torch.Size([2, 3]))
        assert not uses.add(ops)
        assert uses.whole and uses.mask is None


# ---------------------------------------------------------------- stand-ins


def test_wrap():
    value = torch.randn(2, 3, requires_grad=True)
    d = dist.Normal(torch.zeros(2, 3), 1.0)
    msgs = [{"name": "a"}, {"name": "b"}]
    w = SiteValue.wrap(value, d, msgs)
    assert not w.is_deferred and w.concrete is value
    assert w.site_dist is d and w.msgs is msgs and w.site == "b"
    assert w.view_ops == () and w.derived is None and w.is_view
    assert w.uses.shape == (2, 3) and not w.uses.whole
    assert w.data_ptr() == value.data_ptr()  # shares the storage
    # given view_ops, derived and uses are kept
    uses = Uses(torch.Size([3, 2]))
    ops = ((_T.t, (), {}),)
    v = SiteValue.wrap(value.t(), d, msgs, ops, "expand", uses)
    assert v.view_ops is ops and v.derived == "expand" and not v.is_view and v.uses is uses


def test_site_without_messages():
    assert SiteValue.wrap(torch.randn(2), None, []).site is None


def test_defer_does_not_draw_until_used():
    value = torch.randn(3, 4)
    calls = []
    w = _deferred(value, calls)
    assert w.is_deferred and calls == []
    assert w.site == "w" and w.view_ops == () and w.derived is None
    assert w.uses.shape == (3, 4)
    assert torch.equal(w * 2, value * 2) and calls == [1]
    assert not w.is_deferred and w.concrete is value
    assert torch.equal(w + 1, value + 1) and calls == [1]  # drawn once


def test_defer_releases_the_thunk_after_drawing():
    def thunk_holding(held):
        return lambda: held * 1

    held = torch.randn(3)
    ref = weakref.ref(held)
    w = SiteValue.defer(thunk_holding(held), torch.Size([3]), like=torch.zeros(1))
    del held
    gc.collect()
    assert ref() is not None  # kept by the thunk until the draw
    assert torch.equal(w.concrete, w.concrete * 1)
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("dtype", [None, torch.float64], ids=["like's dtype", "given dtype"])
def test_defer_shape_dtype_and_default_messages(dtype):
    like = torch.zeros(1, dtype=torch.float32)
    w = SiteValue.defer(lambda: torch.zeros(2, 5), torch.Size([2, 5]), like=like, dtype=dtype)
    assert w.shape == (2, 5) and w.dtype == (dtype or torch.float32)
    assert w.msgs == [] and w.site is None and w.site_dist is None
    assert w.is_deferred


def test_deferred_value_is_unwrapped():
    # a thunk may return another stand-in: the value is its plain tensor
    value = torch.randn(2)
    w = SiteValue.defer(lambda: _wrapped(value), torch.Size([2]), like=value)
    assert type(w.concrete) is torch.Tensor and w.concrete is value


@pytest.mark.parametrize("grad", [True, False], ids=["grad enabled", "no grad"])
@pytest.mark.parametrize("later", [True, False], ids=["drawn with grad", "drawn without"])
def test_deferred_value_is_drawn_in_the_grad_mode_of_deferral(grad, later):
    loc = torch.zeros(3, requires_grad=True)
    modes = []

    def thunk():
        modes.append(torch.is_grad_enabled())
        return loc + 1

    with torch.set_grad_enabled(grad):
        w = SiteValue.defer(thunk, torch.Size([3]), like=loc)
    with torch.set_grad_enabled(later):
        value = w.concrete
    assert modes == [grad] and value.requires_grad is grad
    assert torch.is_grad_enabled()  # restored


METADATA = {
    "shape": lambda w: w.shape,
    "dtype": lambda w: w.dtype,
    "device": lambda w: w.device,
    "ndim": lambda w: w.ndim,
    "layout": lambda w: w.layout,
    "is_cuda": lambda w: w.is_cuda,
    "is_nested": lambda w: w.is_nested,
    "is_sparse": lambda w: w.is_sparse,
    "is_quantized": lambda w: w.is_quantized,
    "is_meta": lambda w: w.is_meta,
    "dim": lambda w: w.dim(),
    "size": lambda w: w.size(),
    "size(1)": lambda w: w.size(1),
    "numel": lambda w: w.numel(),
    "nelement": lambda w: w.nelement(),
    "ndimension": lambda w: w.ndimension(),
    "len": len,
    "is_floating_point": lambda w: w.is_floating_point(),
    "is_complex": lambda w: w.is_complex(),
    "element_size": lambda w: w.element_size(),
    "get_device": lambda w: w.get_device(),
    "zeros_like": torch.zeros_like,
    "ones_like": torch.ones_like,
    "empty_like": lambda w: torch.empty_like(w).shape,
    "full_like": lambda w: torch.full_like(w, 2.5),
}


@pytest.mark.parametrize("query", sorted(METADATA))
def test_metadata_queries_do_not_draw(query):
    value = torch.randn(3, 4, dtype=torch.float64)
    calls = []
    w = _deferred(value, calls)
    out = METADATA[query](w)
    assert calls == [] and w.is_deferred
    expected = METADATA[query](value)
    if isinstance(out, torch.Tensor):
        assert type(out) is torch.Tensor and torch.equal(out, expected)
    else:
        assert out == expected


def test_grad_of_deferred_and_drawn_values():
    value = torch.randn(3, requires_grad=True)
    value.sum().backward()
    w = _deferred(value)
    assert w.grad is None and w.is_deferred  # e.g. torch.compile's hasattr(t, "grad")
    assert w.concrete is value
    assert torch.equal(w.grad, torch.ones(3))
    assert torch.equal(_wrapped(value).grad, torch.ones(3))


def test_operations_run_on_the_value():
    value, other = torch.randn(3, 4), torch.randn(3, 4)
    w = _wrapped(value)
    out = torch.add(other, other=w, alpha=2)  # stand-ins as keyword arguments too
    assert type(out) is torch.Tensor and torch.equal(out, torch.add(other, value, alpha=2))
    assert torch.equal(torch.stack([w, other]), torch.stack([value, other]))


class _Seeing:
    # A stand-in for the active handler: it sees each op, answers some.
    def __init__(self, answer):
        self.answer, self.seen = answer, []

    def _site_value_op(self, func, args, kwargs):
        self.seen.append((func, kwargs))
        return self.answer


@pytest.mark.parametrize("answer", ["handled", NotImplemented], ids=["answered", "declined"])
def test_active_handler_sees_operations(answer):
    value = torch.randn(3)
    w = _wrapped(value)
    handler = _Seeing(answer)
    ACTIVE.append(handler)
    try:
        out = torch.mul(w, other=2.0)
        assert w.shape == (3,)  # metadata is not handed over
    finally:
        ACTIVE.remove(handler)
    assert handler.seen == [(torch.mul, {"other": 2.0})]
    if answer is NotImplemented:
        assert torch.equal(out, value * 2)  # run as usual
    else:
        assert out == "handled"


# ---------------------------------------------------------------- views and derive


def _derive(w, op):
    with LayerCallMessenger():
        return op(w)


VIEW_SPELLINGS = {
    "t": (lambda w: w.t(), (3, 2)),
    "torch.t": (lambda w: torch.t(w), (3, 2)),
    "T": (lambda w: w.T, (3, 2)),
    "mT": (lambda w: w.mT, (3, 2)),
    "transpose": (lambda w: w.transpose(0, 1), (3, 2)),
    "torch.transpose": (lambda w: torch.transpose(w, 0, 1), (3, 2)),
    "permute": (lambda w: w.permute(1, 0), (3, 2)),
    "torch.permute": (lambda w: torch.permute(w, (1, 0)), (3, 2)),
    "swapaxes": (lambda w: w.swapaxes(0, 1), (3, 2)),
    "torch.swapaxes": (lambda w: torch.swapaxes(w, 0, 1), (3, 2)),
    "movedim": (lambda w: w.movedim(0, 1), (3, 2)),
    "torch.movedim": (lambda w: torch.movedim(w, 0, 1), (3, 2)),
    "reshape": (lambda w: w.reshape(6), (6,)),
    "torch.reshape": (lambda w: torch.reshape(w, (3, 2)), (3, 2)),
    "view": (lambda w: w.view(3, 2), (3, 2)),
    "view_as": (lambda w: w.view_as(torch.zeros(6)), (6,)),
    "reshape_as": (lambda w: w.reshape_as(torch.zeros(1, 6)), (1, 6)),
    "flatten": (lambda w: w.flatten(), (6,)),
    "torch.flatten": (lambda w: torch.flatten(w), (6,)),
    "unflatten": (lambda w: w.unflatten(1, (3, 1)), (2, 3, 1)),
    "squeeze": (lambda w: w.squeeze(), (2, 3)),  # nothing to squeeze: still a view
    "torch.squeeze": (lambda w: torch.squeeze(w, 0), (2, 3)),
    "unsqueeze": (lambda w: w.unsqueeze(0), (1, 2, 3)),
    "torch.unsqueeze": (lambda w: torch.unsqueeze(w, -1), (2, 3, 1)),
    "contiguous": (lambda w: w.contiguous(), (2, 3)),
    "clone": (lambda w: w.clone(), (2, 3)),
    "torch.clone": (lambda w: torch.clone(w), (2, 3)),
    "narrow": (lambda w: w.narrow(1, 1, 2), (2, 2)),
    "torch.narrow": (lambda w: torch.narrow(w, 0, 1, 1), (1, 3)),
    "basic index": (lambda w: w[None, ..., 1:, -1], (1, 1)),
    "to dtype": (lambda w: w.to(torch.float32), (2, 3)),
    "float": (lambda w: w.float(), (2, 3)),
    "double": (lambda w: w.double(), (2, 3)),
    "half": (lambda w: w.half(), (2, 3)),
    "bfloat16": (lambda w: w.bfloat16(), (2, 3)),
    "type": (lambda w: w.type(torch.float32), (2, 3)),
    "expand to the same shape": (lambda w: w.expand(2, 3), (2, 3)),
    # keyword arguments are part of the op, for the deferred draw too
    "reshape with keyword": (lambda w: w.reshape(shape=(3, 2)), (3, 2)),
    "transpose with keywords": (lambda w: w.transpose(dim0=1, dim1=0), (3, 2)),
    "to with keyword": (lambda w: w.to(dtype=torch.float32), (2, 3)),
    "expand_as the same shape": (lambda w: w.expand_as(torch.zeros(2, 3)), (2, 3)),
}


@pytest.mark.parametrize("spelling", sorted(VIEW_SPELLINGS))
def test_deferred_views_stay_deferred(spelling):
    # The view's shape and dtype come from a meta tensor; its value is the view of the
    # draw, drawn once for the view and the drawn value.
    op, shape = VIEW_SPELLINGS[spelling]
    value = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)
    calls = []
    w = _deferred(value, calls)
    view = _derive(w, op)
    assert isinstance(view, SiteValue) and view.is_deferred and view.is_view and calls == []
    assert view.shape == shape and view.dtype == op(value).dtype
    assert view.site == "w" and view.site_dist is w.site_dist and view.uses is w.uses
    assert view.msgs == w.msgs and view.msgs is not w.msgs
    assert len(view.view_ops) == len(w.view_ops) + 1
    assert torch.equal(view.concrete, op(value)) and calls == [1]
    assert not w.is_deferred  # the draw is the drawn value's
    assert torch.equal(replay(view.view_ops, value), view.concrete)


@pytest.mark.parametrize("spelling", sorted(VIEW_SPELLINGS))
def test_views_of_drawn_values(spelling):
    op, shape = VIEW_SPELLINGS[spelling]
    value = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)
    w = _wrapped(value)
    view = _derive(w, op)
    assert isinstance(view, SiteValue) and view.is_view and not view.is_deferred
    assert view.shape == shape and torch.equal(view.concrete, op(value))
    assert view.uses is w.uses and view.site_dist is w.site_dist and view.site == "w"
    assert view.msgs == w.msgs and view.msgs is not w.msgs
    assert torch.equal(replay(view.view_ops, value), view.concrete)


def test_views_of_views_keep_every_op():
    value = torch.arange(24.0).reshape(2, 3, 4)
    for w in (_wrapped(value), _deferred(value)):
        view = _derive(w, lambda w: w.permute(2, 0, 1)[1:].flatten(1).double())
        assert [op[0] for op in view.view_ops] == [_T.permute, _T.__getitem__, _T.flatten,
                                                    _T.double]
        expected = value.permute(2, 0, 1)[1:].flatten(1).double()
        assert view.dtype == torch.float64 and torch.equal(view.concrete, expected)


NOT_VIEWS = {
    "expand": (lambda w: w[:1].expand(4, 3), "expand"),
    "expand_as": (lambda w: w.expand_as(torch.zeros(2, 2, 3)), "expand_as"),
    "advanced index": (lambda w: w[[0, 0]], "__getitem__"),
    "tensor index": (lambda w: w[torch.tensor([1])], "__getitem__"),
    "advanced index in a tuple": (lambda w: w[:, [0, 0]], "__getitem__"),
    "bool index": (lambda w: w[True], "__getitem__"),
    "detach": (lambda w: w.detach(), "detach"),
    "bit view": (lambda w: w.view(torch.int64), "view"),
}


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "drawn"])
@pytest.mark.parametrize("spelling", sorted(NOT_VIEWS))
def test_derived_values_are_not_views(spelling, deferred):
    # Ops that repeat or detach elements give the plain value, drawn, marked derived
    # with the op's name; view_ops stay those of the value it derives from.
    op, name = NOT_VIEWS[spelling]
    value = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)
    w = (_deferred if deferred else _wrapped)(value)
    out = _derive(w, op)
    assert isinstance(out, SiteValue) and not out.is_deferred
    assert out.derived == name and not out.is_view
    assert torch.equal(out.concrete, op(value))
    assert out.uses is w.uses and out.site == "w" and out.site_dist is w.site_dist
    # w[:1].expand: the slice is a view, the expand is not
    assert len(out.view_ops) == (1 if spelling == "expand" else 0)


def test_derived_keeps_the_first_op():
    value = torch.randn(2, 3)
    out = _derive(_wrapped(value), lambda w: w.t().detach().t().reshape(6))
    assert out.derived == "detach" and not out.is_view
    assert [op[0] for op in out.view_ops] == [_T.t]
    assert torch.equal(out.concrete, value.reshape(6))


def test_derived_name_of_a_function_without_one():
    class NoName:
        def __call__(self, t):
            return t * 2

        def __str__(self):
            return "no-name op"

    out = _wrapped(torch.ones(2)).derive(NoName())
    assert out.derived == "no-name op" and torch.equal(out.concrete, torch.full((2,), 2.0))


def test_derive_with_non_tensor_result():
    value = torch.randn(2, dtype=torch.float64)
    for w in (_wrapped(value), _deferred(value)):
        assert _derive(w, lambda w: w.type()) == "torch.DoubleTensor"


def test_derive_unwraps_its_arguments():
    # a stand-in among the op's arguments is kept as its plain tensor
    w = _wrapped(torch.arange(6.0))
    like = _wrapped(torch.zeros(2, 3), name="v")
    view = w.derive(_T.view_as, (like,))
    assert view.shape == (2, 3)
    assert type(view.view_ops[0][1][0]) is torch.Tensor
    view = w.derive(_T.reshape, (), {"shape": (3, 2)})
    assert view.view_ops == ((_T.reshape, (), {"shape": (3, 2)}),)
    d = _deferred(torch.arange(6.0))
    view = d.derive(_T.view_as, (like,))
    assert view.is_deferred and type(view.view_ops[0][1][0]) is torch.Tensor


def test_view_moving_device_is_drawn():
    # A view that a meta tensor cannot answer (a move to a device) draws the value.
    value = torch.randn(2, 3)
    calls = []
    w = _deferred(value, calls)
    out = _derive(w, lambda w: w.to("cpu"))
    assert calls == [1] and not out.is_deferred and out.is_view
    assert torch.equal(out.concrete, value)


@pytest.mark.parametrize(
    "error", [RuntimeError, TypeError, ValueError, NotImplementedError], ids=lambda e: e.__name__
)
def test_meta_result_is_none_when_the_op_fails_on_meta(error):
    def op(t):
        raise error("no meta")

    assert _meta_result(op, _deferred(torch.zeros(2)), (), {}) is None


def test_meta_result():
    w = _deferred(torch.zeros(2, 3))
    out = _meta_result(_T.reshape, w, (3, 2), {})
    assert out.device.type == "meta" and out.shape == (3, 2)
    assert _meta_result(_T.reshape, w, (), {"shape": (6,)}).shape == (6,)
    assert _meta_result(_T.numel, w, (), {}) is None  # not a tensor


# ---------------------------------------------------------------- is_transpose


def _op(func, *args, **kwargs):
    return ((func, args, kwargs),)


TRANSPOSES = {
    "t": _op(_T.t),
    "torch.t": _op(torch.t),
    "T": _op(getter("T")),
    "mT": _op(getter("mT")),
    "transpose(0, 1)": _op(_T.transpose, 0, 1),
    "transpose(1, 0)": _op(_T.transpose, 1, 0),
    "transpose(-1, -2)": _op(_T.transpose, -1, -2),
    "torch.transpose": _op(torch.transpose, 0, -1),
    "swapaxes": _op(_T.swapaxes, 0, 1),
    "torch.swapaxes": _op(torch.swapaxes, 1, 0),
    "permute(1, 0)": _op(_T.permute, 1, 0),
    "permute((1, 0))": _op(_T.permute, (1, 0)),
    "permute([-1, 0])": _op(_T.permute, [-1, 0]),
    "torch.permute": _op(torch.permute, (1, -2)),
}
NOT_TRANSPOSES = {
    "no op": (),
    "two transposes": _op(_T.t) + _op(_T.t),
    "transpose(0, 0)": _op(_T.transpose, 0, 0),
    "transpose(1, -1)": _op(_T.transpose, 1, -1),
    "transpose with keywords": _op(_T.transpose, dim0=0, dim1=1),
    "transpose, one argument": _op(_T.transpose, 0),
    "swapaxes with keywords": _op(_T.swapaxes, axis0=0, axis1=1),
    "permute(0, 1)": _op(_T.permute, 0, 1),
    "permute((0, 1))": _op(_T.permute, (0, 1)),
    "permute with keywords": _op(_T.permute, dims=(1, 0)),
    "permute of three": _op(_T.permute, 1, 0, 2),
    "permute of one": _op(_T.permute, 1),
    "reshape": _op(_T.reshape, 3, 2),
    "movedim": _op(_T.movedim, 0, 1),
}


@pytest.mark.parametrize("spelling", sorted(TRANSPOSES))
def test_is_transpose(spelling):
    ops = TRANSPOSES[spelling]
    assert is_transpose(ops, torch.Size([2, 3]))
    # and it does transpose
    value = torch.randn(2, 3)
    assert torch.equal(replay(ops, value), value.T)
    # only a matrix is transposed
    assert not is_transpose(ops, torch.Size([2, 3, 4]))
    assert not is_transpose(ops, torch.Size([6]))


@pytest.mark.parametrize("spelling", sorted(NOT_TRANSPOSES))
def test_is_not_transpose(spelling):
    assert not is_transpose(NOT_TRANSPOSES[spelling], torch.Size([2, 3]))


#: the module between a caller and from_the_model, which dispatches as for its callers
_OWN = (from_the_model.__module__,)


def _in_module(module, call, *args):
    """A function defined in a module named ``module`` (None: globals without a
    ``__name__``) that returns ``call(*args)``: a frame of that module on the stack."""
    namespace = {"call": call, "args": args}
    if module is not None:
        namespace["__name__"] = module
    exec("def caller():\n    return call(*args)\n", namespace)
    return namespace["caller"]


@pytest.mark.parametrize("chain, dispatch, expected", [
    (["user_model"], (), True),
    (["pyro.infer.svi"], (), False),
    (["pyro_vinit.poutine.handlers"], (), False),
    (["pyro_vinit.testing.user_models"], (), True),
    # torch's frames and the dispatch modules are skipped: the first other caller decides
    (["pyro.infer.svi", "torch.nn.functional"], (), False),
    (["user_model", "torch.nn.functional"], (), True),
    (["pyro.infer.svi", "my.dispatch"], ("my.dispatch",), False),
    (["user_model", "my.dispatch", "torch.overrides"], ("my.dispatch",), True),
    (["pyro.infer.svi", "my.dispatch"], (), True),
    # the immediate caller decides, not the one above it
    (["user_model", "pyro.distributions.util"], (), False),
    (["pyro.infer.svi", "user_model"], (), True),
    # a frame whose globals have no __name__ is a model's (named ""), unless "" dispatches
    ([None], (), True),
    (["pyro.infer.svi", None], ("",), False),
])
def test_from_the_model_reads_the_first_caller_outside_torch_and_dispatch(chain, dispatch,
                                                                          expected):
    # chain: the callers' modules, outermost first
    call, args = from_the_model, dispatch + _OWN
    for module in reversed(chain):
        call, args = _in_module(module, call, *args), ()
    assert call() is expected


@pytest.mark.parametrize("chain, expected", [
    (["user_model", "mutmut.mutation.trampoline"], True),
    (["pyro.infer.predictive", "mutmut.mutation.trampoline"], False),
    (["pyro.infer.predictive", "mutmut.mutation.trampoline", "torch.functional",
      "mutmut.mutation.trampoline"], False),
])
def test_from_the_model_passes_over_mutation_testings_trampolines(chain, expected):
    # a mutation run (tools/mutate.py) calls each function through a trampoline of
    # mutmut's: the handlers tell the model's calls from Pyro's there as without it
    call, args = from_the_model, _OWN
    for module in reversed(chain):
        call, args = _in_module(module, call, *args), ()
    assert call() is expected


def test_from_the_model_on_a_stack_of_torch_frames_only():
    # a thread whose only frame is torch's: no caller is a model's
    out, done = [], threading.Event()
    namespace = {"__name__": "torch.fake", "from_the_model": from_the_model, "own": _OWN,
                 "out": out, "done": done}
    exec("def run():\n    out.append(from_the_model(*own))\n    done.set()\n", namespace)
    _thread.start_new_thread(namespace["run"], ())
    assert done.wait(10) and out == [False]
