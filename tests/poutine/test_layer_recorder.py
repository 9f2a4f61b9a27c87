"""
LayerRecorderMessenger, the tracer behind the I-BLM initializer, checked
directly on small models: which calls it records as layers and with which
weight layout and bias, which sites count, what it changes while active
(dropout, batch norm, subsampled plates), its hooks, and the data flow into
the likelihood.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine

from pyro_vinit.poutine.layer_recorder import (
    LayerRecorderMessenger,
    PlateRowsMessenger,
    RecordedLayer,
    StopModel,
    norm_statistics,
)
from tests.common import assert_close

_T = torch.Tensor


def _latent(name, *shape, dtype=torch.float32):
    return pyro.sample(name, dist.Normal(torch.zeros(shape, dtype=dtype), 1.0).to_event(len(shape)))


def _record(model, values, *args, latent=None, **options):
    """Runs ``model(*args)`` with its sites set to ``values`` under a recorder (whose
    latent sites are ``values``' names unless given) and returns (recorder, output)."""
    recorder = LayerRecorderMessenger(list(values) if latent is None else latent, **options)
    with recorder:
        out = poutine.condition(model, data=values)(*args)
    return recorder, out


def _only_layer(recorder):
    assert len(recorder.layers) == 1
    return recorder.layers[0]


def _flat_index(shape):
    return torch.arange(torch.Size(shape).numel()).reshape(shape)


# ---------------------------------------------------------------- layer calls

X = torch.randn(5, 4)
W_OUT_IN = torch.randn(3, 4)  # F.linear's layout
B = torch.randn(3)

# name -> (program on (x, w, b), bias passed to the op or None, source)
LINEAR_CALLS = {
    "F.linear": (lambda x, w, b: F.linear(x, w), False, "linear"),
    "F.linear with bias": (lambda x, w, b: F.linear(x, w, b), True, "linear"),
    "F.linear keywords": (lambda x, w, b: F.linear(input=x, weight=w, bias=b), True, "linear"),
    "F.linear, weight keyword": (lambda x, w, b: F.linear(x, weight=w, bias=b), True, "linear"),
    "einsum bi,oi->bo": (lambda x, w, b: torch.einsum("bi,oi->bo", x, w), False, "einsum"),
}


@pytest.mark.parametrize("name", sorted(LINEAR_CALLS))
def test_linear_calls_recorded(name):
    program, with_bias, source = LINEAR_CALLS[name]

    def model(x):
        return program(x, _latent("w", 3, 4), _latent("b", 3))

    rec, out = _record(model, {"w": W_OUT_IN, "b": B}, X)
    layer = _only_layer(rec)
    assert layer.weight_name == "w" and layer.weight_index is None
    assert layer.call.op == "linear" and layer.call.source == source
    assert layer.call.transposed is False and layer.call.kwargs == {}
    assert torch.equal(layer.call.weight, W_OUT_IN) and torch.equal(layer.call.input, X)
    expected = F.linear(X, W_OUT_IN, B if with_bias else None)
    assert_close(out, expected)
    assert layer.output is out
    if with_bias:
        assert layer.bias_name == "b" and layer.bias_index is None
        assert layer.site_names == ("w", "b") and layer.call.bias is not None
    else:
        assert layer.bias_name is None and layer.site_names == ("w",)
    assert layer.fixed_bias is None and rec.observed == []


W_IN_OUT = torch.randn(4, 3)  # a matrix product's layout

# name -> (program on (x, w, b), the bias is b, source)
PRODUCTS = {
    "x @ w": (lambda x, w, b: x @ w, False, "matmul"),
    "w.__rmatmul__(x)": (lambda x, w, b: w.__rmatmul__(x), False, "matmul"),
    "torch.matmul": (lambda x, w, b: torch.matmul(x, w), False, "matmul"),
    "x.matmul": (lambda x, w, b: x.matmul(w), False, "matmul"),
    "torch.mm": (lambda x, w, b: torch.mm(x, w), False, "mm"),
    "x.mm": (lambda x, w, b: x.mm(w), False, "mm"),
    "torch.addmm": (lambda x, w, b: torch.addmm(b, x, w), True, "addmm"),
    "einsum bi,io->bo": (lambda x, w, b: torch.einsum("bi,io->bo", x, w), False, "einsum"),
    "einsum list operands": (lambda x, w, b: torch.einsum("bi,io->bo", [x, w]), False, "einsum"),
}


@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_matrix_products_recorded_as_linear(name):
    # x @ w with w of shape (in, out) is F.linear(x, w.t()): the weight is recorded in
    # F.linear's layout, and weight_index maps it back to the site's elements.
    program, with_bias, source = PRODUCTS[name]

    def model(x):
        return program(x, _latent("w", 4, 3), _latent("b", 3))

    rec, out = _record(model, {"w": W_IN_OUT, "b": B}, X)
    layer = _only_layer(rec)
    assert layer.weight_name == "w" and layer.call.op == "linear"
    assert layer.call.transposed and layer.call.source == source
    assert torch.equal(layer.call.weight, W_IN_OUT.t())
    assert torch.equal(layer.weight_index, _flat_index((4, 3)).t())
    assert torch.equal(W_IN_OUT.reshape(-1)[layer.weight_index.reshape(-1)],
                       layer.call.weight.reshape(-1))
    assert_close(out, X @ W_IN_OUT + (B if with_bias else 0))
    assert layer.output is out
    assert layer.bias_name == ("b" if with_bias else None)
    assert layer.fixed_bias is None


CONV_CALLS = {
    "conv1d positional": (
        lambda x, w, b: F.conv1d(x, w, b, 2, 1), (2, 3, 9), (4, 3, 3),
        {"stride": 2, "padding": 1, "dilation": 1, "groups": 1}),
    "conv2d keywords": (
        lambda x, w, b: F.conv2d(x, w, b, padding=1, dilation=2), (2, 3, 6, 6), (4, 3, 3, 3),
        {"stride": 1, "padding": 1, "dilation": 2, "groups": 1}),
    "conv3d groups": (
        lambda x, w, b: F.conv3d(x, w, b, groups=2), (1, 2, 4, 4, 4), (4, 1, 2, 2, 2),
        {"stride": 1, "padding": 0, "dilation": 1, "groups": 2}),
}


@pytest.mark.parametrize("name", sorted(CONV_CALLS))
def test_convolutions_recorded(name):
    program, x_shape, w_shape, kwargs = CONV_CALLS[name]
    x, w, b = torch.randn(x_shape), torch.randn(w_shape), torch.randn(4)

    def model(x):
        return program(x, _latent("w", *w_shape), _latent("b", 4))

    rec, out = _record(model, {"w": w, "b": b}, x)
    layer = _only_layer(rec)
    assert layer.call.op == name[:6] and layer.call.kwargs == kwargs
    assert layer.weight_name == "w" and layer.bias_name == "b" and layer.weight_index is None
    assert torch.equal(layer.call.weight, w) and layer.call.transposed is False
    assert_close(out, program(x, w, b))


def test_plain_tensors_and_other_ops_not_recorded():
    # Only a latent site's value as the weight makes a layer: a plain weight, a latent value
    # used as the input, a product of two latent values and other values do not.
    w_plain = torch.randn(3, 4)

    def model(x):
        w = _latent("w", 3, 4)
        v = _latent("v", 4, 4)
        F.linear(x, w_plain)
        x @ w_plain.t()
        F.linear(w, w_plain)  # the latent value is the input
        w @ v  # both operands latent
        w.t() @ w  # both operands latent views
        F.linear(x, w * 2)  # same shape, other values
        F.linear(x, torch.relu(w))
        return torch.relu(x).sum()

    rec, _ = _record(model, {"w": W_OUT_IN, "v": torch.randn(4, 4)}, X)
    assert rec.layers == []


def test_only_latent_sites_count():
    def model(x, y):
        h = F.linear(x, _latent("w", 3, 4))
        return pyro.sample("y", dist.Normal(h, 1.0).to_event(2), obs=y)

    y = torch.randn(5, 3)
    # a site set by condition but not named latent is observed, not a weight
    rec, _ = _record(model, {"w": W_OUT_IN}, X, y, latent=[])
    assert rec.layers == [] and [s["name"] for s in rec.observed] == ["w", "y"]
    rec, _ = _record(model, {"w": W_OUT_IN}, X, y)
    assert _only_layer(rec).weight_name == "w"
    assert [s["name"] for s in rec.observed] == ["y"] and torch.equal(rec.observed[0]["value"], y)
    # a latent site drawn (not set) is a weight all the same
    rec = LayerRecorderMessenger(["w"])
    with rec:
        model(X, y)
    assert _only_layer(rec).weight_name == "w" and len(rec.observed) == 1


def test_deterministic_sites_ignored():
    w = torch.randn(3, 4)

    def model(x):
        d = pyro.deterministic("d", w)
        return pyro.deterministic("out", F.linear(x, d))

    rec, out = _record(model, {}, X, latent=["d"])
    assert rec.layers == [] and rec.observed == []
    assert_close(out, F.linear(X, w))


# ---------------------------------------------------------------- weight layouts

# name -> (site shape, program turning the site value into F.linear's (3, 4) weight)
RELAYOUTS = {
    "reshape": ((12,), lambda w: w.reshape(3, 4)),
    "torch.reshape": ((2, 6), lambda w: torch.reshape(w, (3, 4))),
    "view": ((12,), lambda w: w.view(3, 4)),
    "view_as": ((12,), lambda w: w.view_as(W_OUT_IN)),
    "reshape_as": ((2, 6), lambda w: w.reshape_as(W_OUT_IN)),
    "unflatten": ((12,), lambda w: w.unflatten(0, (3, 4))),
    "flatten": ((3, 2, 2), lambda w: w.flatten(1)),
    "torch.flatten": ((3, 2, 2), lambda w: torch.flatten(w, 1)),
    "squeeze": ((1, 3, 4), lambda w: w.squeeze(0)),
    "torch.squeeze": ((3, 1, 4), lambda w: torch.squeeze(w, 1)),
    "unsqueeze": ((3, 4), lambda w: w.unsqueeze(0).squeeze(0)),
    "torch.unsqueeze then squeeze": ((3, 4), lambda w: torch.unsqueeze(w, 1).squeeze(1)),
    "t": ((4, 3), lambda w: w.t()),
    "torch.t": ((4, 3), lambda w: torch.t(w)),
    "T": ((4, 3), lambda w: w.T),
    "mT": ((4, 3), lambda w: w.mT),
    "transpose": ((4, 3), lambda w: w.transpose(0, 1)),
    "torch.transpose": ((4, 3), lambda w: torch.transpose(w, 1, 0)),
    "transpose keywords": ((4, 3), lambda w: w.transpose(dim0=1, dim1=0)),
    "flatten keywords": ((3, 2, 2), lambda w: torch.flatten(w, start_dim=1)),
    "permute": ((4, 3), lambda w: w.permute(1, 0)),
    "torch.permute": ((4, 3), lambda w: torch.permute(w, (1, 0))),
    "movedim": ((4, 3), lambda w: w.movedim(0, 1)),
    "torch.movedim": ((4, 3), lambda w: torch.movedim(w, 1, 0)),
    "swapaxes": ((4, 3), lambda w: w.swapaxes(0, 1)),
    "torch.swapaxes": ((4, 3), lambda w: torch.swapaxes(w, 0, 1)),
    "t then contiguous": ((4, 3), lambda w: w.t().contiguous()),
    "t then reshape": ((2, 6), lambda w: w.t().reshape(3, 4)),
    "reshape then t": ((12,), lambda w: w.reshape(4, 3).t()),
    "clone of t": ((4, 3), lambda w: torch.clone(w.t())),
    "t then detach": ((4, 3), lambda w: w.t().detach()),
    "t twice": ((3, 4), lambda w: w.t().t()),
}


@pytest.mark.parametrize("name", sorted(RELAYOUTS))
def test_relaid_out_weights(name):
    # weight_index[i] is the flat index in the site value of the i-th element of the
    # weight (flattened); None when they agree.
    shape, program = RELAYOUTS[name]
    value = torch.randn(shape)

    def model(x):
        return F.linear(x, program(_latent("w", *shape)))

    rec, out = _record(model, {"w": value}, X)
    layer = _only_layer(rec)
    weight = program(value)
    assert layer.weight_name == "w" and torch.equal(layer.call.weight, weight)
    expected_index = program(_flat_index(shape)).reshape(-1)
    if torch.equal(expected_index, torch.arange(12)):
        assert layer.weight_index is None
    else:
        assert torch.equal(layer.weight_index.reshape(-1), expected_index)
        assert torch.equal(value.reshape(-1)[layer.weight_index.reshape(-1)], weight.reshape(-1))
    assert_close(out, F.linear(X, weight))


def test_view_as_its_own_dtype_is_the_weight():
    # Regression: w.view(w.dtype) was replayed on the int64 indices, which reinterpreted
    # their bits and raised the "repeats or drops elements" error.
    def model(x):
        w = _latent("w", 4, 3, dtype=torch.float64).view(torch.float64)
        return F.linear(x, w.t().view(torch.float64))

    value = torch.randn(4, 3, dtype=torch.float64)
    rec, out = _record(model, {"w": value}, X.double())
    layer = _only_layer(rec)
    assert layer.weight_name == "w" and torch.equal(layer.weight_index, _flat_index((4, 3)).t())
    assert_close(out, F.linear(X.double(), value.t()))


def test_view_as_its_own_dtype_by_keyword_is_the_weight():
    def model(x):
        return F.linear(x, _latent("w", 3, 4, dtype=torch.float64).view(dtype=torch.float64))

    value = torch.randn(3, 4, dtype=torch.float64)
    rec, out = _record(model, {"w": value}, X.double())
    layer = _only_layer(rec)
    assert layer.weight_name == "w" and layer.weight_index is None
    assert_close(out, F.linear(X.double(), value))


def test_transposed_product_of_a_transposed_weight():
    # x @ w.t() is F.linear(x, w): the two transpositions cancel.
    def model(x):
        return x @ _latent("w", 3, 4).t()

    rec, out = _record(model, {"w": W_OUT_IN}, X)
    layer = _only_layer(rec)
    assert layer.call.transposed and layer.weight_index is None
    assert torch.equal(layer.call.weight, W_OUT_IN)
    assert_close(out, F.linear(X, W_OUT_IN))


CASTS = {
    "double": (lambda w: w.double(), torch.float64),
    "to": (lambda w: w.to(torch.float64), torch.float64),
    "type": (lambda w: w.type(torch.float64), torch.float64),
    "float": (lambda w: w.float(), torch.float32),
    "half": (lambda w: w.half(), torch.float16),
    "bfloat16": (lambda w: w.bfloat16(), torch.bfloat16),
    "clone": (lambda w: w.clone(), torch.float64),
    "torch.clone": (lambda w: torch.clone(w), torch.float64),
    "detach": (lambda w: w.detach(), torch.float64),
    "contiguous": (lambda w: w.contiguous(), torch.float64),
}


@pytest.mark.parametrize("name", sorted(CASTS))
def test_cast_weights(name):
    program, dtype = CASTS[name]

    def model(x):
        return F.linear(x.to(dtype), program(_latent("w", 3, 4, dtype=torch.float64)))

    value = torch.randn(3, 4, dtype=torch.float64)
    rec, out = _record(model, {"w": value}, X)
    layer = _only_layer(rec)
    assert layer.weight_name == "w" and layer.weight_index is None
    assert layer.call.weight.dtype == dtype and out.dtype == dtype


REPEATING = {
    "half-precision bit view": ((3, 4), lambda w: w.view(torch.float16), torch.float16),
    "double-precision bit view": ((3, 8), lambda w: w.view(torch.float64), torch.float64),
}


@pytest.mark.parametrize("name", sorted(REPEATING))
def test_weight_through_non_permutation_raises(name):
    # A bit view splits or merges elements: the weight is no longer the site's elements.
    shape, program, dtype = REPEATING[name]

    def model(x):
        return F.linear(x, program(_latent("w", *shape)))

    with pytest.raises(ValueError) as error:
        _record(model, {"w": torch.randn(shape)}, torch.randn(5, 8, dtype=dtype)[:, :4])
    assert str(error.value) == (
        "the weight of sample site 'w' reaches a layer call through an operation that repeats "
        "or drops elements (view); pass it to the layer whole (reshaped or transposed at most)"
    )


# name -> (program on the site value of shape (4, 4), the ops the error names)
SLICED = {
    "narrow": (lambda w: w.narrow(0, 0, 3), "narrow"),
    "torch.narrow": (lambda w: torch.narrow(w, 0, 0, 3), "narrow"),
    "getitem": (lambda w: w[:3], "getitem"),
    "transposed, then sliced": (lambda w: w.t()[:3], "t, getitem"),
    "clone, then narrow": (lambda w: w.clone().narrow(0, 1, 3), "clone, narrow"),
    "repeating expand": (lambda w: w[:1].expand(3, 4), "getitem, expand"),
    # the ops up to the first that repeats (the later ones are not views of the site)
    "repeating expand, then transposed": (lambda w: w[:, :1].expand(4, 3).t(),
                                          "getitem, expand"),
}


@pytest.mark.parametrize("name", sorted(SLICED))
def test_sliced_weight_is_seen_and_refused(name):
    # Regression (issue 23 item 8): the weight handlers and the recorder share one table of
    # views, so a narrowed weight is the layer's weight for both. The recorder cannot map
    # part of a site to a layer: it names the site and the ops instead of not seeing the
    # layer (which made I-BLM fail later on the output layer's shape).
    program, ops = SLICED[name]

    def model(x):
        return F.linear(x, program(_latent("w", 4, 4)))

    with pytest.raises(ValueError) as error:
        _record(model, {"w": torch.randn(4, 4)}, X)
    assert str(error.value) == (
        "the weight of sample site 'w' reaches a layer call through an operation that repeats "
        f"or drops elements ({ops}); pass it to the layer whole (reshaped or transposed at most)"
    )


def test_sliced_bias_is_a_fixed_bias():
    # Part of a latent bias is not the layer's bias site: it is used as a fixed bias.
    def model(x):
        return F.linear(x, _latent("w", 3, 4), _latent("b", 4)[:3])

    b = torch.randn(4)
    rec, out = _record(model, {"w": W_OUT_IN, "b": b}, X)
    layer = _only_layer(rec)
    assert layer.bias_name is None and torch.equal(layer.fixed_bias, b[:3])
    assert_close(out, F.linear(X, W_OUT_IN, b[:3]))
    assert not torch.overrides._is_torch_function_mode_enabled()


# ---------------------------------------------------------------- biases


def test_fixed_and_broadcast_biases():
    # A bias that is not a latent vector is recorded as a fixed bias (detached).
    param = torch.nn.Parameter(torch.randn(3))
    b2 = torch.randn(1, 3)

    def model(x):
        w = _latent("w", 3, 4)
        F.linear(x, w, param)
        F.linear(x, w, _latent("b2", 1, 3))  # latent, but not a vector
        return F.linear(x, w, _latent("b", 1, 3).reshape(3))  # a latent vector, reshaped

    rec, out = _record(model, {"w": W_OUT_IN, "b2": b2, "b": B[None]}, X)
    first, second, third = rec.layers
    assert first.bias_name is None and first.site_names == ("w",)
    assert torch.equal(first.fixed_bias, param) and not first.fixed_bias.requires_grad
    assert second.bias_name is None and torch.equal(second.fixed_bias, b2)
    assert third.bias_name == "b" and third.fixed_bias is None
    assert torch.equal(third.bias_index, torch.arange(3))
    assert_close(out, F.linear(X, W_OUT_IN, B))


ADDED_BIASES = {
    "x @ w + b": lambda h, b: h + b,
    "b + x @ w": lambda h, b: b + h,
    "torch.add": lambda h, b: torch.add(h, b),
    "add method": lambda h, b: h.add(b),
    # as a program that vectorizes over sample dims writes it
    "x @ w + b.unsqueeze(-2)": lambda h, b: h + b.unsqueeze(-2),
    "b[None] + x @ w": lambda h, b: b[None] + h,
}


@pytest.mark.parametrize("name", sorted(ADDED_BIASES))
def test_latent_vector_added_to_product_is_its_bias(name):
    add = ADDED_BIASES[name]

    def model(x):
        out = add(x @ _latent("w", 4, 3), _latent("b", 3))
        return out + _latent("b2", 3)  # the product has its bias already

    b2 = torch.randn(3)
    rec, out = _record(model, {"w": W_IN_OUT, "b": B, "b2": b2}, X)
    layer = _only_layer(rec)
    assert layer.bias_name == "b" and layer.call.bias is not None
    assert torch.equal(layer.call.bias, B) and layer.site_names == ("w", "b")
    assert layer.fixed_bias is None and layer.bias_index is None
    assert_close(layer.output, X @ W_IN_OUT + B)
    assert_close(layer.call(), layer.output)
    assert_close(out, X @ W_IN_OUT + B + b2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("constant", ["vector", "row", "one element", "number"])
def test_a_constant_added_to_a_product_is_its_fixed_bias(constant, dtype):
    # x @ w + c with c no site's (a plain tensor of one value per unit, or a number): the
    # layer's fixed bias, the sum its output (a number in the output's dtype)
    c = {"vector": torch.randn(3, dtype=dtype), "row": torch.randn(1, 3, dtype=dtype),
         "one element": torch.randn(1, dtype=dtype), "number": 0.5}[constant]
    x, w = X.to(dtype), W_IN_OUT.to(dtype)

    def model(x):
        return x @ _latent("w", 4, 3, dtype=dtype) + c

    rec, out = _record(model, {"w": w}, x)
    layer = _only_layer(rec)
    assert layer.bias_name is None and layer.output is out
    assert layer.fixed_bias.dtype == dtype
    assert torch.equal(layer.fixed_bias, torch.as_tensor(c, dtype=dtype))
    assert_close(out, x @ w + c)


NOT_BIASES = {
    "plain matrix": lambda x, w, s: x @ w + s["plain"].expand(5, 3),
    "scaled by alpha": lambda x, w, s: torch.add(x @ w, s["b"], alpha=2.0),
    "one-element latent": lambda x, w, s: x @ w + s["one"],
    # each output sharing one element: no bias site in the layer's layout (regression: it
    # was recorded as the bias site "one", and I-BLM failed on its shape)
    "one-element latent, expanded": lambda x, w, s: x @ w + s["one"].expand(3),
    "one-element latent, expanded, cast": lambda x, w, s: x @ w + s["one"].expand(3).float(),
    "latent row": lambda x, w, s: x @ w + s["row"],
    "reshaped latent vector": lambda x, w, s: x @ w + s["row"].reshape(3),
    "unsqueezed vector that broadcasts the output": lambda x, w, s: (x @ w)[0] + s["b"][None],
    # one value per row of a product of three rows, not per unit
    "vector as a column": lambda x, w, s: x[:3] @ w + s["b"].reshape(3, 1),
    "after F.linear": lambda x, w, s: F.linear(x, w.t()) + s["b"],
    # one value per unit, but with two dims left of them: it adds a dim to the output
    "constant of three dims": lambda x, w, s: x @ w + s["plain"].reshape(1, 1, 3),
    "after addmm's bias": lambda x, w, s: torch.addmm(s["plain"], x, w) + s["b"],
    "product of a product": lambda x, w, s: (x @ w) * s["b"],
    # a vector site's elements out of order: one per unit, but not unit i's at i
    "permuted latent vector": lambda x, w, s: x @ w + s["b"][torch.tensor([2, 0, 1])],
    "latent vector in steps of two": lambda x, w, s: x @ w + s["b6"][::2],
}


@pytest.mark.parametrize("name", sorted(NOT_BIASES))
def test_additions_that_are_no_bias(name):
    program = NOT_BIASES[name]
    plain = torch.randn(3)

    def model(x):
        sites = {"b": _latent("b", 3), "one": _latent("one", 1), "row": _latent("row", 1, 3),
                 "b6": _latent("b6", 6), "plain": plain}
        return program(x, _latent("w", 4, 3), sites)

    values = {"w": W_IN_OUT, "b": B, "one": torch.randn(1), "row": torch.randn(1, 3),
              "b6": torch.randn(6)}
    rec, out = _record(model, values, X)
    layer = _only_layer(rec)
    assert layer.bias_name is None and layer.site_names == ("w",)
    assert layer.output is not out
    assert_close(out, program(X, W_IN_OUT, {**values, "plain": plain}))


def test_the_element_of_a_one_element_site_added_to_a_one_unit_product_is_no_bias():
    # b[0] of b of shape (1,): one value, 0-d, for the one unit of x @ w (w of shape (4, 1))
    def model(x):
        return x @ _latent("w", 4, 1) + _latent("b", 1)[0]

    w, b = torch.randn(4, 1), torch.randn(1)
    rec, out = _record(model, {"w": w, "b": b}, X)
    layer = _only_layer(rec)
    assert layer.bias_name is None and layer.site_names == ("w",)
    assert_close(out, X @ w + b[0])


def test_iblm_on_a_product_plus_an_expanded_one_element_site():
    # Regression: the expanded site was taken for the layer's bias site, and I-BLM failed
    # with "shape '[3]' is invalid for input of size 1"; it is a fixed bias, as it is
    # through F.linear, and the site keeps the guide's values (named in the warning).
    from pyro.infer.autoguide import AutoNormal

    from pyro_vinit import init_guide_iblm

    def model(x, y=None):
        f = x @ _latent("w", 4, 3) + _latent("one", 1).expand(3)
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(f, 0.1).to_event(1), obs=y)

    x = torch.randn(50, 4)
    y = x @ W_IN_OUT + 0.1 * torch.randn(50, 3)
    guide = AutoNormal(model)
    guide(x, y)
    before = guide.locs.w.detach().clone()
    with pytest.warns(UserWarning, match=r"keep the guide's own initial values: \['one'\]"):
        init_guide_iblm(guide, (x, y), batch_size=50)
    assert not torch.equal(guide.locs.w.detach(), before)


# ---------------------------------------------------------------- plates


def _plate_model(size, subsample_size):
    def model():
        with pyro.plate("data", size, subsample_size=subsample_size) as rows:
            return rows
    return model


def _plates(model, rows=None, num_rows=None):
    """Runs ``model()`` under a PlateRowsMessenger: (messenger, output)."""
    plates = PlateRowsMessenger(rows, num_rows)
    return plates, plates(model)()


def test_subsampled_plates_recorded_and_rows_honoured():
    rows = torch.tensor([9, 0, 4])
    plates, out = _plates(_plate_model(10, 3), rows)
    assert plates.subsampled_plates == {"data": (10, 3)} and torch.equal(out, rows)
    # neither rows nor num_rows: the first indices (the rows at hand of a plate scaled to
    # the data set), not a draw of the generator
    rng = torch.get_rng_state()
    plates, out = _plates(_plate_model(10, 3))
    assert plates.subsampled_plates == {"data": (10, 3)} and torch.equal(out, torch.arange(3))
    assert torch.equal(rng, torch.get_rng_state())
    # a plate that is not subsampled is not listed
    for subsample_size in (None, 10):
        plates, out = _plates(_plate_model(10, subsample_size), rows)
        assert plates.subsampled_plates == {} and torch.equal(out, torch.arange(10))


def test_the_recorder_leaves_plates_alone():
    pyro.set_rng_seed(0)
    expected = _plate_model(10, 3)()
    pyro.set_rng_seed(0)
    _, out = _record(_plate_model(10, 3), {})
    assert torch.equal(out, expected)


@pytest.mark.parametrize("num_rows", [None, 2])
def test_plate_rows_follow_the_plate_device(num_rows):
    def model():
        with pyro.plate("data", 10, subsample_size=3, device="meta") as rows:
            return rows

    plates, out = _plates(model, torch.tensor([9, 0, 4]) if num_rows is None else None,
                          num_rows)
    assert plates.subsampled_plates == {"data": (10, 3)}
    assert out.device.type == "meta" and out.shape == (3,)


@pytest.mark.parametrize(
    "rows",
    [torch.tensor([1, 2]), torch.tensor([1, 2, 3, 4]), torch.tensor([10, 0, 1])],
    ids=["too short", "too long", "out of range"],
)
def test_plate_rows_ignored_when_they_do_not_fit(rows):
    plates, out = _plates(_plate_model(10, 3), rows)
    assert plates.subsampled_plates == {"data": (10, 3)}
    assert out.shape == (3,) and int(out.max()) < 10


def test_plate_rows_for_an_empty_subsample():
    plates, out = _plates(_plate_model(10, 0), torch.tensor([], dtype=torch.long))
    assert plates.subsampled_plates == {"data": (10, 0)} and out.shape == (0,)


@pytest.mark.parametrize("size, subsample_size, num_rows, expected", [
    (10, 3, 2, [0, 1, 0]),  # a plate over more rows than the arguments have: theirs, wrapped
    (10, 3, 1, [0, 0, 0]),
    (10, 3, 4, [0, 1, 2]),
    (10, 3, 9, [0, 1, 2]),
])
def test_plate_over_more_rows_than_the_arguments_takes_theirs(size, subsample_size, num_rows,
                                                               expected):
    plates, out = _plates(_plate_model(size, subsample_size), num_rows=num_rows)
    assert plates.subsampled_plates == {"data": (size, subsample_size)}
    assert out.tolist() == expected
    # rows that fit the plate come first
    _, out = _plates(_plate_model(size, subsample_size), torch.tensor([9, 0, 4]), num_rows)
    assert out.tolist() == [9, 0, 4]


@pytest.mark.parametrize("num_rows, expected", [
    (None, [0, 1, 2, 3, 0, 1]),  # a subsample larger than the plate: its rows, wrapped
    (4, [0, 1, 2, 3, 0, 1]),
    (3, [0, 1, 2, 0, 1, 2]),
])
def test_plate_smaller_than_its_subsample_takes_its_rows_wrapped(num_rows, expected):
    # (declared over the rows at hand, run on a chunk smaller than its subsample: Pyro's
    # own draw would refuse it)
    plates, out = _plates(_plate_model(4, 6), num_rows=num_rows)
    assert plates.subsampled_plates == {"data": (4, 6)}
    assert out.tolist() == expected
    _, out = _plates(_plate_model(4, 6), torch.tensor([3, 2, 1, 0, 3, 2]), num_rows)
    assert out.tolist() == [3, 2, 1, 0, 3, 2]


@pytest.mark.parametrize("num_rows", [0, 10, 12])
def test_plate_over_the_rows_of_the_arguments_draws_as_usual(num_rows):
    # (a plate as large as the data at hand: Pyro's own random draw)
    model = _plate_model(10, 3)
    pyro.set_rng_seed(0)
    expected = model()
    pyro.set_rng_seed(0)
    plates, out = _plates(model, num_rows=num_rows)
    assert torch.equal(out, expected) and plates.subsampled_plates == {"data": (10, 3)}


def test_plate_rows_leave_set_subsamples_alone():
    conditioned = pyro.poutine.condition(_plate_model(10, 3),
                                         data={"data": torch.tensor([7, 8, 9])})
    plates = PlateRowsMessenger(torch.tensor([0, 1, 2]), num_rows=2)
    with plates:
        assert conditioned().tolist() == [7, 8, 9]
    assert plates.subsampled_plates == {}


# ---------------------------------------------------------------- dropout and batch norm

DROPOUTS = {
    "dropout": (lambda x: F.dropout(x, 0.9, True), (4, 6)),
    "dropout1d": (lambda x: F.dropout1d(x, 0.9, True), (4, 3, 6)),
    "dropout2d": (lambda x: F.dropout2d(x, 0.9, True), (4, 3, 2, 2)),
    "dropout3d": (lambda x: F.dropout3d(x, 0.9, True), (4, 3, 2, 2, 2)),
    "alpha_dropout": (lambda x: F.alpha_dropout(x, 0.9, True), (4, 6)),
    "feature_alpha_dropout": (lambda x: F.feature_alpha_dropout(x, 0.9, True), (4, 3, 2)),
    "nn.Dropout in training": (torch.nn.Dropout(0.9).train(), (4, 6)),
    "dropout by keyword": (lambda x: F.dropout(input=x, p=0.9, training=True), (4, 6)),
}


@pytest.mark.parametrize("name", sorted(DROPOUTS))
def test_dropout_off(name):
    program, shape = DROPOUTS[name]
    x = torch.randn(shape)
    _, out = _record(program, {}, x)
    assert out is x


def _bn_closed_form(x, mean, var, weight, bias, eps):
    shape = [1, -1] + [1] * (x.dim() - 2)
    return (x - mean.reshape(shape)) / (var.reshape(shape) + eps).sqrt() * weight.reshape(
        shape) + bias.reshape(shape)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5)], ids=["2-d", "3-d"])
def test_batch_norm_uses_batch_statistics(shape, training):
    bn = torch.nn.BatchNorm1d(3, eps=0.5)
    bn.running_mean.fill_(2.0)
    bn.running_var.fill_(7.0)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 3.0]))
        bn.bias.copy_(torch.tensor([0.1, 0.2, 0.3]))
    bn.train(training)
    x = torch.randn(shape) * 3 + 1
    rec, out = _record(bn, {}, x)
    dims = [0] + list(range(2, x.dim()))
    expected = _bn_closed_form(x, x.mean(dims), x.var(dims, unbiased=False), bn.weight, bn.bias,
                               0.5)
    assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(bn.running_mean, torch.full((3,), 2.0))
    assert torch.equal(bn.running_var, torch.full((3,), 7.0))
    assert rec.num_batch_norms == 1


@pytest.mark.parametrize("keep", [False, True])
def test_a_frozen_batch_norm_keeps_its_running_statistics_where_asked(keep):
    # a BatchNorm in eval mode in a model in train mode (a frozen layer): under
    # keep_frozen_norms it normalizes as it does outside the recorder, and its statistics
    # are not collected
    bn = torch.nn.BatchNorm1d(3, eps=0.5).eval()
    bn.running_mean.fill_(2.0)
    bn.running_var.fill_(7.0)
    with torch.no_grad():  # (an affine part of its own: not the identity)
        bn.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
        bn.bias.copy_(torch.tensor([0.3, -0.2, 1.5]))
    x = torch.randn(6, 3) * 3 + 1
    stats = {}
    rec, out = _record(bn, {}, x, norm_statistics=stats, keep_frozen_norms=keep)
    if keep:
        assert torch.equal(out, bn(x)) and stats == {}
    else:
        assert_close(out, _bn_closed_form(x, x.mean(0), x.var(0, unbiased=False), bn.weight,
                                          bn.bias, 0.5), atol=1e-5, rtol=1e-5)
        assert len(stats) == 1
    assert rec.num_batch_norms == 1
    # a layer in train mode is no frozen one
    rec, out = _record(bn.train(), {}, x, norm_statistics=stats, keep_frozen_norms=True)
    assert torch.equal(bn.running_mean, torch.full((3,), 2.0))
    assert_close(out, _bn_closed_form(x, x.mean(0), x.var(0, unbiased=False), bn.weight,
                                      bn.bias, 0.5), atol=1e-5, rtol=1e-5)


def test_norm_sync_used():
    calls = []

    def sync(x, dims):
        calls.append((x, dims))
        return torch.tensor([1.0, -1.0]), torch.tensor([3.0, 0.5])

    bn = torch.nn.BatchNorm2d(2, eps=1.0).eval()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([2.0, 3.0]))
        bn.bias.copy_(torch.tensor([0.5, -0.5]))
    x = torch.randn(3, 2, 4, 5)
    rec, out = _record(bn, {}, x, norm_sync=sync)
    assert len(calls) == 1 and calls[0][0] is x and calls[0][1] == [0, 2, 3]
    expected = _bn_closed_form(x, torch.tensor([1.0, -1.0]), torch.tensor([3.0, 0.5]), bn.weight,
                               bn.bias, 1.0)
    assert_close(out, expected)
    assert torch.equal(bn.running_mean, torch.zeros(2))
    assert rec.num_batch_norms == 1


def test_norm_statistics_accumulated_across_runs():
    bn1 = torch.nn.BatchNorm1d(3)
    bn2 = torch.nn.BatchNorm1d(2)

    def model(x):
        h = bn1(x)
        return bn2(h[:, :2]), F.batch_norm(x, None, None, training=True)  # no buffers

    xs = [torch.randn(4, 3, 5) * 2 + 1, torch.randn(3, 3, 5) - 1]
    acc = {}
    for x in xs:
        rec, _ = _record(model, {}, x, norm_statistics=acc)
        assert rec.num_batch_norms == 3
    assert len(acc) == 2
    found = norm_statistics(acc)
    assert found[0][0] is bn1.running_mean and found[0][1] is bn1.running_var
    assert found[1][0] is bn2.running_mean and found[1][1] is bn2.running_var
    joined = torch.cat([x.transpose(0, 1).reshape(3, -1) for x in xs], 1)
    assert_close(found[0][2], joined.mean(1), atol=1e-5)
    assert_close(found[0][3], joined.var(1, unbiased=True), atol=1e-5)
    # the second norm's inputs are the first's outputs, normalized per run
    normalized = torch.cat([
        F.batch_norm(x, None, None, training=True)[:, :2].transpose(0, 1).reshape(2, -1)
        for x in xs], 1)
    assert_close(found[1][2], normalized.mean(1), atol=1e-5)
    assert_close(found[1][3], normalized.var(1, unbiased=True), atol=1e-5)


@pytest.mark.parametrize("norm_rows, counted", [
    (None, 6), ((6, 4), 4), ((6, 0), 0), ((5, 2), 6),  # (another number of rows: all count)
])
def test_norm_statistics_count_the_new_rows(norm_rows, counted):
    # of a batch-norm input with norm_rows[0] rows, the first norm_rows[1] count (the
    # others repeat rows counted before); normalization still uses all of them
    bn = torch.nn.BatchNorm1d(2)
    x = torch.randn(6, 2)
    acc = {}
    _, out = _record(lambda x: bn(x), {}, x, norm_statistics=acc, norm_rows=norm_rows)
    assert_close(out, F.batch_norm(x, None, None, training=True))
    _, _, n, total, squares = acc[id(bn.running_mean)]
    assert n == counted
    assert_close(total, x[:counted].sum(0) if counted else torch.zeros(2))
    assert_close(squares, (x[:counted] ** 2).sum(0) if counted else torch.zeros(2))


def test_norm_statistics_closed_form():
    # (n, sum, sum of squares) -> mean and unbiased variance; never negative, and 0 for n = 1.
    x = torch.tensor([[1.0, 0.1], [2.0, 0.1], [4.0, 0.1], [9.0, 0.1], [0.0, 0.1], [3.0, 0.1],
                      [2.0, 0.1]])
    rm, rv = torch.zeros(2), torch.ones(2)
    pair = torch.tensor([1.0, 4.0])
    acc = {1: [rm, rv, 7, x.sum(0), (x * x).sum(0)],
           2: [rm, rv, 1, torch.tensor([3.0]), torch.tensor([9.0])],
           3: [rm, rv, 2, pair.sum(0, True), (pair * pair).sum(0, True)]}
    (m1, v1, mean, var), (_, _, mean1, var1), (_, _, mean2, var2) = norm_statistics(acc)
    assert m1 is rm and v1 is rv
    assert_close(mean, x.mean(0))
    assert_close(var[0], x[:, 0].var(unbiased=True), rtol=1e-5)
    assert var[1] == 0.0  # rounding gives a tiny negative difference
    assert torch.equal(mean1, torch.tensor([3.0])) and torch.equal(var1, torch.tensor([0.0]))
    assert_close(mean2, [2.5])
    assert_close(var2, [4.5])  # (1.5^2 + 1.5^2) / (2 - 1)


# ---------------------------------------------------------------- hooks and exits


def test_metadata_and_factory_calls_pass_through():
    # shape queries with keywords, and factories called with keywords only, work as without
    # the recorder
    with LayerRecorderMessenger([]):
        x = torch.zeros(size=(2, 3))
        assert x.size(dim=1) == 3 and x.stride(dim=0) == 3
        assert torch.equal(torch.ones(size=(2,)), torch.tensor([1.0, 1.0]))


def _two_layer_model(x):
    h = F.linear(x, _latent("w1", 3, 4))
    return F.linear(h, _latent("w2", 2, 3))


def test_on_layer_replaces_outputs():
    seen = []

    def hook(layer):
        assert isinstance(layer, RecordedLayer)
        seen.append((layer.weight_name, len(rec.layers)))
        return torch.ones(5, 3) if layer.weight_name == "w1" else None

    w2 = torch.randn(2, 3)
    rec = LayerRecorderMessenger(["w1", "w2"], on_layer=hook)
    with rec:
        out = poutine.condition(_two_layer_model, data={"w1": W_OUT_IN, "w2": w2})(X)
    assert seen == [("w1", 1), ("w2", 2)]  # the layer is listed before the hook runs
    assert torch.equal(rec.layers[0].output, torch.ones(5, 3))
    assert torch.equal(rec.layers[1].call.input, torch.ones(5, 3))
    assert_close(out, F.linear(torch.ones(5, 3), w2))


def test_stop_model_swallowed_other_errors_not():
    def stop(layer):
        raise StopModel

    values = {"w1": W_OUT_IN, "w2": torch.randn(2, 3)}
    rec = LayerRecorderMessenger(["w1", "w2"], on_layer=stop)
    with rec:
        poutine.condition(_two_layer_model, data=values)(X)
        raise AssertionError("not reached")  # pragma: no cover
    assert [layer.weight_name for layer in rec.layers] == ["w1"]
    assert not torch.overrides._is_torch_function_mode_enabled()
    assert rec not in pyro.poutine.runtime._PYRO_STACK

    def fail(layer):
        raise KeyError("inside")

    rec = LayerRecorderMessenger(["w1", "w2"], on_layer=fail)
    with pytest.raises(KeyError):
        with rec:
            poutine.condition(_two_layer_model, data=values)(X)
    assert not torch.overrides._is_torch_function_mode_enabled()
    assert rec not in pyro.poutine.runtime._PYRO_STACK
    # the messenger works again after both exits
    rec = LayerRecorderMessenger(["w1", "w2"])
    with rec:
        poutine.condition(_two_layer_model, data=values)(X)
    assert [layer.weight_name for layer in rec.layers] == ["w1", "w2"]
    with rec:
        pass  # a clean exit returns False: nothing to swallow


# ---------------------------------------------------------------- data flow


def _flow_model(x, y):
    h = torch.tanh(F.linear(x, _latent("w1", 3, 4), _latent("b1", 3)))
    out = h @ _latent("w2", 3, 2) + _latent("b2", 2)
    loc, head = out.chunk(2, dim=-1)
    noise = pyro.sample("noise", dist.LogNormal(0.0, 1.0))
    s = pyro.param("s", torch.tensor([0.5]))
    scale = F.softplus(s) * noise
    pyro.sample("y", dist.Normal(loc, scale).to_event(2), obs=y)
    pyro.sample("z", dist.Normal(torch.cat([loc, h], -1), F.softplus(head)).to_event(2),
                obs=torch.zeros(5, 4))


_FLOW_VALUES = {"w1": W_OUT_IN, "b1": B, "w2": torch.randn(3, 2), "b2": torch.randn(2),
                "noise": torch.tensor(0.7)}


def test_likelihood_flow():
    pyro.clear_param_store()
    rec, _ = _record(_flow_model, _FLOW_VALUES, X, torch.zeros(5, 1), track_flow=True)
    assert [layer.site_names for layer in rec.layers] == [("w1", "b1"), ("w2", "b2")]
    assert [s["name"] for s in rec.observed] == ["y", "z"]
    # the last observed site's parameters: its loc joins the first layer's output and a
    # chunk of the second's, its scale the other chunk
    assert rec.likelihood_flow == {
        "loc": frozenset({("layer", 1), ("layer", 0)}),
        "scale": frozenset({("layer", 1)}),
    }
    pyro.clear_param_store()


def test_likelihood_flow_of_normal_loc_and_scale():
    pyro.clear_param_store()

    def model(x, y):
        h = torch.tanh(F.linear(x, _latent("w1", 3, 4), _latent("b1", 3)))
        loc = h @ _latent("w2", 3, 1) + _latent("b2", 1)
        noise = pyro.sample("noise", dist.LogNormal(0.0, 1.0))
        s = pyro.param("s", torch.tensor([0.5]))
        pyro.sample("y", dist.Normal(loc, F.softplus(s) * noise).to_event(2), obs=y)

    values = {"w1": W_OUT_IN, "b1": B, "w2": torch.randn(3, 1), "b2": torch.randn(1),
              "noise": torch.tensor(0.7)}
    rec, _ = _record(model, values, X, torch.zeros(5, 1), track_flow=True)
    assert rec.likelihood_flow == {
        "loc": frozenset({("layer", 1)}),
        "scale": frozenset({("param", "s"), ("site", "noise")}),
    }
    # without track_flow nothing is followed
    rec, _ = _record(model, values, X, torch.zeros(5, 1))
    assert rec.likelihood_flow == {} and [s["name"] for s in rec.observed] == ["y"]
    pyro.clear_param_store()


def test_likelihood_flow_through_a_bias_added_to_a_product():
    # A scale head written as h @ w + b flows like F.linear(h, w.t(), b): from the layer only.
    def model(x, y, spelled_out):
        w, b = _latent("w", 4, 2), _latent("b", 2)
        out = x @ w + b if spelled_out else F.linear(x, w.t(), b)
        loc, head = out.chunk(2, dim=-1)
        pyro.sample("y", dist.Normal(loc, F.softplus(head)).to_event(2), obs=y)

    values = {"w": torch.randn(4, 2), "b": torch.randn(2)}
    for spelled_out in (False, True):
        rec, _ = _record(model, values, X, torch.zeros(5, 1), spelled_out, track_flow=True)
        assert rec.likelihood_flow == {
            "loc": frozenset({("layer", 0)}), "scale": frozenset({("layer", 0)}),
        }, spelled_out


def test_likelihood_flow_through_a_param_added_as_a_fixed_bias():
    def model(x, y):
        loc = x @ _latent("w", 4, 1) + pyro.param("c", torch.zeros(1))
        pyro.sample("y", dist.Normal(loc, 1.0).to_event(2), obs=y)

    pyro.clear_param_store()
    rec, _ = _record(model, {"w": torch.randn(4, 1)}, X, torch.zeros(5, 1), track_flow=True)
    assert _only_layer(rec).bias_name is None
    assert rec.likelihood_flow["loc"] == frozenset({("layer", 0), ("param", "c")})
    pyro.clear_param_store()


class _NoConstraints(dist.TorchDistribution):
    # a user's likelihood that declares no arg_constraints (torch only warns about it)
    support = dist.constraints.real

    def __init__(self, loc):
        self.loc = loc
        super().__init__(loc.shape[:-1], loc.shape[-1:], validate_args=False)

    def log_prob(self, value):
        return -(value - self.loc).pow(2).sum(-1)


class _DuckTyped:
    # not a Distribution at all: a callable with a log_prob
    def __init__(self, loc):
        self.loc = loc

    def __call__(self):
        return self.loc

    def log_prob(self, value):
        return -(value - self.loc).pow(2).sum(-1)


@pytest.mark.parametrize(
    "likelihood", [_NoConstraints, _DuckTyped], ids=["no arg_constraints", "duck-typed"]
)
def test_likelihood_without_arg_constraints(likelihood):
    # Regression: the recorder raised a bare NotImplementedError (torch's arg_constraints)
    # before I-BLM could say which likelihoods it supports.
    def model(x, y):
        pyro.sample("y", likelihood(F.linear(x, _latent("w", 3, 4))), obs=y)
        pyro.sample("z", dist.Normal(0.0, 1.0), obs=0.5)  # not a tensor: not listed

    y = torch.zeros(5, 3)
    rec, _ = _record(model, {"w": W_OUT_IN}, X, y, track_flow=True)
    assert rec.likelihood_flow == {} and [s["name"] for s in rec.observed] == ["y"]


@pytest.mark.parametrize(
    "likelihood",
    [
        (lambda t: dist.OneHotCategorical(logits=t), torch.eye(3)[[0, 2, 1, 1, 0]]),
        (lambda t: dist.Categorical(logits=t), torch.tensor([0, 2, 1, 1, 0])),
        (lambda t: dist.Bernoulli(logits=t).to_event(1), torch.ones(5, 3)),
    ],
    ids=["one-hot categorical", "categorical", "bernoulli"],
)
def test_likelihood_flow_of_logits(likelihood):
    likelihood, y = likelihood

    def model(x):
        logits = F.linear(torch.relu(F.linear(x, _latent("w1", 3, 4))), _latent("w2", 3, 3))
        pyro.sample("y", likelihood(logits), obs=y)

    values = {"w1": W_OUT_IN, "w2": torch.randn(3, 3)}
    rec, _ = _record(model, values, X, track_flow=True)
    # the distribution's own (wrapped or wrapping) parameters, all from the last layer
    # (torch computes probs from the logits for some)
    assert rec.likelihood_flow["logits"] == frozenset({("layer", 1)})
    assert set(rec.likelihood_flow.values()) == {frozenset({("layer", 1)})}


def test_flow_through_batch_norm_and_lists():
    def model(x, y):
        h = F.linear(x, _latent("w", 3, 4))
        normed = F.batch_norm(h, None, None, pyro.param("g", torch.ones(3)), training=True)
        loc = torch.cat([normed, pyro.param("c", torch.zeros(5, 1))], dim=1)
        pyro.sample("y", dist.Normal(loc, 1.0).to_event(2), obs=y)

    pyro.clear_param_store()
    rec, _ = _record(model, {"w": W_OUT_IN}, X, torch.zeros(5, 4), track_flow=True)
    assert rec.likelihood_flow == {
        "loc": frozenset({("layer", 0), ("param", "g"), ("param", "c")}),
        "scale": frozenset(),
    }
    pyro.clear_param_store()


def test_sources_are_followed_as_the_values_of_their_sites():
    # a site hidden from the recorder (its value set outside, e.g. held by a poutine.block
    # inside it) is followed through the tensor given as its value
    sigma = torch.tensor(0.3)

    def model(x, y):
        mean = F.linear(x, _latent("w", 3, 4))
        pyro.sample("y", dist.Normal(mean, sigma * 2.0).to_event(2), obs=y)

    rec, _ = _record(model, {"w": W_OUT_IN}, X, torch.zeros(5, 3), track_flow=True,
                     sources={"sigma": sigma})
    assert rec.likelihood_flow == {"loc": frozenset({("layer", 0)}),
                                   "scale": frozenset({("site", "sigma")})}
    rec, _ = _record(model, {"w": W_OUT_IN}, X, torch.zeros(5, 3), track_flow=True)
    assert rec.likelihood_flow["scale"] == frozenset()  # (a constant without it)


def test_a_latent_bias_is_in_the_flow_through_its_layer_only():
    # x @ w + b: the sum is the layer's output, whose flow is the layer's (not b's site)
    def model(x, y):
        mean = x @ _latent("w", 4, 3) + _latent("b", 3)
        pyro.sample("y", dist.Normal(mean, 1.0).to_event(2), obs=y)

    rec, _ = _record(model, {"w": W_IN_OUT, "b": B}, X, torch.zeros(5, 3), track_flow=True)
    assert _only_layer(rec).bias_name == "b"
    assert rec.likelihood_flow == {"loc": frozenset({("layer", 0)}), "scale": frozenset()}


def test_tensors_made_from_a_shape_carry_no_flow():
    # ones_like / zeros_like / full_like read a tensor's shape only (the table the handlers
    # use too): a scale written torch.ones_like(mean) * 0.3 does not depend on the layer.
    def model(x, y):
        mean = F.linear(x, _latent("w", 3, 4))
        scale = torch.ones_like(mean) * 0.3 + torch.zeros_like(mean)
        return pyro.sample("y", dist.Normal(mean, scale).to_event(2), obs=y)

    rec, _ = _record(model, {"w": W_OUT_IN}, X, torch.zeros(5, 3), track_flow=True)
    assert rec.likelihood_flow["loc"] == frozenset({("layer", 0)})
    assert rec.likelihood_flow["scale"] == frozenset()
