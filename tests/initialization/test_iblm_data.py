"""The data pool of the initializers: model arguments from one tuple or an
iterable of batches, the rows it keeps and the arguments it slices."""

import pytest
import torch

from pyro_vinit.initialization._data import DataPool


def _batches(num_batches, rows, consumed):
    """``num_batches`` batches ``(x, y, k, s)`` of ``rows`` rows each, recording in
    ``consumed`` how many were read: x and y are indexed by the rows, k (a tensor
    of another length) and s (a float) are not."""
    k = torch.arange(3.0)
    for i in range(num_batches):
        consumed.append(i)
        x = torch.arange(i * rows, (i + 1) * rows, dtype=torch.float32)[:, None].expand(rows, 2)
        yield x, x[:, 0] * 10, k, 0.5


@pytest.mark.parametrize("max_rows, read, kept", [
    (25, 3, 25),  # stops at the first batch that reaches max_rows, and cuts it
    (30, 3, 30),  # reached exactly: no batch more is read
    (31, 4, 31),
    (None, 5, 50),  # every batch
    (100, 5, 50),  # fewer rows than max_rows
])
def test_pool_of_batches_reads_only_the_batches_it_keeps(max_rows, read, kept):
    consumed = []
    pool = DataPool(_batches(5, 10, consumed), max_rows)
    assert len(consumed) == read
    assert pool.num_rows == kept
    x, y, k, s = pool.args
    assert torch.equal(x[:, 0], torch.arange(kept, dtype=torch.float32))
    assert torch.equal(y, x[:, 0] * 10)
    # the arguments not indexed by the rows are the first batch's, not concatenated
    assert torch.equal(k, torch.arange(3.0)) and s == 0.5
    assert sum(len(c[0]) for c in pool.chunks(7)) == kept


def test_select_slices_only_the_arguments_indexed_by_the_rows():
    x, y, k = torch.randn(10, 2), torch.randn(10), torch.randn(3)
    pool = DataPool((x, y, k, "mode"))
    rows = torch.tensor([1, 4, 2])
    sx, sy, sk, mode = pool.select(rows)
    assert torch.equal(sx, x[rows]) and torch.equal(sy, y[rows])
    assert sk is k and mode == "mode"
    sx, sy, sk, mode = pool.select(slice(0, 2))
    assert torch.equal(sx, x[:2]) and torch.equal(sy, y[:2])
    assert sk is k and mode == "mode"


def test_batch_that_is_not_a_tuple_is_refused_by_type():
    x, y = torch.randn(10, 2), torch.randn(10)
    # a list [x, y] is an iterable of batches x and y, not one tuple of arguments
    with pytest.raises(TypeError, match=r"^each batch of the data iterable must be a tuple of "
                       r"model arguments, got Tensor \(a list of tensors is read as an "
                       r"iterable of batches: pass one batch as a tuple, e.g. \(x, y\)\)$"):
        DataPool([x, y])
    # (the advice is for a list; a generator of tensors is no list of two)
    with pytest.raises(TypeError, match=r"^each batch of the data iterable must be a tuple of "
                       r"model arguments, got Tensor$"):
        DataPool(iter([x, y]))


def test_a_bare_tensor_is_refused_naming_the_tuple_to_pass():
    # iterated, its rows were read as batches: "each batch ... got Tensor"
    with pytest.raises(TypeError, match=r"^the data is one tensor of shape \(10, 2\): pass "
                       r"the model's arguments as one tuple, e\.g\. \(x, y\), or a "
                       r"DataLoader of such tuples$"):
        DataPool(torch.randn(10, 2))


def test_data_without_a_tensor_is_refused_naming_arrays_where_given():
    x, y = torch.randn(10, 2), torch.randn(10)
    message = (r"^the data must contain at least one tensor argument whose leading dim "
               r"indexes the data rows, e\.g\. \(x_train, y_train\)")
    with pytest.raises(ValueError, match=message + r"; convert arrays with torch\.as_tensor$"):
        DataPool((x.numpy(), y.numpy()))
    with pytest.raises(ValueError, match=message + "$"):
        DataPool((3, None))
    with pytest.raises(ValueError, match=message + "$"):
        DataPool((torch.tensor(1.0),))  # a scalar indexes no rows


@pytest.mark.parametrize("data", [[], iter([])])
def test_iterable_without_batches_is_refused(data):
    with pytest.raises(ValueError, match=r"^the data is empty: the iterable yielded no batch$"):
        DataPool(data, 100)


def test_a_batch_unlike_the_first_is_refused_by_name():
    # the concatenation of the batches failed in torch ("Sizes of tensors must match")
    import re

    from pyro.infer.autoguide import AutoNormal

    from pyro_vinit import init_guide_iblm
    from pyro_vinit.nn import BayesianClassifier, bayesianize, mlp

    x, y = torch.randn(64, 4), torch.arange(64) % 3
    guide = AutoNormal(BayesianClassifier(bayesianize(mlp((4, 8, 3))), num_data=64))
    message = ("batch 1 of the data has argument 0 of shape (32, 3) torch.float32, batch 0 of "
               "shape (32, 4) torch.float32: every batch must have the shapes and dtypes of "
               "the first, but for the number of rows")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        init_guide_iblm(guide, [(x[:32], y[:32]), (x[32:, :3], y[32:])], batch_size=32)
    assert guide.prototype_trace is None
    with pytest.raises(ValueError, match="batch 1 of the data has 1 arguments, batch 0 has 2"):
        init_guide_iblm(guide, [(x[:32], y[:32]), (x[32:],)], batch_size=32)


def test_describe_names_shapes_dtypes_and_other_types():
    from pyro_vinit.initialization._data import describe

    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    assert describe([x, y]) == "(4, 3) torch.float32, (4,) torch.int64"
    assert describe([x, 2.0, None]) == "(4, 3) torch.float32, float, NoneType"
    assert describe([x, y], ("x", "y")) == "x (4, 3) torch.float32, y (4,) torch.int64"


def test_check_like_first_names_the_argument_that_differs():
    from pyro_vinit.initialization._data import check_like_first

    first = (torch.zeros(4, 3), torch.zeros(4))
    check_like_first(1, (torch.zeros(2, 3), torch.zeros(2)), first)  # rows may differ
    with pytest.raises(ValueError, match=r"^fit: batch 2 of the data has y of shape \(4,\) "
                       r"torch.float64, batch 0 of shape \(4,\) torch.float32: "):
        check_like_first(2, (torch.zeros(4, 3), torch.zeros(4, dtype=torch.float64)), first,
                         ("x", "y"), "fit: ")
