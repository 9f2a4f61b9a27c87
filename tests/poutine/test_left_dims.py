"""``poutine/_left_dims.py``: the table of dim arguments, read as torch reads them."""

import pytest
import torch
import torch.nn.functional as F

from pyro_vinit.poutine._left_dims import first_dim, left_dims


@pytest.mark.parametrize("rank, implicit", [(1, 0), (2, 1), (3, 0), (4, 1)])
def test_a_softmax_without_dim_takes_torchs_implicit_dim(rank, implicit):
    # torch's _get_softmax_dim: 0 for 0, 1 and 3 dims, else 1
    x = torch.randn((2,) * rank)
    with pytest.warns(UserWarning, match="Implicit dimension choice"):
        expected = F.softmax(x)
    assert torch.equal(expected, F.softmax(x, dim=implicit))
    found = first_dim(F.softmax, (x,), {})
    assert (found is not None) == (implicit == 0)
    # with no leading dims, every model dim counts from the left
    found = left_dims(F.softmax, (x,), {}, lambda t: 0)
    assert found is not None and found.own == implicit - rank and found.given is None


@pytest.mark.parametrize("key", ["input", "tensors", "tensor", "logits", "x1"])
def test_the_input_is_read_from_each_keyword(key):
    x = torch.randn(3, 4)
    func = {"input": torch.sum, "tensors": torch.cat, "tensor": torch.split,
            "logits": F.gumbel_softmax, "x1": F.cosine_similarity}[key]
    value = [x, x] if key == "tensors" else x
    # one leading dim: the model's own dim 0 is written -1 from the right
    assert left_dims(func, (), {key: value, "dim": -1}, lambda t: 1) is None
    found = left_dims(func, (), {key: value, "dim": 0}, lambda t: 1)
    assert found is not None and found.input is x and found.own == -1


def test_a_list_of_tensors_is_read_by_its_first():
    x, y = torch.randn(3, 4), torch.randn(5, 4, 2)
    assert left_dims(torch.cat, ([x, y],), {"dim": 0}, lambda t: t.dim() - 1).input is x
    assert left_dims(torch.cat, ([],), {"dim": 0}, lambda t: 0) is None


@pytest.mark.parametrize("dim, first", [(0, True), (-3, True), (1, False), (-1, False),
                                        ((0, 2), True), ((1, -1), False), ([], False)])
def test_a_dim_naming_the_first_counts_from_either_end(dim, first):
    x = torch.randn(2, 3, 4)
    assert (first_dim(torch.sum, (x,), {"dim": dim}) is not None) == first


@pytest.mark.parametrize("dim", [True, (0, True), "0", 0.0])
def test_what_is_not_an_int_names_no_dim(dim):
    assert first_dim(torch.sum, (torch.randn(2, 3),), {"dim": dim}) is None


@pytest.mark.parametrize("func", [torch.sum, torch.Tensor.sum])
def test_a_call_without_its_input_names_no_dim(func):
    # (torch would refuse it; the handlers read it first and leave it to torch)
    assert left_dims(func, (), {"dim": 0}, lambda t: 0) is None
    assert first_dim(func, (), {"dim": 0}) is None


def test_a_dim_argument_that_is_not_an_int_is_passed_over_for_the_next():
    # x.transpose("a", 0) of a tensor with named dims: dim0 names no int dim, dim1 does
    x = torch.randn(5, 3, 4)
    found = left_dims(torch.Tensor.transpose, (x, "a", 0), {}, lambda t: 1)
    assert found is not None and found.name == "dim1" and found.given == 0 and found.own == -2


@pytest.mark.parametrize("dims, own", [((0, -1), (-2, -1)), ((0, 2), (-2, 2)),
                                       ([1, 0], (-1, -2))])
def test_the_dims_counted_from_the_right_keep_the_others_as_given(dims, own):
    # one leading dim and two of the model's: only those counted from the left within
    # them move (a dim past them, 2, is torch's to refuse)
    x = torch.randn(5, 3, 4)
    found = left_dims(torch.sum, (x, dims), {}, lambda t: 1)
    assert found is not None and found.given == dims and found.own == own
