"""
Small data sets that ship with packages (no download at run time), as
tensors: scikit-learn's digits and diabetes, and the toy regression of [1].

[1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
Bayes for Deep Models"
"""

import math
from typing import Optional, Tuple

import torch

__all__ = ["load_diabetes", "load_digits", "toy_function", "toy_regression"]

Split = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _sklearn():
    try:
        import sklearn.datasets
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "pyro_vinit.data needs scikit-learn: pip install 'pyro-vinit[examples]'"
        ) from e
    return sklearn.datasets


def _split(x: torch.Tensor, y: torch.Tensor, test_fraction: float, seed: int) -> Split:
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * x.shape[0]))
    test, train = perm[:n_test], perm[n_test:]
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
