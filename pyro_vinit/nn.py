"""
One-call conversion of ordinary ``torch.nn`` networks into Bayesian Pyro
models.
"""

import math
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple, Type, Union, cast

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.nn import PyroModule, PyroParam, PyroSample
from torch import nn

from pyro_vinit._pyro_compat import active_messengers, active_sample_plate
from pyro_vinit._warn import warn_at_caller
from pyro_vinit.initialization.pretrained import TRAINED_PREFIX
from pyro_vinit.poutine import LayerCallMessenger

__all__ = ["BayesianClassifier", "BayesianRegressor", "bayesianize", "mlp"]

_LAYER_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_Layer = Union[nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d]


def _fan_in(module: _Layer) -> int:
    # in_features for Linear; in_channels / groups * prod(kernel_size) for Conv
    # (from the shape, so that a layer with no output units has one too)
    return module.weight.shape[1:].numel()


class _NormalPrior:
    """
    The prior N(loc, scale²) of one parameter, built at each access from the
    layer's ``prior_scale`` buffer (and, for a prior centred at the trained
    weights, the buffer ``loc``) so that it follows the module through
    ``.to()``, ``.double()`` and ``.cuda()``; ``loc`` None is a zero mean. A
    class rather than a lambda so that converted modules pickle.
    """

    def __init__(self, shape: torch.Size, loc: Optional[str] = None) -> None:
        self.shape = torch.Size(shape)
        self.loc = loc
        self._cached: Optional[Tuple[Tuple[Any, ...], dist.Independent]] = None

    def __call__(self, module: nn.Module) -> dist.Independent:
        scale = cast(torch.Tensor, module.prior_scale)  # the buffer bayesianize registered
        loc = None if self.loc is None else cast(torch.Tensor, getattr(module, self.loc))
        # The prior is rebuilt only when a buffer is replaced (.to(), .double(), a new
        # tensor) or changed in place (its version counter moves): not at every step.
        key = (scale, scale._version) + (() if loc is None else (loc, loc._version))
        cached = self._cached
        if cached is not None and len(cached[0]) == len(key) and all(
            a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(cached[0], key)
        ):
            return cached[1]
        mean = torch.zeros_like(scale) if loc is None else loc
        prior: dist.Independent = (
            dist.Normal(mean, scale).expand(self.shape).to_event(len(self.shape))
        )
        self._cached = (key, prior)
        return prior

    def __getstate__(self) -> Dict[str, Any]:
        return {"shape": self.shape, "loc": self.loc, "_cached": None}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update({"loc": None}, **state)


def _check_exclude(
    module: nn.Module, exclude: Iterable[Union[str, Type[nn.Module]]]
) -> Tuple[Tuple[str, ...], Tuple[type, ...]]:
    if isinstance(exclude, (str, type)):
        exclude = (exclude,)
    exclude = tuple(exclude)
    names = {name for name, _ in module.named_modules()}
    bad = [
        e
        for e in exclude
        if not (isinstance(e, str) or (isinstance(e, type) and issubclass(e, nn.Module)))
    ]
    if bad:
        raise TypeError(
            f"bayesianize: exclude takes submodule names (str) or nn.Module subclasses "
            f"(e.g. nn.Conv2d, not nn.Conv2d(...)), got {bad!r}"
        )
    excluded_names = tuple(e for e in exclude if isinstance(e, str))
    unknown = [e for e in excluded_names if e not in names]
    if unknown:
        raise ValueError(
            f"bayesianize: exclude names {unknown} are not submodules of the network; "
            f"its submodule names are {sorted(n for n in names if n)}"
        )
    return excluded_names, tuple(e for e in exclude if isinstance(e, type))


def _is_excluded(
    name: str, sub: nn.Module, names: Tuple[str, ...], types: Tuple[type, ...]
) -> bool:
    # a name excludes the submodule and everything inside it ("" is the root)
    inside = any(name == e or name.startswith(e + ".") or e == "" for e in names)
    return inside or isinstance(sub, types)


def bayesianize(
    module: nn.Module,
    *,
    prior_scale: Optional[float] = None,
    exclude: Iterable[Union[str, Type[nn.Module]]] = (),
    keep_weights: bool = False,
    prior_loc: str = "zero",
) -> PyroModule:
    r"""
    Turns every ``nn.Linear`` and ``nn.Conv1d/2d/3d`` of ``module`` (at any
    depth, including inside ``nn.Sequential``) into a Bayesian layer in place:
    its ``weight`` and ``bias`` become sample sites with a Normal prior.

    Usage::

        net = bayesianize(nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10)))
        model = BayesianClassifier(net)
        guide = AutoKTiedNormal(model)

    A trained network's weights are dropped unless ``keep_weights=True``
    (see :func:`~pyro_vinit.init_guide_pretrained`). The default prior is the
    one of [1],

    .. math::

        w \sim \mathcal{N}(0, 1 / D_\text{in}),

    with :math:`D_\text{in}` the layer's fan-in (``in_features``, or
    ``in_channels / groups × kernel size``), for weights and biases alike.
    Sample sites are named after the parameters (``"0.weight"``, and
    ``"net.0.weight"`` once inside a :class:`BayesianClassifier`). Each
    converted layer keeps its prior standard deviation in a buffer
    ``prior_scale``, so the prior follows ``.to(dtype/device)``. Layers of
    width 0 are converted too (their zero-size sites work with every guide); a
    layer with no inputs has only its bias, with prior N(0, 1) and a warning.

    Every other parameter (of excluded layers, normalization layers, ...)
    stays deterministic: Pyro registers it in the param store when the model
    runs, and SVI learns it as a point estimate. Matrices that are not an
    ``nn.Linear`` / ``nn.Conv*d`` weight (attention projections, embeddings,
    a module's own weights used in ``x @ w``) stay deterministic with one
    warning naming them: their fan-in depends on how they are used, so make
    them Bayesian by hand with :class:`~pyro.nn.PyroSample` (matrix products
    with a latent weight are layers for :func:`~pyro_vinit.init_guide_iblm`
    and :class:`~pyro_vinit.poutine.LocalReparamMessenger`).

    :param torch.nn.Module module: The network; converted in place and returned.
    :param float prior_scale: If given, a fixed prior N(0, prior_scale²) for
        every weight and bias instead.
    :param exclude: Layers to leave deterministic, by qualified name (as in
        ``module.named_modules()``, e.g. ``"0"`` or ``"features.conv1"``; a
        container's name excludes all layers inside it) or by type (e.g.
        ``nn.Conv2d``).
    :type exclude: str, type, list or tuple
    :param bool keep_weights: Keep each converted layer's current (trained)
        weight and bias in the buffers ``trained_weight`` and ``trained_bias``,
        which :func:`~pyro_vinit.init_guide_pretrained` starts the guide from.
        By default they are dropped.
    :param str prior_loc: The prior mean: ``"zero"``, or ``"weights"`` (the
        kept weights, with ``keep_weights=True``).
    :return: The converted module, now a :class:`~pyro.nn.PyroModule`.

    [1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
    Bayes for Deep Models"
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"bayesianize: expected a torch.nn.Module, got {type(module).__name__}")
    if prior_scale is not None and (
        isinstance(prior_scale, bool)
        or not isinstance(prior_scale, (int, float))
        or not math.isfinite(prior_scale)
        or not prior_scale > 0
    ):
        raise ValueError(
            f"bayesianize: prior_scale must be a positive finite number, got {prior_scale!r}"
        )
    if not isinstance(keep_weights, bool):
        raise TypeError(
            f"bayesianize: keep_weights must be a bool, got {type(keep_weights).__name__}"
        )
    if prior_loc not in ("zero", "weights"):
        raise ValueError(f"bayesianize: prior_loc must be 'zero' or 'weights', got {prior_loc!r}")
    if prior_loc == "weights" and not keep_weights:
        raise ValueError(
            "bayesianize: prior_loc='weights' centres the priors at the trained weights, "
            "which only keep_weights=True keeps; pass keep_weights=True"
        )
    excluded_names, excluded_types = _check_exclude(module, exclude)

    layers = [
        (name, sub)
        for name, sub in module.named_modules()
        if isinstance(sub, _LAYER_TYPES)
        and not _is_excluded(name, sub, excluded_names, excluded_types)
    ]
    if not layers:
        raise ValueError(
            "bayesianize: the network has no nn.Linear or nn.Conv1d/2d/3d layer left to convert "
            "(check `exclude`). bayesianize converts only these layer types, whose fan-in it "
            "knows. A parameter used in a matrix product (e.g. `x @ self.w + self.b`) is made "
            "Bayesian by hand with PyroSample, e.g. `module.w = PyroSample(dist.Normal(0., "
            "d_in ** -0.5).expand([d_in, d_out]).to_event(2))` on a PyroModule; "
            "init_guide_iblm and local_reparam treat such matrix products as layers"
        )
    converted = [name or "<root>" for name, sub in layers if "weight" not in sub._parameters]
    if converted:
        raise ValueError(
            f"bayesianize: layers {converted} have no weight parameter; are they Bayesian "
            "already? Convert a fresh network, or exclude them by name"
        )

    # Matrices outside the layer types (attention projections, embeddings, a user's own
    # matmul weights) are not converted: say so rather than leave them silently (those
    # the user excluded, and what is inside them, are deterministic by request).
    asked = excluded_names + tuple(name for name, sub in module.named_modules()
                                   if isinstance(sub, excluded_types))
    left = [
        f"{name}.{p}" if name else p
        for name, sub in module.named_modules()
        if not isinstance(sub, _LAYER_TYPES) and not _is_excluded(name, sub, asked, ())
        for p, param in sub.named_parameters(recurse=False)
        if param.dim() >= 2
    ]
    if left:
        warnings.warn(
            f"bayesianize: the parameters {left} are not in an nn.Linear or nn.Conv1d/2d/3d "
            "layer and stay deterministic (point estimates learned by SVI). To make one "
            "Bayesian, set it to a PyroSample with its prior by hand",
            UserWarning,
            stacklevel=2,
        )
    no_inputs = [name or "<root>" for name, sub in layers if _fan_in(sub) == 0]
    if no_inputs and prior_scale is None:
        warnings.warn(
            f"bayesianize: layers {no_inputs} have no inputs (fan-in 0), so the default "
            "prior N(0, 1 / fan-in) is undefined; their biases get N(0, 1). Pass "
            "prior_scale=... to choose another prior",
            stacklevel=2,
        )

    # all checks passed: now modify
    for _, sub in layers:
        weight, bias = sub.weight, sub.bias
        scale = prior_scale if prior_scale is not None else 1.0 / math.sqrt(max(_fan_in(sub), 1))
        pyro.nn.module.to_pyro_module_(sub, recurse=False)
        sub.register_buffer(
            "prior_scale",
            torch.tensor(scale, dtype=weight.dtype, device=weight.device),
            persistent=False,
        )
        locs: Dict[str, Optional[str]] = {"weight": None, "bias": None}
        for name, param in (("weight", weight), ("bias", bias)):
            if keep_weights and param is not None:
                # the trained values, read by init_guide_pretrained (and the prior's mean)
                sub.register_buffer(TRAINED_PREFIX + name, param.detach().clone())
                if prior_loc == "weights":
                    locs[name] = TRAINED_PREFIX + name
        # PyroModule's __setattr__ makes a PyroSample attribute a sample site.
        sub.weight = PyroSample(_NormalPrior(weight.shape, locs["weight"]))  # type: ignore[assignment]
        if bias is not None:
            sub.bias = PyroSample(_NormalPrior(bias.shape, locs["bias"]))  # type: ignore[assignment]
    pyro.nn.module.to_pyro_module_(module)
    return cast(PyroModule, module)  # to_pyro_module_ changed its class in place


def _check_num_data(cls: type, num_data: Optional[int]) -> None:
    if num_data is not None and (
        isinstance(num_data, bool) or not isinstance(num_data, int) or num_data < 1
    ):
        raise ValueError(
            f"{cls.__name__}: num_data must be a positive int or None, got {num_data!r}"
        )


def _check_batched_run(who: str) -> None:
    """Refuses a run in the plate of Predictive's samples or of vectorized particles
    with no layer-call handler: the weights lead with their dims, which nn.Linear
    and nn.Conv*d do not take (torch refuses it deep inside)."""
    plate = active_sample_plate()
    if plate is None or any(isinstance(m, LayerCallMessenger) for m in active_messengers()):
        return
    raise ValueError(
        f"{who}: the {plate} of Predictive(parallel=True) or of vectorized particles give "
        "every weight a leading dim, which nn.Linear and nn.Conv*d do not take: run it "
        "under pyro_vinit.poutine.vectorized_layers() (or local_reparam(), flipout()), e.g. "
        "with vectorized_layers(): Predictive(model, guide=guide, num_samples=100, "
        "parallel=True)(x)")


def _warn_minibatches(
    model: Union["BayesianClassifier", "BayesianRegressor"],
    x: torch.Tensor,
    y: Optional[torch.Tensor],
) -> None:
    """Warns once per model when it is conditioned on batches of different sizes
    without ``num_data``: a sign of minibatches whose likelihood is not scaled.
    Only runs that compute gradients (training steps) count: initializers and
    predictions run the model on chunks of any size without them."""
    if (y is None or model.num_data is not None or model._warned_num_data
            or not torch.is_grad_enabled()):
        return
    rows, seen = x.shape[0], model._observed_rows
    if seen is None:
        model._observed_rows = rows
    elif rows != seen:
        model._warned_num_data = True
        warn_at_caller(  # the user's call (of the model, of svi.step), not nn.Module's
            f"{type(model).__name__}: conditioned on batches of {seen} and {rows} rows without "
            "num_data. On minibatches pass num_data=<size of the training set>: without it "
            "the likelihood is not scaled up to the data set and the KL term weighs "
            "N / batch times too much",
            UserWarning,
        )


def _data_plate(x: torch.Tensor, num_data: Optional[int], observed: bool) -> pyro.plate:
    # An explicit subsample makes the plate scale the likelihood by num_data / batch. A
    # prediction (nothing observed) may run on more rows than the training set has: a
    # plate over them, which no training step sees.
    n = x.shape[0]
    if num_data is not None and n > num_data:
        if not observed:
            return pyro.plate("data", n, subsample=torch.arange(n, device=x.device))
        raise ValueError(
            f"the batch has {n} points but num_data={num_data}: num_data is the size of the "
            "full training set, at least the batch size"
        )
    return pyro.plate("data", num_data or n, subsample=torch.arange(n, device=x.device))


class BayesianClassifier(PyroModule):
    """
    A Pyro model ``model(x, y=None)`` with a Categorical likelihood on the
    logits of a Bayesian network (see :func:`bayesianize`).

    :param torch.nn.Module net: A network mapping ``x`` to logits ``(batch, classes)``.
    :param int num_data: Size of the full data set when the model is called on
        minibatches; the likelihood is scaled by ``num_data / batch``.
    """

    def __init__(self, net: nn.Module, num_data: Optional[int] = None):
        if not isinstance(net, nn.Module):
            raise TypeError(
                f"BayesianClassifier: net must be an nn.Module, got {type(net).__name__}"
            )
        _check_num_data(type(self), num_data)
        super().__init__()
        self.net = net
        self.num_data = num_data
        self._observed_rows: Optional[int] = None
        self._warned_num_data = False

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        _warn_minibatches(self, x, y)
        _check_batched_run(type(self).__name__)
        logits: torch.Tensor = self.net(x)
        if y is not None and y.shape != (x.shape[0],):
            # (a y of shape (batch, 1) would broadcast with the logits to (batch, batch))
            raise ValueError(
                f"BayesianClassifier: y must hold one class label per row, shape (batch,) = "
                f"({x.shape[0]},), got {tuple(y.shape)}"
                + (": pass y.squeeze(-1)" if y.shape == (x.shape[0], 1) else "")
            )
        with _data_plate(x, self.num_data, y is not None):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


class BayesianRegressor(PyroModule):
    """
    A Pyro model ``model(x, y=None)`` with a Normal likelihood around a
    Bayesian network's output, of fixed or learned noise scale.

    Usage::

        model = BayesianRegressor(bayesianize(mlp((10, 50, 1))), num_data=442, learn_noise=True)

    With ``learn_noise=True`` the noise scale is a positive
    :class:`~pyro.nn.PyroParam` (``model.noise_scale``, a point estimate that
    SVI learns) started at ``noise_scale``;
    :func:`~pyro_vinit.init_guide_iblm` sets it to the residual standard
    deviation of the network it fits.

    :param torch.nn.Module net: A network mapping ``x`` to ``(batch, 1)`` or ``(batch,)``;
        the targets ``y`` are ``(batch,)``.
    :param float noise_scale: The likelihood's standard deviation (its
        initial value with ``learn_noise``).
    :param int num_data: Size of the full data set when the model is called on
        minibatches; the likelihood is scaled by ``num_data / batch``.
    :param bool learn_noise: Learn the noise scale.
    """

    noise_scale: Union[float, torch.Tensor]

    def __init__(self, net: nn.Module, noise_scale: float = 1.0, num_data: Optional[int] = None,
                 *, learn_noise: bool = False):
        if not isinstance(net, nn.Module):
            raise TypeError(
                f"BayesianRegressor: net must be an nn.Module, got {type(net).__name__}"
            )
        if (
            isinstance(noise_scale, bool)
            or not isinstance(noise_scale, (int, float))
            or not math.isfinite(noise_scale)
            or not noise_scale > 0
        ):
            raise ValueError(
                f"BayesianRegressor: noise_scale must be a positive number, got {noise_scale!r}"
            )
        if not isinstance(learn_noise, bool):
            raise TypeError(
                f"BayesianRegressor: learn_noise must be a bool, got {type(learn_noise).__name__}"
            )
        _check_num_data(type(self), num_data)
        super().__init__()
        self.net = net
        self.learn_noise = learn_noise
        if learn_noise:
            # PyroModule's __setattr__ makes this a constrained param, read as its value
            self.noise_scale = PyroParam(  # type: ignore[assignment]
                torch.tensor(float(noise_scale)), constraint=constraints.positive
            )
        else:
            self.noise_scale = noise_scale
        self.num_data = num_data
        self._observed_rows: Optional[int] = None
        self._warned_num_data = False

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        _warn_minibatches(self, x, y)
        _check_batched_run(type(self).__name__)
        out: torch.Tensor = self.net(x)
        mean = out.squeeze(-1) if out.dim() > 1 else out
        # leading dims beyond the batch are allowed (e.g. vectorized particles)
        if mean.dim() == 0 or mean.shape[-1] != x.shape[0]:
            raise ValueError(
                f"BayesianRegressor: the network must output shape (batch,) or (batch, 1), "
                f"got {tuple(out.shape)} for a batch of {x.shape[0]}"
            )
        if y is not None and y.shape != (x.shape[0],):
            # (a y of shape (batch, 1) would broadcast with the mean to (batch, batch))
            raise ValueError(
                f"BayesianRegressor: y must have shape (batch,) = ({x.shape[0]},), got "
                f"{tuple(y.shape)}" + (": pass y.squeeze(-1)" if y.shape == (x.shape[0], 1)
                                       else "")
            )
        with _data_plate(x, self.num_data, y is not None):
            pyro.sample("obs", dist.Normal(mean, self.noise_scale), obs=y)
        return mean


def mlp(sizes: Tuple[int, ...], activation: Type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """
    An ``nn.Sequential`` MLP with layer sizes ``sizes`` (input, hidden...,
    output) and ``activation`` between layers (not after the last).

    Usage::

        net = bayesianize(mlp((64, 100, 10)))

    :param tuple sizes: At least two positive ints.
    :param type activation: An ``nn.Module`` class, instantiated between layers.
    """
    sizes = tuple(sizes)
    if len(sizes) < 2 or not all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in sizes
    ):
        raise ValueError(f"mlp: sizes must be at least two positive ints, got {sizes!r}")
    if not (isinstance(activation, type) and issubclass(activation, nn.Module)):
        raise TypeError(
            f"mlp: activation must be an nn.Module class (e.g. nn.Tanh), got {activation!r}"
        )
    layers: List[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(d_in, d_out))
        if i < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)
