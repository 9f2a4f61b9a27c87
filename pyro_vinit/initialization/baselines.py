"""The initializations I-BLM is compared with in [1], behind one entry point."""

import math
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple, TypeVar

import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoGuide, AutoGuideList

from pyro_vinit.guides import site_params
from pyro_vinit.guides._base import is_real_support
from pyro_vinit.initialization._data import Data
from pyro_vinit.initialization._marks import mark_initialized
from pyro_vinit.initialization._options import _check_positive
from pyro_vinit.initialization._rollback import GuideRollback
from pyro_vinit.initialization._runs import capture
from pyro_vinit.initialization._tracing import (
    Layer,
    Prepared,
    guide_values,
    prepare,
    trace_observed_site,
)
from pyro_vinit.initialization.iblm import init_guide_iblm

__all__ = ["METHODS", "init_guide"]

METHODS = ("uninformative", "heuristic", "xavier", "orthogonal", "lsuv", "map", "iblm")
_DATA_METHODS = ("lsuv", "map", "iblm")
_MAP_LOG_VAR = -5.5
_G = TypeVar("_G", bound=AutoGuide)


def _layers_by_name(guide: AutoGuide) -> List[Layer]:
    """Without data: every real-support site with two or more dims is a weight
    ``<m>.weight``, paired with a real-support site ``<m>.bias`` of its output size
    if there is one. Other sites (e.g. a positive noise scale) are left alone."""
    shapes = {
        name: site["value"].shape
        for name, site in site_params.latent_sites(guide).items()
        if is_real_support(site["fn"].support)
    }
    layers = []
    for name, shape in shapes.items():
        if len(shape) < 2:
            continue
        prefix = name.rpartition(".")[0]
        bias = f"{prefix}.bias" if prefix else "bias"
        layer = Layer("unknown", name, shape)
        if bias in shapes and tuple(shapes[bias]) == (shape[0],):
            layer.bias_name = bias
        layers.append(layer)
    if not layers:
        raise ValueError(
            "the guide has no real-support latent site with two or more dims (a layer "
            "weight) to initialize"
        )
    return layers


def _orthogonal(layer: Layer, like: torch.Tensor) -> torch.Tensor:
    matrix = torch.empty(layer.num_units, layer.fan_in, dtype=like.dtype, device=like.device)
    return torch.nn.init.orthogonal_(matrix).reshape(layer.weight_shape)


def _variance(method: str, layer: Layer) -> float:
    if method == "uninformative":
        return 1.0
    if method == "xavier":
        return 2.0 / (layer.fan_in + layer.fan_out)
    if method == "map":
        return math.exp(_MAP_LOG_VAR)
    return 1.0 / layer.fan_in  # heuristic, orthogonal, lsuv


def _lsuv(guide: AutoGuide, prep: Prepared, means: Dict[str, torch.Tensor], batch_size: int,
          tol: float, max_iters: int) -> None:
    """Rescales each layer's (orthogonal) mean so that its output on a data batch
    has unit variance, layer by layer (Mishkin and Matas, 2015)."""
    pool, model = prep.pool, guide.model
    batch_size = pool.effective_batch_size(batch_size, "init_guide(method='lsuv')")
    args = pool.select(pool.batch_indices(1, batch_size)[0])
    values = guide_values(guide, args, prep.latent)
    for layer in prep.layers:
        for _ in range(max_iters):
            _, out = capture(model, {**values, **means}, args, prep.latent, layer.weight_name,
                             output=True)
            assert out is not None  # output=True
            var = out.var().item()
            if not math.isfinite(var) or var <= 0:
                raise ValueError(
                    f"LSUV: the output of layer {layer.weight_name!r} has variance {var}"
                )
            if abs(var - 1.0) < tol:
                break
            means[layer.weight_name] = means[layer.weight_name] / math.sqrt(var)


def _map(
    guide: AutoGuide,
    prep: Prepared,
    means: Dict[str, torch.Tensor],
    batch_size: int,
    num_steps: int,
    max_seconds: Optional[float],
    lr: float,
) -> None:
    """Means minimizing the mean negative log-likelihood of the data with Adam."""
    pool = prep.pool
    batch_size = pool.effective_batch_size(batch_size, "init_guide(method='map')")
    model = guide.model
    params = {name: value.clone().requires_grad_() for name, value in means.items()}
    optim = torch.optim.Adam(params.values(), lr=lr)
    # The model's other latent sites (if any) stay at one draw from the guide.
    with torch.no_grad():
        values = guide_values(guide, prep.first, prep.latent)
    values.update(params)
    start = time.perf_counter()
    for step in range(num_steps):
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
        args = pool.select(pool.batch_indices(1, batch_size)[0])
        trace = poutine.trace(poutine.condition(model, data=values)).get_trace(*args)
        site = trace_observed_site(trace, prep.latent, model)
        loss = -site["fn"].log_prob(site["value"]).sum() / batch_size
        if not torch.isfinite(loss):
            raise ValueError(f"MAP: the negative log-likelihood is {loss.item()} at step {step}")
        optim.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch's is unannotated
        optim.step()
    for name, value in params.items():
        means[name] = value.detach()


def init_guide(
    guide: _G,
    data: Optional[Data] = None,
    *,
    method: str,
    batch_size: int = 128,
    max_pool_size: int = 10_000,
    lsuv_tol: float = 0.1,
    lsuv_max_iters: int = 10,
    map_steps: int = 500,
    map_seconds: Optional[float] = None,
    map_lr: float = 1e-2,
    **iblm_options: Any,
) -> _G:
    r"""
    Initializes the layer sites of an autoguide with one of the methods
    compared in [1], in place, and returns the guide.

    Usage::

        init_guide(guide, method="xavier")                   # data-free
        init_guide(guide, (x_train, y_train), method="iblm")

    Each Bayesian layer's weight (and bias) site gets a mean :math:`\mu` and a
    per-weight variance :math:`\sigma^2`, with :math:`D_\text{in}` the fan-in
    (``in_features``, or ``in_channels / groups ×`` kernel size) and
    :math:`D_\text{out}` the fan-out (``out_features``, or ``out_channels ×``
    kernel size); biases get :math:`\mu = 0` and their layer's variance:

    ================= ========================================= ========
    method            mean                                      variance
    ================= ========================================= ========
    ``uninformative`` 0                                         1
    ``heuristic``     0                                         :math:`1/D_\text{in}`
    ``xavier``        0                                         :math:`2/(D_\text{in}+D_\text{out})`
    ``orthogonal``    a random orthogonal matrix (QR)           :math:`1/D_\text{in}`
    ``lsuv``          orthogonal, rescaled so that each layer's :math:`1/D_\text{in}`
                      output has unit variance on a data batch
    ``map``           Adam on the mean negative log-likelihood  :math:`e^{-5.5}`
                      from a Xavier-Normal draw
    ``iblm``          :func:`init_guide_iblm`                   :func:`init_guide_iblm`
    ================= ========================================= ========

    The data-free methods need only a set-up guide; their layers are then
    recognized by name: every real-support site with two or more dims is a
    weight, and a real-support site ``<module>.bias`` of matching size is its
    bias, with ``nn.Linear``'s ``(out, in)`` layout (a warning names the weights
    not called ``<module>.weight``). With data, the layers are found by tracing
    the model's ``F.linear`` / ``F.conv*d`` calls and matrix products. Sites
    that are not a layer's weight or bias (e.g. a ``HalfNormal`` noise scale)
    keep the guide's own initialization, and the writes (through
    :mod:`~pyro_vinit.guides.site_params`) are all or nothing.

    :param guide: A guide :mod:`~pyro_vinit.guides.site_params` supports:
        AutoNormal, AutoDiagonalNormal, AutoLowRankMultivariateNormal,
        AutoKTiedNormal, AutoRadialNormal or another AutoSiteGuide.
    :param data: One tuple of model arguments or an iterable of such tuples;
        required by ``lsuv``, ``map`` and ``iblm`` (and to set up a guide that
        is not set up yet).
    :param str method: One of ``uninformative``, ``heuristic``, ``xavier``,
        ``orthogonal``, ``lsuv``, ``map``, ``iblm``.
    :param int batch_size: Rows per batch for ``lsuv`` and ``map`` (and ``iblm``).
    :param int max_pool_size: At most this many data rows are read.
    :param float lsuv_tol: LSUV stops when the output variance is within this of 1.
    :param int lsuv_max_iters: Maximum LSUV rescalings per layer.
    :param int map_steps: Adam steps for ``map``.
    :param float map_seconds: Optional time budget for ``map``, in seconds.
    :param float map_lr: Adam's learning rate for ``map``.
    :param iblm_options: Further options of
        :class:`~pyro_vinit.initialization.IBLMGuideInitializer` (``iblm`` only).

    [1] Rossi, Michiardi, Filippone (2019) "Good Initializations of Variational
    Bayes for Deep Models"
    """
    if method not in METHODS:
        raise ValueError(f"unknown initialization method {method!r}; valid methods are {METHODS}")
    if data is None and method in _DATA_METHODS:
        raise ValueError(f"init_guide(method={method!r}) needs data: pass (x, y) or a loader")
    for name, value, kind, zero in (
            ("batch_size", batch_size, int, False), ("max_pool_size", max_pool_size, int, False),
            ("lsuv_tol", lsuv_tol, (int, float), True),
            ("lsuv_max_iters", lsuv_max_iters, int, True), ("map_steps", map_steps, int, True),
            ("map_lr", map_lr, (int, float), False),
            ("map_seconds", 1.0 if map_seconds is None else map_seconds, (int, float), False)):
        _check_positive(name, value, kind, who="init_guide", zero=zero)
    if method == "iblm":
        assert data is not None  # checked above
        initialized: _G = init_guide_iblm(
            guide, data, batch_size=batch_size, max_pool_size=max_pool_size, **iblm_options
        )
        return initialized
    if iblm_options:
        raise TypeError(f"init_guide: unexpected options {sorted(iblm_options)} for {method!r}")
    if isinstance(guide, AutoGuideList):
        raise TypeError(
            f"init_guide(method={method!r}) initializes an AutoGuideList member by member: "
            f"call it on each member, guide[0] to guide[{len(guide) - 1}]"
            + (", after setting the list up, guide(x, y)" if guide.prototype_trace is None
               else "")
        )
    # a failure leaves the guide (not set up, if it was not), the param store and the
    # model's buffers (BatchNorm statistics that lsuv's and map's runs move) as they were
    with GuideRollback(guide) as rollback:
        if data is None:
            site_params.check_supported(guide)
            if guide.prototype_trace is None:
                raise RuntimeError(
                    f"{type(guide).__name__} is not set up yet: pass data (e.g. "
                    "init_guide(guide, (x, y), method=...)) or call the guide once first"
                )
            layers, prep = _layers_by_name(guide), None
            guessed = [layer.weight_name for layer in layers
                       if layer.weight_name.rpartition(".")[2] != "weight"]
            if guessed and method != "uninformative":
                warnings.warn(
                    f"init_guide(method={method!r}): without data, layers are recognized by "
                    f"name, and the sites {guessed}, not named '<module>.weight', are taken for "
                    "weights in nn.Linear's (out, in) layout (fan-in: the last dims), which is "
                    "wrong for e.g. x @ w; pass data (init_guide(guide, (x, y), method=...)) "
                    "to find the layers by tracing the model",
                    UserWarning,
                    stacklevel=2,
                )
        else:
            prep = prepare(guide, data, max_pool_size, chunk_rows=4096, normal_priors=False,
                           likelihood=method == "map")
            layers = prep.layers

        like = next(guide.parameters())
        sites = site_params.latent_sites(guide)
        means: Dict[str, torch.Tensor] = {}
        shapes: Dict[str, Tuple[torch.Size, float]] = {}
        for layer in layers:
            var = _variance(method, layer)
            # means are made in the op's layout, stored in the site's (a matmul weight x @ w
            # is the transpose of its layer's (out, in) weight)
            name = layer.weight_name
            site_shape = sites[name]["value"].shape
            shapes[name] = (site_shape, var)
            if method in ("orthogonal", "lsuv"):
                means[name] = layer.to_site(name, _orthogonal(layer, like), site_shape)
            elif method == "map":
                std = math.sqrt(2.0 / (layer.fan_in + layer.fan_out))
                means[name] = std * torch.randn(site_shape, dtype=like.dtype, device=like.device)
            if layer.bias_name is not None:
                bias_shape = sites[layer.bias_name]["value"].shape
                shapes[layer.bias_name] = (bias_shape, var)
                means[layer.bias_name] = like.new_zeros(bias_shape)

        if method == "lsuv":
            assert prep is not None  # lsuv and map need data, checked above
            with torch.no_grad():
                _lsuv(guide, prep, means, batch_size, lsuv_tol, lsuv_max_iters)
        elif method == "map":
            assert prep is not None
            _map(guide, prep, means, batch_size, map_steps, map_seconds, map_lr)

        rollback.checkpoint()  # the writes: all or nothing
        for name, (shape, var) in shapes.items():
            loc = means.get(name, like.new_zeros(shape))
            scale = torch.full_like(loc, math.sqrt(var))
            site_params.set_loc_and_scale(guide, name, loc, scale)
    mark_initialized(guide)
    return guide
