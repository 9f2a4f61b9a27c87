"""
One call that trains a Bayesian neural network: I-BLM, then SVI with the
recipe that keeps I-BLM's head start (see the "Training" method page).
"""

import contextlib
import math
import os
import warnings
from dataclasses import dataclass, field, replace
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Tuple,
    Union,
    cast,
)

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer import SVI, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoGuide, AutoNormal
from pyro.optim import PyroOptim
from torch import nn

from pyro_vinit.guides import AutoKTiedNormal, AutoMeanFieldNormal, AutoRadialNormal
from pyro_vinit.initialization import init_guide_iblm
from pyro_vinit.poutine import KLAnnealingMessenger, flipout, local_reparam

__all__ = ["FitConfig", "FitHistory", "fit", "fit_config", "is_initialized"]

Batch = Tuple[torch.Tensor, torch.Tensor]
Data = Union[Batch, Iterable[Batch]]

_CHECKPOINT_FORMAT = "pyro_vinit.fit/1"


@dataclass(frozen=True)
class FitConfig:
    """
    The training configuration :func:`fit` uses, for users who keep their own
    SVI loop (see :func:`fit_config`).

    Usage::

        config = fit_config(guide)
        svi = SVI(model, guide, config.optimizer(), config.elbo())
        with config.handlers():
            svi.step(x, y)

    :param float lr: Adam's learning rate.
    :param float kl_weight: The weight :math:`\\lambda` of the KL term
        (:class:`~pyro_vinit.poutine.KLAnnealingMessenger`).
    :param int num_particles: Monte Carlo samples per ELBO evaluation.
    :param callable weight_noise: Returns a fresh weight-noise handler
        (:func:`~pyro_vinit.poutine.local_reparam` or
        :func:`~pyro_vinit.poutine.flipout`), or None.
    :param float max_scale_ratio: I-BLM's cap on the guide's standard
        deviations, relative to the prior's.
    :param int iblm_batch_size: I-BLM's rows per unit.
    """

    lr: float = 1e-3
    kl_weight: float = 0.01
    num_particles: int = 1
    weight_noise: Optional[Callable[[], ContextManager[Any]]] = None
    max_scale_ratio: Optional[float] = 0.1
    iblm_batch_size: int = 512

    def optimizer(self) -> PyroOptim:
        """A fresh ``pyro.optim.Adam`` at :attr:`lr`."""
        return PyroOptim(torch.optim.Adam, {"lr": self.lr})

    def elbo(self) -> TraceMeanField_ELBO:
        """A fresh ``TraceMeanField_ELBO`` with :attr:`num_particles`."""
        return TraceMeanField_ELBO(
            num_particles=self.num_particles, vectorize_particles=self.num_particles > 1
        )

    def handlers(self) -> ContextManager[Any]:
        """A context in which to call ``svi.step``: the KL weight and the weight-noise
        handler, entered afresh at each use."""
        stack = contextlib.ExitStack()
        stack.enter_context(KLAnnealingMessenger(self.kl_weight))
        if self.weight_noise is not None:
            stack.enter_context(self.weight_noise())
        return stack


def _default_weight_noise(guide: Callable[..., Any]) -> Optional[Callable[[], ContextManager[Any]]]:
    if isinstance(guide, AutoRadialNormal):
        return flipout
    if isinstance(guide, (AutoKTiedNormal, AutoMeanFieldNormal, AutoNormal)):
        return local_reparam
    return None


def _check_positive(name: str, value: Any, kind: Any = (int, float)) -> None:
    if (isinstance(value, bool) or not isinstance(value, kind)
            or not math.isfinite(value) or not value > 0):
        raise ValueError(f"fit: {name} must be a positive number, got {value!r}")


def fit_config(
    guide: Callable[..., Any],
    *,
    lr: Optional[float] = None,
    kl_weight: Optional[float] = None,
    num_particles: Optional[int] = None,
) -> FitConfig:
    """
    The configuration :func:`fit` trains ``guide`` with: Adam at learning rate
    1e-3, ``TraceMeanField_ELBO`` with one particle, the KL term weighted by
    0.01, under :func:`~pyro_vinit.poutine.local_reparam` for factorized-Normal
    guides (AutoKTiedNormal, AutoMeanFieldNormal, AutoNormal),
    :func:`~pyro_vinit.poutine.flipout` for AutoRadialNormal and no handler
    for other guides; before training, I-BLM with 512 rows per unit and the
    standard deviations capped at 0.1 times the prior's.

    Usage::

        config = fit_config(guide)  # after init_guide_iblm(guide, data, max_scale_ratio=0.1)
        svi = SVI(model, guide, config.optimizer(), config.elbo())
        with config.handlers():
            svi.step(x, y)

    :param guide: The guide.
    :param float lr: Overrides the learning rate.
    :param float kl_weight: Overrides the KL weight.
    :param int num_particles: Overrides the number of particles.
    """
    changes: Dict[str, Any] = {"weight_noise": _default_weight_noise(guide)}
    if lr is not None:
        _check_positive("lr", lr)
        changes["lr"] = float(lr)
    if kl_weight is not None:
        _check_positive("kl_weight", kl_weight)
        changes["kl_weight"] = float(kl_weight)
    if num_particles is not None:
        _check_positive("num_particles", num_particles, int)
        changes["num_particles"] = num_particles
    return replace(FitConfig(), **changes)


@dataclass
class FitHistory:
    """
    What :func:`fit` returns: the loss of every SVI step and the validation
    metrics at each evaluation.

    :ivar list loss: ``svi.step``'s loss (the KL-weighted negative ELBO
        estimate of the whole data set) at every step of this call, and of
        the run it resumed.
    :ivar list validation: One dict per evaluation, with ``"step"``,
        ``"mnll"`` and ``"error_rate"`` (a Categorical likelihood) or
        ``"rmse"`` (a Normal one).
    :ivar bool initialized: Whether this call initialized the guide with I-BLM.
    :ivar FitConfig config: The configuration it trained with.
    """

    loss: List[float] = field(default_factory=list)
    validation: List[Dict[str, float]] = field(default_factory=list)
    initialized: bool = False
    config: FitConfig = field(default_factory=FitConfig)

    @property
    def steps(self) -> int:
        """Number of SVI steps taken."""
        return len(self.loss)


def is_initialized(guide: Callable[..., Any]) -> bool:
    """
    Whether :func:`fit` takes ``guide`` as initialized (and so does not run
    I-BLM on it): an autoguide that is set up (by an initializer, by
    training, or by a call before ``load_state_dict``), or whose parameters
    are in Pyro's param store (e.g. after ``pyro.get_param_store().load``).
    A guide that is not an :class:`~pyro.infer.autoguide.AutoGuide` is never
    taken as initialized (I-BLM cannot start it: train it with ``init=None``).

    Usage::

        is_initialized(AutoKTiedNormal(model))  # False

    :param guide: The guide.
    """
    if isinstance(guide, AutoGuide):
        if guide.prototype_trace is not None:
            return True
        prefix = f"{type(guide).__name__}."  # an autoguide's params are named after its class
        return any(name.startswith(prefix) for name in pyro.get_param_store().keys())
    return False


# ---- the data -------------------------------------------------------------------------


def _is_pair(data: Any) -> bool:
    return (isinstance(data, (tuple, list)) and len(data) == 2
            and all(isinstance(t, torch.Tensor) for t in data))


def _check_batch(batch: Any, what: str) -> Batch:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise TypeError(
            f"fit: {what} must be a pair (x, y) of tensors, got "
            f"{type(batch).__name__}" + (f" of length {len(batch)}"
                                         if isinstance(batch, (tuple, list)) else "")
        )
    x, y = batch
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"fit: x and y of {what} must have the same number of rows, got shapes "
            f"{tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.shape[0] == 0:
        raise ValueError(f"fit: {what} has no rows")
    return x, y


class _Batches:
    """An endless stream of minibatches: shuffled epochs of an (x, y) pair, or the
    batches of a re-iterable loader, pass after pass."""

    def __init__(self, data: Data, batch_size: int) -> None:
        self.pair: Optional[Batch] = None
        self.loader: Optional[Iterable[Batch]] = None
        self.batch_size = batch_size
        if _is_pair(data):
            self.pair = _check_batch(data, "data")
            self.num_data = self.pair[0].shape[0]
            self.first = (self.pair[0][:batch_size], self.pair[1][:batch_size])
            self.batches_per_epoch = math.ceil(self.num_data / batch_size)
        else:
            if isinstance(data, torch.Tensor) or not isinstance(data, Iterable):
                raise TypeError(
                    "fit: data must be an (x, y) pair of tensors or an iterable of (x, y) "
                    f"batches (e.g. a DataLoader), got {type(data).__name__}"
                )
            if iter(data) is data:
                raise TypeError(
                    "fit: data is an iterator, which can be read only once; pass a "
                    "re-iterable such as a DataLoader or a list of batches"
                )
            self.loader = cast(Iterable[Batch], data)
            count, first, batches = 0, None, 0
            for i, batch in enumerate(self.loader):
                xb, yb = _check_batch(batch, f"batch {i} of data")
                first = (xb, yb) if first is None else first
                count += xb.shape[0]
                batches += 1
            if first is None:
                raise ValueError("fit: data (the loader) yields no batches")
            self.first, self.num_data, self.batches_per_epoch = first, count, batches
        self.generator = torch.Generator(device="cpu")
        self.order: Optional[torch.Tensor] = None
        self.position = 0
        self._iter: Optional[Iterator[Batch]] = None

    def start(self) -> None:
        """Seeds the shuffling from the global RNG (after every check has passed)."""
        self.generator.manual_seed(int(torch.randint(2**62, ()).item()))

    def __next__(self) -> Batch:
        if self.pair is not None:
            x, y = self.pair
            if self.order is None or self.position >= self.num_data:
                self.order = torch.randperm(self.num_data, generator=self.generator)
                self.position = 0
            idx = self.order[self.position:self.position + self.batch_size].to(x.device)
            self.position += self.batch_size
            return x[idx], y[idx]
        assert self.loader is not None
        for _ in range(2):
            if self._iter is None:
                self._iter = iter(self.loader)
            try:
                return cast(Batch, tuple(next(self._iter)))
            except StopIteration:
                self._iter = None
        raise ValueError("fit: data (the loader) yields no batches on a second pass")

    def state(self) -> Dict[str, Any]:
        return {"generator": self.generator.get_state(), "order": self.order,
                "position": self.position}

    def set_state(self, state: Dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.order, self.position = state["order"], state["position"]


# ---- checks that run the model without changing anything -------------------------------


def _base(fn: Any) -> Any:
    while isinstance(fn, (dist.Independent, dist.MaskedDistribution)):
        fn = fn.base_dist
    return fn


@contextlib.contextmanager
def _sandbox(model: Callable[..., Any]) -> Iterator[None]:
    """Runs the block with the param store, the model's buffers and the RNG restored
    afterwards."""
    store = pyro.get_param_store()
    names = set(store.keys())
    buffers = ({k: b.clone() for k, b in model.named_buffers()}
               if isinstance(model, nn.Module) else {})
    rng = torch.get_rng_state()
    # what BayesianClassifier / BayesianRegressor note of the batch sizes they see
    notes = {k: v for k, v in vars(model).items() if k in ("_observed_rows", "_warned_num_data")}
    try:
        with torch.no_grad():
            yield
    finally:
        vars(model).update(notes)
        for name in set(store.keys()) - names:
            del store[name]
        if isinstance(model, nn.Module):
            for k, b in model.named_buffers():
                if k in buffers:
                    b.copy_(buffers[k])
        torch.set_rng_state(rng)


def _check_model(model: Callable[..., Any], batch: Batch, num_data: int) -> None:
    x, y = batch
    declared = getattr(model, "num_data", None)
    if isinstance(declared, int) and declared != num_data:
        raise ValueError(
            f"fit: the model was built with num_data={declared} but the data has {num_data} "
            f"rows; build it with num_data={num_data}"
        )
    with _sandbox(model):
        try:
            trace = poutine.trace(model).get_trace(x, y)
        except Exception as e:  # the user's model: any error, said with context
            raise ValueError(
                f"fit: the model fails on the first batch (x {tuple(x.shape)} {x.dtype}, "
                f"y {tuple(y.shape)} {y.dtype}): {type(e).__name__}: {e}"
            ) from e
    observed = [s for s in trace.nodes.values() if s["type"] == "sample" and s["is_observed"]]
    if not observed:
        raise ValueError(
            "fit: the model has no observed sample site when called as model(x, y); it must "
            "condition on y, e.g. pyro.sample('obs', dist.Categorical(logits=...), obs=y)"
        )
    for site in observed:
        fn = _base(site["fn"])
        if isinstance(fn, dist.Categorical) and (y.is_floating_point() or y.dtype == torch.bool):
            raise TypeError(
                f"fit: the likelihood {site['name']!r} is Categorical, so y must hold integer "
                f"class labels (y.long()), got {y.dtype}"
            )
        if not fn.support.is_discrete and not y.is_floating_point():
            raise TypeError(
                f"fit: the likelihood {site['name']!r} is {type(fn).__name__}, continuous, "
                f"so y must be floating point (y.float()), got {y.dtype}"
            )
        rows = x.shape[0]
        scale = float(site["scale"]) if not isinstance(site["scale"], torch.Tensor) else float(
            site["scale"].max())
        if rows < num_data and abs(scale - 1.0) < 1e-6:
            raise ValueError(
                f"fit: the likelihood {site['name']!r} is not scaled to the data set: on a "
                f"batch of {rows} of {num_data} rows its scale is 1, so the KL term would "
                f"weigh {num_data / rows:.3g} times too much. Build the model with "
                f"num_data={num_data} (BayesianClassifier / BayesianRegressor), or use "
                f"pyro.plate('data', {num_data}, subsample=...) in your model"
            )


def _set_up(guide: Callable[..., Any], batch: Batch) -> None:
    """Sets an autoguide up (its parameters take the param store's values where it
    has them), leaving the RNG as it was."""
    if isinstance(guide, AutoGuide) and guide.prototype_trace is None:
        rng = torch.get_rng_state()
        with torch.no_grad():
            poutine.block(guide)(*batch)
        torch.set_rng_state(rng)


# ---- evaluation ----------------------------------------------------------------------


@torch.no_grad()
def _evaluate(model: Callable[..., Any], guide: Callable[..., Any], x: torch.Tensor,
              y: torch.Tensor, num_samples: int, chunk: int) -> Dict[str, float]:
    """Monte Carlo predictive MNLL (and error rate or RMSE) of ``num_samples`` guide
    draws, the model in eval mode, on chunks of at most ``chunk`` rows (a model built
    with ``num_data`` takes no larger batch)."""
    modules = [m for m in (model, guide) if isinstance(m, nn.Module)]
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        log_probs, means, kind = [], [], ""
        for _ in range(num_samples):
            guide_trace = poutine.trace(guide).get_trace(x[:chunk], y[:chunk])
            sample_lp, sample_means = [], []
            for start in range(0, x.shape[0], chunk):
                xc, yc = x[start:start + chunk], y[start:start + chunk]
                trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(xc, yc)
                lp = xc.new_zeros(xc.shape[0])
                observed = [s for s in trace.nodes.values()
                            if s["type"] == "sample" and s["is_observed"]]
                for site in observed:
                    fn: Any = site["fn"]
                    site_lp = cast(torch.Tensor, fn.log_prob(site["value"]))
                    site_lp = site_lp.reshape(site_lp.shape[:1] + (-1,)).sum(-1) if (
                        site_lp.dim() and site_lp.shape[0] == xc.shape[0]) else site_lp.sum()
                    lp = lp + site_lp
                sample_lp.append(lp)
                if len(observed) == 1:
                    base = _base(observed[0]["fn"])
                    if isinstance(base, dist.Categorical):
                        kind = "error_rate"
                        sample_means.append(base.probs)
                    elif isinstance(base, (dist.Normal, dist.StudentT)):
                        kind = "rmse"
                        value = cast(torch.Tensor, observed[0]["value"])
                        sample_means.append(base.loc.expand(value.shape))
            log_probs.append(torch.cat(sample_lp))
            if sample_means:
                means.append(torch.cat(sample_means))
        stacked = torch.stack(log_probs)
        result = {"mnll": float(-(stacked.logsumexp(0) - math.log(num_samples)).mean())}
        if kind == "error_rate":
            pred = torch.stack(means).mean(0).argmax(-1)
            result[kind] = float((pred != y).float().mean())
        elif kind == "rmse":
            mean = torch.stack(means).mean(0)
            result[kind] = float((mean - y.reshape(mean.shape)).pow(2).mean().sqrt())
        return result
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


# ---- checkpoints ---------------------------------------------------------------------


def _save(path: str, step: int, optim: PyroOptim, model: Callable[..., Any],
          batches: _Batches, history: FitHistory) -> None:
    state = {
        "format": _CHECKPOINT_FORMAT,
        "step": step,
        "param_store": pyro.get_param_store().get_state(),
        "optim": optim.get_state(),
        "model": model.state_dict() if isinstance(model, nn.Module) else None,
        "rng": torch.get_rng_state(),
        "batches": batches.state(),
        "loss": list(history.loss),
        "validation": list(history.validation),
    }
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load(path: str) -> Dict[str, Any]:
    # our own file, with the param store's constraints pickled: not weights only
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"fit: {path!r} is not a checkpoint written by pyro_vinit.fit")
    return cast(Dict[str, Any], state)


# ---- fit -----------------------------------------------------------------------------


def fit(
    model: Callable[..., Any],
    guide: Callable[..., Any],
    data: Data,
    *,
    steps: Optional[int] = None,
    epochs: Optional[float] = None,
    batch_size: int = 128,
    optim: Optional[PyroOptim] = None,
    lr: Optional[float] = None,
    kl_weight: Optional[float] = None,
    num_particles: Optional[int] = None,
    init: Optional[str] = "iblm",
    init_options: Optional[Dict[str, Any]] = None,
    validation: Optional[Batch] = None,
    eval_every: Optional[int] = None,
    num_samples: int = 32,
    progress: bool = True,
    checkpoint: Optional[Union[str, "os.PathLike[str]"]] = None,
    checkpoint_every: Optional[int] = None,
) -> FitHistory:
    r"""
    Trains a Bayesian neural network ``model(x, y)`` and its ``guide`` on
    ``data``: initializes the guide with I-BLM unless it is initialized
    already (see :func:`is_initialized`), then runs SVI with the configuration
    of :func:`fit_config`, the recipe that keeps I-BLM's head start.

    Usage::

        model = BayesianClassifier(bayesianize(mlp((64, 100, 10))), num_data=len(x))
        guide = AutoKTiedNormal(model, rank=2)
        history = fit(model, guide, (x, y), steps=400, progress=False)
        history = fit(model, guide, (x, y), steps=100, progress=False)  # continues

    The model must condition on ``y`` through an observed site whose
    likelihood is scaled to the full data set (``num_data=`` of
    :class:`~pyro_vinit.nn.BayesianClassifier`, or a subsampled
    ``pyro.plate``). Everything about ``data``, the model's first batch and
    the options is checked before any parameter changes.

    :param model: The Pyro model, called as ``model(x, y)``.
    :param guide: Its guide (AutoKTiedNormal, AutoMeanFieldNormal,
        AutoRadialNormal or AutoNormal for I-BLM; with ``init=None`` any).
    :param data: An ``(x, y)`` pair of tensors, shuffled into minibatches of
        ``batch_size`` each epoch, or a re-iterable of ``(x, y)`` batches
        (e.g. a :class:`~torch.utils.data.DataLoader`), read pass after pass.
    :param int steps: Number of SVI steps (with ``checkpoint``, the total
        including the steps already in it); default 1000 unless ``epochs``.
    :param float epochs: Alternatively, passes over the data.
    :param int batch_size: Minibatch size for an ``(x, y)`` pair.
    :param optim: A Pyro optimizer instead of :meth:`FitConfig.optimizer`
        (pass the same one to a second call to keep Adam's moments).
    :param float lr: Learning rate of the default optimizer.
    :param float kl_weight: KL weight instead of 0.01.
    :param int num_particles: Particles of the ELBO.
    :param init: ``"iblm"`` (I-BLM for a guide not yet initialized) or None.
    :param dict init_options: Keyword options of
        :func:`~pyro_vinit.init_guide_iblm`, over fit's (``batch_size=512``,
        ``max_scale_ratio=0.1``).
    :param tuple validation: An ``(x, y)`` pair evaluated every
        ``eval_every`` steps and after the last one.
    :param int eval_every: Steps between evaluations (default a tenth of the run).
    :param int num_samples: Guide draws of the Monte Carlo predictive.
    :param bool progress: Show a tqdm progress bar with the loss.
    :param checkpoint: A file to which the guide's and model's parameters,
        the optimizer's state, the RNG states and the step are saved every
        ``checkpoint_every`` steps and at the end; if it exists, training
        resumes from it (bit-identically for an ``(x, y)`` pair).
    :type checkpoint: str or os.PathLike
    :param int checkpoint_every: Steps between checkpoints (default: only at the end).
    :return: A :class:`FitHistory`.
    """
    # ---- every check first: nothing is modified until they pass --------------------
    if steps is not None and epochs is not None:
        raise ValueError("fit: pass steps or epochs, not both")
    _check_positive("batch_size", batch_size, int)
    _check_positive("num_samples", num_samples, int)
    for name, value, kind in (("steps", steps, int), ("epochs", epochs, (int, float)),
                              ("eval_every", eval_every, int),
                              ("checkpoint_every", checkpoint_every, int)):
        if value is not None:
            _check_positive(name, value, kind)
    if lr is not None:
        _check_positive("lr", lr)
    if kl_weight is not None:
        _check_positive("kl_weight", kl_weight)
    if num_particles is not None:
        _check_positive("num_particles", num_particles, int)
    if init not in ("iblm", None):
        raise ValueError(f"fit: init must be 'iblm' or None, got {init!r}")
    if optim is not None and not isinstance(optim, PyroOptim):
        raise TypeError(
            f"fit: optim must be a Pyro optimizer (e.g. pyro.optim.Adam({{'lr': 1e-3}})), "
            f"got {type(optim).__name__}"
        )
    if optim is not None and lr is not None:
        raise ValueError("fit: pass lr or optim, not both (lr sets the default optimizer's)")
    if not callable(model) or not callable(guide):
        raise TypeError("fit: model and guide must be callables (a Pyro model and its guide)")
    batches = _Batches(data, batch_size)
    num_data = batches.num_data
    if validation is not None:
        validation = _check_batch(validation, "validation")
    _check_model(model, batches.first, num_data)
    initialized = is_initialized(guide)
    if init == "iblm" and not initialized and not isinstance(guide, AutoGuide):
        raise TypeError(
            f"fit: I-BLM initializes autoguides, not a {type(guide).__name__}; pass init=None "
            "to train this guide from its own initial values"
        )
    path = os.fspath(checkpoint) if checkpoint is not None else None
    resumed = _load(path) if path is not None and os.path.exists(path) else None
    if steps is None:
        steps = (max(1, round(epochs * batches.batches_per_epoch)) if epochs is not None
                 else 1000)
    done = 0 if resumed is None else int(resumed["step"])

    # ---- initialize, or restore --------------------------------------------------------
    batches.start()
    history = FitHistory()
    defaults = FitConfig()
    if resumed is not None:
        _set_up(guide, batches.first)  # the checkpoint then overwrites its values
        device = batches.first[0].device  # the checkpoint was loaded onto the CPU
        store_state = resumed["param_store"]
        pyro.get_param_store().set_state({
            "params": {k: v.to(device) for k, v in store_state["params"].items()},
            "constraints": store_state["constraints"]})
        if isinstance(model, nn.Module) and resumed["model"] is not None:
            model.load_state_dict(resumed["model"])
        history.loss = list(resumed["loss"])
        history.validation = list(resumed["validation"])
    elif init == "iblm" and not initialized:
        options = {"batch_size": min(defaults.iblm_batch_size, num_data),
                   "max_scale_ratio": defaults.max_scale_ratio, **(init_options or {})}
        init_data = batches.pair if batches.pair is not None else batches.loader
        init_guide_iblm(cast(AutoGuide, guide), cast(Any, init_data), **options)
        history.initialized = True
    elif not initialized:  # init=None: Pyro's own initial values, set up here
        guide(*batches.first)
    else:  # e.g. parameters loaded into the param store: set up, taking their values
        _set_up(guide, batches.first)
    config = fit_config(guide, lr=lr, kl_weight=kl_weight, num_particles=num_particles)
    history.config = config
    optim = optim if optim is not None else config.optimizer()
    if resumed is not None:
        optim.set_state(resumed["optim"])
        batches.set_state(resumed["batches"])
        torch.set_rng_state(resumed["rng"])
    svi = SVI(model, guide, optim, config.elbo())
    every = eval_every or max(1, steps // 10)
    chunk = max(1, min(num_data, 4096))  # validation rows per model call

    # ---- train ---------------------------------------------------------------------------
    from tqdm.auto import tqdm  # type: ignore[import-untyped]  # a dependency of Pyro

    if validation is not None and done == 0:
        history.validation.append({"step": 0.0, **_evaluate(model, guide, *validation,
                                                            num_samples, chunk)})
    bar = tqdm(total=steps, initial=done, disable=not progress, desc="fit")
    try:
        for step in range(done + 1, steps + 1):
            xb, yb = next(batches)
            with config.handlers():
                loss = svi.step(xb, yb)
            if not math.isfinite(loss):
                warnings.warn(f"fit: the loss is {loss} at step {step}", RuntimeWarning,
                              stacklevel=2)
            history.loss.append(float(loss))
            bar.update(1)
            if step % 10 == 0 or step == steps:
                bar.set_postfix(loss=f"{loss / num_data:.4g}")
            if validation is not None and (step % every == 0 or step == steps):
                history.validation.append({"step": float(step),
                                           **_evaluate(model, guide, *validation,
                                                       num_samples, chunk)})
            if path is not None and ((checkpoint_every and step % checkpoint_every == 0)
                                     or step == steps):
                _save(path, step, optim, model, batches, history)
    finally:
        bar.close()
    return history
