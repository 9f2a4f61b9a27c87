r"""
Bayesian neural networks in the styles of Pyro's tutorials and forum posts:
functional models with :func:`pyro.sample` and ``F.linear`` or ``@``,
:class:`~pyro.nn.PyroModule` with :class:`~pyro.nn.PyroSample` weights,
``pyro.deterministic`` sites, learned observation noise (a latent site or a
``pyro.param``), heteroscedastic heads, BatchNorm/residual CNNs, subsampled
plates and a Transformer layer.

Each :class:`UserModel` bundles a model with a data set that ships with a
package (no download), so that tests and benchmarks can run it end to end.
"""

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.distributions import constraints
from pyro.nn import PyroModule, PyroParam, PyroSample
from torch import nn

from pyro_vinit.data import load_diabetes, load_digits
from pyro_vinit.nn import bayesianize

__all__ = ["USER_MODELS", "UserModel", "blobs", "iris"]

Split = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class UserModel:
    """
    A model and its data.

    :ivar str name: Short name.
    :ivar str task: ``"classification"`` or ``"regression"``.
    :ivar callable make: ``make(num_data) -> model``, a fresh model (new
        module parameters) for a training set of ``num_data`` rows.
    :ivar callable data: ``data() -> (x_train, y_train, x_test, y_test)``.
    :ivar callable predict: ``predict(model, x) -> (mean or logits)``, the
        model's prediction given the latent sites (run under a condition
        handler); None means the model's return value.
    """

    name: str
    task: str
    make: Callable[[int], Callable[..., Any]]
    data: Callable[[], Split]
    predict: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None


def blobs(num_classes: int = 3, dim: int = 10, n: int = 600, seed: int = 0) -> Split:
    """A small, linearly separable classification problem: Gaussian blobs."""
    g = torch.Generator().manual_seed(seed)
    centers = 2.0 * torch.randn(num_classes, dim, generator=g)
    y = torch.arange(n) % num_classes
    x = centers[y] + torch.randn(n, dim, generator=g)
    perm = torch.randperm(n, generator=g)
    x, y = x[perm], y[perm]
    cut = int(0.7 * n)
    return x[:cut], y[:cut], x[cut:], y[cut:]


def iris(seed: int = 0) -> Split:
    """scikit-learn's iris (150 flowers, 3 classes), standardized, split 100 / 50."""
    import sklearn.datasets

    data = sklearn.datasets.load_iris()
    x = torch.as_tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.as_tensor(data.target)
    perm = torch.randperm(150, generator=torch.Generator().manual_seed(seed))
    return x[perm[:100]], y[perm[:100]], x[perm[100:]], y[perm[100:]]


def _standardized_diabetes() -> Split:
    x, y, xt, yt = load_diabetes()
    mean, std = y.mean(), y.std()
    return x, (y - mean) / std, xt, (yt - mean) / std


def _weight(d_in: int, d_out: int) -> dist.TorchDistribution:
    prior: dist.TorchDistribution = (
        dist.Normal(0.0, 1.0 / math.sqrt(d_in)).expand([d_out, d_in]).to_event(2)
    )
    return prior


def functional_tanh(depth: int, width: int = 100) -> Callable[..., torch.Tensor]:
    """A functional model, ``pyro.sample`` + ``F.linear`` with ``pyro.deterministic``
    records of the hidden activations and logits (3 classes)."""

    def model(x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = x
        sizes = [x.shape[-1]] + [width] * depth + [3]
        for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            w = pyro.sample(f"w{i}", _weight(d_in, d_out))
            b = pyro.sample(f"b{i}", dist.Normal(0.0, 1.0).expand([d_out]).to_event(1))
            h = F.linear(h, w, b)
            if i < depth:
                h = pyro.deterministic(f"h{i}", torch.tanh(h))
        logits = pyro.deterministic("logits", h)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits

    return model


class MatmulRegressor(PyroModule):
    """Pyro's "modules" tutorial style: ``x @ self.w + self.b`` with PyroSample
    weights of shape ``(in, out)``, and the noise ``sigma ~ Uniform(0, 10)`` of
    Pyro's regression tutorial."""

    # Read as tensors: PyroModule draws a PyroSample attribute's value (and
    # constrains a PyroParam's) when it is read.
    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    sigma: torch.Tensor

    def __init__(self, d_in: int, hidden: int = 50, noise: str = "uniform") -> None:
        super().__init__()
        # PyroModule's __setattr__ turns these into sample sites / a constrained param.
        self.w1 = PyroSample(  # type: ignore[assignment]
            dist.Normal(0.0, 1.0 / math.sqrt(d_in)).expand([d_in, hidden]).to_event(2)
        )
        self.b1 = PyroSample(  # type: ignore[assignment]
            dist.Normal(0.0, 1.0).expand([hidden]).to_event(1)
        )
        self.w2 = PyroSample(  # type: ignore[assignment]
            dist.Normal(0.0, 1.0 / math.sqrt(hidden)).expand([hidden, 1]).to_event(2)
        )
        self.b2 = PyroSample(  # type: ignore[assignment]
            dist.Normal(0.0, 1.0).expand([1]).to_event(1)
        )
        self.noise = noise
        if noise == "param":
            self.sigma = PyroParam(  # type: ignore[assignment]
                torch.tensor(1.0), constraint=constraints.positive
            )

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = torch.relu(x @ self.w1 + self.b1)
        mean = (h @ self.w2 + self.b2).squeeze(-1)
        if self.noise == "uniform":
            sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
        elif self.noise == "halfnormal":
            sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        else:
            sigma = self.sigma
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean


class HeteroscedasticRegressor(PyroModule):
    """Shared Bayesian layers, a mean head and a scale head:
    ``Normal(mean, softplus(s))``."""

    def __init__(self, d_in: int, hidden: int = 50) -> None:
        super().__init__()
        self.body = bayesianize(nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU()))
        self.mean_head = bayesianize(nn.Linear(hidden, 1))
        self.scale_head = bayesianize(nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.body(x)
        mean: torch.Tensor = self.mean_head(h).squeeze(-1)
        scale = F.softplus(self.scale_head(h)).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, scale), obs=y)
        return mean


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))


def resnet(channels: int = 16, classes: int = 10) -> nn.Module:
    """A small ResNet-style CNN: Bayesian convs, BatchNorm2d, a residual block,
    dropout, global average pooling and a Bayesian linear head."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        _Block(channels),
        nn.Dropout(0.1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, classes),
    )


class Classifier(PyroModule):
    """``Categorical(logits=net(x))`` over a plate (subsampled with
    ``subsample_size``: the model indexes its own logits and labels)."""

    def __init__(
        self, net: nn.Module, num_data: int, subsample_size: Optional[int] = None
    ) -> None:
        super().__init__()
        self.net = net
        self.num_data = num_data
        self.subsample_size = subsample_size

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits: torch.Tensor
        if self.subsample_size is None:
            logits = self.net(x)
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
            return logits
        logits = self.net(x)
        with pyro.plate("data", x.shape[0], subsample_size=self.subsample_size) as ind:
            pyro.sample("obs", dist.Categorical(logits=logits[ind]),
                        obs=y[ind] if y is not None else None)
        return logits


def _digits_images() -> Split:
    return load_digits(image=True)


def _mlp(sizes: Sequence[int], activation: Type[nn.Module] = nn.ReLU) -> nn.Sequential:
    layers: List[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


class _TokenTransformer(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # digits rows as 8 tokens of 8 pixels
        h = self.layer(self.embed(x.reshape(x.shape[0], 8, 8)))
        logits: torch.Tensor = self.head(h.mean(1))
        return logits


def _net(model: Classifier, x: torch.Tensor) -> torch.Tensor:
    logits: torch.Tensor = model.net(x)
    return logits


USER_MODELS: Dict[str, UserModel] = {
    m.name: m
    for m in [
        UserModel("tanh_depth3", "classification", lambda n: functional_tanh(3), iris),
        UserModel("matmul_uniform_noise", "regression", lambda n: MatmulRegressor(10),
                  _standardized_diabetes),
        UserModel("matmul_halfnormal_noise", "regression",
                  lambda n: MatmulRegressor(10, noise="halfnormal"), _standardized_diabetes),
        UserModel("matmul_param_noise", "regression",
                  lambda n: MatmulRegressor(10, noise="param"), _standardized_diabetes),
        UserModel("heteroscedastic", "regression", lambda n: HeteroscedasticRegressor(10),
                  _standardized_diabetes),
        UserModel("resnet_bn", "classification",
                  lambda n: Classifier(bayesianize(resnet()), n), _digits_images, _net),
        UserModel("subsampled_plate", "classification",
                  lambda n: Classifier(bayesianize(_mlp((64, 100, 10))), n, subsample_size=64),
                  load_digits, _net),
        UserModel("transformer", "classification",
                  lambda n: Classifier(bayesianize(_TokenTransformer()), n), load_digits, _net),
    ]
}
