"""Which matrix products are read as a linear layer, and that the reading is exact:
whenever :func:`parse_matmul` accepts a call, ``F.linear`` with what it returns gives
the call's own output."""

import pytest
import torch
import torch.nn.functional as F

from pyro_vinit.poutine._layer_ops import parse_layer_call, parse_matmul

_T = torch.Tensor
torch.manual_seed(0)
X = torch.randn(5, 4, dtype=torch.float64)
X3 = torch.randn(2, 5, 4, dtype=torch.float64)
X1 = torch.randn(4, dtype=torch.float64)
XT = X.t().contiguous()  # (in, batch)
W = torch.randn(4, 3, dtype=torch.float64)  # (in, out), as x @ w takes it
WT = W.t().contiguous()  # (out, in), as F.linear takes it
B = torch.randn(3, dtype=torch.float64)
W3 = torch.randn(4, 3, 2, dtype=torch.float64)
WEIGHTS = (W, WT, W3)


def is_weight(t):
    return any(t is w for w in WEIGHTS)


# name: (func, args, kwargs)
ACCEPTED = {
    "matmul": (torch.matmul, (X, W), {}),
    "Tensor.matmul": (_T.matmul, (X, W), {}),
    "x @ w": (_T.__matmul__, (X, W), {}),
    "w.__rmatmul__(x)": (_T.__rmatmul__, (W, X), {}),
    "mm": (torch.mm, (X, W), {}),
    "Tensor.mm": (_T.mm, (X, W), {}),
    "addmm": (torch.addmm, (B, X, W), {}),
    "Tensor.addmm": (_T.addmm, (B, X, W), {}),
    "addmm, unit alpha and beta": (torch.addmm, (B, X, W), {"alpha": 1, "beta": 1}),
    "1-d input": (torch.matmul, (X1, W), {}),
    "batched input": (torch.matmul, (X3, W), {}),
    "einsum": (torch.einsum, ("bi,io->bo", X, W), {}),
    "einsum, spaces": (torch.einsum, ("b i , i o -> b o", X, W), {}),
    "einsum, operand list": (torch.einsum, ("bi,io->bo", [X, W]), {}),
    "einsum, operand tuple": (torch.einsum, ("bi,io->bo", (X, W)), {}),
    "einsum, weight first": (torch.einsum, ("io,bi->bo", W, X), {}),
    "einsum, (out, in) weight": (torch.einsum, ("bi,oi->bo", X, WT), {}),
    "einsum, ellipsis": (torch.einsum, ("...i,io->...o", X3, W), {}),
    "einsum, batched": (torch.einsum, ("bti,io->bto", X3, W), {}),
    "einsum, contracted index first": (torch.einsum, ("ib,io->bo", XT, W), {}),
    # written to vectorize over the weight's sample dims, run on one weight
    "einsum, ellipsis on a 2-d weight": (torch.einsum, ("bi,...io->...bo", X, W), {}),
    "einsum, ellipsis on both": (torch.einsum, ("...bi,...io->...bo", X3, W), {}),
}

REFUSED = {
    "not a product": (torch.bmm, (X3, X3.transpose(1, 2)), {}),
    "matmul with out=": (torch.matmul, (X, W), {"out": torch.empty(5, 3)}),
    "matmul, three arguments": (torch.matmul, (X, W, W), {}),
    "matmul, two weights": (torch.matmul, (WT, W), {}),
    "matmul, input not a weight's partner": (torch.matmul, (X, X.t()), {}),
    "matmul, 3-d weight": (torch.matmul, (X, W3), {}),
    "matmul, 0-d input": (torch.matmul, (torch.tensor(2.0), W), {}),
    "matmul, not a tensor": (torch.matmul, (2.0, W), {}),
    "matmul, weight first": (torch.matmul, (W, X.t()), {}),
    "rmatmul, three arguments": (_T.__rmatmul__, (W, X, X), {}),
    "addmm, beta": (torch.addmm, (B, X, W), {"beta": 2}),
    "addmm, alpha": (torch.addmm, (B, X, W), {"alpha": 0.5}),
    "addmm, two arguments": (torch.addmm, (X, W), {}),
    "addmm, matrix bias": (torch.addmm, (torch.zeros(5, 3), X, W), {}),
    "addmm, bias not a tensor": (torch.addmm, (1.0, X, W), {}),
    # mm and addmm take matrices only: as layers, F.linear would run what the program can't
    "mm, batched input": (torch.mm, (X3, W), {}),
    "Tensor.mm, 1-d input": (_T.mm, (X1, W), {}),
    "addmm, batched input": (torch.addmm, (B, X3, W), {}),
    "Tensor.addmm, 1-d input": (_T.addmm, (B, X1, W), {}),
    "einsum, no output": (torch.einsum, ("bi,io", X, W), {}),
    "einsum, three operands": (torch.einsum, ("bi,io,o->bo", X, W, B), {}),
    "einsum, keyword argument": (torch.einsum, ("bi,io->bo", X, W), {"optimize": None}),
    "einsum, one operand": (torch.einsum, ("bi->b", X), {}),
    "einsum, one operand in a list": (torch.einsum, ("bi->b", [X]), {}),
    "einsum, three operands in a list": (torch.einsum, ("bi,io,o->bo", [X, W, B]), {}),
    "einsum, second argument not a list": (torch.einsum, ("bi,io->bo", X), {}),
    "einsum, operand not a tensor": (torch.einsum, ("bi,io->bo", [X, 2.0]), {}),
    "einsum, first operand not a tensor": (torch.einsum, ("bi,io->bo", [2.0, W]), {}),
    "einsum, equation not a string": (torch.einsum, (1, X, W), {}),
    "einsum, two weights": (torch.einsum, ("oi,io->oo", WT, W), {}),
    "einsum, two weights in a layer's equation": (torch.einsum, ("bi,io->bo", WT, W), {}),
    "einsum, two weights, weight first": (torch.einsum, ("io,bi->bo", W, WT), {}),
    "einsum, no weight in a layer's equation": (torch.einsum, ("io,bi->bo", W.clone(), X), {}),
    "einsum, repeated free input index": (torch.einsum, ("bbi,io->bbo", X3, W), {}),
    "einsum, no weight": (torch.einsum, ("bi,ci->bc", X, X), {}),
    "einsum, 3-d weight": (torch.einsum, ("bi,iop->bop", X, W3), {}),
    "einsum, ellipsis in the weight": (torch.einsum, ("bi,...o->bo", X, W), {}),
    "einsum, ellipsis on a 3-d weight": (torch.einsum, ("bi,...io->...bo", X, W3), {}),
    "einsum, a dot in the weight": (torch.einsum, ("bi,i.->b.", X, W), {}),
    "einsum, a dot first in the weight": (torch.einsum, ("bi,.i->b.", X, WT), {}),
    "einsum, nothing contracted": (torch.einsum, ("bi,jo->bijo", X, W), {}),
    "einsum, contracted index kept": (torch.einsum, ("bi,io->bio", X, W), {}),
    "einsum, repeated input index": (torch.einsum, ("ii,io->io", X[:4], W), {}),
    "einsum, output reordered": (torch.einsum, ("bi,io->ob", X, W), {}),
    "einsum, output index also in the input": (torch.einsum, ("oi,io->oo", X[:4], W), {}),
    "einsum, ellipsis, contracted index not last": (torch.einsum, ("...ib,io->...bo", X3, W),
                                                    {}),
    # the sample dims of a weight written to vectorize placed inside the output, not first
    "einsum, a 2-d weight's ellipsis inside the output": (torch.einsum, ("bi,...io->b...o", X,
                                                                         W), {}),
}


def _as_linear(parsed):
    x, w, transposed, bias = parsed
    return F.linear(x, w.t() if transposed else w, bias)


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_products_are_exact(name):
    func, args, kwargs = ACCEPTED[name]
    parsed = parse_matmul(func, args, kwargs, is_weight)
    assert parsed is not None, name
    x, w, transposed, bias = parsed
    assert w is W or w is WT  # the program's own tensor, not a copy
    assert transposed == (w is W)
    expected = func(*args, **kwargs) if func is not torch.einsum or len(args) == 3 else \
        torch.einsum(args[0], *args[1])
    torch.testing.assert_close(_as_linear(parsed), expected, rtol=1e-12, atol=1e-12)
    assert (bias is B) == (func in (torch.addmm, _T.addmm))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_calls(name):
    func, args, kwargs = REFUSED[name]
    assert parse_matmul(func, args, kwargs, is_weight) is None


def test_is_weight_decides_which_operand_is_the_layer():
    # The same product is a layer or not depending on which operand is a weight.
    assert parse_matmul(torch.matmul, (X, W), {}, lambda t: False) is None
    assert parse_matmul(torch.matmul, (X, W), {}, lambda t: True) is None  # both
    parsed = parse_matmul(torch.einsum, ("bi,io->bo", X, W), {}, lambda t: t is W)
    assert parsed is not None and parsed[1] is W
    parsed = parse_matmul(torch.einsum, ("io,bi->bo", W, X), {}, lambda t: t is W)
    assert parsed is not None and parsed[1] is W and torch.equal(parsed[0], X)


def test_parse_layer_call_fills_conv_defaults_and_keywords():
    x, w, b = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3), torch.randn(3)
    op, inp, weight, bias, extra = parse_layer_call(F.conv2d, (x, w), {})
    assert (op, inp is x, weight is w, bias) == ("conv2d", True, True, None)
    assert extra == {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}
    op, inp, weight, bias, extra = parse_layer_call(F.conv2d, (x, w, b, 2, 1), {"groups": 1})
    assert (op, inp is x, weight is w, bias is b) == ("conv2d", True, True, True)
    assert extra == {"stride": 2, "padding": 1, "dilation": 1, "groups": 1}
    x2, w2 = x[0, 0], w[0, 0]
    op, inp, weight, bias, extra = parse_layer_call(
        F.linear, (), {"input": x2, "weight": w2, "bias": b})
    assert (op, inp is x2, weight is w2, bias is b, extra) == ("linear", True, True, True, {})
    assert parse_layer_call(F.linear, (x2, w2), {})[3] is None
    op, inp, weight, bias, extra = parse_layer_call(F.linear, (x2,), {"weight": w2})
    assert (op, inp is x2, weight is w2, bias, extra) == ("linear", True, True, None, {})
    assert parse_layer_call(torch.matmul, (x, w), {}) is None


def test_iblm_traces_a_model_with_a_one_operand_einsum():
    # Regression: the list form of a one-operand einsum (here an identity between
    # the layers) crashed the layer recorder with "not enough values to unpack".
    import pyro
    import pyro.distributions as dist
    from pyro.infer.autoguide import AutoNormal

    from pyro_vinit import init_guide_iblm

    def model(x, y=None):
        w1 = pyro.sample("w1", dist.Normal(0.0, 1.0).expand([3, 4]).to_event(2))
        w2 = pyro.sample("w2", dist.Normal(0.0, 1.0).expand([1, 3]).to_event(2))
        h = torch.einsum("bi->bi", [torch.tanh(F.linear(x, w1))])
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(F.linear(h, w2).squeeze(-1), 1.0), obs=y)

    x = torch.randn(20, 4)
    y = x.sum(-1) + 0.1 * torch.randn(20)
    guide = AutoNormal(model)
    guide(x, y)
    before = guide.locs.w2.detach().clone()
    init_guide_iblm(guide, (x, y))
    assert not torch.equal(guide.locs.w2.detach(), before)


def test_layer_call_reruns_with_replaced_arguments():
    from pyro_vinit.poutine._layer_ops import LayerCall

    x, w, b = torch.randn(2, 2, 7, 7), torch.randn(3, 2, 3, 3), torch.randn(3)
    kwargs = {"stride": 2, "padding": 1, "dilation": 1, "groups": 1}
    call = LayerCall("conv2d", x, w, b, dict(kwargs))
    torch.testing.assert_close(call(), F.conv2d(x, w, b, **kwargs))
    x2, w2, b2 = torch.randn_like(x), torch.randn_like(w), torch.randn_like(b)
    torch.testing.assert_close(call(input=x2), F.conv2d(x2, w, b, **kwargs))
    torch.testing.assert_close(call(weight=w2), F.conv2d(x, w2, b, **kwargs))
    torch.testing.assert_close(call(bias=b2), F.conv2d(x, w, b2, **kwargs))
    torch.testing.assert_close(call(bias=False), F.conv2d(x, w, None, **kwargs))
    torch.testing.assert_close(call(x2, w2, b2), F.conv2d(x2, w2, b2, **kwargs))


def test_op_name():
    # The names users spell; a callable without a __name__ (which reaches the handlers only
    # through a third-party __torch_function__ dispatch) is named by its str.
    import functools

    from pyro_vinit.poutine._layer_ops import op_name

    assert [op_name(f) for f in (torch.mm, _T.__matmul__, _T.__rmatmul__, F.conv2d)] == \
        ["mm", "matmul", "matmul", "conv2d"]
    unnamed = functools.partial(F.linear, bias=None)
    assert op_name(unnamed) == str(unnamed)



# op, input shape, weight shape (with the batch dims (S, 1) = (2, 1)), groups
FITTING = {
    "linear": ("linear", (5, 4), (2, 1, 3, 4), 1),
    "linear, batched input": ("linear", (2, 5, 4), (2, 1, 3, 4), 1),
    "conv1d": ("conv1d", (5, 2, 9), (2, 1, 6, 2, 3), 1),
    "conv2d, groups": ("conv2d", (2, 5, 4, 6, 6), (2, 1, 6, 2, 3, 3), 2),
    "conv3d": ("conv3d", (5, 2, 4, 4, 4), (2, 1, 4, 2, 2, 2, 2), 1),
}


@pytest.mark.parametrize("op, x_shape, w_shape, dim", [
    ("linear", (2, 5, 3), (2, 1, 3, 4), "feature"),
    ("conv2d", (2, 5, 3, 6, 6), (2, 1, 6, 2, 3, 3), "channel"),
])
@pytest.mark.parametrize("name", ["w", None])
def test_check_batched_input_messages(op, x_shape, w_shape, dim, name):
    from pyro_vinit.poutine._layer_ops import check_batched_input

    kwargs = {} if op == "linear" else {"groups": 1}
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    site = " (sample site 'w')" if name else ""
    expected = 4 if op == "linear" else 2
    message = (
        f"F.{op}{site} runs batched (its weight or bias has the batch dims of vectorized "
        f"samples or particles) with a weight that takes {expected} input {dim}s, but its "
        f"input of shape {tuple(x.shape)} has 3. Where the layers before it ran batched, "
        "their outputs carry these batch dims on the left of the model's own dims, so a "
        "reshape that counts dims from the left (nn.Flatten(), x.flatten(1), "
        "x.view(x.size(0), -1), x.reshape(len(x), -1)) merges them with the "
        f"{dim}s. Count dims from the right instead, as models run with vectorized samples "
        "must: e.g. nn.Flatten(-3), x.flatten(-3) or x.reshape(x.shape[:-3] + (-1,)) for "
        "(C, H, W) features.")
    with pytest.raises(ValueError) as error:
        check_batched_input(op, x, w, kwargs, name)
    assert str(error.value) == message
    # batch dims that do not broadcast: (3, 5) left of the features against (2, 1)
    x = torch.randn((3, 5) + ((4,) if op == "linear" else (2, 6, 6)))
    features, x_batch = ("features" if op == "linear" else "channels"), (3, 5)
    with pytest.raises(ValueError) as error:
        check_batched_input(op, x, w, kwargs, name)
    assert str(error.value) == (
        f"F.{op}{site} runs batched with a weight of batch dims (2, 1) (a dim of "
        "vectorized samples or particles, left of the model's max_plate_nesting plate "
        f"dims), which do not line up with its input's {x_batch}: the input has more dims "
        f"left of its {features} than the plates, e.g. (batch, tokens, features) under one "
        "plate. Give the ELBO max_plate_nesting= that many dims (TraceMeanField_ELBO(..., "
        "max_plate_nesting=2))")


def test_check_batched_input_leaves_an_input_without_a_channel_dim_to_the_op():
    # F.conv2d's own error says what is wrong with a 2-d input
    from pyro_vinit.poutine._layer_ops import check_batched_input

    w = torch.randn(2, 1, 6, 2, 3, 3)
    assert check_batched_input("conv2d", torch.randn(4, 6), w, {"groups": 1}, "w") is None


@pytest.mark.parametrize("case", FITTING, ids=list(FITTING))
def test_check_batched_input_refuses_what_the_batched_layer_cannot_run(case):
    # An input the batched layer runs passes; one feature or channel less, or the
    # features merged with the dim before them (x.flatten(1) of a batched output), which
    # the batched layer fails on with torch's own error, is refused with the spellings
    # that count dims from the right.
    from pyro_vinit.poutine._layer_ops import batched_layer, check_batched_input

    op, x_shape, w_shape, groups = FITTING[case]
    kwargs = {} if op == "linear" else {"groups": groups}
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    check_batched_input(op, x, w, kwargs, "w")
    batched_layer(op, x, w, None, kwargs)
    c = x.dim() - (1 if op == "linear" else int(op[-2]) + 1)  # the feature or channel dim
    for bad in (x.narrow(c, 0, x.shape[c] - 1), x.flatten(c - 1, c)):
        with pytest.raises(RuntimeError):
            batched_layer(op, bad, w, None, kwargs)
        with pytest.raises(ValueError, match=rf"F\.{op} \(sample site 'w'\) runs batched.*"
                           r"x\.flatten\(-3\)"):
            check_batched_input(op, bad, w, kwargs, "w")
