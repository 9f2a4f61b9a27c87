r"""
Bayesian neural networks in the styles of Pyro's tutorials and forum posts:
functional models with :func:`pyro.sample` and ``F.linear`` or ``@``,
:class:`~pyro.nn.PyroModule` with :class:`~pyro.nn.PyroSample` weights,
``pyro.deterministic`` sites, learned observation noise (a latent site or a
``pyro.param``), heteroscedastic heads, BatchNorm/residual CNNs, subsampled
plates, a Transformer layer, a siamese net (one weight used twice), an
:class:`~pyro.infer.autoguide.AutoGuideList` over hidden hyperparameters and a
model conditioned with :func:`pyro.condition`.

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
from pyro.infer.autoguide import AutoDelta, AutoGuide, AutoGuideList, AutoNormal
from pyro.nn import PyroModule, PyroParam, PyroSample
from torch import nn

from pyro_vinit.data import load_diabetes, load_digits
from pyro_vinit.nn import bayesianize

__all__ = [
    "USER_MODELS",
    "ResNetBlock",
    "ResNetClassifier",
    "SiameseNet",
    "UserModel",
    "blobs",
    "digit_pairs",
    "hierarchical_regressor",
    "hyperparameter_guide",
    "iris",
]

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
    :ivar callable guide: ``guide(model) -> guide``, the guide the user builds
        for this model; None means any autoguide of the whole model.
    :ivar bool conditioned: Whether ``make`` returns the model conditioned on
        the training targets (called with ``x_train`` alone).
    """

    name: str
    task: str
    make: Callable[[int], Callable[..., Any]]
    data: Callable[[], Split]
    predict: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None
    guide: Optional[Callable[[Callable[..., Any]], AutoGuide]] = None
    conditioned: bool = False


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


class ResNetBlock(PyroModule):
    """A residual block of two Bayesian 3x3 convolutions with BatchNorm."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = _bayesian_conv(channels, channels)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = _bayesian_conv(channels, channels)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))


def _bayesian_conv(c_in: int, c_out: int) -> nn.Module:
    # mypy reads PyroModule[...] as PyroModule's own constructor.
    conv = PyroModule[nn.Conv2d](c_in, c_out, 3, padding=1, bias=False)  # type: ignore[call-arg, arg-type]
    conv.weight = PyroSample(
        dist.Normal(0.0, math.sqrt(2.0 / (9 * c_in))).expand([c_out, c_in, 3, 3]).to_event(4)
    )
    return conv


class ResNetClassifier(PyroModule):
    """A ResNet-style CNN written with ``PyroModule[nn.Conv2d]`` and PyroSample
    kernels: a stem convolution, residual blocks with BatchNorm2d, global
    average pooling and a Bayesian linear head, ``Categorical(logits=...)``."""

    def __init__(self, channels: int = 16, blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = _bayesian_conv(1, channels)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = PyroModule[nn.Sequential](
            *[ResNetBlock(channels) for _ in range(blocks)]  # type: ignore[arg-type]
        )
        self.fc = PyroModule[nn.Linear](channels, classes)  # type: ignore[call-arg, arg-type]
        self.fc.weight = PyroSample(
            dist.Normal(0.0, 1.0 / math.sqrt(channels)).expand([classes, channels]).to_event(2)
        )
        self.fc.bias = PyroSample(
            dist.Normal(0.0, 1.0).expand([classes]).to_event(1)
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.bn(self.stem(x))))
        out: torch.Tensor = self.fc(h.mean((-2, -1)))  # global average pooling
        return out

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = self.logits(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


class SiameseNet(PyroModule):
    """A siamese net: one Bayesian embedding applied to both images of a pair
    (``pairs[:, 0]`` and ``pairs[:, 1]``, one weight used twice in a forward
    pass), then ``Bernoulli(logits=...)`` of "same digit" from ``|a - b|``."""

    def __init__(self, d_in: int = 64, width: int = 32) -> None:
        super().__init__()
        self.embed = PyroModule[nn.Linear](d_in, width)  # type: ignore[call-arg, arg-type]
        self.embed.weight = PyroSample(
            dist.Normal(0.0, 1.0 / math.sqrt(d_in)).expand([width, d_in]).to_event(2)
        )
        self.embed.bias = PyroSample(
            dist.Normal(0.0, 1.0).expand([width]).to_event(1)
        )
        self.head = PyroModule[nn.Linear](width, 1)  # type: ignore[call-arg, arg-type]
        self.head.weight = PyroSample(
            dist.Normal(0.0, 1.0 / math.sqrt(width)).expand([1, width]).to_event(2)
        )
        self.head.bias = PyroSample(
            dist.Normal(0.0, 1.0).expand([1]).to_event(1)
        )

    def forward(self, pairs: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        a = torch.tanh(self.embed(pairs[:, 0]))
        b = torch.tanh(self.embed(pairs[:, 1]))  # the same weight, a second time
        logits: torch.Tensor = self.head((a - b).abs()).squeeze(-1)
        with pyro.plate("data", pairs.shape[0]):
            pyro.sample("obs", dist.Bernoulli(logits=logits), obs=y)
        return logits


def digit_pairs(n: int = 600, seed: int = 0) -> Split:
    """Pairs of digits images, ``(N, 2, 64)``, labelled 1. when both show the same
    digit (half of them), split 70 / 30."""
    x, y, _, _ = load_digits(test_fraction=0.3, seed=seed)
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(len(x), (n,), generator=g)
    same = torch.arange(n) % 2 == 0
    second = torch.empty(n, dtype=torch.long)
    for i in range(n):
        pool = (y == y[first[i]]) if same[i] else (y != y[first[i]])
        candidates = pool.nonzero().squeeze(-1)
        second[i] = candidates[torch.randint(len(candidates), (), generator=g)]
    pairs = torch.stack([x[first], x[second]], 1)
    label = same.float()
    perm = torch.randperm(n, generator=g)
    pairs, label = pairs[perm], label[perm]
    cut = int(0.7 * n)
    return pairs[:cut], label[:cut], pairs[cut:], label[cut:]


def hierarchical_regressor(hidden: int = 50) -> Callable[..., torch.Tensor]:
    """A functional regression net with a prior scale ``tau`` on the weights and a
    noise ``sigma``, hyperparameters a user fits by MAP in an
    :class:`~pyro.infer.autoguide.AutoGuideList` (see :func:`hyperparameter_guide`)."""

    def model(x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        tau = pyro.sample("tau", dist.HalfNormal(1.0))
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        d_in = x.shape[-1]
        w1 = pyro.sample("w1", dist.Normal(0.0, tau / math.sqrt(d_in))
                         .expand([hidden, d_in]).to_event(2))
        b1 = pyro.sample("b1", dist.Normal(0.0, 1.0).expand([hidden]).to_event(1))
        w2 = pyro.sample("w2", dist.Normal(0.0, tau / math.sqrt(hidden))
                         .expand([1, hidden]).to_event(2))
        b2 = pyro.sample("b2", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
        mean = F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean

    return model


def hyperparameter_guide(model: Callable[..., Any]) -> AutoGuideList:
    """The guide of Pyro's forum for :func:`hierarchical_regressor`: an AutoNormal
    over the weights (the hyperparameters hidden from it) and an AutoDelta
    (MAP) over ``tau`` and ``sigma``."""
    guide = AutoGuideList(model)
    guide.append(AutoNormal(pyro.poutine.block(model, hide=["tau", "sigma"])))
    guide.append(AutoDelta(pyro.poutine.block(model, expose=["tau", "sigma"])))
    return guide


def _conditioned_regressor(num_data: int) -> Callable[..., Any]:
    # Conditioned on the training targets of the data below, as a user writes it.
    y = _standardized_diabetes()[1]
    return pyro.condition(MatmulRegressor(10, noise="halfnormal"), data={"obs": y})


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
        UserModel("resnet_pyrosample", "classification", lambda n: ResNetClassifier(),
                  _digits_images, lambda m, x: m.logits(x)),
        UserModel("siamese", "classification", lambda n: SiameseNet(), digit_pairs),
        UserModel("guide_list_hyperparameters", "regression",
                  lambda n: hierarchical_regressor(), _standardized_diabetes,
                  guide=hyperparameter_guide),
        UserModel("conditioned", "regression", _conditioned_regressor,
                  _standardized_diabetes, conditioned=True),
    ]
}
